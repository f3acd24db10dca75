"""Exactness of Transformers' Trainer and a plain Accelerate loop with Ulysses SP, every ZeRO stage, both switches.

    DS_ACCELERATOR=cpu python -m tests.trainer_exactness [--steps 3] [--loops trainer accelerate]

Each case trains a tiny Llama for ``--steps`` SGD steps (no clipping, where a constant factor on the
gradient shows at once) at sp 2 on 2 gloo ranks and prints the worst per-step loss and parameter-update
relative errors against the same training in one process without SP (plain torch). The Accelerate loop
with ``parallelism_config`` alone is the loop written for DeepSpeed's SP path (its loss from the logits,
weighted through an all-gather): its numbers are that loss's, printed under DeepSpeed's module too. The update is
``lr x`` the sum of the gradients, so its error is the gradients' (bar: loss 1e-5, update 1e-4).
About 30 s a case on two cores; ``make test`` runs a subset (tests/integration/test_trainer.py,
test_accelerate.py).
"""

import argparse
import tempfile
import time

from tests.support import trainer_cases as tc
from tests.support.distributed import run_distributed


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--loops", nargs="+", default=["trainer", "accelerate"], choices=["trainer", "accelerate"])
    args = p.parse_args(argv)
    reference = tc.reference(tc.samples(2 * args.steps), args.steps)
    print("| loop | switch | ZeRO | loss rel err (worst step) | update rel err (worst parameter) | s |")
    print("|---|---|---|---|---|---|")
    cases = [(loop, switch, "ours") for loop in args.loops for switch in ("section", "parallelism_config")]
    if "accelerate" in args.loops:  # DeepSpeed's loop under DeepSpeed's module: the numbers ours must give
        cases.append(("accelerate", "parallelism_config", "deepspeed"))
    for loop, switch, library in cases:
        for stage in (1, 2, 3):
            start = time.time()
            with tempfile.TemporaryDirectory() as out:
                if loop == "trainer":
                    results = run_distributed(tc.trainer_run, 2, stage, switch, out, args.steps, timeout=900)
                else:  # parallelism_config: DeepSpeed's switch, its loop (tc.accelerate_run's "example")
                    loss = "example" if switch == "parallelism_config" else "model"
                    results = run_distributed(tc.accelerate_run, 2, stage, switch, args.steps, False, library, loss,
                                              timeout=900)
            errors = [tc.compare(res, reference) for res in results]
            loss, update = max(e["loss"] for e in errors), max(e["update"] for e in errors)
            name = switch if library == "ours" else f"{switch}, DeepSpeed's module"
            print(f"| {loop} | {name} | {stage} | {loss:.1e} | {update:.1e} | {time.time() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()

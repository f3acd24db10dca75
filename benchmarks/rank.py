"""``python -m benchmarks.rank SPEC.json``: one rank of one launch, in a fresh process of its own.

:func:`benchmarks.launch.launch` writes the launch's spec to a file and starts one such process per rank (with
``RANK``/``WORLD_SIZE`` set), so each arm's peak RSS is its own. This module only picks the loop the spec names
and writes the rank's result next to the spec, ``SPEC.json.rank<r>.json``:

- the engine loop (:mod:`benchmarks.engine_loop`), the default;
- ``loop`` ``trainer``, ``accelerate``, ``trl``: Transformers' Trainer (:mod:`benchmarks.trainer`), a plain
  Accelerate loop (:mod:`benchmarks.accelerate_loop`), TRL's SFTTrainer (:mod:`benchmarks.trl_loop`);
- ``loop`` ``breakdown``: the engine loop under live-tensor tracking (:mod:`benchmarks.breakdown_loop`);
- ``impl`` ``layer`` / ``tiled``: the attention layer alone (:mod:`benchmarks.layer`), one tiled operation
  (:mod:`benchmarks.tiled`).

Each loop is imported only when picked, so a rank loads nothing another arm needs (DeepSpeed's arm runs without
ds_ulysses in the process).
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["run_spec", "main"]


def run_spec(spec: dict) -> dict:
    """This rank's result of the loop ``spec`` names."""
    if spec["impl"] == "layer":
        from .layer import run as run_layer

        return run_layer(spec["seq_len"], spec["iters"])
    if spec["impl"] == "tiled":
        from .tiled import run as run_tiled

        return run_tiled(spec["op"], spec["seq_len"], spec["iters"], spec.get("model"))
    loop = spec.get("loop")
    if loop == "breakdown":
        from .breakdown_loop import run
    elif loop == "trainer":
        from .trainer import run
    elif loop == "trl":
        from .trl_loop import run
    elif loop == "accelerate":
        from .accelerate_loop import run
    else:
        from .engine_loop import run
    return run(spec)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.rank SPEC.json``: writes ``SPEC.json.rank<r>.json``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit(f"usage: python -m benchmarks.rank SPEC.json (got {argv}); run it through "
                         "`ds-ulysses bench`, which writes the spec and sets RANK/WORLD_SIZE")
    with open(argv[0]) as f:
        spec = json.load(f)
    result = run_spec(spec)
    with open(f"{argv[0]}.rank{os.environ['RANK']}.json", "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    # The result is written and closed. Interpreter teardown then aborted a finished rank ("terminate called
    # without an active exception") in 2 launches of ~150 on 2026-11-24, voiding figures already on disk;
    # a finished rank leaves without that teardown (ds_ulysses.train.job.leave says why), imported only now so
    # that the DeepSpeed arm measures without ds_ulysses loaded.
    code = main()
    from ds_ulysses.train.job import leave

    leave(code)

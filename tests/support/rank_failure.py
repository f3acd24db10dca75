"""One rank of a 2-rank SP training run in which rank 1 dies or stalls in the middle of step 2.

Run as ``python -m tests.rank_failure MODE TIMEOUT STAMP`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (tests/test_reliability.py launches both ranks). MODE is ``die`` (``os._exit``) or
``stall`` (sleep far past the timeout). Rank 1 writes the time it failed to STAMP first, so the test
can measure how long the survivor took to exit. The survivor is expected to raise, not to finish.
"""

from __future__ import annotations

import os
import sys
import time

import torch


def main(mode: str, timeout: float, stamp: str) -> int:
    import ds_ulysses

    from tests.support.engine_cases import dataset, ds_config
    from tests.support.models import tiny_config, tiny_model

    torch.set_num_threads(1)
    config = ds_config(0, sp=2, extra_section={"comm_timeout_seconds": timeout})
    model = tiny_model(tiny_config("llama", heads=4, kv_heads=2))
    engine, _, loader, _ = ds_ulysses.initialize(model=model, config=config, training_data=dataset(8, 24))
    rank = int(os.environ["RANK"])
    for step, batch in enumerate(loader, start=1):
        loss = engine(**batch).loss
        if step == 2 and rank == 1:
            with open(stamp, "w") as f:
                f.write(str(time.time()))
            if mode == "die":
                os._exit(17)
            time.sleep(10 * timeout)
        engine.backward(loss)
        engine.step()
    print("survivor finished every step: the failure went unnoticed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]), sys.argv[3]))

"""A plain Accelerate loop (accelerator.prepare / accelerator.backward) with Ulysses SP from the DeepSpeed
config's "ulysses" section, at sp 2 on 2 gloo ranks, against one process without SP (plain torch).

Each step's loss rel 1e-5, the whole parameter update (the sum of the gradients) rel 1e-4. Accelerate
turns SP off in eval mode (``disable_in_eval``); a model left in eval mode that trains on the adapter's shards
still runs SP (the input is a shard), so a loop that never calls ``model.train()`` trains exactly. Every stage for both switches: ``python -m tests.trainer_exactness``.
"""

import pytest

from tests.support import trainer_cases as tc
from tests.support.distributed import run_distributed

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.mark.parametrize("eval_mode", [False, True], ids=["train-mode", "left-in-eval-mode"])
def test_accelerate_loop_trains_like_one_process_without_sp(eval_mode):
    reference = tc.reference(tc.samples(2 * STEPS), STEPS)
    for res in run_distributed(tc.accelerate_run, 2, 2, "section", STEPS, eval_mode, timeout=600):
        assert res["sp"] == 2
        errors = tc.compare(res, reference)
        assert errors["loss"] <= 1e-5 and errors["update"] <= 1e-4, errors
        assert res["trims"] == STEPS  # the section's default: the heap trimmed after every step


def test_deepspeed_s_accelerate_loop_runs_unchanged_after_install_and_trains_like_deepspeed():
    """The loop Accelerate's ALST example writes for DeepSpeed's module (DeepSpeed's switch,
    ``parallelism_config``, and the loss from ``model(**batch).logits`` weighted across the SP group through a
    differentiable all-gather), under DeepSpeed's module and after ``ds_ulysses.install()``: the same losses and
    updates, both the unsharded model's at ZeRO-3 (where that loss is right). After ``install()`` the model
    returns there what DeepSpeed's makes it return, logits and no loss (``model_loss`` off); with the section's
    defaults it returned no logits, and the loop raised in Transformers' loss (``'NoneType' object has no
    attribute 'float'``). Its engine steps as DeepSpeed's, without the heap trim, which made that loop's step
    1.09x DeepSpeed's at 4K (docs/CHANGELOG.md, the Accelerate loop's heap trim)."""
    reference = tc.reference(tc.samples(2 * STEPS), STEPS)
    runs = {library: run_distributed(tc.accelerate_run, 2, 3, "parallelism_config", STEPS, False, library, "example",
                                     timeout=600) for library in ("deepspeed", "ours")}
    for library, results in runs.items():
        for res in results:
            errors = tc.compare(res, reference)
            assert errors["loss"] <= 1e-5 and errors["update"] <= 1e-4, (library, errors)
            assert res["model_losses"] == [None] * STEPS, library
            assert res["trims"] == 0, library
    assert runs["ours"][0]["losses"] == pytest.approx(runs["deepspeed"][0]["losses"], rel=1e-6)

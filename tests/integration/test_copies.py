"""Copies of an SP model: ``copy.deepcopy`` and pickling (TRL's reference models, EMA weights, snapshots,
``torch.save(model)``) on every way SP is switched on, at sp 2 on 2 gloo ranks, against the unsharded model.

A copy shares the original's process group and SP attention and computes with its own weights: loss rel 1e-5,
SP-summed gradients rel 1e-4 (the correctness bar), as the original, and after its weights change; the
original does not follow. After ``uninstall()`` a copy is a plain model, and so is a pickle loaded in a
process that never ran SP. A DeepSpeed engine's module is deep-copied only: DeepSpeed's engine puts a local
function on it as a hook, which no pickle can name (with or without SP).
"""

import pickle

import pytest

from tests.support import copy_cases
from tests.support.distributed import run_distributed
from tests.support.models import rel_err

pytestmark = pytest.mark.slow

PATHS = ("dropin", "model-scope", "initialize", "install")


@pytest.mark.parametrize("path", PATHS)
def test_copies_compute_the_sp_loss_and_gradients_on_their_own_weights(path):
    import torch

    from tests.support.models import tiny_config, tiny_model
    from tests.support.sp_cases import make_sample

    for res in run_distributed(copy_cases.copies_vs_reference, 2, path, timeout=400):
        expected = {"original", "deepcopy", "deepcopy-changed", "original-after-changes"}
        if path in ("dropin", "model-scope"):  # a DeepSpeed engine's module holds DeepSpeed's unpicklable hook
            expected |= {"pickle", "pickle-changed"}
        if path == "dropin":
            expected.add("built-after-deepcopy")
        assert expected <= set(res), sorted(res)
        for name in expected:
            assert res[name]["loss"] <= 1e-5 and res[name]["grad"] <= 1e-4, (name, res[name])
        assert res["after-uninstall"] <= 1e-6
    if "pickled" not in res:
        return
    # unpickled here, where no SP ran: the plain model
    loaded = pickle.loads(res["pickled"])
    whole = make_sample(100, copy_cases.LENGTH)
    plain = tiny_model(tiny_config("llama", heads=4, kv_heads=2))
    with torch.no_grad():
        got = loaded(input_ids=whole["input_ids"], labels=whole["labels"]).loss
        want = plain(input_ids=whole["input_ids"], labels=whole["labels"]).loss
    assert rel_err(got, want) <= 1e-6 and rel_err(want, torch.tensor(res["plain-loss"])) <= 1e-6


def test_a_dpo_step_with_trl_s_reference_model_copy_is_exact():
    for res in run_distributed(copy_cases.dpo_step_vs_reference, 2, timeout=300):
        assert res["reference_eval"] and res["reference_frozen"]
        assert res["logps"] <= 1e-5 and res["loss"] <= 1e-5 and res["grad"] <= 1e-4, res

"""examples/train.py resumed on another mesh (ZeRO-3 with CPU offload, the demo's config, 1-4 gloo ranks).

A run of 8 steps at dp 1 x sp 2 (gradient accumulation 2: global batch 2) saves at step 4; the
checkpoint is resumed at dp 2 x sp 1 (same world: DeepSpeed's ordinary load), on one rank and at
dp 1 x sp 4 (other worlds: the universal conversion), and a one-rank run's step 4 at dp 1 x sp 2
(growth). Steps 5-8 of each resume are compared with an uninterrupted run of 8 steps at the new mesh.

Tolerance: the losses are equal (0.0) where this machine's measurements found them equal, and a bound of
2e-6 relative elsewhere. The resumed run and the uninterrupted one at the new mesh differ only in
where steps 1-4 ran: the old mesh reduces each gradient in another order (dp 1 x sp 2 sums the two
micro-batches' gradients by accumulation, dp 2 x sp 1 by an all-reduce), so their weights after step 4
may differ by fp32 rounding (~1e-7 relative), which steps 5-8 carry along; a wrong optimizer state
(Adam's step off by one changes the bias correction), a wrong learning-rate schedule position or data
shifted by one sample moves the loss by 1e-4 or more.
"""

import json
from pathlib import Path

import pytest

from tests.integration.test_train import CONFIG, SEQ, _example, tiny_model_dir  # noqa: F401 (a fixture)
from tests.support.distributed import run_distributed

pytestmark = pytest.mark.slow

STEPS = 8
TOLERANCE = 2e-6


def _config(path: Path, sp: int, grad_accum: int) -> str:
    config = json.loads(CONFIG.read_text())
    config["ulysses"]["sequence_parallel_size"] = sp
    config["gradient_accumulation_steps"] = grad_accum
    path.write_text(json.dumps(config))
    return str(path)


def _run(config, out, model_dir, *extra):
    return _example().train(["--deepspeed_config", config, "--model", model_dir, "--seq-len", str(SEQ), "--steps",
                             str(STEPS), "--save-every", "4", "--out", out, "--buckets", "16", *extra])


def _train(config, out, model_dir, *extra):
    return _run(config, out, model_dir, *extra)["losses"]


def _refusal(fn):
    from ds_ulysses.train.checkpoint import CheckpointError

    try:
        fn()
    except CheckpointError as err:
        return str(err)
    return None


def _two_ranks(rank, world_size, tmp, model_dir):
    """dp1 x sp2 (the source), dp2 x sp1 uninterrupted and resumed, the refusal, a batch change."""
    import torch.distributed as dist

    sp2, sp1 = _config(Path(tmp) / "sp2.json", 2, 2), _config(Path(tmp) / "sp1.json", 1, 1)
    source = _train(sp2, f"{tmp}/source", model_dir)
    step4 = f"{tmp}/source/checkpoints/step_00000004"
    reference = _train(sp1, f"{tmp}/dp2", model_dir, "--eval-samples", "2")
    resumed = _train(sp1, f"{tmp}/dp2_resumed", model_dir, "--resume", step4)
    gas2 = _config(Path(tmp) / "sp1_gas2.json", 1, 2)
    refused = _refusal(lambda: _train(gas2, f"{tmp}/refused", model_dir, "--resume", step4))
    dist.barrier()
    changed = _train(gas2, f"{tmp}/changed", model_dir, "--resume", step4, "--allow-batch-change", "--steps", "5")
    return {"source": source, "reference": reference, "resumed": resumed, "refused": refused, "changed": changed}


def _one_rank(rank, world_size, tmp, model_dir):
    one = _config(Path(tmp) / "one.json", 1, 2)
    reference = _train(one, f"{tmp}/one", model_dir, "--eval-samples", "2")
    resumed = _train(one, f"{tmp}/one_resumed", model_dir, "--resume", f"{tmp}/source/checkpoints/step_00000004")
    return {"reference": reference, "resumed": resumed}


def _grown_from_one_rank(rank, world_size, tmp, model_dir):
    return _train(str(Path(tmp) / "sp2.json"), f"{tmp}/grown", model_dir, "--resume",
                  f"{tmp}/one/checkpoints/step_00000004")


def _four_ranks(rank, world_size, tmp, model_dir):
    sp4 = _config(Path(tmp) / "sp4.json", 4, 2)
    reference = _train(sp4, f"{tmp}/sp4", model_dir, "--eval-samples", "2", "--save-every", "0")
    resumed = _run(sp4, f"{tmp}/sp4_resumed", model_dir, "--resume", f"{tmp}/source/checkpoints/step_00000004")
    # the checkpoint's 2 held-out samples on 4 ranks: two ranks evaluate a filler that counts no token
    return {"reference": reference, "resumed": resumed["losses"], "eval_tokens": int(resumed["eval"].counts.sum())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):  # noqa: F811
    tmp = tmp_path_factory.mktemp("mesh")
    two = run_distributed(_two_ranks, 2, str(tmp), str(tiny_model_dir), timeout=900)
    # a conversion killed half way leaves its temporary directory behind: the next one starts over
    step4 = tmp / "source" / "checkpoints" / "step_00000004"
    (step4 / ".universal.tmp" / "zero").mkdir(parents=True)
    (step4 / ".universal.tmp" / "zero" / "optimizer_state.pt").write_bytes(b"cut short")
    one = run_distributed(_one_rank, 1, str(tmp), str(tiny_model_dir), timeout=900)
    grown = run_distributed(_grown_from_one_rank, 2, str(tmp), str(tiny_model_dir), timeout=900)
    four = run_distributed(_four_ranks, 4, str(tmp), str(tiny_model_dir), timeout=900)
    return tmp, two, one, grown, four


def _assert_continues(resumed, reference, tolerance=TOLERANCE):
    assert sorted(resumed) == [5, 6, 7, 8]
    for step, loss in resumed.items():
        assert abs(loss - reference[step]) <= tolerance * abs(reference[step]), (step, loss, reference[step])


def test_same_world_other_split_loads_without_conversion(runs):
    tmp, two, *_ = runs
    for rank in two:
        _assert_continues(rank["resumed"], rank["reference"])
    assert not (tmp / "dp2_resumed" / "checkpoints" / "step_00000008" / "universal").exists()


def test_fewer_ranks_load_the_universal_conversion(runs):
    tmp, _, one, *_ = runs
    _assert_continues(one[0]["resumed"], one[0]["reference"])
    step4 = tmp / "source" / "checkpoints" / "step_00000004"
    assert (step4 / "universal" / "universal.json").is_file() and not (step4 / ".universal.tmp").exists()


def test_more_ranks_load_the_universal_conversion(runs):
    tmp, two, one, grown, four = runs
    for rank in grown:  # one rank -> dp1 x sp2: the reference is the source run itself
        _assert_continues(rank, two[0]["source"])
    for rank in four:
        _assert_continues(rank["resumed"], rank["reference"])
        assert rank["eval_tokens"] == 2 * (SEQ - 1)
    manifest = json.loads((tmp / "grown" / "checkpoints" / "step_00000008" / "manifest.json").read_text())
    assert manifest["zero_partitions"] == 2 and manifest["data"]["samples_consumed"] == 16
    assert manifest["data"]["held_out_samples"] == 2  # the checkpoint's, not this world's (1 rank wrote it)


def test_changed_global_batch_refused_unless_allowed(runs):
    tmp, two, *_ = runs
    for rank in two:
        assert rank["refused"].startswith("global batch: the checkpoint trained 2 samples per step")
        assert "fix: set gradient_accumulation_steps to 1 for this mesh, or pass --allow-batch-change" in rank["refused"]
        assert sorted(rank["changed"]) == [5]
    manifest = json.loads((tmp / "changed" / "checkpoints" / "step_00000005" / "manifest.json").read_text())
    assert manifest["data"]["samples_consumed"] == 8 + 4 and manifest["data"]["global_batch"] == 4

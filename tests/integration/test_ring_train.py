"""examples/train.py with a ring, and its checkpoints across ring sizes (ZeRO-3, CPU offload: the demo's config).

The tiny Llama (4 query / 2 KV heads) at sp 2 as a ring of 2 (``ring_size: 2``, Ulysses 1) on 2 gloo ranks,
gradient accumulation 2 (global batch 2): its losses against the same job on one rank without SP (sp 1,
gradient accumulation 2: the same samples per step, the same 2 held out). A checkpoint written at step 2 by the
ring run resumes Ulysses alone (``ring_size: 1``) and one written by Ulysses alone resumes the ring: steps 3-4
equal the uninterrupted run at the new ring size. The ring changes neither the data each SP group trains on nor ZeRO's
partitions (the world and dp are the same), so it is DeepSpeed's ordinary load.

Tolerance: 5e-7 relative, as in test_resume_mesh.py (the meshes reduce gradients in another order, which fp32
rounding shows; Adam's step, the schedule or a shifted sample move the loss by 1e-4 or more). Measured: the ring
against one rank 8.6e-8 at most (Ulysses alone: the same); ring 2 -> 1 0.0, ring 1 -> 2 4.3e-8.
"""

import json
from pathlib import Path

import pytest

from tests.integration.test_train import CONFIG, SEQ, _example, tiny_model_dir  # noqa: F401 (a fixture)
from tests.support.distributed import run_distributed

pytestmark = pytest.mark.slow

STEPS = 4
TOLERANCE = 5e-7


def _config(path: Path, sp: int, ring: int) -> str:
    config = json.loads(CONFIG.read_text())
    config["ulysses"].update(sequence_parallel_size=sp, ring_size=ring)
    config["gradient_accumulation_steps"] = 2  # dp 1 (one rank at sp 1, two at sp 2): global batch 2
    path.write_text(json.dumps(config))
    return str(path)


def _train(config, out, model_dir, *extra):
    return _example().train(["--deepspeed_config", config, "--model", model_dir, "--seq-len", str(SEQ), "--steps",
                             str(STEPS), "--save-every", "2", "--out", out, "--buckets", "16", "--eval-samples", "2",
                             *extra])["losses"]


def _two_ranks(rank, world_size, tmp, model_dir):
    ring, plain = _config(Path(tmp) / "ring.json", 2, 2), _config(Path(tmp) / "plain.json", 2, 1)
    out = {"ring": _train(ring, f"{tmp}/ring", model_dir), "plain": _train(plain, f"{tmp}/plain", model_dir)}
    out["ring_to_plain"] = _train(plain, f"{tmp}/ring_to_plain", model_dir, "--resume",
                                  f"{tmp}/ring/checkpoints/step_00000002")
    out["plain_to_ring"] = _train(ring, f"{tmp}/plain_to_ring", model_dir, "--resume",
                                  f"{tmp}/plain/checkpoints/step_00000002")
    return out


def _one_rank(rank, world_size, tmp, model_dir):
    return _train(_config(Path(tmp) / "one.json", 1, 1), f"{tmp}/one", model_dir, "--save-every", "0")


def _close(got: dict, want: dict, steps) -> None:
    assert sorted(got) == list(steps)
    for step in steps:
        assert abs(got[step] - want[step]) <= TOLERANCE * abs(want[step]), (step, got[step], want[step])


def test_the_training_app_trains_a_ring_as_one_rank_and_resumes_across_ring_sizes(
        tmp_path, tiny_model_dir):  # noqa: F811
    (one,) = run_distributed(_one_rank, 1, str(tmp_path), str(tiny_model_dir), timeout=900)
    for res in run_distributed(_two_ranks, 2, str(tmp_path), str(tiny_model_dir), timeout=900):
        _close(res["ring"], one, range(1, STEPS + 1))
        _close(res["ring_to_plain"], res["plain"], range(3, STEPS + 1))
        _close(res["plain_to_ring"], res["ring"], range(3, STEPS + 1))

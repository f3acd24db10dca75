"""The universal conversion's refusals and its checksum record, in one process without DeepSpeed runs
(the conversions and loads themselves: tests/integration/test_resume_mesh.py and test_universal_groups.py)."""

import json
from types import SimpleNamespace

import deepspeed
import pytest

from ds_ulysses.train import universal
from ds_ulysses.train.checkpoint import CheckpointError
from ds_ulysses.train.job import _prepare_universal


def test_deepspeed_too_old_is_refused_with_both_fixes(monkeypatch, tmp_path):
    monkeypatch.setattr(deepspeed, "__version__", "0.17.6")
    with pytest.raises(CheckpointError, match=r"DeepSpeed too old: resuming at another world size needs DeepSpeed "
                                              r">= 0.18.0 .*got 0.17.6; fix: pip install 'deepspeed>=0.18.0', or "
                                              r"resume on 2 ranks \(any dp x sp split"):
        universal.ensure_universal(tmp_path, 2)
    (tmp_path / "latest").write_text("global_step3")
    with pytest.raises(CheckpointError, match="DeepSpeed too old"):
        universal.convert_checkpoint(tmp_path)


def test_a_world_change_without_zero_is_refused(tmp_path):
    manifest = SimpleNamespace(zero_partitions=2)
    assert _prepare_universal(manifest, tmp_path, {"zero_optimization": {"stage": 0}}, 2) is None  # same world
    with pytest.raises(CheckpointError, match=r"written by 2 ranks and this job has 4; .* converts ZeRO stages 1-3, "
                                              r"and this config has zero_optimization.stage 0; fix: launch 2 ranks"):
        _prepare_universal(manifest, tmp_path, {}, 4)


def test_neither_app_nor_deepspeed_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"expected a training checkpoint .* or a DeepSpeed checkpoint directory "
                                              r"\(with a 'latest' file naming its tag\)"):
        universal.convert_checkpoint(tmp_path)


def test_a_damaged_or_unfinished_conversion_is_refused_with_the_fix(tmp_path):
    target = tmp_path / "universal"
    (target / "zero").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"is incomplete: expected universal.json.*fix: delete"):
        universal.verify_universal(target)
    (target / "zero" / "optimizer_state.pt").write_bytes(b"state")
    (target / "universal.json").write_text(json.dumps({"files": {"zero/optimizer_state.pt": "0" * 64}}))
    with pytest.raises(CheckpointError, match=r"is damaged: 1 files missing or changed \['zero/optimizer_state.pt'\]"):
        universal.verify_universal(target)

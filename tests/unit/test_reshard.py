"""ds_ulysses.reshard in one process: what a DeepSpeed checkpoint says about the job that wrote it, the
data-prefix rule, and how ``load_on_any_mesh`` routes a load (DeepSpeed's own load and conversion are
faked here; the real ones: tests/integration/test_trainer_resume_mesh.py, test_resume_mesh.py)."""

import hashlib
import json
import threading
import time
from types import SimpleNamespace

import deepspeed
import pytest
import torch

from ds_ulysses import reshard
from ds_ulysses.reshard import CheckpointError, Layout
from tests.support.resume_cases import deepspeed_checkpoint


def test_a_checkpoint_s_ranks_and_layout_come_from_deepspeed_s_files(tmp_path):
    tag_dir = deepspeed_checkpoint(tmp_path, ranks=4, config={"train_micro_batch_size_per_gpu": 2,
                                                               "gradient_accumulation_steps": 3,
                                                               "sequence_parallel_size": 2})
    assert reshard.zero_partitions(tag_dir) == 4
    assert reshard.saved_layout(tag_dir) == Layout(world_size=4, sp=2, micro_batch=2, grad_accum=3)
    assert reshard.saved_layout(tag_dir).global_batch == 2 * 2 * 3  # dp 2 x micro 2 x gas 3
    plain = deepspeed_checkpoint(tmp_path / "plain", ranks=2, config={"train_micro_batch_size_per_gpu": 1},
                                  zero=False)
    assert reshard.zero_partitions(plain) == 0  # stage 0: loads on any world size
    assert reshard.saved_layout(plain) == Layout(2, 1, 1, 1)
    with pytest.raises(CheckpointError, match=r"expected DeepSpeed's model states \(\*model_states.pt\) in .*got "
                                              r"none; fix: pass a checkpoint directory written by a DeepSpeed engine"):
        reshard.saved_layout(tmp_path)


@pytest.mark.parametrize("layout,micro_batches,prefix", [
    (Layout(2, 2, 1, 1), 1, True),  # dp 1, micro 1: each micro-batch is the next sample
    (Layout(4, 2, 1, 1), 1, False),  # dp 2: micro-batch 0 trained samples 0 and 2, not 1
    (Layout(4, 2, 1, 1), 2, True),  # a whole refill
    (Layout(4, 4, 2, 1), 1, False),  # dp 1 but micro 2: samples 0-1 and 2-3 belong to different ranks' slots
    (Layout(4, 1, 1, 1), 3, True),  # sp 1: every micro-batch is a refill
])
def test_prefix_after_follows_the_refill(layout, micro_batches, prefix):
    assert layout.prefix_after(micro_batches) is prefix


class _Engine:
    """The parts of a DeepSpeed engine load_on_any_mesh uses, and a load_checkpoint that records its calls."""

    def __init__(self, world, stage=3, load_universal=False):
        self.seq_dp_world_size = world
        self._config = SimpleNamespace(load_universal_checkpoint=load_universal)
        self.stage = stage
        self.calls = []

    def load_universal_checkpoint(self):
        return self._config.load_universal_checkpoint

    def zero_optimization_stage(self):
        return self.stage

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        self.calls.append({"dir": str(load_dir), "tag": tag, "universal": self._config.load_universal_checkpoint,
                           "optimizer": load_optimizer_states})
        return str(load_dir), {}


def _fake_convert(converted):
    """A stand-in for DeepSpeed's converter: one file and its checksum record, renamed into place."""
    def convert(source, target):
        converted.append((source.name, target.name))
        target.mkdir()
        (target / "zero").mkdir()
        (target / "zero" / "optimizer_state.pt").write_bytes(b"state")
        digest = hashlib.sha256(b"state").hexdigest()
        (target / "universal.json").write_text(json.dumps({"files": {"zero/optimizer_state.pt": digest}}))
        return target
    return convert


def _load(engine, directory, *args, **kwargs):
    return reshard.load_on_any_mesh(engine, engine.load_checkpoint, str(directory), *args, **kwargs)


def test_the_same_world_without_zero_or_with_universal_set_is_deepspeed_s_own_load(tmp_path, monkeypatch):
    monkeypatch.setattr(reshard, "convert", lambda *a: pytest.fail("converted"))
    deepspeed_checkpoint(tmp_path, ranks=2)
    for engine, args in ((_Engine(2), ()), (_Engine(4, load_universal=True), ()), (_Engine(2), ("global_step4",))):
        _load(engine, tmp_path, *args)
        assert engine.calls == [{"dir": str(tmp_path), "tag": args[0] if args else None,
                                 "universal": engine.load_universal_checkpoint(), "optimizer": True}]
    deepspeed_checkpoint(tmp_path / "stage0", ranks=2, zero=False)
    engine = _Engine(4)
    _load(engine, tmp_path / "stage0")
    assert engine.calls[0]["tag"] is None and not engine.calls[0]["universal"]
    engine = _Engine(4)
    _load(engine, tmp_path / "nothing")  # no latest: DeepSpeed's own warning and (None, None)
    assert engine.calls[0]["tag"] is None


def test_another_world_converts_once_loads_universal_for_that_load_and_repairs_the_groups(tmp_path, monkeypatch):
    converted, repaired = [], []
    monkeypatch.setattr(reshard, "convert", _fake_convert(converted))
    monkeypatch.setattr(reshard, "restore_param_groups", lambda engine, universal: repaired.append(universal.name))
    deepspeed_checkpoint(tmp_path, ranks=2)
    engine = _Engine(4)
    _load(engine, tmp_path)
    assert converted == [("global_step4", "global_step4_universal")]
    assert engine.calls == [{"dir": str(tmp_path), "tag": "global_step4_universal", "universal": True,
                             "optimizer": True}]
    assert engine.load_universal_checkpoint() is False  # for that one load only
    assert repaired == ["global_step4_universal"]
    again = _Engine(1)
    _load(again, tmp_path, "global_step4", load_optimizer_states=False)  # Accelerate passes the tag
    assert len(converted) == 1 and again.calls[0]["tag"] == "global_step4_universal"
    assert repaired == ["global_step4_universal"]  # no optimizer state loaded: nothing to repair
    zero2 = _Engine(1, stage=2)
    _load(zero2, tmp_path)
    assert repaired == ["global_step4_universal"]  # DeepSpeed's ZeRO-1/2 universal load restores each group


def test_a_damaged_conversion_is_refused_before_deepspeed_reads_it(tmp_path, monkeypatch):
    monkeypatch.setattr(reshard, "convert", _fake_convert([]))
    deepspeed_checkpoint(tmp_path, ranks=2)
    _load(_Engine(4, stage=2), tmp_path)
    (tmp_path / "global_step4_universal" / "zero" / "optimizer_state.pt").write_bytes(b"short")
    engine = _Engine(4)
    with pytest.raises(CheckpointError, match=r"global_step4_universal is damaged: 1 files missing or changed .*fix: "
                                              r"delete .* and resume again"):
        _load(engine, tmp_path)
    assert engine.calls == []


def test_other_ranks_wait_for_rank_0_s_conversion_on_the_filesystem(tmp_path, monkeypatch):
    monkeypatch.setattr(reshard, "convert", lambda *a: pytest.fail("only rank 0 converts"))
    monkeypatch.setattr(reshard, "WAIT_SECONDS", 0.01)
    deepspeed_checkpoint(tmp_path, ranks=2)
    rank0 = threading.Timer(0.2, lambda: _fake_convert([])(tmp_path / "global_step4", tmp_path / "global_step4_universal"))
    rank0.start()
    started = time.monotonic()
    target = reshard._universal_of(tmp_path, "global_step4", 2, rank=1)
    rank0.join()
    assert target.name == "global_step4_universal" and time.monotonic() - started >= 0.2


def test_a_read_only_checkpoint_or_an_old_deepspeed_is_refused_naming_the_fix(tmp_path, monkeypatch):
    deepspeed_checkpoint(tmp_path, ranks=2)
    monkeypatch.setattr(reshard.os, "access", lambda path, mode: False)
    with pytest.raises(CheckpointError, match=r"global_step4 was written by 2 ranks and needs DeepSpeed's universal "
                                              r"form .* is not writable; fix: convert it once where it is writable "
                                              r"with `ds-ulysses universal .*` \(one process, no GPU\), or resume on "
                                              r"2 ranks"):
        _load(_Engine(4), tmp_path)
    monkeypatch.setattr(deepspeed, "__version__", "0.17.6")
    with pytest.raises(CheckpointError, match=r"DeepSpeed too old: .*got 0.17.6; fix: pip install 'deepspeed>=0.18.0', "
                                              r"or resume on 2 ranks \(any dp x sp split"):
        _load(_Engine(4), tmp_path)


def test_batch_fix_names_the_setting_for_the_new_mesh():
    assert reshard.batch_fix(4, Layout(2, 1, 1, 1)) == "set gradient_accumulation_steps to 2 for this mesh"
    assert reshard.batch_fix(2, Layout(2, 1, 4, 1)).startswith("choose train_micro_batch_size_per_gpu x "
                                                               "gradient_accumulation_steps = 1")
    assert reshard.batch_fix(3, Layout(2, 1, 1, 1)) == "launch a mesh whose dp divides 3"

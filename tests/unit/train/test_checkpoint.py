"""Checkpoint atomicity, verification and compatibility errors, in one process with a stand-in engine.

The stand-in writes files the way DeepSpeed's save_checkpoint does (into ``save_dir/tag``), so the
tests exercise ds_ulysses' own part: temp dir + rename, manifest written last, checksums, and the
messages. The 2-rank DeepSpeed runs (exact resume, crash mid-save) are in test_train.py.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from ds_ulysses.train import checkpoint as ckpt


class StandInEngine:
    mpu = SimpleNamespace(dp=1, sp=1, world_size=1)
    seq_dp_world_size = 1

    def save_checkpoint(self, save_dir, tag):
        (Path(save_dir) / tag).mkdir()
        torch.save({"w": torch.arange(4.0)}, Path(save_dir) / tag / "model_states.pt")
        (Path(save_dir) / "latest").write_text(tag)


CONFIG = LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)


def _save(root, step, **kw):
    return ckpt.save_checkpoint(StandInEngine(), root, step, model_config=CONFIG, seq_len=64, tokenizer="bytes",
                                data={"sample_offset": step}, **kw)


def test_save_is_complete_and_verifiable(tmp_path):
    path = _save(tmp_path, 3)
    assert path.name == "step_00000003" and not list(tmp_path.glob(".*"))
    manifest = ckpt.verify_checkpoint(path)
    assert (manifest.step, manifest.dp, manifest.sp, manifest.data) == (3, 1, 1, {"sample_offset": 3})
    assert set(manifest.files) >= {"ds/model_states.pt", "rng/rank_00000.pt", "model/config.json"}
    assert manifest.model_hash == ckpt.model_fingerprint(CONFIG)
    assert ckpt.find_checkpoint(tmp_path) == path


def test_crash_mid_save_leaves_previous_checkpoint_latest(tmp_path, monkeypatch):
    first = _save(tmp_path, 2)

    def crash(directory):
        raise RuntimeError("simulated crash after DeepSpeed's files were written")

    monkeypatch.setattr(ckpt, "_save_rng", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _save(tmp_path, 4)
    partial = tmp_path / ".step_00000004.tmp"
    assert (partial / "ds" / "model_states.pt").is_file() and not (partial / ckpt.MANIFEST).exists()
    assert ckpt.find_checkpoint(tmp_path) == first
    ckpt.verify_checkpoint(first)
    monkeypatch.undo()
    assert ckpt.find_checkpoint(tmp_path) == first
    again = _save(tmp_path, 4)  # the next attempt replaces the leftover
    assert ckpt.find_checkpoint(tmp_path) == again and not partial.exists()


def test_keep_last_prunes_older_complete_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]


def test_partial_or_damaged_checkpoint_raises_with_fix(tmp_path):
    path = _save(tmp_path, 5)
    target = path / "ds" / "model_states.pt"
    data = target.read_bytes()
    target.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    damaged = r"is damaged: .* 0 missing \[\] and 1 changed \['ds/model_states.pt'\]"
    with pytest.raises(ckpt.CheckpointError, match=damaged):
        ckpt.verify_checkpoint(path)
    (path / ckpt.MANIFEST).unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"is incomplete: expected manifest.json, .*fix: resume from the"):
        ckpt.verify_checkpoint(path)
    with pytest.raises(ckpt.CheckpointError, match=r"got none \(directories: step_00000005\).*fix:"):
        ckpt.find_checkpoint(tmp_path)


def test_mismatched_job_names_every_difference_but_the_mesh(tmp_path):
    path = _save(tmp_path, 1)
    manifest = ckpt.verify_checkpoint(path)
    manifest = ckpt.Manifest(**{**manifest.__dict__, "dp": 1, "sp": 2, "world_size": 2})
    other = LlamaConfig(**{**CONFIG.to_dict(), "num_hidden_layers": 2})
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.check_compatible(manifest, path, model_hash=ckpt.model_fingerprint(other), seq_len=128,
                              tokenizer="gpt2")
    msg = str(err.value)
    assert "model config: checkpoint" in msg and "seq_len: checkpoint 64, this job 128" in msg
    assert "tokenizer: checkpoint 'bytes', this job 'gpt2'" in msg
    assert "--seq-len 64" in msg and "pass the same --tokenizer" in msg and "mesh" not in msg
    ckpt.check_compatible(manifest, path, model_hash=manifest.model_hash, seq_len=64, tokenizer="bytes")


def test_new_manifest_records_what_a_remap_needs_and_older_ones_imply_it(tmp_path):
    import deepspeed

    data = {"sample_offset": 10, "skip_micro_batches": 1, "held_out_samples": 2, "gradient_accumulation_steps": 2,
            "micro_batch_size": 1}
    path = ckpt.save_checkpoint(StandInEngine(), tmp_path, 4, model_config=CONFIG, seq_len=64, tokenizer="bytes",
                                data=data)
    manifest = ckpt.verify_checkpoint(path)
    assert (manifest.zero_partitions, manifest.rng_ranks, manifest.deepspeed) == (1, 1, deepspeed.__version__)
    # a manifest written before these fields: the run had one mesh and one batch throughout
    raw = json.loads((path / ckpt.MANIFEST).read_text())
    for key in ("zero_partitions", "rng_ranks", "deepspeed"):
        del raw[key]
    raw.update(dp=2, sp=2, world_size=4)
    (path / ckpt.MANIFEST).write_text(json.dumps(raw))
    old = ckpt.Manifest.read(path)
    assert (old.zero_partitions, old.rng_ranks) == (4, 4)
    assert old.data == {**data, "global_batch": 4, "samples_consumed": 16}


def test_fingerprint_ignores_attention_choice_and_paths():
    a = LlamaConfig(**CONFIG.to_dict())
    a._attn_implementation = "sdpa"
    a._name_or_path = "/somewhere"
    assert ckpt.model_fingerprint(a) == ckpt.model_fingerprint(CONFIG)


def test_rng_state_round_trips_through_weights_only_load(tmp_path):
    import random

    import numpy as np

    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    ckpt._save_rng(tmp_path)
    expect = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    ckpt._set_rng_state(ckpt.safe_torch_load(tmp_path / "rng" / "rank_00000.pt"))
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expect[0]) and got[1:] == expect[1:]
    saved = json.loads(json.dumps(sorted(ckpt._rng_state())))
    assert saved == ["numpy", "python", "torch"]

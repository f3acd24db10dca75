"""Reliability: every bad input a clear error on every rank, unservable models refused, a dead or
stalled rank an error naming the SP group and the step, and properties of the adapter.

Multi-rank cases run several scenarios in one process group: each scenario must raise at the same
point on every rank, so the group stays in step for the next one (a rank that did not raise would
hang the next scenario, and ``run_distributed``'s timeout turns that into a failure). Rank
functions return plain strings and numbers only."""

import datetime
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from ds_ulysses import (UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, build_mesh, enable_sp_loss,
                        tiled_causal_lm_loss)
from ds_ulysses.config import UlyssesConfig
from tests.support import REPO
from tests.support.distributed import free_port, run_distributed
from tests.support.models import VOCAB, hf_config, tiny_config, tiny_model

SCENARIO_TIMEOUT = 60  # a scenario that fails on one rank only surfaces as SPCommError, not a hang


def _ids(*shape, high=VOCAB):
    return torch.randint(0, high, shape)


def _run_scenarios(rank, world_size, names):
    """Each named scenario on this rank; its error message (or 'NO ERROR') by name."""
    group = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=SCENARIO_TIMEOUT))
    out = {}
    for name in names:
        try:
            SCENARIOS[name][0](rank, group)
            out[name] = "NO ERROR"
        except Exception as err:  # the message is what the test checks
            out[name] = f"{type(err).__name__}: {err}"
    return out


def _adapter_next(rank, group, batches, **kwargs):
    next(iter(UlyssesSPDataLoaderAdapter([batches[rank]], rank, group, 2, "cpu", **kwargs)))


def _sc_label_range(rank, group):
    labels = torch.arange(8)[None].clone()
    if rank == 1:
        labels[0, 3] = 500
    _adapter_next(rank, group, [{"input_ids": _ids(1, 8), "labels": labels}] * 2, vocab_size=VOCAB)


def _sc_not_json(rank, group):
    _adapter_next(rank, group, [{"input_ids": _ids(1, 8), "meta": {1, 2}}, {"input_ids": _ids(1, 8), "meta": "x"}])


def _sc_padding_hole(rank, group):
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 3] = 0 if rank == 1 else 1
    _adapter_next(rank, group, [{"input_ids": _ids(1, 8), "attention_mask": mask}] * 2)


def _sc_unpadded_length(rank, group):
    _adapter_next(rank, group, [{"input_ids": _ids(1, 6)}, {"input_ids": _ids(1, 7)}], pad_to_multiple=False)


def _sc_both_bad(rank, group):
    _adapter_next(rank, group, [{"input_ids": _ids(1, 8).float()}] * 2)


_MESH: dict = {}  # one mesh per spawned process, shared by its scenarios


def _mesh():
    if "mesh" not in _MESH:
        _MESH["mesh"] = build_mesh(2, timeout_seconds=SCENARIO_TIMEOUT)
    return _MESH["mesh"]


def _sp_model(rank, group, dtype=torch.float32, **register):
    model = tiny_model(tiny_config("llama", heads=4, kv_heads=2)).to(dtype)
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, mesh=_mesh(), scope="model", **register)
    return model


def _shard(rank, bs=1, sl_l=4):
    return _ids(bs, sl_l), torch.arange(rank * sl_l, (rank + 1) * sl_l).expand(bs, sl_l).clone()


def _sc_pos_float(rank, group):
    ids, pos = _shard(rank)
    _sp_model(rank, group)(input_ids=ids, position_ids=pos.float() if rank == 1 else pos)


def _sc_pos_missing(rank, group):
    ids, pos = _shard(rank)
    _sp_model(rank, group)(input_ids=ids, position_ids=None if rank == 0 else pos)


def _sc_pos_shape(rank, group):
    ids, pos = _shard(rank)
    _sp_model(rank, group)(input_ids=ids, position_ids=pos[:, :3] if rank == 1 else pos)


def _sc_pos_negative(rank, group):
    ids, pos = _shard(rank)
    _sp_model(rank, group)(input_ids=ids, position_ids=pos - 10 if rank == 0 else pos)


def _sc_varlen_offsets(rank, group):
    ids, pos = _shard(rank)
    offsets = torch.tensor([0, 8]) if rank == 1 else None  # the whole row's, from a padding-free collator
    _sp_model(rank, group)(input_ids=ids, position_ids=pos, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets)


def _sc_batch_sizes(rank, group):
    ids, pos = _shard(rank, bs=2 if rank == 0 else 1)
    _sp_model(rank, group)(input_ids=ids, position_ids=pos)


def _sc_dtypes(rank, group):
    ids, pos = _shard(rank)
    _sp_model(rank, group, torch.float64 if rank == 1 else torch.float32)(input_ids=ids, position_ids=pos)


def _sc_fixed_length(rank, group):
    ids, pos = _shard(rank)
    _sp_model(rank, group, seq_length=32, seq_length_is_variable=False)(input_ids=ids, position_ids=pos)


def _loss_with_bad_label(rank, group, loss_fn):
    model = _sp_model(rank, group)
    enable_sp_loss(model, group, loss_fn=loss_fn, watch=_mesh().sp_watch)
    ids, pos = _shard(rank)
    labels = _ids(1, 4)
    if rank == 1:
        labels[0, 0] = 999
    model(input_ids=ids, position_ids=pos, shift_labels=labels)


def _sc_loss_label(rank, group):
    _loss_with_bad_label(rank, group, None)


def _sc_tiled_loss_label(rank, group):
    _loss_with_bad_label(rank, group, tiled_causal_lm_loss(2))


def _sc_window_in_mask_only(rank, group):
    from transformers import AutoModelForCausalLM

    cfg = hf_config("qwen2_moe", vocab_size=VOCAB, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  num_experts=2, num_experts_per_tok=1, use_sliding_window=True, sliding_window=4, max_window_layers=2)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, mesh=_mesh(), scope="model")
    ids, pos = _shard(rank)
    model(input_ids=ids, position_ids=pos)


def _sc_config_disagreement(rank, group):
    from ds_ulysses.engine import _check_ranks_agree

    section = UlyssesConfig(sequence_parallel_size=2 if rank == 0 else 1)
    _check_ranks_agree(section, tiny_model(tiny_config("llama")))


def _sc_model_disagreement(rank, group):
    from ds_ulysses.engine import _check_ranks_agree

    _check_ranks_agree(UlyssesConfig(sequence_parallel_size=2), tiny_model(tiny_config("llama", heads=4 + 4 * rank)))


SCENARIOS = {
    "label_range": (_sc_label_range, r"ValueError: SP rank 1: 'labels' has a value out of range: expected -100 or "
                                     rf"\[0, {VOCAB}\), got 500"),
    "not_json": (_sc_not_json, "ValueError: SP rank 0: non-tensor batch entries 'meta' \\(set\\) are not "
                               "JSON-serializable.*never pickled"),
    "padding_hole": (_sc_padding_hole, r"SP rank 1: attention_mask has padding between real tokens \(row 0, "
                                       r"token 3\)"),
    "unpadded_length": (_sc_unpadded_length, "SP rank 1: sequence length 7 is not divisible by "
                                             "sequence_parallel_size=2"),
    "both_bad": (_sc_both_bad, r"SP rank 0 \(ranks \[1\] failed too\): 'input_ids' must be an integer tensor"),
    "pos_float": (_sc_pos_float, "SP rank 1: position_ids must be an integer tensor, got float32"),
    "pos_missing": (_sc_pos_missing, "SP rank 0: Ulysses SP needs position_ids in the model call"),
    "pos_shape": (_sc_pos_shape, r"SP rank 1: position_ids must have shape \[bs, sl_l\] = \[1, 4\] or \[1, 4\], "
                                 r"got \[1, 3\]"),
    "pos_negative": (_sc_pos_negative, "SP rank 0: position_ids must be >= 0, got -10"),
    "varlen_offsets": (_sc_varlen_offsets, r"SP rank 1: the attention call carries flash attention's varlen "
                                           r"offsets \(cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k\)"),
    "batch_sizes": (_sc_batch_sizes, r"SP ranks disagree on the batch size: per SP rank \[2, 1\]"),
    "dtypes": (_sc_dtypes, r"SP ranks disagree on the attention dtype: per SP rank \['float32', 'float64'\]"),
    "fixed_length": (_sc_fixed_length, "seq_length_is_variable is false with seq_length=32, but this forward's "
                                       r"shards add up to 8 tokens \[4, 4\]"),
    "loss_label": (_sc_loss_label, r"shift_labels out of range: 1 label\(s\) across SP group ranks \[0, 1\]"),
    "tiled_loss_label": (_sc_tiled_loss_label, r"shift_labels out of range: 1 label\(s\) across SP group ranks"),
    "window_in_mask_only": (_sc_window_in_mask_only, "model not servable by Ulysses SP: layer 0 attends within a "
                                                     "sliding window, but its attention call passes no sliding_window"),
    "config_disagreement": (_sc_config_disagreement, r"ranks disagree on the \"ulysses\" section or the model's "
                                                     r"layout: ranks \[0\] vs \[1\]"),
    "model_disagreement": (_sc_model_disagreement, r"ranks disagree on .* ranks \[0\] vs \[1\]"),
}


@pytest.fixture(scope="module")
def two_rank_errors():
    return run_distributed(_run_scenarios, 2, list(SCENARIOS), timeout=600)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bad_input_on_one_rank_raises_the_same_error_on_every_rank(name, two_rank_errors):
    import re

    phrase = SCENARIOS[name][1]
    messages = [ranks[name] for ranks in two_rank_errors]
    assert messages[0] == messages[1], messages
    assert re.search(phrase, messages[0]), messages[0]


def _launch_failure(mode: str, timeout: float, tmp_path) -> dict:
    """Both ranks of tests/support/rank_failure.py; rank 1 fails at step 2. How and when did rank 0 end?"""
    stamp = tmp_path / "failed_at"
    port = free_port()
    procs, logs = [], []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        log = open(tmp_path / f"rank{rank}.log", "w+")
        logs.append(log)
        command = [sys.executable, "-m", "tests.support.rank_failure", mode, str(timeout), str(stamp)]
        procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        code = procs[0].wait(timeout=600)
        ended = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs[0].seek(0)
    output = logs[0].read()
    for log in logs:
        log.close()
    failed_at = float(stamp.read_text()) if stamp.exists() else None
    return {"code": code, "output": output, "seconds": None if failed_at is None else ended - failed_at}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["die", "stall"])
def test_survivor_exits_naming_group_and_step_within_the_timeout(mode, tmp_path):
    timeout = 10
    res = _launch_failure(mode, timeout, tmp_path)
    tail = res["output"][-3000:]
    assert res["seconds"] is not None, tail  # rank 1 reached step 2
    assert res["code"] != 0, tail
    assert "SPCommError: SP group ranks [0, 1]" in res["output"] and "failed at step 2" in res["output"], tail
    assert "survivor finished every step" not in res["output"], tail
    assert res["seconds"] < timeout + 30, (res["seconds"], tail)



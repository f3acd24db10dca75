"""The plan search: the cheapest setup that fits and the longest sequence some setup fits, within the device, the
host and the 2**31-element limits, with a valid section for it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ds_ulysses import cli
from ds_ulysses.config import UlyssesConfig
from ds_ulysses.constants import GIB
from ds_ulysses.plan_search import max_seq_len, recommend, ulysses_section
from ds_ulysses.planner import INDEX_LIMIT, KNOWN_MODELS, breakdown, largest_tensor

LLAMA8B = KNOWN_MODELS["llama-3.1-8b"]


@pytest.mark.parametrize("gpus,paper", [(1, 500_000), (8, 3_700_000), (32, 15_000_000)])
def test_max_length_close_to_the_alst_paper(gpus, paper):
    """ALST (arXiv 2506.13996) reports these maxima for Llama-3.1-8B on H100 80GB; within 15%."""
    seq_len, setup = max_seq_len(LLAMA8B, gpus, 80 * GIB)
    assert seq_len == pytest.approx(paper, rel=0.15)
    assert setup.sp == gpus and setup.ckpt_offload and setup.tiled_mlp > 1 and setup.tiled_loss > 1


def test_recommendation_prefers_no_tools_when_short_and_none_when_impossible():
    short = recommend(LLAMA8B, 2048, 8, 80 * GIB)
    assert short.sp == 1 and not short.ckpt_offload
    assert recommend(LLAMA8B, 50_000_000, 8, 80 * GIB) is None


def test_past_the_heads_the_plan_takes_the_smallest_ring_within_a_node(capsys):
    # Llama-3.1-8B has 32 heads: 20M tokens need every one of 64 GPUs, so sp 64 = Ulysses 8 (a node) x ring 8
    setup = recommend(LLAMA8B, 20_000_000, 64, 80 * GIB)
    assert (setup.sp, setup.ring) == (64, 8)
    assert UlyssesConfig.from_dict(ulysses_section(setup)).ring_size == 8
    assert recommend(LLAMA8B, 2048, 64, 80 * GIB).ring == 1  # within the heads: Ulysses alone
    assert max_seq_len(LLAMA8B, 64, 80 * GIB)[0] > max_seq_len(LLAMA8B, 32, 80 * GIB)[0] * 1.5
    assert cli.main(["plan", "--model", "llama-3.1-8b", "--seq-len", "20M", "--gpus", "64", "--gpu-mem", "80"]) == 0
    assert "sp = Ulysses 8 x ring 8; sent per layer and rank" in capsys.readouterr().out


def test_host_budget_limits_checkpoint_offload():
    """Checkpoint offload keeps one hidden-sized tensor per layer per token on the host: 8 ranks at 1M tokens
    each hold 32 x 1M x 4096 x 2 bytes = 256 GiB apiece, 2 TiB on the node; a smaller host budget shortens the
    longest sequence, and a plan's host total stays within it."""
    free, _ = max_seq_len(LLAMA8B, 8, 80 * GIB)
    for host_gib in (2048, 512):
        seq_len, setup = max_seq_len(LLAMA8B, 8, 80 * GIB, host_gib * GIB)
        host = sum(h for _, h in breakdown(LLAMA8B, setup).values()) * 8
        assert host <= host_gib * GIB
        assert seq_len <= free
    assert max_seq_len(LLAMA8B, 8, 80 * GIB, 512 * GIB)[0] < max_seq_len(LLAMA8B, 8, 80 * GIB, 2048 * GIB)[0]


def test_no_plan_passes_the_int32_index_limit_unless_allowed():
    """ALST's published maxima sit under 2**31 elements per tensor: q over the whole sequence for one rank's
    head group (S x heads / sp x head_dim) passes it at 4M tokens on 8 GPUs."""
    limited, setup = max_seq_len(LLAMA8B, 8, 141 * GIB)
    assert largest_tensor(LLAMA8B, setup) <= INDEX_LIMIT
    assert limited <= INDEX_LIMIT // (LLAMA8B.heads // 8 * LLAMA8B.head_dim)
    unlimited, setup = max_seq_len(LLAMA8B, 8, 141 * GIB, index_limit=None)
    assert unlimited > limited and largest_tensor(LLAMA8B, setup) > INDEX_LIMIT


def test_a_small_host_offloads_the_first_layers_only():
    """A host budget that cannot hold every layer's checkpoints: the plan offloads the first N layers'
    (``activation_checkpoint_offload.layers``) and keeps the others on the device; the node's host total stays
    within the budget and one more layer would pass it."""
    seq_len, host_budget = 2 << 20, 256 * GIB
    setup = recommend(LLAMA8B, seq_len, 8, 80 * GIB, host_budget)
    assert setup is not None and setup.ckpt_offload and 0 < setup.offload_layers < LLAMA8B.layers

    def host(s):
        return sum(h for _, h in breakdown(LLAMA8B, s).values()) * 8

    assert host(setup) <= host_budget < host(replace(setup, offload_layers=setup.offload_layers + 1))
    per_layer = setup.local * LLAMA8B.hidden * 2
    device, on_host = breakdown(LLAMA8B, setup)["checkpointed layer inputs"]
    assert (device, on_host) == (pytest.approx((LLAMA8B.layers - setup.offload_layers) * per_layer),
                                 pytest.approx(setup.offload_layers * per_layer))
    section = UlyssesConfig.from_dict(ulysses_section(setup))
    assert section.activation_checkpoint_offload.layers == setup.offload_layers
    assert recommend(LLAMA8B, seq_len, 8, 80 * GIB, 4096 * GIB).offload_layers is None  # the host holds all

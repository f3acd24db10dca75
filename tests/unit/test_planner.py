"""The memory planner: its terms move the way the ALST tools say they should, and its plans are valid."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from ds_ulysses import cli
from ds_ulysses.config import UlyssesConfig, parse_ds_config
from benchmarks.breakdown_fit import dims_of, measured_terms, planner_terms
from ds_ulysses.plan_search import ulysses_section
from ds_ulysses.planner import (GIB, KNOWN_MODELS, MEASURED_TERMS, TILED_NORMS_FIT, Setup, breakdown, layer_traffic,
                                load_dims, segment_peaks, tiled_attention_units)

LLAMA8B = KNOWN_MODELS["llama-3.1-8b"]


def device_total(dims, setup) -> float:
    return sum(d for d, _ in breakdown(dims, setup).values())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_monotonic_in_sequence_length(checkpointing):
    totals = [device_total(LLAMA8B, Setup(s, 8, 8, checkpointing=checkpointing)) for s in (8192, 32768, 131072, 524288)]
    assert totals == sorted(totals) and len(set(totals)) == len(totals)


def test_sequence_parallelism_divides_activations():
    one = breakdown(LLAMA8B, Setup(65536, 8, 1))
    eight = breakdown(LLAMA8B, Setup(65536, 8, 8))
    for term in ("checkpointed layer inputs", "layer recompute + backward", "logits + loss"):
        assert eight[term][0] == pytest.approx(one[term][0] / 8, rel=1e-3)


@pytest.mark.parametrize("act_bytes,untiled,fused", [(4, 12, 4), (2, 16, 6)])
def test_tiled_loss_holds_one_tile_of_one_buffer(act_bytes, untiled, fused):
    # untiled: autograd's logits, log-softmax and gradient in fp32 (+ bf16 logits); tiled: one fp32 buffer
    # per tile (+ the bf16 logits it upcasts), memory.fused_ce
    logits = 65536 * LLAMA8B.vocab
    base = breakdown(LLAMA8B, Setup(65536, 1, 1, act_bytes=act_bytes))["logits + loss"][0]
    assert base == logits * untiled
    for tiles in (2, 8, 64):
        got = breakdown(LLAMA8B, Setup(65536, 1, 1, act_bytes=act_bytes, tiled_loss=tiles))["logits + loss"][0]
        assert got == pytest.approx(logits / tiles * fused)


def test_tiled_mlp_only_shrinks_the_layer_working_set():
    plain, tiled = (breakdown(LLAMA8B, Setup(65536, 1, 1, tiled_mlp=t)) for t in (1, 16))
    assert tiled["layer recompute + backward"][0] < plain["layer recompute + backward"][0]
    assert tiled["logits + loss"] == plain["logits + loss"]
    assert tiled["checkpointed layer inputs"] == plain["checkpointed layer inputs"]


def test_checkpoint_offload_moves_layer_inputs_to_the_host():
    on_device = breakdown(LLAMA8B, Setup(65536, 1, 1))["checkpointed layer inputs"]
    offloaded = breakdown(LLAMA8B, Setup(65536, 1, 1, ckpt_offload=True))["checkpointed layer inputs"]
    assert offloaded == (0.0, on_device[0])
    # 32 layers x 64K tokens x 4096 x bf16
    assert on_device[0] == 32 * 65536 * 4096 * 2


def test_checkpointing_saves_more_than_it_costs():
    assert device_total(LLAMA8B, Setup(65536, 1, 1, checkpointing=True)) < \
        device_total(LLAMA8B, Setup(65536, 1, 1, checkpointing=False)) / 3


def test_llama_8b_numbers_are_sane():
    assert LLAMA8B.params == pytest.approx(8.03e9, rel=0.01)
    # ZeRO-3 without offload: fp32 master + Adam + fp32 grads = 16 bytes per parameter, over 8 GPUs
    states = breakdown(LLAMA8B, Setup(4096, 8, 1, offload_optimizer=False))["gradients + optimizer states"]
    assert states[0] == pytest.approx(16 * LLAMA8B.params / 8)


def test_written_section_is_valid(tmp_path, capsys):
    section = ulysses_section(Setup(1 << 20, 8, 8, ckpt_offload=True, tiled_mlp=32, tiled_loss=16))
    cfg = UlyssesConfig.from_dict(section)
    assert (cfg.sp, cfg.tiled_mlp.shards, cfg.tiled_loss.shards) == (8, 32, 16)
    out = tmp_path / "plan.json"
    code = cli.main(["plan", "--model", "meta-llama/Llama-3.1-8B", "--seq-len", "1M", "--gpus", "8",
                     "--gpu-mem", "80", "--write", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| term | device GiB | host GiB |" in printed and "total per rank" in printed
    _, parsed = parse_ds_config(str(out))
    assert parsed.sp in (2, 4, 8)  # 1M tokens cannot fit without SP
    assert json.loads(out.read_text())["zero_optimization"]["stage"] == 3


def test_model_from_a_config_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "vocab_size": 32000}))
    assert load_dims(str(tmp_path)) == KNOWN_MODELS["ds-ulysses-bench"]


def test_unknown_model_and_impossible_plan_exit_codes(capsys):
    with pytest.raises(ValueError, match="neither a known name"):
        load_dims("no-such-model")
    assert cli.main(["plan", "--model", "no-such-model", "--seq-len", "4K", "--gpus", "1", "--gpu-mem", "80"]) == 2
    assert cli.main(["plan", "--model", "llama-3.1-8b", "--seq-len", "100M", "--gpus", "1", "--gpu-mem", "80"]) == 1
    assert "nothing fits" in capsys.readouterr().err


def test_layer_traffic_counts_what_leaves_a_rank():
    dims = KNOWN_MODELS["ds-ulysses-bench"]  # 8 heads, 2 KV heads, head size 32
    b, s = 2, 4096
    # Ulysses 4: q, k, v, out (8 + 4 + 4 + 8 heads: each KV head goes to 2 ranks) of S/4 tokens, 3/4 of each sent,
    # forward and backward; benchmarks/ring_layouts.py counted the same bytes (fp32, S 1024) on 4 gloo ranks
    assert layer_traffic(dims, Setup(s, 4, 4)) == {"ulysses": 2 * (s / 4) * 32 * 24 * 3 / 4 * b, "ring": 0.0}
    assert layer_traffic(dims, Setup(1024, 4, 4, act_bytes=4))["ulysses"] == 1179648
    # Ulysses 2 x ring 2: each rank's K/V block is 1 KV head x S/2 tokens; 1 send forward, 1 back, 2 fp32 grads
    block = 2 * 1 * (s / 2) * 32
    assert layer_traffic(dims, Setup(s, 4, 4, ring=2)) == {"ulysses": 2 * (s / 4) * 32 * 20 / 2 * b,
                                                           "ring": 2 * block * b + 2 * block * 4}
    assert layer_traffic(dims, Setup(s, 4, 4, ring=4))["ulysses"] == 0.0
    assert [layer_traffic(dims, Setup(1024, 4, 4, act_bytes=4, ring=r))["ring"] for r in (2, 4)] == [524288, 1310720]
    assert breakdown(dims, Setup(s, 4, 4, ring=2))["ring blocks in flight"][0] > 0


def test_the_loss_and_the_layers_peak_apart():
    """Measured terms: the step's working set is its largest segment, not the sum of the loss's and a layer's."""
    setup = Setup(1 << 20, 8, 8, ckpt_offload=True, tiled_mlp=32, tiled_loss=512)
    segments = segment_peaks(LLAMA8B, setup)
    working = [v for k, v in breakdown(LLAMA8B, setup).items() if k.startswith("step working set")]
    assert working == [(max(d for d, _ in segments.values()), 0.0)]
    assert working[0][0] < sum(d for d, _ in segments.values())


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_tiled_attention_term_is_one_function_of_the_shards(shards):
    base = Setup(1 << 20, 8, 8, ckpt_offload=True, tiled_mlp=32, tiled_loss=512)
    tiled = Setup(1 << 20, 8, 8, ckpt_offload=True, tiled_mlp=32, tiled_loss=512, tiled_attention=shards)
    saved = segment_peaks(LLAMA8B, base)["layer"][0] - segment_peaks(LLAMA8B, tiled)["layer"][0]
    assert saved == pytest.approx(tiled_attention_units(LLAMA8B, shards, 2) * (1 << 17) * LLAMA8B.hidden * 2)
    assert (saved == 0) == (shards == 1)


def _breakdown_records():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "breakdown.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("kind") == "breakdown" and "error" not in r]


def _latest(records, name, sp):
    return [r for r in records if r["name"] == name and r["sp"] == sp][-1]


def test_the_planner_holds_the_fit_of_the_latest_breakdown_records():
    """Every measured figure the plans use is fitted from benchmarks/results/breakdown.jsonl (printed by
    ``python -m benchmarks.breakdown --report-only --terms``): a new record without a refit fails here."""
    fitted = measured_terms(_breakdown_records(), "benchmarks/results/breakdown.jsonl")["terms"]
    held = {recipe: {sp: {seg: asdict(t) for seg, t in segs.items()} for sp, segs in by_sp.items()}
            for recipe, by_sp in MEASURED_TERMS["terms"].items()}
    assert held == fitted


def test_tiled_attention_and_tiled_norms_terms_are_the_measured_differences():
    """What the two switches take off each segment is the difference between the latest records measured side by
    side in one run (ours, ours[tiled_attention], ours[tiled_attention,tiled_norms], sp 2), in the units the
    planner counts (per-token units and fp32 norm units)."""
    records = _breakdown_records()
    base, attention, norms = (planner_terms(_latest(records, name, 2)) for name in
                              ("ours", "ours[tiled_attention]", "ours[tiled_attention,tiled_norms]"))
    dims = dims_of(_latest(records, "ours[tiled_attention]", 2))
    assert base["layer"]["units"] - attention["layer"]["units"] == pytest.approx(tiled_attention_units(dims, 2, 4),
                                                                                 abs=0.01)
    for segment in base:
        units, norm = TILED_NORMS_FIT.get(segment, (0.0, 0.0))
        assert attention[segment]["units"] - norms[segment]["units"] == pytest.approx(units, abs=0.01), segment
        assert attention[segment]["norm_units"] - norms[segment]["norm_units"] == pytest.approx(norm, abs=0.01), \
            segment


def test_tiled_norms_take_their_fit_off_each_segment():
    base = Setup(1 << 20, 8, 8, ckpt_offload=True, tiled_mlp=32, tiled_loss=512, tiled_attention=4)
    plain, normed = segment_peaks(LLAMA8B, base), segment_peaks(LLAMA8B, replace(base, tiled_norms=True))
    fp32_unit = (1 << 17) * LLAMA8B.hidden * 4
    for segment, (units, norm) in TILED_NORMS_FIT.items():
        if segment in plain:
            saved = plain[segment][0] - normed[segment][0]
            assert saved == pytest.approx(units * fp32_unit / 2 + norm * fp32_unit), segment
    assert UlyssesConfig.from_dict(ulysses_section(replace(base, tiled_norms=True))).tiled_norms.enabled

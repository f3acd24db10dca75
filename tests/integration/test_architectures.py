"""The architecture sweep's fast subset: representative models are exact under SP or refused by name.

One SP step at sp 2 on 2 gloo ranks vs the unsharded model, through the drop-in API and (tiled loss,
ZeRO-3; a few with tiled MLPs, checkpoint offload or both with the loss in tiles, or tiled attention) through
``ds_ulysses.initialize``, MoE router losses among them (tiled MoE blocks too, on 2 padded rows), and Llama
in other layouts (sp 4, a padded length, 2 rows, with Mixtral's router loss too; dp 2 x sp 2 for 3 steps;
2 micro-batches per step, Mixtral among it; bf16 at ZeRO-1 and fp16 at ZeRO-2, and Gemma 3 in bf16 at
ZeRO-3; Ulysses 2 x ring 2), and the flash path (a stand-in kernel) for softcaps, sinks and windows; the full sweep is
``python -m tests.architectures`` (``--core flash-standin`` for the flash path).
A model is never allowed to come out ``wrong`` (silently off) or ``crash``; a refusal must name the
real cause.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.architectures import _outcome, _step, run_cases, summary, write_reports
from tests.support.engine_cases import require_fp16

DROPIN = [
    "llama", "qwen3", "gemma3_text", "cohere", "granite", "gpt_neox", "phi",
    "mistral",     # sliding window 16 < 64 tokens: the window reaches the core as sliding_window
    "mixtral",     # MoE (no aux loss in the default config)
    "qwen2_moe",   # MoE with a shared expert
    "bamba",       # mamba layers: refused at registration
    "gpt2",        # merges heads itself after the attention call
    "gptj",        # partial RoPE: rotary_dim (8) of a head's 16 dims, rotated interleaved
    "jetmoe",      # K/V head count at the call (kv heads * top_k) differs from the config
    "modernbert-decoder",  # get_decoder() is not the text decoder
    "falcon",      # its sdpa branch calls F.scaled_dot_product_attention itself: refused at the first forward
    "doge",        # builds its own attention mask inside the attention module: refused
    "gemma4_text",  # per-layer head_dim (16 vs 512): each call's q/k/v decide the head split
    "ctrl",        # positions reach neither its attention calls nor a module (it indexes a table): refused
    "gpt_bigcode",  # its attention calls get no position_ids; its position embedding takes the call's: served
    "llama+rope_dynamic",  # RoPE scaled by the batch's longest position: refused
    "mixtral+aux",  # a router load-balancing loss: the whole sequence's, from the SP group's routing statistics
    "llama4_text+full",         # Llama 4 without chunks: MoE, a NoPE layer, L2-normed q/k: served
    "llama4_text+temperature",  # its NoPE layer scales queries by a position counted from the shard: refused
]
ENGINE = ["llama@tiled", "cohere@tiled", "granite@tiled", "gemma3_text@tiled",
          "longcat_flash@tiled",  # MoE with identity experts, its block a ZeRO-3 leaf (without, gloo aborts the step)
          "mixtral@mlp",          # tiled MLPs; the MoE block is a ZeRO-3 leaf by DeepSpeed's default
          "qwen2_moe+aux@tiled",  # a router loss beside the tiled loss, which runs the decoder itself
          "mixtral+aux@mlp",      # a router loss from tiled MoE blocks: their joined router logits carry the gradient
          "longcat_flash@mlp",    # tiled MLPs, the tiled block the leaf
          "opt@mlp",              # no module named mlp: tiled_mlp refused, not silently off
          "llama@offload",        # checkpointed layers with their inputs on the host
          "gemma3_text@all-tools",  # loss tiles, tiled MLPs and offload at once; a tied, soft-capped head
          "llama@attention",        # tiled attention under ZeRO-3: the projections gathered once per pass
          "gemma3_text@attention",  # per-head q/k norms, sliding layers
          "olmo2@attention",        # a q/k norm over all heads' features: tiled_attention refused
          "gemma3_text@norms",      # tiled norms: sandwich norms, (1 + weight) scaling, a tied head
          "olmo2@norms"]            # norms after the blocks, on their outputs
# the cause a refusal must name
REFUSED_FOR = {"opt@mlp": "tiled_mlp is enabled but OPTForCausalLM's decoder has no module named 'mlp'",
               "olmo2@attention": "its q_norm normalises every head's features together",
               "ctrl": "none of the decoder's own modules (a position or rotary embedding) took that tensor",
               "llama4_text+temperature": "by each token's position (attn_temperature_tuning, floor_scale=4)"}
# served, never refused
EXACT = {"llama", "mixtral", "mixtral+aux", "gpt_bigcode", "llama4_text+full", "llama@tiled", "qwen2_moe+aux@tiled",
         "mixtral+aux@mlp", "llama@attention", "gemma3_text@attention", "gemma3_text@norms", "olmo2@norms"}


def _names(params) -> list[str]:
    return [p.values[0] if hasattr(p, "values") else p for p in params]


@pytest.fixture(scope="module")
def dropin_results():
    return run_cases(_names(DROPIN), "dropin", case_timeout=120)


@pytest.fixture(scope="module")
def engine_results():
    return run_cases(_names(ENGINE), "engine", case_timeout=120)


def _check(rec: dict) -> None:
    assert rec["status"] in ("exact", "refused"), f"{rec['model']} came out {rec['status']}: {summary(rec)}"
    if rec["status"] == "refused":
        message = rec["message"]
        assert "fix" in message, f"a refusal must say how to fix it: {message}"
        # the sweep always passes position_ids (the adapter's batch): a refusal blaming them names the wrong cause
        assert "needs position_ids" not in message, f"refusal names the wrong cause: {message}"


@pytest.mark.parametrize("name", DROPIN)
def test_dropin_api_is_exact_or_refuses(name, dropin_results):
    _check(dropin_results[name])
    assert name not in EXACT or dropin_results[name]["status"] == "exact", summary(dropin_results[name])
    if name in REFUSED_FOR:
        assert dropin_results[name]["status"] == "refused" and REFUSED_FOR[name] in dropin_results[name]["message"]


# the drop-in API on the flash path: flash_attention_2's contract in plain torch (tests.support.sp_cases.flash_standin)
# against the model run eager, for what that path hands the kernel beside q/k/v
FLASH = ["gemma2",   # attention logits soft-capped (softcap), no sdpa
         "gpt_oss",  # attention sinks (s_aux), one per query head: each rank's core gets its own heads' sinks
         "mistral"]  # a sliding window shorter than the sequence (sliding_window)


def test_the_flash_path_is_exact_for_softcaps_sinks_and_windows():
    records = run_cases(FLASH, "dropin", case_timeout=120, core="flash-standin")
    for rec in records.values():
        assert rec["status"] == "exact", summary(rec)


@pytest.mark.slow
@pytest.mark.parametrize("case", ENGINE)
def test_initialize_tiled_loss_is_exact_or_refuses(case, engine_results):
    _check(engine_results[case])
    assert case not in EXACT or engine_results[case]["status"] == "exact", summary(engine_results[case])
    if case in REFUSED_FOR:
        assert engine_results[case]["status"] == "refused" and REFUSED_FOR[case] in engine_results[case]["message"]


def test_the_sweep_runs_in_another_layout():
    """``--sp 4 --length 70 --batch 2``: 4 ranks share the 2 KV heads, the adapter pads 70 tokens to 4 shards
    of 18, and every micro-batch has 2 rows; Mixtral's router loss must not count the 2 padded tokens."""
    records = run_cases(["llama", "mixtral+aux"], "dropin", sp=4, length=70, docs=[30, 25, 15], batch=2,
                        case_timeout=120)
    for rec in records.values():
        assert rec["status"] == "exact", summary(rec)
        assert rec["shard_shape"] == [2, 18]
        assert [len(rec["steps"][kind]) for kind in ("plain", "packed")] == [4, 4]  # one step per rank's sample


def test_the_sweep_runs_with_a_ring():
    """``--sp 4 --ring 2``: Ulysses 2 x ring 2 through the drop-in call's ``ring_size`` and the adapter's head-tail
    layout, plain samples only. Llama and Mixtral's router loss (its routing statistics over the whole
    sequence, in head-tail order) are exact; Mistral's window of 16 tokens over 64, which the ring does not
    serve, is refused by name."""
    records = run_cases(["llama", "mixtral+aux", "mistral"], "dropin", sp=4, ring=2, case_timeout=120)
    for name in ("llama", "mixtral+aux"):
        rec = records[name]
        assert rec["status"] == "exact" and rec["ring"] == 2, summary(rec)
        assert list(rec["steps"]) == ["plain"] and len(rec["steps"]["plain"]) == 4  # one step per rank's sample
    assert records["mistral"]["status"] == "refused"
    assert "asks for a sliding window of 16 tokens over a 64-token sequence" in records["mistral"]["message"]


@pytest.mark.slow
def test_tiled_moe_blocks_give_the_router_loss_their_logits_in_token_order():
    """``--length 63 --batch 2`` with tiled MLPs (4 tiles) and Mixtral's router loss: each micro-batch has 2 rows
    the adapter pads, and a tile records its router logits batch-major, so the tiles' logits must be joined
    in token order to meet the padding mask (joined tile after tile, the gate's gradient is 0.13 away)."""
    rec = run_cases(["mixtral+aux@mlp"], "engine", sp=2, length=63, docs=[20, 30, 13], batch=2,
                    case_timeout=120)["mixtral+aux@mlp"]
    assert rec["status"] == "exact", summary(rec)


@pytest.mark.slow
def test_the_engine_check_runs_data_parallel_sp_groups_for_several_steps():
    """``--dp 2 --steps 3``: 4 ranks as 2 SP groups of 2, each on samples of its own, 3 optimizer steps (lr 0),
    the third micro-batch from the loaders' second batch; every step's ZeRO-3 gradient must be the mean of
    that step's two samples' unsharded gradients (feeding both groups the same sample, or comparing every
    step with the first step's samples, comes out wrong)."""
    rec = run_cases(["llama@tiled"], "engine", sp=2, dp=2, steps=3, case_timeout=120)["llama@tiled"]
    assert rec["status"] == "exact", summary(rec)
    assert [len(rec["steps"][kind]) for kind in ("plain", "packed")] == [3, 3]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama@loss-tiles", "mixtral@mlp"])
def test_the_engine_check_accumulates_gradients_over_micro_batches(case):
    """``--gas 2 --steps 2``: gradient_accumulation_steps 2 with the loss in 4 tiles (the fused head and
    cross-entropy, its gradient computed in forward and scaled in backward by the 1/GAS DeepSpeed puts on
    each micro-batch's loss) and with tiled MLPs (their parameters' gradients held back over the tiles,
    then reduced), Mixtral's MoE block, DeepSpeed's default ZeRO-3 leaf, being the tiled MLP. Each step's
    gradient must be the mean of its two micro-batches' unsharded gradients (comparing with the last
    micro-batch's alone comes out wrong)."""
    rec = run_cases([case], "engine", sp=2, steps=2, gas=2, case_timeout=120)[case]
    assert rec["status"] == "exact", summary(rec)
    assert [len(rec["steps"][kind]) for kind in ("plain", "packed")] == [2, 2]


@pytest.mark.slow
@pytest.mark.parametrize("case,zero,dtype", [("llama@loss-tiles", 1, "bf16"), ("gemma3_text@loss-tiles", 3, "bf16"),
                                            ("llama@loss-tiles", 2, "fp16")])
def test_the_engine_check_runs_in_low_precision(case, zero, dtype):
    """``--dtype bf16|fp16``: the engine with bf16 parameters (ZeRO-1 then reduces through DeepSpeed's
    BF16_Optimizer, a path fp32 never takes) or fp16 ones under a dynamic loss scale (every backward's incoming
    gradient 16, not 1: a tiled loss that dropped it is off by that factor), judged against the fp32
    reference with the unsharded model's own distance from it in that precision as the noise."""
    if dtype == "fp16":
        require_fp16()
    rec = run_cases([case], "engine", sp=2, zero=zero, dtype=dtype, case_timeout=120)[case]
    assert rec["status"] == "exact", summary(rec)
    assert rec["param_dtype"] == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[dtype]
    steps = [s for kind in ("plain", "packed") for s in rec["steps"][kind]]
    assert len(steps) == 2 and all(0 < s["grad_excess"] <= 1 for s in steps)


def _grads(scale: float, seed: int, jitter: float) -> dict:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(64, generator=torch.Generator().manual_seed(0))
    return {"w": scale * base * (1 + jitter * torch.randn(64, generator=gen)),
            "b": scale * base[:8] * (1 + jitter * torch.randn(8, generator=gen))}


def test_the_low_precision_judgment_takes_noise_and_refuses_a_factor():
    """In bf16 or fp16 a step is exact when its distance from the fp32 reference is within 4x the unsharded
    model's (plus a floor); a gradient off by a factor (a scale applied twice) or a loss off by a dropped
    term is wrong, however noisy that precision is; a step whose low-precision reference overflowed is left
    out (Gemma 3 in fp16)."""
    ref = {"loss": 2.0, "grads": _grads(1.0, 0, 0.0), "low": {"loss": 2.0 * (1 + 3e-3), "grads": _grads(1.0, 1, 1e-2)}}
    has = {"w": True, "b": True}
    noisy = _step(2.0 * (1 - 5e-3), _grads(1.0, 2, 2e-2), has, ref)
    assert _outcome({}, {"plain": [noisy]})["status"] == "exact"
    assert _outcome({}, {"plain": [_step(2.0, _grads(2.0, 2, 1e-2), has, ref)]})["status"] == "wrong"
    assert _outcome({}, {"plain": [_step(2.0 * 1.05, _grads(1.0, 2, 1e-2), has, ref)]})["status"] == "wrong"
    one_param = {**_grads(1.0, 2, 1e-2), "b": 0.5 * _grads(1.0, 2, 1e-2)["b"]}
    assert _outcome({}, {"plain": [_step(2.0, one_param, has, ref)]})["status"] == "wrong"
    overflowed = {**ref, "low": {**ref["low"], "grads": {**ref["low"]["grads"], "b": torch.full((8,), math.inf)}}}
    skipped = _step(2.0, _grads(1.0, 2, 2e-2), has, overflowed)
    assert skipped["ref_nonfinite"] and _outcome({}, {"plain": [skipped, noisy]})["status"] == "exact"
    assert _outcome({}, {"plain": [skipped]})["status"] == "n/a"


def test_a_model_with_nothing_to_compare_is_not_counted_exact():
    """A step whose unsharded reference is non-finite is left out; a model left with no compared step at all
    is ``n/a`` (Gemma 3n at dp 2 with 2 micro-batches: every step's mean gradient had a non-finite
    sample), not ``exact``, and one wrong step makes it ``wrong``."""
    ok = {"loss_rel": 0.0, "grad_rel": 0.0, "no_grad": [], "ref_nonfinite": False}
    off = {**ok, "grad_rel": 1.0}
    na = {**off, "ref_nonfinite": True}
    assert _outcome({}, {"plain": [na], "packed": [na, na]})["status"] == "n/a"
    assert _outcome({}, {"plain": [na, ok], "packed": [na]})["status"] == "exact"
    assert _outcome({}, {"plain": [na], "packed": [ok, off]})["status"] == "wrong"


def test_the_sweep_writes_its_reports_into_a_directory_it_makes(tmp_path):
    """``--out runs/sweep/architectures.jsonl`` on a fresh checkout: the reports land there (the sweep used
    to run for minutes and then fail on the missing directory)."""
    out = tmp_path / "runs" / "sweep" / "architectures.jsonl"
    rec = {"model": "llama", "mode": "dropin", "status": "exact", "steps": {}}
    md = write_reports([rec], str(out))
    assert [json.loads(line) for line in out.read_text().splitlines()] == [rec]
    assert "llama" in Path(md).read_text()

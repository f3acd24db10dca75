"""The architecture sweep: every decoder-only causal LM of Transformers, one SP step vs the unsharded model.

For each model type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (encoder-decoders and models without
sdpa left out), a tiny model is built from config (:func:`tiny_config`, per-model overrides in
:data:`OVERRIDES`, each with its reason), and on 2 gloo ranks at sp 2 the drop-in API
(``UlyssesSPAttentionHF.register_with_transformers`` + ``enable_sp_loss`` +
``UlyssesSPDataLoaderAdapter``) trains one step per micro-batch on a plain and on a packed sample. The
loss and every parameter's gradient (summed over the SP ranks) are compared with the same weights run
unsharded in one process. Each model comes out as one of

- ``exact``: loss rel <= 1e-5 and every gradient rel <= 1e-4 (the design's correctness bar);
- ``refused``: a ValueError at registration/setup or on the first SP forward (the message is kept);
- ``wrong``: ran, numbers off (loss rel, worst gradient and its parameter, parameters left without a
  gradient) -- the worst outcome;
- ``crash``: any other exception (type, message, innermost ds_ulysses and transformers frames);
- ``skipped``: could not be built tiny or does not run unsharded (not a finding about SP);
- ``n/a``: ran, but the unsharded model's own gradients (in fp32, or in the ``--dtype`` it runs) are
  non-finite on every step, so nothing was compared (a model with some such steps is judged on the
  others, and the summary counts the left-out).

``--engine`` runs the same comparison (steps on plain samples, steps on packed samples, each kind with
an engine of its own) through ``ds_ulysses.initialize`` under ZeRO-3 for
:data:`ENGINE_MODELS`, with each section of :data:`ENGINE_SECTIONS`: the default "ulysses" section
(tiled loss on, its "auto" tile count one at these lengths), the tiled loss off (the path where a model's
head transform, Cohere ``logit_scale``, Granite ``logits_scaling``, Gemma softcapping, can be dropped),
the loss in 4 tiles (the fused head and cross-entropy that "auto" picks at long sequences), tiled MLPs,
checkpoint offload, all three tools at once, and tiled attention (``--section attention``: exact, or refused
by name where a block is not a sum over heads).
``--engine-all`` runs every model through it with one section (``--section``, the default one unless told).

Many models share one pair of ranks (spawning costs more than a tiny model); the parent watches
every case and, when one stalls or kills a rank, records it and restarts the ranks for the rest.

    python -m tests.architectures [--all | --models llama,gpt2] [--engine] [--engine-all] [--out FILE]
                                  [--sp N] [--dp N] [--length TOKENS] [--docs A,B,C] [--batch ROWS] [--steps N]
                                  [--gas N] [--zero N] [--dtype bf16|fp16] [--ring N]

``--sp``, ``--dp``, ``--length``, ``--docs`` and ``--batch`` pick another layout than the default (one SP
group of 2 ranks, one row of 64 tokens, documents 24+25+15): e.g. sp 4, where the tiny models' 2 KV heads
are replicated over the ranks; sp 3, where 4 query heads split unevenly; dp 2, two SP groups each on a
sample of its own, where the engine's gradient must be the mean of the samples' unsharded gradients; a
length that is not a multiple of sp, which the adapter pads; micro-batches of several rows. ``--steps N``
runs the engine check for N optimizer steps (lr 0, so the reference's weights hold), each on a new sample:
what a step leaves behind (ZeRO-3's recorded trace, the SP hooks' state) meets the next one. ``--gas N``
makes each step N micro-batches (gradient_accumulation_steps), each on a new sample: the step's gradient
must be the mean of its micro-batches' unsharded gradients (DeepSpeed scales each loss by 1/N).
``--zero N`` runs the engine check under ZeRO stage N instead of 3 (each stage reduces SP peers'
gradients on a path of its own; the MoE leaves are ZeRO-3's and only set there). ``--dtype bf16`` runs
the engine with ``"bf16": {"enabled": true}`` (at ZeRO-0 and ZeRO-1 DeepSpeed then reduces through optimizer
wrappers fp32 never uses), ``--dtype fp16`` with ``"fp16"`` and its dynamic loss scale (every backward's
gradient multiplied by it, so a backward that drops its incoming gradient is off by that factor; at ZeRO-0
``initialize`` refuses it, as DeepSpeed would never scale the loss there), and
judges it against the fp32 reference, the unsharded model's own distance from it in that precision being
the noise (``_step``): a scale or a dropped term shows far above it, rounding does not. ``--ring N`` runs both
checks with ``ring_size`` N (the drop-in call's keyword, the section's field): the SP group becomes ``sp / N``
Ulysses ranks times a ring of N (docs/ring.md), e.g. ``--sp 4 --ring 2`` at 2 ranks per head group; on plain
samples only, since the ring refuses packed documents by design.

writes ``FILE`` (JSON lines, one record per model) and ``FILE`` with ``.md`` (a table grouped by
cause). The fast subset for ``make test`` is ``tests/integration/test_architectures.py``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import queue as queue_mod
import re
import sys
import time
import traceback
import warnings

import torch

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # design.md's correctness bar (fp32, CPU)
# bf16 and fp16 (--dtype): the SP run's distance from the fp32 reference, for the loss and for each
# gradient, may be this many times the unsharded model's own distance in that precision (its noise), or up
# to the floor. A gradient's distance is relative to its norm or, for gradients under LOW_NORM_FLOOR of the
# whole model's, to that floor: DiffLlama's lambdas and xIELU's alphas are sums over every token that
# nearly cancel, and bf16 rounding moves them by up to 3x their own norm from one summation order to another.
LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LOW_LOSS_FACTOR, LOW_LOSS_FLOOR = 4.0, 1e-4
LOW_GRAD_FACTOR, LOW_GRAD_FLOOR = 4.0, 1e-2
LOW_NORM_FLOOR = 1e-3
# fp16's initial dynamic loss scale, 2^4: DeepSpeed's default 2^16 (and even 2^8, times sp at ZeRO-3) overflows
# the tiny random models' embedding gradients; 16 still shows a backward that drops its incoming gradient
FP16_SCALE_POWER = 4
SP = 2
LENGTH = 64                       # tokens per sample; shards of 32 at sp 2
PACKED_DOCS = [24, 25, 15]        # documents of the packed sample; the second crosses the shard boundary
SEED = 0
# the core attention the drop-in check registers: sdpa, or flash_attention_2 as a stand-in that computes, in
# plain torch on CPU, what Transformers' flash path would (tests.support.sp_cases.flash_standin: no mask,
# documents from position_ids, sliding_window, softcap, attention sinks), against the model run eager
CORES = ("sdpa", "flash-standin")
MAX_PARAMS = 3_000_000          # a tiny model here has 0.1-1M parameters
SPAWN_SECONDS = 120             # on top of the case timeout, for a rank to start (imports, process group)

# The tiny shape every model gets, for the keys its config has (aliases like n_embd resolve through
# the config's attribute_map). 4 query / 2 KV heads exercise GQA at sp 2 (one KV head per rank).
TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    # MoE: few, small experts (defaults reach 256-512 experts)
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
    topk_group=1, ffn_dim=128,
    # MLA (deepseek-style latent attention)
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # a window shorter than the sample, so sliding layers really slide under SP (only where the
    # default config has a window: see _applicable)
    sliding_window=16,
    # token ids inside the tiny vocabulary (an out-of-range padding_idx does not build)
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
# Head transforms whose default is the identity get a value that changes the loss, so a loss path
# that drops them shows up (design: "whatever a model does to its logits after lm_head is part of
# its loss"). Cohere's logit_scale defaults to 0.0625 already.
EXERCISE = dict(logits_scaling=4.0, final_logit_softcapping=0.5, lm_head_multiplier=2.0)
# Sub-configs of composite (multimodal) models that are not the text model: shrunk the same way.
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, depth=1,
             num_heads=2, num_key_value_heads=2, head_dim=16, embed_dim=32, hidden_act="gelu")

# Encoder families whose causal-LM head is causal only with is_decoder=True (without it Transformers
# warns and every layer attends both ways): swept as the decoders they are meant to be.
ENCODER_AS_DECODER = frozenset({"bert", "bert-generation", "camembert", "data2vec-text", "electra", "ernie", "roberta",
                                "roberta-prelayernorm", "roc_bert", "xlm-roberta", "xlm-roberta-xl", "xmod"})

# Per-model overrides, one reason each. Keys are model types (or variants, ``type+name``, which add
# a feature the default config leaves off). Applied after TINY/EXERCISE, so they win.
OVERRIDES: dict[str, tuple[dict, str]] = {
    # hybrids: two layers of the default pattern are all recurrent/linear (the model then has no
    # attention layer at all and does not run); one of each kind is what SP must refuse or serve
    "bailing_hybrid": (dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                            num_experts_per_token=2, linear_head_dim=16, num_nextn_predict_layers=0),
                       "one linear-attention and one full-attention layer; small heads"),
    "bamba": (dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_state=16, mamba_chunk_size=16),
              "one mamba and one attention layer; small SSM"),
    "granitemoehybrid": (dict(layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_state=16,
                              mamba_chunk_size=16, shared_intermediate_size=32),
                         "one mamba and one attention layer; small SSM"),
    "jamba": (dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                   mamba_d_state=16, mamba_dt_rank=8), "layer 0 mamba, layer 1 attention + MoE; small SSM"),
    "qwen3_5_text": (dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                          linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4),
                     "one gated-DeltaNet and one full-attention layer"),
    "qwen3_5": (dict(text_config=dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                                      linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)),
                "as qwen3_5_text"),
    "qwen3_5_moe_text": (dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                              linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4),
                         "as qwen3_5_text"),
    "qwen3_5_moe": (dict(text_config=dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                                          linear_value_head_dim=16, linear_num_key_heads=2,
                                          linear_num_value_heads=4)), "as qwen3_5_text"),
    "qwen3_next": (dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4),
                   "as qwen3_5_text"),
    "recurrent_gemma": (dict(block_types=["recurrent", "attention"], lru_width=64, attention_window_size=16),
                        "one recurrent and one attention block; small LRU"),
    "zamba2": (dict(layers_block_type=["linear_attention", "hybrid"], attention_hidden_size=128, mamba_headdim=16,
                    chunk_size=16, mamba_d_state=16), "one mamba and one hybrid (mamba + shared attention) layer"),
    "lfm2": (dict(layer_types=["conv", "full_attention"]),
             "the default lists only attention layers; real LFM2 interleaves short convolutions"),
    "lfm2_moe": (dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
                 "no default layer_types (does not build); one conv and one attention layer"),
    "kimi_linear": (dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                         linear_head_dim=16, num_experts_per_token=2),
                    "one linear-attention and one MLA layer; small heads"),
    "gemma3n_text": (dict(num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"],
                          vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
                          activation_sparsity_pattern=[0.0, 0.0]),
                     "defaults share KV across 15 of 35 layers; 2 layers cannot"),
    "gemma4_text": (dict(layer_types=["sliding_attention", "full_attention"], global_head_dim=32,
                         vocab_size_per_layer_input=128, hidden_size_per_layer_input=8),
                    "the full-attention layer keeps a head_dim of its own (32 vs 16), as the real model's "
                    "(512 vs 256)"),
    "gemma4_unified_text": (dict(layer_types=["sliding_attention", "full_attention"], global_head_dim=32),
                            "as gemma4_text"),
    "gemma4": (dict(text_config=dict(layer_types=["sliding_attention", "full_attention"], global_head_dim=32,
                                     vocab_size_per_layer_input=128, hidden_size_per_layer_input=8)),
               "as gemma4_text"),
    "gemma4_unified": (dict(text_config=dict(layer_types=["sliding_attention", "full_attention"],
                                             global_head_dim=32)), "as gemma4_text"),
    "cohere_compass_text": (dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0),
                                                  "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}),
                            "the model reads RoPE per layer type; the default config has one global entry"),
    "gemma3_text": (dict(layer_types=["sliding_attention", "full_attention"]),
                    "the default 5:1 pattern makes both layers sliding; one of each"),
    "gemma3": (dict(text_config=dict(layer_types=["sliding_attention", "full_attention"])), "as gemma3_text"),
    "zamba": (dict(num_hidden_layers=3, layers_block_type=["hybrid", "linear_attention", "hybrid"],
                   attention_hidden_size=128, mamba_dt_rank=8, mamba_d_state=16),
              "two hybrid layers (their shared attention weights are tied; one alone fails the tie check)"),
    "qwen4_exp_text": (dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                            hc_lowrank=16, ple_embed_dim=16, indexer_n_heads=2, indexer_kv_heads=1,
                            indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4),
                       "one gated-DeltaNet and one full-attention layer with its QSA indexer; small heads"),
    "qwen4_exp": (dict(text_config=dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                                        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                        hc_lowrank=16, ple_embed_dim=16, indexer_n_heads=2, indexer_kv_heads=1,
                                        indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4)),
                  "as qwen4_exp_text"),
    "phi4_multimodal": (dict(audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1,
                                               num_attention_heads=2, nemo_conv_channels=32, ext_pw_out_channel=32,
                                               depthwise_seperable_out_channel=32)),
                        "a small audio encoder (its convolutions have sizes of their own)"),
    "moshi": (dict(depth_decoder_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=2, ffn_dim=64)), "a small depth decoder"),
    "dots3_note_text": (dict(per_layer_config={}, layer_types=["sliding_attention", "indexed_attention"],
                             mlp_layer_types=["dense", "sparse"], index_head_dim=16, index_n_heads=2,
                             shared_experts_intermediate_size=32, index_topk=16, num_key_value_heads=4,
                             head_dim=16),
                        "no per-layer head overrides (the default lists 46 layers); MLA wants KV heads == heads and "
                        "head_dim == nope + rope"),
    "codegen": (dict(rotary_dim=8), "RoPE on the first rotary_dim dims of a head: 64 by default, the tiny head has 16"),
    "gptj": (dict(rotary_dim=8), "as codegen"),
    "zaya": (dict(num_experts_per_tok=1), "ZAYA supports top-1 routing only"),
    "xmod": (dict(default_language="en_XX"), "X-MOD needs a language to pick its adapters"),
    "dbrx": (dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=512,
                  attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                  ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
             "dbrx names its sizes d_model/n_heads/n_layers and keeps attention/FFN in sub-configs; the default "
             "clip_qkv=None crashes in clamp (Transformers 5.23)"),
    "roc_bert": (dict(shape_vocab_size=128, pronunciation_vocab_size=128, shape_embed_dim=16,
                      pronunciation_embed_dim=16), "RoCBert's glyph and pinyin embeddings have their own sizes"),
    # variants: a feature the default config leaves off
    "bert+bidirectional": (dict(is_decoder=False), "BertLMHeadModel as built by default: bidirectional attention "
                                                   "(is_causal False on every layer)"),
    "llama+rope_dynamic": (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0),
                                max_position_embeddings=48),
                           "dynamic NTK RoPE rescales when the longest position passes max_position_embeddings "
                           "(48 < 64 tokens): a shard sees only its own positions"),
    "phi3+longrope": (dict(rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                short_factor=[1.0] * 4, long_factor=[2.0] * 4,
                                                original_max_position_embeddings=48),
                           max_position_embeddings=512, original_max_position_embeddings=48, head_dim=8,
                           hidden_size=32),
                      "longrope switches factors when the sequence passes original_max_position_embeddings"),
    "llama4_text+full": (dict(attention_chunk_size=None, layer_types=["full_attention"] * 2, no_rope_layers=[1, 0],
                              attn_temperature_tuning=False),
                         "Llama 4 without chunked attention, one NoPE layer, no temperature tuning"),
    "llama4_text+temperature": (dict(attention_chunk_size=None, layer_types=["full_attention"] * 2,
                                     no_rope_layers=[1, 0], attn_temperature_tuning=True, floor_scale=4),
                                "the NoPE layer scales its queries by a position it counts from its own input "
                                "(floor_scale 4 < 64 tokens)"),
    "mixtral+aux": (dict(output_router_logits=True, router_aux_loss_coef=0.5),
                    "the router's load-balancing loss is part of the model's loss"),
    "qwen2_moe+aux": (dict(output_router_logits=True, router_aux_loss_coef=0.5),
                      "the router's load-balancing loss is part of the model's loss"),
    **{f"{moe}+aux": (dict(output_router_logits=True, router_aux_loss_coef=0.5), "as mixtral+aux")
       for moe in ("qwen3_moe", "olmoe", "granitemoe", "gpt_oss", "minimax", "flex_olmo", "ernie4_5_moe", "phimoe",
                   "dbrx", "doge", "granitemoeshared", "jamba")},
    "jetmoe+aux": (dict(output_router_logits=True, aux_loss_coef=0.5), "as mixtral+aux, JetMoE's coefficient name"),
}


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    import transformers
    transformers.logging.set_verbosity_error()


def model_type_of(name: str) -> str:
    return name.split("+")[0]


def candidates(core: str = "sdpa") -> tuple[list[str], dict[str, str]]:
    """Model types to sweep (plus variants) under ``core``, and the skipped ones with why."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    keep, skipped = [], {}
    for model_type, cls_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        cls = getattr(transformers, cls_name, None)
        if cls is None:
            skipped[model_type] = f"{cls_name} is not importable"
            continue
        flag, short = ("_supports_flash_attn", "flash") if core == "flash-standin" else ("_supports_sdpa", "sdpa")
        if not getattr(cls, flag, False):
            skipped[model_type] = f"no {short}: {cls_name}.{flag} is False"
            continue
        try:
            cfg = AutoConfig.for_model(model_type)
        except Exception as err:  # noqa: BLE001 -- a config that does not build from defaults
            cfg = None
            if model_type not in OVERRIDES:
                skipped[model_type] = f"no config: the default config does not build: {type(err).__name__}: " \
                                      f"{_first_line(err)}"
                continue
        if cfg is not None and getattr(cfg, "is_encoder_decoder", False):
            skipped[model_type] = "encoder-decoder: not a decoder-only model"
            continue
        keep.append(model_type)
    keep += [name for name in OVERRIDES if "+" in name]
    return keep, skipped


def _has(cfg, key: str) -> bool:
    """Whether ``key`` can be passed to the config class (a field, an alias, a settable property).

    ``hasattr`` is not enough: read-only properties (falcon's head_dim) take no value, and per-layer
    attributes (gemma4's head_dim) raise on a global read."""
    cls = type(cfg)
    attr = getattr(cls, key, None)
    if isinstance(attr, property):
        return attr.fset is not None
    return (key in getattr(cls, "attribute_map", {}) or key in getattr(cls, "__dataclass_fields__", {})
            or key in vars(cfg))


def _applicable(cfg, values: dict) -> dict:
    out = {k: v for k, v in values.items() if _has(cfg, k)}
    if "sliding_window" in out and not vars(cfg).get("sliding_window"):
        del out["sliding_window"]  # shrink a window the model has; do not add one it has not
    if "kv_lora_rank" in out:  # MLA: no grouped KV heads; RoPE runs on the rope part of each head
        if "num_key_value_heads" in out:
            out["num_key_value_heads"] = out["num_attention_heads"]
        if "head_dim" in out and "qk_rope_head_dim" in out:
            out["head_dim"] = out["qk_rope_head_dim"]
    if "qk_head_dim" in out:
        out["qk_head_dim"] = TINY["qk_rope_head_dim"] + TINY["qk_nope_head_dim"]
    return out


def _zero_dropout(d: dict) -> dict:
    """Every dropout probability 0: SP and the reference must compute the same function."""
    return {k: 0.0 for k, v in d.items()
            if isinstance(v, float) and not isinstance(v, bool) and ("dropout" in k or "pdrop" in k) and v}


_TOWERS = re.compile(r"vision|audio|vq|depth|speech|image")  # sub-configs that are not the language model


def tiny_config(name: str):
    """A tiny config of model type (or variant) ``name``: TINY + EXERCISE + OVERRIDES[name].

    Composite (multimodal) configs: ``text_config`` (or the config itself) gets the tiny shape, each
    vision/audio sub-config is shrunk with TOWER.
    """
    from transformers import AutoConfig, PretrainedConfig

    model_type = model_type_of(name)
    extra = {"is_decoder": True} if model_type in ENCODER_AS_DECODER else {}
    extra.update(OVERRIDES.get(model_type, ({}, ""))[0])
    if "+" in name:
        extra.update(OVERRIDES[name][0])
    try:
        default = AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001 -- only the override makes it build
        default = AutoConfig.for_model(model_type, **extra)
    subs = {n: v for n, v in vars(default).items() if isinstance(v, PretrainedConfig)}
    kwargs = {}
    if "text_config" in subs:
        text = subs["text_config"]
        kwargs["text_config"] = {**_applicable(text, {**TINY, **EXERCISE}), **_zero_dropout(text.to_dict()),
                                 **extra.pop("text_config", {})}
        kwargs.update(_applicable(default, {k: TINY[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")}))
    else:
        kwargs.update({**_applicable(default, {**TINY, **EXERCISE}), **_zero_dropout(default.to_dict())})
    for sub_name, sub in subs.items():
        if sub_name != "text_config" and _TOWERS.search(sub_name):
            kwargs[sub_name] = {**_applicable(sub, TOWER), **_zero_dropout(sub.to_dict()), **extra.pop(sub_name, {})}
    kwargs.update(extra)
    return AutoConfig.for_model(model_type, **kwargs)


def build(name: str, seed: int = SEED, attn: str = "sdpa"):
    """The tiny model, fp32, running ``attn`` (sdpa; eager as the flash stand-in's reference), deterministic
    init, every dropout off."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(name)
    with torch.device("meta"):  # count first: an un-shrunk default (e.g. a 500K-row hash embedding) takes minutes
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).parameters())
    if size > MAX_PARAMS:
        raise NotTiny(f"{size / 1e6:.1f}M parameters with the tiny overrides (limit {MAX_PARAMS / 1e6:.0f}M): "
                      "some size the overrides do not reach")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


class NotTiny(Exception):
    """The overrides leave the model too large to sweep on CPU."""


def _first_line(err: BaseException, limit: int = 300) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else "")[:limit]


def _frame(tb, part: str) -> str | None:
    """``path:line in function`` of the innermost traceback frame whose path contains ``part``."""
    for fs in reversed(traceback.extract_tb(tb)):
        path = fs.filename.replace("\\", "/")
        if part in path:
            return f"{path[path.index(part):].lstrip('/')}:{fs.lineno} in {fs.name}"
    return None


def _error_record(err: BaseException, phase: str, first_forward: bool) -> dict:
    """``refused`` for a ValueError that ds_ulysses raises at setup or on the first SP forward, else ``crash``."""
    tb = err.__traceback__
    frames = traceback.extract_tb(tb)
    raised_in = frames[-1].filename.replace("\\", "/") if frames else ""
    ours = "/ds_ulysses/" in raised_in
    refused = isinstance(err, ValueError) and ours and (phase in ("register", "setup") or first_forward)
    return {"status": "refused" if refused else "crash", "phase": phase, "error": type(err).__name__,
            "message": str(err).strip()[:1500], "ds_frame": _frame(tb, "/ds_ulysses/"),
            "hf_frame": _frame(tb, "/transformers/"), "model_frame": _frame(tb, "/transformers/models/")}


# -- the unsharded reference --------------------------------------------------------------------------


class Skip(Exception):
    """The case says nothing about SP: the model does not build tiny or does not run unsharded."""


def reference(model, sample: dict, own_loss: bool, loss_scale: float = 1.0) -> dict:
    """Loss and gradients of the unsharded model on one sample.

    ``own_loss``: the model's own loss from ``labels`` (logit transforms, router aux losses and all);
    otherwise each packed document is run alone and its token-mean CE taken (what packing means), plus what
    the model's own loss adds to CE on the packed row (a router's load-balancing loss is the row's).
    ``loss_scale``: the backward runs on the loss times it and the gradients come back divided by it, as
    fp16 training scales them (so an fp16 model overflows here where it would under DeepSpeed).
    """
    import torch.nn.functional as F

    from tests.support.sp_cases import reference_loss

    model.zero_grad(set_to_none=True)
    extra = {}
    if own_loss:
        out = model(input_ids=sample["input_ids"], labels=sample["labels"], position_ids=sample["position_ids"])
        loss = out.loss
        ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), sample["labels"][:, 1:].flatten(),
                             ignore_index=-100)
        extra["own_minus_ce"] = abs(loss.item() - ce.item())  # > 0: the model's loss adds terms beyond CE
    else:
        loss = reference_loss(model, sample) + _beyond_ce(model, sample)
    (loss * loss_scale).backward()
    grads = {n: None if p.grad is None else p.grad.detach().float() / loss_scale for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return {"loss": loss.item(), "grads": grads, **extra}


def _beyond_ce(model, sample: dict):
    """What the model's own loss adds to CE on the packed ``sample``, its documents honoured: a router's
    load-balancing loss (the model's own function, coefficient and expert counts) over the routing of every
    document run alone, as packing means (0 for a model whose loss is CE)."""
    import sys

    ids, pos = sample["input_ids"], sample["position_ids"]
    mask = sample.get("attention_mask", torch.ones_like(ids))
    routed, masks = [], []
    for row in range(ids.shape[0]):
        starts = [0] + [i for i in range(1, ids.shape[1]) if pos[row, i] != pos[row, i - 1] + 1] + [ids.shape[1]]
        for a, b in zip(starts[:-1], starts[1:]):
            out = model(input_ids=ids[row:row + 1, a:b], position_ids=pos[row:row + 1, a:b],
                        attention_mask=mask[row:row + 1, a:b])
            if getattr(out, "aux_loss", None) is None:
                return 0.0
            routed.append(out.router_logits)
            masks.append(mask[row, a:b])
    layers = tuple(torch.cat(per_layer) for per_layer in zip(*routed))  # [tokens E] per layer
    function = sys.modules[type(model).__module__].load_balancing_loss_func
    aux = function(layers, model.num_experts, model.num_experts_per_tok, torch.cat(masks)[None])
    coef = model.aux_loss_coef if hasattr(model, "aux_loss_coef") else model.router_aux_loss_coef  # JetMoE's name
    return coef * aux


def _deterministic(model, sample: dict) -> bool:
    """Whether two training-mode forwards agree. Some models sample in training (PhiMoE's sparsemixer
    draws routes with torch.rand): no sharded run can reproduce their random stream, so they are
    compared in eval mode (SP stays on: disable_in_eval is False)."""
    with torch.no_grad():
        a, b = (model(input_ids=sample["input_ids"], position_ids=sample["position_ids"]).logits for _ in range(2))
    return bool(torch.equal(a, b))


def _samples(count: int, length: int, docs: list[int], batch: int) -> dict:
    """``count`` samples of each kind: rank r's drop-in loader reads sample r; the engine's SP group g
    trains on sample g * micros + m in its micro-batch m (micros = steps x gas)."""
    from tests.support.sp_cases import make_sample

    return {"plain": [make_sample(100 + k, length, bs=batch) for k in range(count)],
            "packed": [make_sample(200 + k, length, bs=batch, docs=docs) for k in range(count)]}


def _low_precision(model, dtype: torch.dtype):
    """``model`` with its parameters in ``dtype`` and its buffers as they are (RoPE's inv_freq stays fp32),
    as DeepSpeed's bf16 and fp16 engines cast the module they wrap."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def _prepare(name: str, rec: dict, samples: dict, dtype: str = "fp32", loss_scale: float = 1.0,
             attn: str = "sdpa") -> tuple:
    """(model to shard, references per sample kind), all computed before any SP registration: the
    drop-in call may replace the core attention process-wide. Raises Skip.

    With ``dtype`` "bf16" or "fp16" each reference also holds, under "low", the same unsharded model's loss
    and gradients with parameters in that precision: how far it alone moves them from the fp32 reference,
    the noise an SP run in it is judged against, its backward scaled by ``loss_scale`` (fp16's)."""
    try:
        base = build(name, attn=attn)
        model = copy.deepcopy(base)  # before any forward: some models cache non-leaf tensors deepcopy refuses
        low = _low_precision(copy.deepcopy(base), LOW_DTYPES[dtype]) if dtype in LOW_DTYPES else None
        # on every kind of sample: on one, two training forwards can agree by chance (PhiMoE's did on the packed one)
        rec["train_mode"] = all(_deterministic(base, ss[0]) for ss in samples.values())
        if not rec["train_mode"]:
            for m in (base, model, low):
                if m is not None:
                    m.eval()
        refs = {kind: [reference(base, s, own_loss=(kind == "plain")) for s in ss] for kind, ss in samples.items()}
        if low is not None:
            for kind, ss in samples.items():
                for ref, s in zip(refs[kind], ss):
                    ref["low"] = reference(low, s, own_loss=(kind == "plain"), loss_scale=loss_scale)
    except Exception as err:  # noqa: BLE001 -- not a finding about SP
        why = "not tiny" if isinstance(err, NotTiny) else "does not run unsharded"
        raise Skip(f"{why}: {type(err).__name__}: {_first_line(err)}") from err
    rec["own_minus_ce"] = max(r.get("own_minus_ce", 0.0) for r in refs["plain"])
    return model, refs


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _step(loss: float, grads: dict, has: dict, ref: dict) -> dict:
    """One SP step vs its reference: loss rel, the worst parameter's gradient rel (norm of difference /
    norm of reference, floored at 1e-5 x the whole reference gradient's norm for gradients that are
    ~0 in exact arithmetic), parameters no rank gave a gradient, non-finite gradients.

    A low-precision reference (``ref["low"]``, the unsharded model with bf16 or fp16 parameters) adds the
    noise that precision itself makes: the loss's bound (``loss_tol``) and, per gradient, the SP distance
    over its bound (``grad_excess``, at most 1 for exact), with the floor at LOW_NORM_FLOOR of the whole
    model's norm. A step whose low-precision reference is not finite (Gemma 3 in fp16 overflows unsharded)
    is left out like one whose fp32 reference is not."""
    from tests.support.models import rel_err

    noise = ref.get("low")
    ref_norms = [g.double().norm() for g in ref["grads"].values() if g is not None]
    total = torch.stack(ref_norms).norm().item() if ref_norms else 1e-25
    tiny = 1e-5 * total
    floor = LOW_NORM_FLOOR * total if noise else tiny
    worst, excess, no_grad, unexpected, nonfinite = (0.0, None), (0.0, None), [], [], []
    for name, r in ref["grads"].items():
        g = grads.get(name)
        if r is None:
            if has.get(name):
                unexpected.append(name)
            continue
        if not has.get(name) and r.double().norm().item() > tiny:
            no_grad.append(name)
        g = torch.zeros_like(r) if g is None else g
        err = rel_err(g, r, floor)
        if not (_finite(g) and _finite(r)):
            nonfinite.append(f"{name} ({'SP' if not _finite(g) else 'reference'})")
            err = math.inf
        if worst[1] is None or err > worst[0]:
            worst = (err, name)
        if noise is not None:
            low = noise["grads"].get(name)
            ratio = err / max(LOW_GRAD_FACTOR * rel_err(torch.zeros_like(r) if low is None else low, r, floor),
                              LOW_GRAD_FLOOR)
            if excess[1] is None or ratio > excess[0]:
                excess = (ratio, name)
    # nothing to compare with: the reference, or (bf16/fp16) the unsharded model in that precision, overflowed
    refs = [ref] + ([noise] if noise is not None else [])
    ref_bad = any(not math.isfinite(r["loss"]) or any(g is not None and not _finite(g) for g in r["grads"].values())
                  for r in refs)
    out = {"loss_rel": _loss_rel(loss, ref["loss"]), "sp_loss": loss,
           "ref_loss": ref["loss"], "grad_rel": worst[0], "grad_param": worst[1], "no_grad": no_grad,
           "unexpected_grad": unexpected, "nonfinite": nonfinite, "ref_nonfinite": ref_bad}
    if noise is not None:
        low_loss_rel = _loss_rel(noise["loss"], ref["loss"])
        out.update(low_loss_rel=low_loss_rel, loss_tol=max(LOW_LOSS_FACTOR * low_loss_rel, LOW_LOSS_FLOOR),
                   grad_excess=excess[0], grad_excess_param=excess[1])
    return out


def _summed_grads(model, ref: dict, group) -> tuple[dict, dict]:
    """This SP group's gradients summed over its ranks, and which parameters any rank gave one.

    A rank without a gradient sends zeros of the reference's shape, so every rank sends the same
    sizes: two all_reduces in all.
    """
    import torch.distributed as dist

    params = dict(model.named_parameters())
    names = [n for n in ref["grads"] if n in params]
    compared = [n for n in names if ref["grads"][n] is not None]
    flat = torch.cat([params[n].grad.reshape(-1).double() if params[n].grad is not None
                      else torch.zeros(ref["grads"][n].numel(), dtype=torch.float64) for n in compared])
    has = torch.tensor([float(params[n].grad is not None) for n in names], dtype=torch.float64)
    dist.all_reduce(flat, group=group)
    dist.all_reduce(has, group=group)
    grads, offset = {}, 0
    for n in compared:
        shape = ref["grads"][n].shape
        grads[n] = flat[offset:offset + shape.numel()].reshape(shape)
        offset += shape.numel()
    return grads, {n: bool(h > 0) for n, h in zip(names, has)}


def _judge(steps: list) -> str:
    """exact / wrong over the steps whose reference is finite ("n/a" when none is: the unsharded model
    itself produces NaN/inf there, so there is nothing to compare against)."""
    steps = [s for s in steps if not s.get("ref_nonfinite")]
    if not steps:
        return "n/a"
    ok = all(s["loss_rel"] <= s.get("loss_tol", LOSS_TOL) and not s["no_grad"]
             and (s["grad_excess"] <= 1.0 if "grad_excess" in s else s["grad_rel"] <= GRAD_TOL) for s in steps)
    return "exact" if ok else "wrong"


def _outcome(rec: dict, steps: dict) -> dict:
    """wrong if a kind is, n/a if no kind compared anything (not counted as exact), else exact."""
    rec["steps"] = steps
    for kind, done in steps.items():
        rec[kind] = _judge(done)
    verdicts = [rec[kind] for kind in steps]
    rec["status"] = "wrong" if "wrong" in verdicts else "n/a" if set(verdicts) == {"n/a"} else "exact"
    return rec


# -- the drop-in check ---------------------------------------------------------------------------------


def sp_step_check(rank: int, sp: int, name: str, samples: dict, phase=lambda p: None, core: str = "sdpa",
                  ring: int = 1) -> dict:
    """One step per micro-batch through the drop-in API at sp ``sp``, plain then packed (with several SP
    groups, each trains on its own ranks' samples), on ``core`` (:data:`CORES`); with ``ring`` > 1 the
    registration's ``ring_size`` and plain samples only (:func:`_kinds`)."""
    import ds_ulysses
    from ds_ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, enable_sp_loss

    rec = {"model": name, "mode": "dropin", "config_note": OVERRIDES.get(name, (None, ""))[1], "ring": ring}
    samples = _kinds(samples, ring)
    phase("build and reference")
    try:
        model, refs = _prepare(name, rec, samples, attn="eager" if core == "flash-standin" else "sdpa")
    except Skip as why:
        return {**rec, "status": "skipped", "why": str(why)}
    current, first_forward, steps = "register", True, {kind: [] for kind in samples}
    try:
        phase(current)
        if core == "flash-standin":  # the eager model switched to the core, as initialize does
            mpu = UlyssesSPAttentionHF.register_with_transformers(model, "flash_attention_2", sp, 1, scope="model")
        else:
            mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, ring_size=ring)
        group = mpu.get_sequence_parallel_group()
        first = mpu.get_data_parallel_rank() * sp  # the SP group's first rank: its micro-batch k is sample first + k
        current = "setup"
        enable_sp_loss(model, group)
        for kind in steps:
            loader = UlyssesSPDataLoaderAdapter([samples[kind][rank]], mpu.get_sequence_parallel_rank(), group,
                                                sp, "cpu", ring_size=mpu.ring_size)
            for k, micro in enumerate(loader):  # micro-batch k is the group's rank k's sample
                current = f"{kind} step {k} forward"
                phase(current)
                rec["shard_shape"] = list(micro["input_ids"].shape)  # [rows, tokens padded to a multiple of sp]
                loss = model(**micro).loss
                first_forward = False
                current = f"{kind} step {k} backward"
                phase(current)
                loss.backward()
                current = f"{kind} step {k} compare"
                ref = refs[kind][first + k]
                steps[kind].append(_step(loss.item(), *_summed_grads(model, ref, group), ref))
                model.zero_grad(set_to_none=True)
    except Exception as err:  # noqa: BLE001 -- classified, not hidden
        return {**rec, **_error_record(err, current, first_forward and current.endswith("forward")), "steps": steps}
    finally:
        ds_ulysses.uninstall()
    return _outcome(rec, steps)


def _kinds(samples: dict, ring: int) -> dict:
    """The sample kinds a check runs: plain and packed, or plain alone under a ring, which refuses packed
    documents by design (docs/ring.md; the refusal has tests of its own)."""
    return samples if ring == 1 else {"plain": samples["plain"]}


# -- the engine check (ds_ulysses.initialize, default section, ZeRO-3 unless told) ----------------------

# models whose head transforms logits (or hidden states) after the decoder, plus a baseline and an aux loss
ENGINE_MODELS = ["llama", "cohere", "cohere2", "granite", "granitemoe", "gemma3_text", "minicpm3", "hyperclovax",
                 "nanochat", "mixtral+aux", "gemma2"]
# MoE blocks that run an expert only for the tokens routed to it, so that ranks holding different tokens
# (SP ranks, or plain data-parallel ones) gather different parameters under ZeRO-3 and gloo aborts the step:
# DeepSpeed's own remedy, with or without SP, is to make the block a ZeRO-3 leaf (gathered whole), what its
# zero_optimization.leaf_module default does for Mixtral's, Qwen2-MoE's and Qwen3-MoE's blocks
Z3_LEAF = {
    "dbrx": "DbrxFFN",                  # its experts call their GLU submodule once per expert hit
    "longcat_flash": "LongcatFlashMoE",  # a rank whose tokens all reach identity experts leaves the weights unused
}
ENGINE_SECTIONS = {
    "tiled": {},                                    # the default section: tiled loss on, "auto" tiles (one here)
    "untiled": {"tiled_loss": {"enabled": False}},  # the plain SP loss, for contrast
    # the loss in 4 tiles, as "auto" gives at long sequences: the fused head + cross-entropy, per tile
    "loss-tiles": {"tiled_loss": {"enabled": True, "shards": 4}},
    # every decoder MLP in 4 tiles (auto would leave a tiny model's 32-token shard in one)
    "mlp": {"tiled_mlp": {"enabled": True, "shards": 4}},
    "offload": {"activation_checkpoint_offload": {"enabled": True}},  # checkpointed layers, inputs on the host
    # every attention block a group of heads at a time ("auto": the most groups whose heads split over the ranks)
    "attention": {"tiled_attention": {"enabled": True}},
    # every decoder norm recomputed from its input, the tiled MLPs (4 tiles) rebuilding the norms' outputs
    "norms": {"tiled_norms": {"enabled": True}, "tiled_mlp": {"enabled": True, "shards": 4}},
    # every tool at once (ArcticTraining's setup): tiled MLPs recomputed inside checkpointed, offloaded layers
    "all-tools": {"tiled_loss": {"enabled": True, "shards": 4}, "tiled_mlp": {"enabled": True, "shards": 4},
                  "activation_checkpoint_offload": {"enabled": True}},
}


def _mean_grads(refs: list) -> dict:
    """The gradient DeepSpeed forms from the micro-batches of ``refs`` (every SP group's, every accumulated
    one): each micro-batch's loss scaled by 1/GAS, the sum averaged over the data-parallel groups, so the
    plain mean (a parameter no micro-batch reached has none)."""
    grads = {}
    for name in refs[0]["grads"]:
        got = [r["grads"][name] for r in refs if r["grads"][name] is not None]
        grads[name] = torch.stack(got).sum(0) / len(refs) if got else None
    return grads


def _loss_rel(loss: float, ref_loss: float) -> float:
    return abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)


def _engine_data(samples: list, world: int, sp: int, micros: int, keys: tuple) -> list:
    """Data items such that SP group g's micro-batch m is sample ``g * micros + m``, its rows in order.

    DistributedSampler (no shuffle) gives rank r items ``r + world * t``, its t-th row overall (row
    ``t % batch`` of its batch ``t // batch``), and the adapter hands an SP group, for each batch of its
    loaders, one micro-batch per member rank: micro-batch ``k * sp + m`` is member m's batch k.
    """
    batch = samples[0]["input_ids"].shape[0]
    rows = batch * (-(-micros // sp) + 1)  # every batch a micro-batch reaches, and one more for drop_last
    data = []
    for i in range(world * rows):
        r, t = i % world, i // world
        micro = (t // batch) * sp + r % sp
        sample = samples[(r // sp) * micros + micro % micros]  # past the last micro-batch: any sample
        data.append({key: sample[key][t % batch] for key in keys})
    return data


def engine_step_check(rank: int, sp: int, case: str, samples: dict, phase=lambda p: None, steps: int = 1,
                      gas: int = 1, zero: int = 3, dtype: str = "fp32", ring: int = 1) -> dict:
    """``case`` = ``model@section``: ``steps`` steps through ``ds_ulysses.initialize`` under ZeRO stage
    ``zero`` at sp ``sp``, on plain samples and, with an engine of its own, on packed ones, a new sample each
    micro-batch. A step is ``gas`` micro-batches (forward, backward, ``engine.step()``), its gradient
    compared before the last ``engine.step()``, each micro-batch's loss with its own sample's. With more
    ranks than ``sp`` the mesh is dp x sp, every SP group on samples of its own.

    The optimizer runs with lr 0, so every step meets the reference's weights; what a second step
    checks is the state the first leaves behind (ZeRO-3's recorded trace and prefetch, zeroed gradients,
    the SP hooks' per-batch state). ``safe_get_full_grad`` gives every rank the full gradient, averaged
    over the data-parallel groups (ZeRO-3's and ZeRO-1/2's partitions gathered, ZeRO-0's all-reduced
    ``.grad``), so no sum over ranks here.

    ``dtype`` "bf16" (or "fp16") runs the engine with ``"bf16": {"enabled": true}`` (bf16 parameters and
    activations, the optimizer's fp32 copy; at ZeRO-0 and ZeRO-1 DeepSpeed reduces through optimizers of their
    own; fp16 adds the dynamic loss scale, divided out of the gradients compared) and judges it against the
    fp32 reference with the unsharded model's distance from it in that precision as the noise (``_step``).
    ``ring`` > 1: the section's ``ring_size``, on plain samples only (:func:`_kinds`).
    """
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    import ds_ulysses
    from ds_ulysses.engine import loss_grad_scale

    name, section_name = case.split("@")
    rec = {"model": name, "mode": f"engine-{section_name}", "config_note": OVERRIDES.get(name, (None, ""))[1],
           "zero": zero, "dtype": dtype, "ring": ring}
    samples = _kinds(samples, ring)
    world = dist.get_world_size()
    dp = world // sp
    config = {
        "train_micro_batch_size_per_gpu": samples["plain"][0]["input_ids"].shape[0], "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": zero},
        "ulysses": {"sequence_parallel_size": sp, "ring_size": ring, **ENGINE_SECTIONS[section_name]},
    }
    if dtype in LOW_DTYPES:
        config[dtype] = {"enabled": True, **({"initial_scale_power": FP16_SCALE_POWER} if dtype == "fp16" else {})}
    # fp16: each rank's backward runs on the loss / gas x the loss scale x the SP loss's own factor (sp where
    # ZeRO-3 averages over the SP ranks too): the reference's fp16 backward gets the same, so both overflow alike
    loss_scale = 2.0 ** FP16_SCALE_POWER * loss_grad_scale(config, sp) / gas if dtype == "fp16" else 1.0
    phase("build and reference")
    try:
        model, refs = _prepare(name, rec, {kind: ss[:dp * steps * gas] for kind, ss in samples.items()}, dtype,
                               loss_scale)
    except Skip as why:
        return {**rec, "status": "skipped", "why": str(why)}
    if zero == 3 and model_type_of(name) in Z3_LEAF:
        from deepspeed.utils import set_z3_leaf_modules

        rec["z3_leaf"] = Z3_LEAF[model_type_of(name)]
        set_z3_leaf_modules(model, [rec["z3_leaf"]])
    # ZeRO partitions or flattens the model it wraps: an engine per kind
    models = {kind: model if kind == "plain" else copy.deepcopy(model) for kind in samples}
    done, current, first_forward = {kind: [] for kind in models}, "setup", True
    for kind, model in models.items():
        # the plain samples leave their position_ids to the adapter, the packed ones bring their documents'
        keys = ("input_ids", "labels") + (("position_ids",) if kind == "packed" else ())
        try:
            current = "setup" if first_forward else f"{kind} setup"
            phase(current)
            data = _engine_data(samples[kind], world, sp, steps * gas, keys)
            engine, _, loader, _ = ds_ulysses.initialize(model=model, config=config, training_data=data)
            rec["param_dtype"] = str(next(engine.module.parameters()).dtype)
            group, micro_batches = engine.mpu.get_data_parallel_rank(), iter(loader)
            for s in range(steps):
                sample_of = [[(g * steps + s) * gas + a for a in range(gas)] for g in range(dp)]
                losses = []
                for a, k in enumerate(sample_of[group]):
                    at = f"{kind} step {s}" + (f" micro-batch {a}" if gas > 1 else "")
                    current = f"{at} forward"
                    phase(current)
                    loss = engine(**next(micro_batches)).loss
                    first_forward = False
                    losses.append((loss.item(), refs[kind][k]))
                    current = f"{at} backward"
                    phase(current)
                    engine.backward(loss)
                    if a < gas - 1:
                        current = f"{at} optimizer"
                        engine.step()
                current = f"{kind} step {s} compare"
                grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
                has = {n: g is not None for n, g in grads.items()}
                sp_loss, worst = max(losses, key=lambda pair: _loss_rel(pair[0], pair[1]["loss"]))
                mine = [refs[kind][k] for ks in sample_of for k in ks]
                ref = {"loss": worst["loss"], "grads": _mean_grads(mine)}
                if dtype in LOW_DTYPES:
                    ref["low"] = {"loss": worst["low"]["loss"], "grads": _mean_grads([r["low"] for r in mine])}
                scale = engine.optimizer.loss_scale if dtype == "fp16" else 1.0  # fp16: the step unscales them
                done[kind].append(_step(sp_loss, {n: g.float() / scale for n, g in grads.items() if g is not None},
                                        has, ref))
                current = f"{kind} step {s} optimizer"
                engine.step()
        except Exception as err:  # noqa: BLE001 -- classified, not hidden
            return {**rec, **_error_record(err, current, first_forward and current.endswith("forward")),
                    "steps": done}
        finally:
            ds_ulysses.uninstall()
    return _outcome(rec, done)


# -- running many cases on one pair of ranks, isolated ------------------------------------------------

CHECKS = {"dropin": sp_step_check, "engine": engine_step_check}


def _rank_main(rank: int, world_size: int, sp: int, port: int, check: str, cases: list, queue, length: int,
               docs: list[int], batch: int, engine_opts: dict, core: str = "sdpa", ring: int = 1) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    _quiet()
    import logging

    import torch.distributed as dist

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    if core == "flash-standin":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from tests.support.sp_cases import flash_standin

        ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = flash_standin
    fn = CHECKS[check]
    micros = engine_opts["steps"] * engine_opts["gas"]
    samples = _samples(max(world_size, world_size // sp * micros), length, docs, batch)
    extra = {**engine_opts, "ring": ring} if check == "engine" else {"core": core, "ring": ring}
    for case in cases:
        queue.put(("start", rank, case, None))
        try:
            rec = fn(rank, sp, case, samples, lambda p, c=case: queue.put(("phase", rank, c, p)), **extra)
        except BaseException as err:  # noqa: BLE001 -- a bug in the sweep itself, reported per case
            rec = {"model": case, "status": "crash", "error": type(err).__name__, "message": _first_line(err),
                   "phase": "sweep", "ds_frame": _frame(err.__traceback__, "/ds_ulysses/"),
                   "hf_frame": _frame(err.__traceback__, "/transformers/"),
                   "sweep_bug": traceback.format_exc()[-2000:]}
        queue.put(("done", rank, case, rec))
        dist.barrier()  # lockstep: a peer stuck in this case holds both here, and the parent's timeout fires
    dist.destroy_process_group()


_ORDER = {"crash": 5, "wrong": 4, "refused": 3, "exact": 2, "n/a": 1, "skipped": 0}


def _merge(case: str, by_rank: dict) -> dict:
    """One record per case: the rank with the worse status (rank 0 on a tie; its numbers equal its SP
    group's: gradients are summed over the group and the loss is the group's mean on every rank)."""
    recs = [by_rank[r] for r in sorted(by_rank)]
    worst = max(recs, key=lambda r: _ORDER.get(r["status"], 6))
    out = dict(worst)
    statuses = {r: rec["status"] for r, rec in by_rank.items()}
    if len(set(statuses.values())) > 1:
        out["ranks_disagree"] = statuses
    return out


def run_cases(cases: list, check: str = "dropin", sp: int = SP, case_timeout: float = 180.0,
              log=None, length: int = LENGTH, docs: list[int] = PACKED_DOCS, batch: int = 1, dp: int = 1,
              steps: int = 1, gas: int = 1, zero: int = 3, dtype: str = "fp32", core: str = "sdpa",
              ring: int = 1) -> dict:
    """Run ``check`` for every case on ``dp * sp`` spawned gloo ranks (``dp`` SP groups of ``sp`` ranks, each
    ``sp / ring`` Ulysses ranks times a ring of ``ring``); {case: record}.

    Samples have ``batch`` rows of ``length`` tokens, plain and packed from ``docs``: one per rank, and
    for the engine check ``steps`` x ``gas`` per SP group (``zero``: its ZeRO stage, ``dtype``: fp32, bf16 or
    fp16).

    Cases share a process group; a case that stalls (no rank finishes it within ``case_timeout``) or
    kills a rank is recorded as a crash, the ranks are restarted, and the sweep goes on.
    """
    import torch.multiprocessing as mp

    from tests.support.distributed import free_port

    ctx = mp.get_context("spawn")
    world_size = dp * sp
    results: dict = {}
    remaining = list(cases)
    while remaining:
        queue, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(r, world_size, sp, port, check, remaining, queue, length, docs, batch,
                                   {"steps": steps, "gas": gas, "zero": zero, "dtype": dtype}, core, ring))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        pending: dict = {}          # case -> {rank: record}
        where = {r: (None, "spawn", time.time()) for r in range(world_size)}
        failed = None
        while True:
            try:
                kind, rank, case, payload = queue.get(timeout=2.0)
            except queue_mod.Empty:
                kind = None
            if kind == "start":
                where[rank] = (case, "start", time.time())
            elif kind == "phase":
                where[rank] = (case, payload, where[rank][2])
            elif kind == "done":
                pending.setdefault(case, {})[rank] = payload
                where[rank] = (None, "between cases", time.time())
                if len(pending[case]) == world_size:
                    results[case] = _merge(case, pending.pop(case))
                    if log:
                        log(results[case])
            if all(c in results for c in remaining):
                break
            now = time.time()
            stalled = [r for r, (c, ph, t0) in where.items()
                       if now - t0 > case_timeout + (SPAWN_SECONDS if ph == "spawn" else 0)]
            # a rank that exited with cases left: killed, or (exit 0) gone with nothing more in the queue
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and (p.exitcode != 0 or kind is None)]
            if stalled or dead:
                # the case in trouble: the first not finished by every rank
                failed = next(c for c in remaining if c not in results)
                partial = pending.get(failed, {})
                stuck = {r: where[r] for r in range(world_size)}
                how = ("rank(s) %s died (exit %s)" % (dead, [procs[r].exitcode for r in dead]) if dead else
                       f"no progress for {case_timeout:.0f} s")
                detail = "; ".join(f"rank {r} at {c or '-'} [{ph}]" for r, (c, ph, _) in stuck.items())
                model, _, section = failed.partition("@")
                rec = {"model": model, "mode": f"engine-{section}" if section else check, "status": "crash",
                       "error": "Timeout" if not dead else "RankDied",
                       "message": f"{how}: {detail}",
                       "phase": next((ph for c, ph, _ in stuck.values() if c == failed), "?")}
                if partial:  # a rank that did finish usually holds the cause (e.g. it raised, its peer waits)
                    done = next(iter(partial.values()))
                    rec["peer_record"] = done
                    if done.get("status") in ("crash", "refused"):
                        rec.update({k: done.get(k) for k in ("error", "message", "ds_frame", "hf_frame", "model_frame",
                                                             "phase")})
                        rec["message"] = f"{done.get('message')} [and its peer hung: {how}]"
                results[failed] = rec
                if log:
                    log(rec)
                break
        for p in procs:
            if failed is not None:
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        remaining = [c for c in remaining if c not in results]
    return {c: results[c] for c in cases}


# -- reports ------------------------------------------------------------------------------------------


def _norm(text: str) -> str:
    """A message with its specifics (quoted names, numbers, lists) blanked, to group by cause."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"\[[^\]]*\]", "[…]", text)
    text = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text)
    return text


def cause(rec: dict) -> str:
    """A short grouping key for a record's outcome."""
    status = rec["status"]
    if status == "exact":
        return "exact"
    if status == "skipped":
        return "skipped: " + rec.get("why", "").split(":")[0]
    if status == "n/a":
        return "n/a: the unsharded model's own gradients are non-finite on every step"
    if status == "refused":
        msg = rec["message"].split("model not servable by Ulysses SP:")[-1]
        return "refused: " + _norm(msg.split(";")[0].strip())[:110]
    if status == "crash":
        where = (rec.get("model_frame") or rec.get("hf_frame") or rec.get("ds_frame") or "?").split(" in ")[-1]
        return f"crash: {rec.get('error')} in {where}: " + _norm(_first_line(Exception(rec.get("message", ""))))[:90]
    steps = [s for kind in ("plain", "packed") for s in rec.get("steps", {}).get(kind, [])]
    hints = []
    if any(s.get("nonfinite") for s in steps):
        hints.append("non-finite gradients")
    if any(s["no_grad"] for s in steps):
        hints.append("parameters without gradient")
    if rec.get("own_minus_ce", 0) > 1e-7 and rec.get("plain") == "wrong":
        hints.append("the model's own loss adds terms beyond CE (e.g. router aux loss)")
    if rec.get("plain") == "exact" and rec.get("packed") == "wrong":
        hints.append("packed sample only")
    return f"wrong ({rec.get('mode')}): " + (", ".join(hints) or "loss/gradients off")


def summary(rec: dict) -> str:
    """The record's numbers or message, one line."""
    if rec["status"] in ("exact", "wrong", "n/a"):
        parts = [] if rec.get("train_mode", True) else ["eval mode (the model samples in training)"]
        if rec.get("z3_leaf"):
            parts.append(f"{rec['z3_leaf']} a ZeRO-3 leaf")
        for kind in ("plain", "packed"):
            every = rec.get("steps", {}).get(kind, [])
            steps = [s for s in every if not s.get("ref_nonfinite")]
            if every and not steps:
                parts.append(f"{kind}: n/a (the unsharded model's own gradients are non-finite)")
                continue
            if not steps:
                continue
            loss = max(s["loss_rel"] for s in steps)
            worst = max(steps, key=lambda s: s["grad_rel"])
            no_grad = sorted({n for s in steps for n in s["no_grad"]})
            nonfinite = sorted({n for s in steps for n in s.get("nonfinite", [])})
            low = ""
            if "grad_excess" in worst:  # bf16/fp16: the unsharded model's own distances, and how near the bound
                over = max(steps, key=lambda s: s["grad_excess"])
                low = (f" [{rec.get('dtype')} alone: loss {max(s['low_loss_rel'] for s in steps):.1e}; worst gradient "
                       f"{over['grad_excess']:.2f} of its bound ({over['grad_excess_param']})]")
            parts.append(f"{kind}: loss {loss:.1e}, grad {worst['grad_rel']:.1e} ({worst['grad_param']}){low}"
                         + (f", no grad: {', '.join(no_grad[:4])}" if no_grad else "")
                         + (f", non-finite: {', '.join(nonfinite[:3])}" if nonfinite else "")
                         + (f" ({len(every) - len(steps)} step(s) n/a: the unsharded model's gradients are "
                            "non-finite)" if len(every) > len(steps) else ""))
        return "; ".join(parts)
    if rec["status"] == "skipped":
        return rec.get("why", "")
    frames = (rec.get("ds_frame"), rec.get("model_frame"), rec.get("hf_frame"))
    where = ", ".join(dict.fromkeys(x for x in frames if x))
    return f"[{rec.get('phase')}] {rec.get('error')}: {_first_line(Exception(rec.get('message', '')), 400)} @ {where}"


def write_reports(records: list, out: str, header: str = "", sp: int = SP, dp: int = 1, ring: int = 1) -> str:
    """``out`` as JSON lines, and ``out`` with ``.md``: counts, then one table per cause (``out``'s
    directory is made if missing)."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        for rec in records:
            f.write(json.dumps(rec, default=str) + "\n")
    counts: dict = {}  # mode -> status -> n
    for rec in records:
        by_status = counts.setdefault(rec.get("mode", "-"), {})
        by_status[rec["status"]] = by_status.get(rec["status"], 0) + 1
    groups: dict = {}
    for rec in records:
        groups.setdefault(cause(rec), []).append(rec)
    statuses = sorted(_ORDER, key=lambda st: -_ORDER[st])
    lines = [f"# Architecture sweep at sp {sp}" + (f" (Ulysses {sp // ring} x ring {ring})" if ring > 1 else "")
             + (f", dp {dp}" if dp > 1 else ""), "", header, "",
             "| mode | " + " | ".join(statuses) + " |", "|---" * (len(statuses) + 1) + "|"]
    lines += [f"| {mode} | " + " | ".join(str(by.get(st, 0)) for st in statuses) + " |" for mode, by in counts.items()]
    order = sorted(groups, key=lambda c: (-_ORDER.get(groups[c][0]["status"], 6), c))
    for key in order:
        lines += ["", f"## {key} ({len(groups[key])})", "", "| model | mode | details |", "|---|---|---|"]
        for rec in groups[key]:
            lines.append(f"| {rec['model']} | {rec.get('mode', '')} | {summary(rec).replace('|', '/')} |")
    md = os.path.splitext(out)[0] + ".md"
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    return md


def _lengths(text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token counts, e.g. 24,25,15") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    pick = parser.add_mutually_exclusive_group()
    pick.add_argument("--all", action="store_true", help="every candidate model type and variant (the default)")
    pick.add_argument("--models", help="comma-separated model types or variants (type+variant)")
    parser.add_argument("--engine", action="store_true", help="also ds_ulysses.initialize (ZeRO-3 unless --zero) "
                        "with every section, for ENGINE_MODELS (or the --models list)")
    parser.add_argument("--engine-all", action="store_true",
                        help="also ds_ulysses.initialize with --section for every model")
    parser.add_argument("--section", choices=sorted(ENGINE_SECTIONS), default="tiled",
                        help="the section --engine-all runs (default tiled: the defaults, tiled loss on)")
    parser.add_argument("--engine-only", action="store_true", help="skip the drop-in check")
    parser.add_argument("--core", choices=CORES, default="sdpa", help="the drop-in check's core attention: sdpa "
                        "(default), or flash-standin (flash_attention_2's contract in plain torch, against the model "
                        "run eager; the models whose class supports flash attention); drop-in only")
    parser.add_argument("--out", default="architectures.jsonl", help="JSON lines; the Markdown goes next to it")
    parser.add_argument("--case-timeout", type=float, default=180.0, help="seconds before a stalled case is abandoned")
    parser.add_argument("--sp", type=int, default=SP, help=f"ranks per SP group (default {SP})")
    parser.add_argument("--length", type=int, default=LENGTH, help=f"tokens per sample (default {LENGTH})")
    parser.add_argument("--docs", type=_lengths, default=PACKED_DOCS,
                        help="document lengths of the packed sample, adding up to --length (default "
                             f"{','.join(map(str, PACKED_DOCS))})")
    parser.add_argument("--batch", type=int, default=1, help="rows per sample, each a micro-batch (default 1)")
    parser.add_argument("--dp", type=int, default=1, help="SP groups, each on a sample of its own: dp x sp gloo "
                        "ranks; the engine check averages the groups' gradients (default 1)")
    parser.add_argument("--steps", type=int, default=1, help="steps of the initialize check, each on a new sample, "
                        "the optimizer at lr 0 (default 1)")
    parser.add_argument("--gas", type=int, default=1, help="micro-batches per step of the initialize check "
                        "(gradient_accumulation_steps), each on a new sample (default 1)")
    parser.add_argument("--zero", type=int, choices=range(4), default=3, help="the ZeRO stage of the initialize check "
                        "(default 3)")
    parser.add_argument("--dtype", choices=("fp32", *LOW_DTYPES), default="fp32", help="the initialize check's "
                        "precision: bf16 and fp16 are judged against the fp32 reference with the unsharded model's "
                        "distance from it in that precision as the noise; needs --engine-only (default fp32)")
    parser.add_argument("--ring", type=int, default=1, help="ring_size: sp = Ulysses ranks x a ring of N, on plain "
                        "samples only (the ring refuses packed documents); sdpa only (default 1: Ulysses alone)")
    args = parser.parse_args(argv)
    docs = args.docs
    if args.sp < 2:
        parser.error(f"--sp {args.sp}: expected at least 2 ranks, or there is nothing to shard")
    if sum(docs) != args.length or min(docs) < 1:
        parser.error(f"--docs {','.join(map(str, docs))} add up to {sum(docs)}: expected positive lengths adding up to "
                     f"--length {args.length}; give both")
    if args.batch < 1:
        parser.error(f"--batch {args.batch}: expected at least one row per sample")
    if args.dp < 1:
        parser.error(f"--dp {args.dp}: expected at least one SP group")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: expected at least one step")
    if args.gas < 1:
        parser.error(f"--gas {args.gas}: expected at least one micro-batch per step")
    if args.core != "sdpa" and (args.engine or args.engine_all or args.engine_only):
        parser.error(f"--core {args.core}: the drop-in check only; drop --engine, --engine-all and --engine-only")
    if args.ring < 1 or args.sp % args.ring:
        parser.error(f"--ring {args.ring}: expected a divisor of --sp {args.sp} (sp = Ulysses ranks x ring_size)")
    if args.ring > 1 and args.core != "sdpa":
        parser.error(f"--ring {args.ring} with --core {args.core}: the ring runs torch's SDPA kernels; drop --core")
    if args.dtype != "fp32" and not args.engine_only:
        parser.error(f"--dtype {args.dtype}: the drop-in check runs in fp32 only; add --engine-only")
    layout = dict(sp=args.sp, dp=args.dp, length=args.length, docs=docs, batch=args.batch, ring=args.ring)
    _quiet()
    import ds_ulysses  # noqa: F401 -- fail here, once, rather than in every case on every rank

    if args.dtype == "fp16":
        from deepspeed.accelerator import get_accelerator

        if not get_accelerator().is_fp16_supported():
            parser.error(f"--dtype fp16: DeepSpeed has no fp16 on this {get_accelerator().device_name()} device "
                         "(a CPU needs AVX512-FP16 or AMX), so it would refuse every case; use --dtype bf16")

    names, skipped = candidates(args.core)
    if args.models:
        names, skipped = args.models.split(","), {}
    started = time.time()

    def log(rec):
        print(f"{time.time() - started:7.0f}s {rec['model']:28s} {rec.get('mode', ''):15s} {rec['status']:8s} "
              f"{summary(rec)[:160]}", flush=True)

    records = [{"model": m, "mode": "-", "status": "skipped", "why": why} for m, why in skipped.items()]
    if not args.engine_only:
        records += run_cases(names, "dropin", case_timeout=args.case_timeout, log=log, core=args.core,
                             **layout).values()
    cases = []
    if args.engine:
        cases += [f"{m}@{s}" for m in (names if args.models else ENGINE_MODELS) for s in ENGINE_SECTIONS]
    if args.engine_all:
        cases += [f"{m}@{args.section}" for m in names if f"{m}@{args.section}" not in cases]
    if cases:
        records += run_cases(cases, "engine", case_timeout=args.case_timeout, log=log, steps=args.steps, gas=args.gas,
                             zero=args.zero, dtype=args.dtype, **layout).values()
    took = time.time() - started
    import transformers

    bar = (f"Exact: loss rel <= {LOSS_TOL:g} and every gradient rel <= {GRAD_TOL:g}." if args.dtype == "fp32" else
           f"The engine in {args.dtype} against the fp32 reference, exact when its loss rel <= "
           f"max({LOW_LOSS_FACTOR:g} x the unsharded {args.dtype} model's, {LOW_LOSS_FLOOR:g}) and each gradient "
           f"rel <= max({LOW_GRAD_FACTOR:g} x the unsharded {args.dtype} model's for that parameter, "
           f"{LOW_GRAD_FLOOR:g}; below {LOW_NORM_FLOOR:g} of the model's gradient norm, relative to that).")
    header = (f"Transformers {transformers.__version__}, torch {torch.__version__}; {len(names)} model types and "
              f"variants swept, {len(skipped)} model types left out before building; {took:.0f} s on "
              f"{os.cpu_count()} cores. {bar} "
              f"Samples: {args.batch} x {args.length} tokens plain"
              + (f" (ring_size {args.ring}: no packed samples, which the ring refuses); " if args.ring > 1 else
                 f", and packed documents {docs} per row; ")
              + f"{args.steps} step(s) of {args.gas} micro-batch(es) per engine, ZeRO-{args.zero}. Drop-in core: "
              f"{args.core}.")
    md = write_reports(records, args.out, header, sp=args.sp, dp=args.dp, ring=args.ring)
    print(f"{took:.0f} s; wrote {args.out} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tiny HF causal LMs built from config (nothing is downloaded), fp32, deterministic init."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 128


def tiny_config(family: str = "llama", heads: int = 4, kv_heads: int | None = None, head_dim: int = 8,
                layers: int = 2, attn: str = "sdpa", **extra):
    """A tiny config of the Transformers model type ``family`` (llama, qwen2, mistral, cohere, ...);
    ``extra`` fields override the tiny defaults (``vocab_size=32000``)."""
    fields = dict(vocab_size=VOCAB, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                  head_dim=head_dim, max_position_embeddings=4096, tie_word_embeddings=False)
    cfg = AutoConfig.for_model(family, **{**fields, **extra})
    cfg._attn_implementation = attn
    return cfg


def tiny_model(config, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)
    return model.float()


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """norm(a - b) / norm(b); ``floor`` (callers: 1e-5 x the whole model's gradient norm) bounds the
    denominator for gradients that are zero in exact
    arithmetic (e.g. k_proj when every document is one token: softmax over a single key)."""
    return ((a.double() - b.double()).norm() / max(b.double().norm().item(), floor)).item()


def hf_config(model_type: str, **extra):
    """A tiny config of any Transformers model type (vocabulary 64, hidden 32, 2 layers, 4/2 heads)."""
    from transformers import AutoConfig

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    return AutoConfig.for_model(model_type, **{**small, **extra})

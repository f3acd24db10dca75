"""The training job's choices that are not mechanisms of their own: the default model and CPU threads.

Where in the sample stream a (resumed) run starts is :mod:`.position`.
"""

from __future__ import annotations

import os

import torch

from ..hf.model_facts import vocab_size

__all__ = ["DEFAULT_MODEL", "build_model", "set_cpu_threads"]

# A tiny Llama: GQA (4 query heads, 2 KV heads), long RoPE range; ~0.5M parameters, so a 2-core CPU
# trains it on 16K-token sequences in seconds per step.
DEFAULT_MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, max_position_embeddings=131072, tie_word_embeddings=False)


def build_model(path, tokenizer, attn_implementation: str = "sdpa", seed: int = 0):
    """The default tiny Llama sized to ``tokenizer``, or the HF model saved in the local directory ``path``.

    A ``path`` model is loaded whole on every rank and partitioned by ZeRO-3 afterwards (DeepSpeed
    #7458): fine while one copy fits in a rank's host memory. Partitioning while loading needs
    Transformers' ``HfDeepSpeedConfig`` alive around ``from_pretrained``, which requires accelerate.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    if path is None:
        config = LlamaConfig(vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_id,
                             eos_token_id=tokenizer.eos_id, bos_token_id=getattr(tokenizer, "bos_id", None),
                             **DEFAULT_MODEL)
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--model: expected a local HF model directory, got {path!r} (no such directory); "
                                "fix: pass a directory written by save_pretrained (e.g. by ds-ulysses export), "
                                "or omit --model for the default tiny Llama")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation=attn_implementation,
                                                 dtype=torch.float32)
    vocab = vocab_size(model)
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"--model {path} has {vocab} embeddings but the tokenizer ({tokenizer.source}) has "
                         f"{tokenizer.vocab_size} tokens; fix: pass the model's own --tokenizer")
    return model


def set_cpu_threads() -> None:
    """Split the cores between the local ranks unless ``OMP_NUM_THREADS`` says otherwise.

    Every rank's intra-op pool defaults to all cores; with several ranks per machine they fight over
    them and a CPU step gets ~10x slower (measured: 4K tokens, 2 ranks on 2 cores). torchrun sets
    OMP_NUM_THREADS=1 itself; the deepspeed launcher does not.
    """
    if "OMP_NUM_THREADS" in os.environ or torch.cuda.is_available():
        return
    # torchrun says LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))

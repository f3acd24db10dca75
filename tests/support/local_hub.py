"""A local stand-in for the hub's ``hf-internal-testing/tiny-random-LlamaForCausalLM`` (nothing is downloaded):
a tiny Llama and a word-level tokenizer saved under that name in a directory, so that an upstream script's
``from_pretrained(model_name)`` run from that directory loads them."""

from __future__ import annotations

import os

from tests.support.models import tiny_config, tiny_model

MODEL_NAME = "hf-internal-testing/tiny-random-LlamaForCausalLM"
VOCAB = 32000
TEXTS = ["The quick brown fox jumps over the lazy dog. ", "Hello world, this is a test sentence for training. "]


def word_level_tokenizer(padding_side: str = "left"):
    """Llama's special tokens (<unk> 0, <s> 1, </s> 2; <s> prepended, no pad token) over the words of
    :data:`TEXTS`, padding on ``padding_side`` (Llama's tokenizer pads on the left)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for text in TEXTS for w in pre_tokenizers.Whitespace().pre_tokenize_str(text)
                    for w in [w[0]]})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: 3 + i for i, w in enumerate(words)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   padding_side=padding_side)


def write_tiny_llama(root: str, padding_side: str = "left", initializer_range: float = 0.02) -> str:
    """Save the model and tokenizer under ``root/MODEL_NAME``; returns that path. A small ``initializer_range``
    makes the model's predictions near uniform, so that any two texts start at nearly the same loss (a test
    that compares runs training different samples per step relies on it)."""
    path = os.path.join(root, MODEL_NAME)
    tokenizer = word_level_tokenizer(padding_side)
    # the hub model's shape: hidden 16, 4 heads, 2 layers, a vocabulary of 32000 (past the tokenizer's words:
    # Accelerate's script feeds ids 101-228), so its losses start near ln(32000) as the upstream tolerances expect
    config = tiny_config("llama", heads=4, kv_heads=4, head_dim=4, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                         initializer_range=initializer_range)
    tiny_model(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

"""Which models Ulysses SP serves exactly, decided from the config and modules before any collective.

Deterministic checks: every rank sees the same model and raises the same error on its own, without
talking, so a refused model never leaves a peer waiting in a collective.
"""

from __future__ import annotations

import functools
import re
import sys

import torch

from ..sp.attention import core_kind
from .model_facts import base_model, config_value

__all__ = ["check_model_servable", "check_attention_classes", "check_core_supported", "check_sinks_reach_kernel",
           "decoder_of", "sliding_layers", "SERVABLE_LAYER_TYPES"]

# Layer types (Transformers' ``layer_types``) whose token mixing is attention SP can serve, or that
# do not mix tokens at all (MLP/MoE kinds). Anything else mixes tokens in a way a shard cannot see.
SERVABLE_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention", "dense", "sparse",
                                  "moe", "mlp"})
# Models whose every layer is recurrent and whose config carries no layer_types.
RECURRENT_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"})
# Module class names of token mixers outside attention (state-space, linear attention, recurrences,
# short convolutions), as Transformers names them.
_TOKEN_MIXER = re.compile(r"Mamba|Mixer|DeltaNet|ShortConv|Lightning|Rglru|RecurrentBlock|Rwkv|xLSTM|"
                          r"mLSTM|sLSTM|LinearAttention|Hyena|StateSpace")


def _layer_kinds(text) -> list:
    for name in ("layer_types", "layers_block_type", "block_types"):
        kinds = config_value(text, name)
        if isinstance(kinds, (list, tuple)) and kinds:
            return [(name, i, kind) for i, kind in enumerate(kinds)]
    return []


def check_model_servable(config, model=None) -> None:
    """Refuse models whose outputs SP would compute wrongly without any error.

    Ulysses shards the sequence everywhere except inside attention, so a layer that mixes tokens by
    any other means (a state-space scan, linear attention, a causal convolution) sees only its
    rank's tokens and silently computes something else (Accelerate #4177). Chunked attention would
    need its chunk mask, which SP drops with the local mask.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", "") or getattr(config, "model_type", "")
    if model_type in RECURRENT_MODEL_TYPES:
        raise ValueError(
            f"model not servable by Ulysses SP: {model_type!r} mixes tokens with a recurrence/state-space "
            "scan, not attention, so each rank would see only its own shard; expected a transformer whose "
            "token mixing is attention; fix: train it without sequence parallelism")
    bad = [(name, i, kind) for name, i, kind in _layer_kinds(text) if kind not in SERVABLE_LAYER_TYPES]
    if bad:
        kinds = sorted({kind for _, _, kind in bad})
        layers = [i for _, i, _ in bad]
        shown = ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")
        raise ValueError(
            f"model not servable by Ulysses SP: {bad[0][0]} has {kinds} at layers [{shown}]; expected only "
            f"{sorted(SERVABLE_LAYER_TYPES)}: these layers mix tokens outside attention (or need a mask SP "
            "drops), so a shard would see only its own tokens and train silently wrong; fix: train this "
            "model without sequence parallelism")
    chunk = config_value(text, "attention_chunk_size", None)
    if chunk:
        raise ValueError(
            f"model not servable by Ulysses SP: chunked attention (attention_chunk_size={chunk}) is not "
            "honoured on the gathered sequence (its chunk mask is dropped with the local mask); expected "
            "attention_chunk_size=None; fix: train without SP, or set attention_chunk_size to None only if "
            "full causal attention is what you want")
    _check_position_scaled_queries(text, model_type)
    heads = config_value(text, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(
            f"model not servable by Ulysses SP: its config has no attention head count "
            f"(num_attention_heads={heads!r}); expected a transformer with num_attention_heads >= 1")
    _check_rope(text, model_type)
    if model is not None:
        _check_head(model)
        _check_prompt_learning(model)
        _check_modules(model)


def _check_position_scaled_queries(text, model_type) -> None:
    """Llama 4's attention temperature tuning scales a NoPE layer's queries by each token's position, and
    Transformers numbers those positions from the layer's own input (``arange`` of its length), not from
    position_ids: under SP each rank would scale its shard as if it began the sequence."""
    if not config_value(text, "attn_temperature_tuning", False):
        return
    nope = [i for i, rope in enumerate(config_value(text, "no_rope_layers", None) or ()) if not rope]
    if nope:
        shown = ", ".join(map(str, nope[:8])) + (", ..." if len(nope) > 8 else "")
        floor = config_value(text, "floor_scale", None)
        raise ValueError(
            f"model not servable by Ulysses SP: {model_type!r} scales the queries of its NoPE layers [{shown}] by "
            f"each token's position (attn_temperature_tuning, floor_scale={floor}), and Transformers counts those "
            "positions from the start of the layer's input, which under SP is each rank's own shard, so every rank "
            "after the first would scale its queries as if its tokens began the sequence and train silently wrong "
            "beyond floor_scale tokens; expected attn_temperature_tuning=False or no NoPE layer (no_rope_layers all "
            "1); fix: train without SP (attn_temperature_tuning=False changes the model's attention past "
            "floor_scale positions)")


# RoPE types whose frequencies depend on the longest position in the batch (Transformers'
# dynamic_rope_update): each SP rank sees only its shard's positions and would scale differently.
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_types(text) -> set:
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return set()
    nested = [v for v in params.values() if isinstance(v, dict)]  # per layer type
    return {str(p.get("rope_type") or p.get("type")) for p in (nested or [params])}


def _check_rope(text, model_type) -> None:
    found = sorted(t for t in _rope_types(text) if any(kind in t for kind in BATCH_DEPENDENT_ROPE))
    if found:
        raise ValueError(
            f"model not servable by Ulysses SP: {model_type!r} uses RoPE {found}, whose frequencies follow the longest "
            "position in the batch; each SP rank sees only its shard's positions and would rotate with another scaling "
            "than the unsharded model; expected a RoPE that does not depend on the batch (default, linear, yarn, "
            "llama3, ...); fix: set rope_parameters to a static rope_type for training, or train without SP")


def decoder_of(model):
    """The text decoder (the language model of a multimodal model; the model itself otherwise).

    Only it is scanned for token mixers: vision and audio towers hold convolutions that are theirs. A
    ``get_decoder()`` that returns something without the input embedding (some models return their
    output head) is not the decoder; the model itself is used then.
    """
    get_decoder = getattr(model, "get_decoder", None)
    try:
        decoder = get_decoder() if callable(get_decoder) else None
    except (AttributeError, NotImplementedError):
        return model
    if not isinstance(decoder, torch.nn.Module) or decoder is model:
        return model
    get_embeddings = getattr(model, "get_input_embeddings", None)
    try:
        embeddings = get_embeddings() if callable(get_embeddings) else None
    except (AttributeError, NotImplementedError):
        embeddings = None
    if embeddings is not None and all(m is not embeddings for m in decoder.modules()):
        return model
    return decoder


# Heads SP cannot serve, with why: those that read one position per sample, or normalise over the
# sequence's positions (each rank would read its own shard's), and per-token classification (the adapter
# shifts labels for next-token prediction; its labels belong to their own position).
_UNSERVED_HEADS = {
    "SequenceClassification": "reads the sequence as a whole (the last token's state)",
    "QuestionAnswering": "reads the sequence as a whole (span logits normalised over every position)",
    "MultipleChoice": "reads the sequence as a whole (one score per choice)",
    "TokenClassification": "labels each token in place, where the SP adapter shifts labels for next-token "
                           "prediction, so every token would learn its neighbour's label",
}
_HEAD = re.compile(r"For(" + "|".join(_UNSERVED_HEADS) + r")$")


def _check_head(model) -> None:
    kind = type(base_model(model)).__name__  # a PEFT wrapper: its model's head
    found = _HEAD.search(kind)
    if found:
        raise ValueError(
            f"model not servable by Ulysses SP: {kind}'s head {_UNSERVED_HEADS[found.group(1)]}; under SP each rank "
            "holds a shard of the sequence and the loss is next-token prediction, so this model would train "
            f"silently wrong; expected a causal LM (such as {kind[:found.start()]}ForCausalLM); fix: train this "
            "model without sequence parallelism")


def _check_prompt_learning(model) -> None:
    """PEFT's prompt learning (prompt, prefix, p-tuning) puts virtual tokens in front of the sequence the
    model is called with: under SP, in front of every rank's shard."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return
    found = [f"'{name}': {getattr(c.peft_type, 'value', c.peft_type)}" for name, c in configs.items()
             if getattr(c, "is_prompt_learning", False)]
    if found:
        raise ValueError(
            f"model not servable by Ulysses SP: PEFT prompt learning ({', '.join(found)}) puts its virtual tokens "
            "in front of the sequence each forward gets (in its input embeddings, or in its keys and values), and "
            "under SP that is every rank's shard, where the whole sequence has them once, before its first token; "
            "expected adapters that change weights only (LoRA, IA3, ...); fix: train the adapter with LoRA, or "
            "train prompt learning without sequence parallelism")


def _check_modules(model) -> None:
    for name, module in decoder_of(model).named_modules():
        kind = type(module).__name__
        if isinstance(module, torch.nn.Conv1d) or _TOKEN_MIXER.search(kind):
            raise ValueError(
                f"model not servable by Ulysses SP: '{name}' ({kind}) mixes tokens outside attention, so "
                "under SP it would see only its rank's shard and train silently wrong; expected token "
                "mixing by attention only; fix: train this model without sequence parallelism")


def check_attention_classes(model, core: str) -> None:
    """Refuse a decoder built for another attention implementation than `core`, where its modeling module
    picks the attention class when the model is built (Falcon's ``FALCON_ATTENTION_CLASSES``, GPT-Neo's).

    Registering SP switches the config to the core; such a layer keeps the class it was built with, which
    computes attention its own way (Falcon's eager class adds a mask the flash path does not build: a
    TypeError deep in its forward; Transformers' own ``set_attn_implementation`` leaves it the same way).
    """
    for name, module in decoder_of(model).named_modules():
        found = _class_table(type(module))
        if found is None:
            continue
        table_name, table = found
        if table.get(core) is type(module):
            continue
        built = sorted(key for key, cls in table.items() if cls is type(module))
        wanted = (f"its class for '{core}' is {table[core].__name__}" if core in table else
                  f"the table has no class for '{core}'")
        cores = [key for key in sorted(table) if _is_sp_core(key)]
        fix = (f"build the model with attn_implementation='{core}' (from_pretrained(..., attn_implementation="
               f"'{core}')) before registering SP" if core in table else
               f"build it for, and register, a core it has ({', '.join(cores)})" if cores else
               "train this model without sequence parallelism")
        raise ValueError(
            f"model not servable by Ulysses SP with core attention '{core}': '{name}' is a {type(module).__name__}, "
            f"the class {table_name} gives for {built}, and its model picks that class when it is built, so "
            f"switching the implementation to '{core}' leaves the layer computing attention its own way ({wanted}); "
            f"expected a model built for the core SP wraps; fix: {fix}")


def _is_sp_core(name) -> bool:
    try:
        core_kind(name)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _class_table(cls):
    """(name, table) of the ``*_ATTENTION_CLASSES`` table of `cls`'s modeling module that holds `cls`
    (implementation name -> class), or None."""
    module = sys.modules.get(cls.__module__)
    for name, value in vars(module).items() if module is not None else ():
        if name.endswith("_ATTENTION_CLASSES") and isinstance(value, dict) and cls in value.values():
            return name, value
    return None


_SUPPORT_FLAGS = {"sdpa": "_supports_sdpa", "flash": "_supports_flash_attn", "flex": "_supports_flex_attn"}
_CORE_NAMES = {"sdpa": "sdpa", "flash": "flash_attention_2", "flex": "flex_attention"}


def check_core_supported(model, core: str) -> None:
    """``scope="model"`` switches the model to the core itself, past Transformers' own check: a core its class
    says it does not support would drop what its attention hands the core (GPT-OSS's sinks, under sdpa:
    silently)."""
    decoder = decoder_of(model)
    owner = decoder if hasattr(type(decoder), "_supports_sdpa") else model
    flag = _SUPPORT_FLAGS[core_kind(core)]
    if getattr(type(owner), flag, True) is not False:
        return
    supported = [name for kind, name in _CORE_NAMES.items() if getattr(type(owner), _SUPPORT_FLAGS[kind], True)]
    fix = (f"set the ulysses section's attn_implementation (or register) to one of {supported}" if supported else
           "train this model without sequence parallelism")
    raise ValueError(
        f"model not servable by Ulysses SP with core attention '{core}': {type(owner).__name__}.{flag} is False, "
        f"so Transformers refuses attn_implementation='{core}' for it, and its attention would hand that core "
        "arguments it ignores (GPT-OSS's attention sinks, for one: the loss silently off); expected a core the "
        f"model supports; fix: {fix}")


def check_sinks_reach_kernel(attention, core: str) -> None:
    """Transformers' flash path hands attention sinks (``s_aux``: GPT-OSS) only to a kernel whose signature
    takes them (``s_aux`` or ``learnable_sink``) and drops them without a word otherwise: the flash-attn
    package's kernels take none, so the model would train silently without its sinks (unsharded too). SP
    refuses that, on every rank at the first call with sinks. A core `attention` that is not Transformers'
    flash function (a kernel of the user's own) is not judged."""
    from transformers import modeling_flash_attention_utils as fa_utils
    from transformers.integrations import flash_attention

    if attention is not flash_attention.flash_attention_forward:
        return
    _, (process, _) = fa_utils.lazy_import_flash_attention(core)
    takes = getattr(process, "keywords", {}).get("supports_mapping")
    if takes is not None and not (takes.get("s_aux") or takes.get("learnable_sink")):
        raise ValueError(
            f"model not servable by Ulysses SP with core attention '{core}': its attention passes attention sinks "
            "(s_aux, GPT-OSS's), and this core's flash kernel takes none, so Transformers drops them silently "
            "(without SP too) and the model would train without its sinks; expected a kernel that takes s_aux or "
            "learnable_sink; fix: use a core whose kernel takes sinks (the Hub kernel "
            "'kernels-community/vllm-flash-attn3', or 'flex_attention'), or train without SP on a core that "
            "computes them (eager)")


def sliding_layers(config) -> frozenset:
    """Indices of layers that attend within a sliding window (empty when the model has none)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = config_value(text, "sliding_window", None)
    if not window:
        return frozenset()
    kinds = config_value(text, "layer_types", None)
    if kinds:
        return frozenset(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    return frozenset(range(config_value(text, "num_hidden_layers", 0)))

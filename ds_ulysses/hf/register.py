"""Hooking the SP attention into Transformers, per model or (DeepSpeed-compatible) by name.

Per model (the default when a model object is given): the wrapper is registered in Transformers'
``AttentionInterface`` and ``AttentionMaskInterface`` under a fresh name that only this model's
config selects, so other models in the process keep their attention. The model gets its own copy of
its config first: models built from one config object share it, and the attention name lives there.

By name or path (DeepSpeed's contract: models created afterwards pick it up): the core
implementation's entry in Transformers' global tables is replaced. A global entry is hit by every
model using that core, vision and audio towers included (DeepSpeed #7834), so the SP wrapper serves
only causal (decoder) attention there and hands any other module to the original.

Every change goes through :data:`ds_ulysses.patching.PATCHES`; :func:`unregister_from_transformers`
(and ``ds_ulysses.uninstall``) undoes all of them. Either way, models SP would compute silently wrong
(token mixing outside attention, chunked attention) are refused here, before any collective: see
:func:`ds_ulysses.hf.servable.check_model_servable`.
"""

from __future__ import annotations

import copy
import functools
import itertools

import torch

from ..distributed.mesh import Mesh, build_mesh
from ..patching import PATCHES
from ..sp.attention import UlyssesAttention, check_core_attention
from ..sp.forward_check import check_positions
from .servable import check_model_servable, decoder_of, sliding_layers

__all__ = ["UlyssesSPAttentionHF", "register_with_transformers", "unregister_from_transformers"]

_TAG = "attention"
_names = itertools.count(1)


def _tables():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    return AttentionInterface, AttentionMaskInterface, ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS


def _own_config(model):
    """Give ``model`` (and only it) a private copy of its config and sub-configs."""
    from transformers import PretrainedConfig

    old = model.config
    new = copy.deepcopy(old)
    swap = {id(old): new}
    for name, value in vars(old).items():
        if isinstance(value, PretrainedConfig):
            swap[id(value)] = getattr(new, name)
    for module in model.modules():
        held = module.__dict__.get("config")
        if held is not None and id(held) in swap:
            PATCHES.set_attr(module, "config", swap[id(held)], _TAG, owner=model)
    return model.config


class UlyssesSPAttentionHF(UlyssesAttention):
    """Drop-in for DeepSpeed's class of the same name: the SP attention plus its registration with
    Transformers (:meth:`register_with_transformers`)."""

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                   micro_batch_size, seq_length=None, seq_length_is_variable=True,
                                   disable_in_eval=False, mesh=None):
        """See :func:`register_with_transformers` (returns the ``mpu``)."""
        return register_with_transformers(model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                          micro_batch_size, seq_length, seq_length_is_variable,
                                          disable_in_eval, mesh)


def register_with_transformers(model_name_or_path, core_attn_implementation, sequence_parallel_size,
                               micro_batch_size, seq_length=None, seq_length_is_variable=True,
                               disable_in_eval=False, mesh: Mesh | None = None):
    """Make the model (or models created later, for a name/path) run Ulysses SP attention.

    Returns the ``mpu`` for ``deepspeed.initialize(mpu=...)``, or None when sequence_parallel_size
    is 1. ``mesh`` reuses an existing :class:`~ds_ulysses.distributed.mesh.Mesh` instead of building one.
    """
    if sequence_parallel_size == 1:
        return None
    check_core_attention(core_attn_implementation)
    if seq_length is None and not seq_length_is_variable:
        raise ValueError(
            "seq_length_is_variable=False needs seq_length (the fixed global sequence length); "
            "pass seq_length=S or leave seq_length_is_variable=True")
    is_model = hasattr(model_name_or_path, "config")
    if is_model:
        config = model_name_or_path.config
    else:
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(model_name_or_path)
    check_model_servable(config, model_name_or_path if is_model else None)
    if mesh is None:
        mesh = build_mesh(sequence_parallel_size)
    elif mesh.sp != sequence_parallel_size:
        raise ValueError(f"mesh has sp={mesh.sp} but sequence_parallel_size={sequence_parallel_size}; make them equal")
    _, _, attn_table, mask_table = _tables()
    text = config.get_text_config()
    core_fn = PATCHES.original_item(attn_table, core_attn_implementation)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    local = None if seq_length is None else seq_length // sequence_parallel_size
    uattn = UlyssesSPAttentionHF(
        core_fn, micro_batch_size, text.num_attention_heads, head_dim,
        getattr(text, "num_key_value_heads", None) or text.num_attention_heads, text.num_hidden_layers,
        mesh.sp_group, seq_length_is_variable, local, seq_length, disable_in_eval, core_attn_implementation,
        watch=mesh.sp_watch, sliding_layers=sliding_layers(config))

    if is_model:
        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            return uattn(module, query, key, value, attention_mask, *args, **kwargs)

        _register_on_model(model_name_or_path, uattn, attention, disable_in_eval)
    else:
        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            if not getattr(module, "is_causal", True):  # an encoder (vision/audio tower): not ours
                return core_fn(module, query, key, value, attention_mask, *args, **kwargs)
            return uattn(module, query, key, value, attention_mask, *args, **kwargs)

        _register_globally(core_attn_implementation, attention)
    return mesh


def _register_on_model(model, uattn, attention, disable_in_eval):
    attn_iface, mask_iface, _, mask_table = _tables()
    core = uattn.core_attn_implementation
    original_mask = mask_table[core]
    name = f"ulysses{next(_names)}_{core}"

    def mask(*args, **kwargs):
        # under SP the mask is rebuilt from global positions; a local one would be wrong and O(sl_l^2)
        if disable_in_eval and not model.training:
            return original_mask(*args, **kwargs)
        return None

    hook = decoder_of(model).register_forward_pre_hook(functools.partial(_check_positions, uattn), with_kwargs=True)
    PATCHES.on_undo(hook.remove, _TAG, owner=model)
    PATCHES.set_item(attn_iface._global_mapping, name, attention, _TAG, owner=model)
    PATCHES.set_item(mask_iface._global_mapping, name, mask, _TAG, owner=model)
    _own_config(model).get_text_config()._attn_implementation = name
    model.__dict__["ulysses_attention"] = uattn  # not a submodule: no params, kept out of module walks
    PATCHES.on_undo(lambda: model.__dict__.pop("ulysses_attention", None), _TAG, owner=model)


def _check_positions(uattn, module, args, kwargs):
    """Decoder pre-hook: judge the call's position_ids before the model uses them.

    The verdict reaches every SP rank through the attention's first gather. A mis-shaped tensor is
    swapped for a local stand-in so this rank gets that far (RoPE would raise here, alone).
    """
    if uattn.world_size == 1 or (uattn.disable_in_eval and not module.training):
        return None
    positional = len(args) > 2  # forward(input_ids, attention_mask, position_ids, ...)
    given = args[2] if positional else kwargs.get("position_ids")
    ids = args[0] if args else kwargs.get("input_ids")
    ref = ids if torch.is_tensor(ids) else kwargs.get("inputs_embeds")
    if not torch.is_tensor(ref) or ref.dim() < 2:
        return None
    bs, sl_l = ref.shape[:2]
    uattn.input_verdict = check_positions(given, bs, sl_l)
    if uattn.input_verdict.ok or given is None:
        return None
    standin = torch.arange(sl_l, device=ref.device).expand(bs, sl_l)
    if positional:
        return (*args[:2], standin, *args[3:]), kwargs
    return args, {**kwargs, "position_ids": standin}


def _register_globally(core, attention):
    _, _, attn_table, mask_table = _tables()
    PATCHES.set_item(attn_table, core, attention, _TAG)
    PATCHES.set_item(mask_table, core, lambda *args, **kwargs: None, _TAG)


def unregister_from_transformers() -> None:
    """Undo every registration: Transformers' tables get their entries back, and every model
    registered by object gets its own config, attention and position hook back."""
    PATCHES.undo(_TAG)

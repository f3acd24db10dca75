"""Hooking the SP attention into Transformers, with DeepSpeed's ``register_with_transformers`` contract.

Transformers looks attention up by name at every call: ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
(and the mask builder in ``ALL_MASK_ATTENTION_FUNCTIONS``). Registration puts one *dispatcher* under the
core's own name (sdpa, flash_attention_2, a Hub kernel, ...): it runs the SP wrapper for the attention
modules SP serves and the original function for every other module. The model keeps the core's name,
which matters: models pick code paths by comparing ``_attn_implementation`` with a name (Falcon checks
``== "sdpa"``, flash paths ``startswith("flash")``).

Two scopes:

- ``"global"`` (DeepSpeed's contract, the default of the drop-in call): every causal attention module
  that runs the core goes through SP, including models built after the call. Vision and audio towers
  (non-causal modules) keep the original (DeepSpeed #7834). The call reads ``.config`` only, so a
  model, a PEFT wrapper, any config holder or a name/path all work.
- ``"model"`` (what :func:`ds_ulysses.initialize` uses): only the given model's text decoder runs SP.
  The model gets a private copy of its config (models built from one config object share it), so its
  mask builder can be told apart from other models' too.

Either way, the decoder of a model SP serves gets forward hooks (:mod:`ds_ulysses.hf.decoder_watch`)
that judge the call's position_ids before Transformers would invent local ones (silently wrong under SP)
and refuse a forward that never reached the SP attention; under the global scope they are added to every
model built while the registration is active. Every change goes
through :data:`ds_ulysses.patching.PATCHES`; :func:`unregister_from_transformers` (and
``ds_ulysses.uninstall``) undoes all of them. Models SP would compute silently wrong are refused here,
before any collective (:func:`ds_ulysses.hf.servable.check_model_servable`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import warnings
import weakref

import torch

from ..config import resolve_ring_size
from ..distributed.mesh import Mesh, build_mesh
from ..patching import PATCHES
from ..sp.attention import HUB_KERNEL, UlyssesAttention, check_core_attention
from ..sp.forward_check import PositionCheck, Problem
from ..sp.ring import RingCore
from .decoder_watch import sp_active, watch_decoder
from .model_facts import config_value, text_config
from .servable import check_attention_classes, check_core_supported, check_model_servable, \
    check_sinks_reach_kernel, decoder_of, sliding_layers

__all__ = ["UlyssesSPAttentionHF", "register_with_transformers", "resolve_ring", "unregister_from_transformers",
           "sp_attention_of", "section_ring", "SCOPES"]

_TAG = "attention"
SCOPES = ("global", "model")


class UlyssesSPAttentionHF(UlyssesAttention):
    """Drop-in for DeepSpeed's class of the same name: the SP attention plus its registration with
    Transformers (:meth:`register_with_transformers`)."""

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                   micro_batch_size, seq_length=None, seq_length_is_variable=True,
                                   disable_in_eval=False, max_length=None, *, mesh=None, scope="global",
                                   ring_size=None):
        """See :func:`register_with_transformers` (returns the ``mpu``)."""
        return register_with_transformers(model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                          micro_batch_size, seq_length, seq_length_is_variable, disable_in_eval,
                                          max_length, mesh=mesh, scope=scope, ring_size=ring_size)


class _Served:
    """A text config whose model SP serves (its mask is not built): weak references, so a served copy of a
    model leaves no trace once it is gone."""

    def __init__(self, uattn, model, config):
        self.uattn, self._model, self._config = uattn, weakref.ref(model), weakref.ref(config)

    @property
    def model(self):
        return self._model()

    def is_for(self, config) -> bool:
        return self._config() is config


class _Dispatch:
    """What runs under one core's name once SP is registered for it."""

    def __init__(self, core: str, attention, mask):
        self.core, self.attention, self.mask = core, attention, mask  # the originals
        self.global_attn: UlyssesSPAttentionHF | None = None
        self.by_module: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> wrapper
        self.sp_configs: dict[int, _Served] = {}  # id(text config) -> what serves it (configs are unhashable)
        self.sinks_reach_kernel = False  # checked once: a call's attention sinks reach the core's kernel

    def served(self, config) -> _Served | None:
        entry = self.sp_configs.get(id(config))
        return entry if entry is not None and entry.is_for(config) else None

    def serve_config(self, config, uattn, model) -> None:
        """Build no mask for ``config``'s model (SP rebuilds causality from the global positions)."""
        self.sp_configs[id(config)] = _Served(uattn, model, config)
        weakref.finalize(config, self.forget_config, id(config))

    def forget_config(self, config_id: int) -> None:
        self.sp_configs.pop(config_id, None)

    def attention_for(self, module):
        uattn = self.by_module.get(module)
        if uattn is None and getattr(module, "is_causal", True):
            uattn = self.global_attn
        return uattn

    def run_attention(self, module, query, key, value, attention_mask, *args, **kwargs):
        uattn = self.attention_for(module)
        if uattn is None:  # not SP's (a vision tower, another model): the original core
            return self.attention(module, query, key, value, attention_mask, *args, **kwargs)
        if attention_mask is not None and sp_active(uattn, module) and \
                self.served(getattr(module, "config", None)) is not None:
            # this model's mask builder returns None under SP, so the mask was made by the module itself
            raise ValueError(
                f"model not servable by Ulysses SP: {type(module).__name__} passes an attention mask it builds "
                "itself (not Transformers' mask builder) to the attention function; SP attends over the gathered "
                "sequence from the global position_ids and cannot apply a mask built for the local shard, so the "
                "model would train silently wrong; expected attention_mask=None from the decoder under SP; fix: "
                "train this model without sequence parallelism")
        if kwargs.get("s_aux") is not None and not self.sinks_reach_kernel:
            self.check_sinks_reach_kernel()
        return uattn(module, query, key, value, attention_mask, *args, **kwargs)

    def check_sinks_reach_kernel(self) -> None:
        """:func:`~ds_ulysses.hf.servable.check_sinks_reach_kernel`, once per core."""
        check_sinks_reach_kernel(self.attention, self.core)
        self.sinks_reach_kernel = True

    def build_mask(self, *args, **kwargs):
        # under SP the mask is rebuilt from the global position_ids; a local one would be wrong and
        # O(sl_l^2) memory, so SP models get none
        entry = self.served(kwargs.get("config"))
        if entry is not None:
            uattn, model = entry.uattn, entry.model
            if model is None or uattn.serves(model):
                if _looks_ahead(kwargs) and (uattn.input_verdict is None or uattn.input_verdict.ok):
                    uattn.input_verdict = PositionCheck(Problem.MASK_LOOKS_AHEAD)  # every rank raises at the gather
                return None
        return self.mask(*args, **kwargs)


def _looks_ahead(kwargs: dict) -> bool:
    """Whether the mask Transformers asks for lets any token see the next one: a bidirectional overlay on the
    causal mask (``block_sequence_ids``, an ``or_mask_function``) that SP's attention would not reproduce.
    Read from the mask function on the ``sl_l - 1`` (query, next key) pairs of each row, not the whole mask."""
    fn, q_length, bs = kwargs.get("mask_function"), kwargs.get("q_length"), kwargs.get("batch_size")
    if fn is None or not isinstance(q_length, int) or q_length < 2 or not isinstance(bs, int):
        return False
    device = kwargs.get("device") or getattr(kwargs.get("attention_mask"), "device", None)
    q = (torch.arange(q_length - 1, device=device) + kwargs.get("q_offset", 0)).view(1, -1)  # [1 sl_l-1]
    batch = torch.arange(bs, device=device).view(-1, 1)  # [bs 1]
    return bool(fn(batch, torch.zeros_like(batch), q, q + 1).any())


_dispatches: dict[str, _Dispatch] = {}
_section_rings: list = []  # the rings section_ring blocks ask for, innermost last


@contextlib.contextmanager
def section_ring(ring_size):
    """While the block runs, a registration that names neither a ring nor a mesh takes ``ring_size`` (an int or
    ``"auto"``, resolved against its model's heads). Accelerate registers SP through DeepSpeed's call, which has no
    ring, from inside ``Accelerator.prepare``: :mod:`ds_ulysses.hf.accelerate_ring` runs that inside this block with the
    section's ``ring_size``, so the mesh Accelerate hands to ``deepspeed.initialize`` is the section's. Nothing
    outlives the block."""
    _section_rings.append(ring_size)
    try:
        yield
    finally:
        _section_rings.pop()


def _tables():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS


def _dispatch(core: str) -> _Dispatch:
    """The dispatcher under ``core``'s name, installed in Transformers' tables on first use."""
    if core in _dispatches:
        return _dispatches[core]
    attn_table, mask_table = _tables()
    # a Hub kernel may come without a mask builder of its own: flash kernels take the flash one
    dispatch = _Dispatch(core, attn_table[core], mask_table.get(core) or mask_table["flash_attention_2"])
    for table, entry in ((attn_table, dispatch.run_attention), (mask_table, dispatch.build_mask)):
        _install(table, core, entry)
    _dispatches[core] = dispatch
    PATCHES.on_undo(lambda: _dispatches.pop(core, None), _TAG)
    return dispatch


def _install(table, name: str, entry) -> None:
    """Put ``entry`` under ``name`` for every instance of the table's interface class. Transformers'
    interfaces read an instance's own entries first, then the class-wide ones, and a model module may
    hold an instance of its own (Doge does): the class-wide entry is the one all of them see. The shared
    instance gets its own entry too, as DeepSpeed's registration leaves it (code written against
    DeepSpeed removes that entry to clean up)."""
    PATCHES.set_item(type(table)._global_mapping, name, entry, _TAG)
    PATCHES.set_item(table._local_mapping, name, entry, _TAG)


def _load_core(name: str) -> None:
    """Make sure ``name`` is in Transformers' attention table: Hub kernels register on first load."""
    attn_table, _ = _tables()
    if isinstance(name, str) and HUB_KERNEL.match(name) and name not in attn_table:
        from transformers import modeling_flash_attention_utils

        try:
            modeling_flash_attention_utils.lazy_import_flash_attention(name)
        except ImportError as err:
            raise ImportError(
                f"core_attn_implementation={name!r} is a Hub kernel, which Transformers loads with the `kernels` "
                f"package; loading it failed ({err}); fix: `pip install kernels` (a version your Transformers "
                "supports), or use 'flash_attention_2' / 'sdpa'") from err
    if name not in attn_table:
        raise ValueError(
            f"core_attn_implementation={name!r} is not an attention implementation Transformers knows; expected "
            f"one of {sorted(k for k in attn_table.keys() if not k.startswith('paged'))} or a Hub kernel "
            "('org/repo[@revision][:function]'); fix: pick one of those")


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


def _check_matching_core(holder, core: str) -> None:
    """DeepSpeed's rule: a loaded model must already use the core it is registered with (the
    dispatcher sits under that name; another name would bypass it)."""
    config = holder.config
    current = getattr(config, "_attn_implementation", None)
    if not isinstance(current, str):
        current = getattr(text_config(config), "_attn_implementation", None)
    if isinstance(current, str) and current != core:
        raise ValueError(
            f"core_attn_implementation='{core}' does not match model config attn_implementation='{current}'; "
            f"expected the model to run the core SP wraps; fix: load the model with attn_implementation='{core}' "
            f"(or call model.set_attn_implementation('{core}')), or register '{current}'")


def register_with_transformers(model_name_or_path, core_attn_implementation, sequence_parallel_size,
                               micro_batch_size, seq_length=None, seq_length_is_variable=True,
                               disable_in_eval=False, max_length=None, *, mesh: Mesh | None = None,
                               scope: str = "global", ring_size=None):
    """Make attention run Ulysses SP; returns the ``mpu`` for ``deepspeed.initialize(mpu=...)`` (None when
    sequence_parallel_size is 1).

    ``model_name_or_path`` is a model, a PEFT wrapper, anything with ``.config``, or a name/path (its
    config is read). ``scope="global"`` (DeepSpeed's behaviour) serves every causal model that runs
    the core, including models built later; ``scope="model"`` only the given model (an
    ``nn.Module``), whose attention is switched to the core. ``mesh`` reuses an existing
    :class:`~ds_ulysses.distributed.mesh.Mesh`. ``max_length`` is DeepSpeed's deprecated name for
    ``seq_length``, used (with a warning) where ``seq_length`` is not given, as DeepSpeed does.
    ``ring_size`` (an int or ``"auto"``; None: the mesh's, else :func:`section_ring`'s, else 1) spreads the
    sequence over a ring of Ulysses groups, so sequence_parallel_size may exceed the heads (:mod:`ds_ulysses.sp.ring`).
    """
    if sequence_parallel_size == 1:
        return None
    if max_length is not None:
        warnings.warn(f"max_length={max_length} is deprecated (DeepSpeed's old name for seq_length); pass "
                      f"seq_length={max_length}" + ("" if seq_length is None else
                                                    f" (seq_length={seq_length} is given, and it is used)"),
                      FutureWarning, stacklevel=2)
        seq_length = max_length if seq_length is None else seq_length
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}; fix: 'global' (DeepSpeed's behaviour: "
                         "every model running the core) or 'model' (only the given model)")
    check_core_attention(core_attn_implementation)
    if seq_length is None and not seq_length_is_variable:
        raise ValueError(
            "seq_length_is_variable=False needs seq_length (the fixed global sequence length); "
            "pass seq_length=S or leave seq_length_is_variable=True")
    loaded = hasattr(model_name_or_path, "config")
    module = model_name_or_path if isinstance(model_name_or_path, torch.nn.Module) else None
    if scope == "model" and module is None:
        raise ValueError(
            f"scope='model' needs the model object (an nn.Module) whose attention SP should serve, got "
            f"{type(model_name_or_path).__name__}; fix: pass the model, or use scope='global'")
    if loaded:
        config = model_name_or_path.config
    else:
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(model_name_or_path)
    check_model_servable(config, module)
    if module is not None:
        _check_causal(module)
        check_attention_classes(module, core_attn_implementation)
    if scope == "model":
        check_core_supported(module, core_attn_implementation)
    _load_core(core_attn_implementation)
    if loaded and scope == "global":
        _check_matching_core(model_name_or_path, core_attn_implementation)
    if mesh is None:
        if ring_size is None:
            ring_size = _section_rings[-1] if _section_rings else 1
        mesh = build_mesh(sequence_parallel_size, ring_size=resolve_ring(config, ring_size, sequence_parallel_size))
    elif mesh.sp != sequence_parallel_size:
        raise ValueError(f"mesh has sp={mesh.sp} but sequence_parallel_size={sequence_parallel_size}; make them equal")
    elif ring_size is not None and resolve_ring(config, ring_size, mesh.sp) != mesh.ring_size:
        raise ValueError(f"mesh has ring_size={mesh.ring_size} but ring_size={ring_size!r} was given; expected one "
                         "ring; fix: make them equal, or give only the mesh")
    ring = None
    if mesh.ring_size > 1:
        resolve_ring(config, mesh.ring_size, mesh.sp)
        ring = RingCore(mesh.ring_group, mesh.ring_size, mesh.ring_rank, core_attn_implementation,
                        watch=mesh.sp_watch)
    dispatch = _dispatch(core_attn_implementation)
    uattn = _wrapper(dispatch.attention, config, core_attn_implementation, mesh, micro_batch_size, seq_length,
                     seq_length_is_variable, disable_in_eval, ring)
    PATCHES.on_undo(uattn.retire, _TAG)
    if scope == "model":
        _serve_model(dispatch, module, uattn)
    else:
        _serve_globally(dispatch, uattn, module)
    return mesh


def _is_causal(decoder) -> bool:
    """False when the decoder's attention modules all say they are not causal (as the dispatcher reads
    them: a module without ``is_causal`` counts as causal), or its config does."""
    flags = [m.is_causal for m in decoder.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    return not (flags and not any(flags)) and getattr(text_config(decoder), "is_causal", True) is not False


def _check_causal(model) -> None:
    """SP serves causal decoders: a model whose attention is bidirectional would need a bidirectional,
    per-document attention over the gathered sequence that the wrapper does not build."""
    if not _is_causal(decoder_of(model)):
        raise ValueError(
            f"model not servable by Ulysses SP: {type(model).__name__}'s attention is bidirectional (is_causal is "
            "False), and Ulysses SP here serves causal decoders; expected a causal LM; fix: train this model "
            "without sequence parallelism")


def resolve_ring(config, ring_size, sequence_parallel_size: int) -> int:
    """``ring_size`` (an int or ``"auto"``) checked against the model's query heads; "auto" keeps the Ulysses
    degree within a node of ``LOCAL_WORLD_SIZE`` ranks (set by torchrun and DeepSpeed's launcher) when known."""
    node = os.environ.get("LOCAL_WORLD_SIZE")
    heads = config_value(text_config(config), "num_attention_heads")
    return resolve_ring_size(ring_size, sequence_parallel_size, [heads], int(node) if node else None)


def _wrapper(core_fn, config, core, mesh, micro_batch_size, seq_length, seq_length_is_variable, disable_in_eval,
             ring=None):
    text = text_config(config)
    heads = config_value(text, "num_attention_heads")
    head_dim = config_value(text, "head_dim") or config_value(text, "hidden_size") // heads
    local = None if seq_length is None else seq_length // mesh.sp
    # the attention's own length check sees its Ulysses group's block: seq_length / ring_size tokens
    block = None if seq_length is None else seq_length // mesh.ring_size
    return UlyssesSPAttentionHF(
        core_fn, micro_batch_size, heads, head_dim, config_value(text, "num_key_value_heads") or heads,
        config_value(text, "num_hidden_layers"), mesh.ulysses_group, seq_length_is_variable, local, block,
        disable_in_eval, core, watch=mesh.sp_watch, sliding_layers=sliding_layers(config), ring=ring)


def _serve_model(dispatch: _Dispatch, model, uattn) -> None:
    """Only ``model``'s text decoder runs SP, under its own config copy switched to the core."""
    config = _own_config(model)
    text = text_config(config)
    text._attn_implementation = dispatch.core
    decoder = decoder_of(model)
    for module in decoder.modules():
        dispatch.by_module[module] = uattn
    dispatch.serve_config(text, uattn, model)
    PATCHES.on_undo(functools.partial(_forget, dispatch, list(decoder.modules()), id(text)), _TAG, owner=model)
    watch_decoder(decoder, uattn, owner=model, tag=_TAG, adopt=functools.partial(_serve_copy, True))


def _forget(dispatch: _Dispatch, modules, config_id: int) -> None:
    for module in modules:
        dispatch.by_module.pop(module, None)
    dispatch.forget_config(config_id)


def _serve_copy(model_scope: bool, uattn, decoder) -> None:
    """At each SP forward (the decoder's pre-hook): a decoder with this registration's hooks that its
    dispatcher does not know is a copy of one it serves (``copy.deepcopy``, a pickle loaded in this process;
    the hooks and ``uattn`` came with it), so it is served as the original is: by this SP attention (model
    scope: its modules; global scope: every causal module already) and with no mask built. The entries are weak:
    a discarded copy leaves nothing behind."""
    dispatch = _dispatches.get(uattn.core_attn_implementation)
    text = text_config(decoder)
    if dispatch is None or dispatch.served(text) is not None:
        return
    if model_scope:
        for module in decoder.modules():
            dispatch.by_module[module] = uattn
    dispatch.serve_config(text, uattn, decoder)


def _serve_globally(dispatch: _Dispatch, uattn, model) -> None:
    """Every causal module running the core goes through ``uattn``; models built from now on (and
    ``model``, when one was given) get the position hook and no local mask."""
    from transformers import PreTrainedModel

    dispatch.global_attn = uattn
    PATCHES.on_undo(lambda: setattr(dispatch, "global_attn", None), _TAG)
    if model is not None:
        _adopt(model)
    if not PATCHES.has("post_init"):
        original = PreTrainedModel.post_init

        @functools.wraps(original)
        def post_init(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            _adopt(self)
            return out

        PATCHES.set_attr(PreTrainedModel, "post_init", post_init, "post_init")


def _adopt(model) -> None:
    """Under a global registration: a causal decoder running a registered core is checked as a model given
    to the registration is (a hybrid or a classifier built later is refused as it is built), gets the
    position hook, and its text config is marked so its mask is not built."""
    decoder = decoder_of(model)
    text = text_config(decoder)
    dispatch = _dispatches.get(getattr(text, "_attn_implementation", None))
    if dispatch is None or dispatch.global_attn is None or decoder in dispatch.by_module:
        return  # not this core's, or served by its own (model-scope) registration
    if not _is_causal(decoder):
        return  # an encoder or a vision/audio tower: never SP's
    check_model_servable(model.config, model)  # the head too: a decoder's own post_init runs before its model's
    if decoder.__dict__.get("_ulysses_hooks", (None,))[0] is dispatch.global_attn:
        return  # adopted already
    dispatch.serve_config(text, dispatch.global_attn, decoder)
    watch_decoder(decoder, dispatch.global_attn, owner=None, tag=_TAG, adopt=functools.partial(_serve_copy, False))


def sp_attention_of(model):
    """The SP attention serving ``model``'s text decoder (by either scope), or None."""
    text = text_config(decoder_of(model))
    dispatch = _dispatches.get(getattr(text, "_attn_implementation", None))
    entry = dispatch.served(text) if dispatch is not None else None
    return None if entry is None else entry.uattn


def unregister_from_transformers() -> None:
    """Undo every registration: Transformers' tables get their entries back, every model registered
    by object its own config and hooks, and models built later are no longer adopted."""
    PATCHES.undo(_TAG)
    PATCHES.undo("post_init")

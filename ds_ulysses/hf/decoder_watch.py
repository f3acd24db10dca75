"""The forward hooks a decoder SP serves gets: its position_ids judged before the model uses them, a
forward that never reached the SP attention refused, and a training forward whose loss SP does not serve
refused (:func:`unserved_loss_scope`). Pre-hooks on the decoder's own modules note whether one took the
call's position_ids, for models whose attention calls get none.

Transformers invents local position_ids (``arange`` over the shard) when a call passes none, which is
silently wrong under SP; the pre-forward hook sees the call first. A model that computes attention
itself on some path (Falcon under sdpa) never calls the registered function, so every rank would
attend only to its own shard; the post-forward hook notices that no SP attention ran during the
forward. Both are added by :mod:`ds_ulysses.hf.register`, which also undoes them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
from transformers.utils import ModelOutput

from ..patching import PATCHES
from ..sp.forward_check import check_positions
from ..sp.shards import SHARDS
from .checkpointing import checkpointing_on

__all__ = ["watch_decoder", "sp_active", "unserved_loss_scope"]

_UNSERVED_LOSS: contextvars.ContextVar = contextvars.ContextVar("ulysses_unserved_loss", default=None)


@contextlib.contextmanager
def unserved_loss_scope(owner: str | None):
    """Within it, a training forward of an SP decoder is refused, ``owner`` (a ``compute_loss`` that is not
    the one SP serves, by qualified name) computing its loss; ``None`` lifts the refusal (the served loss)."""
    token = _UNSERVED_LOSS.set(owner)
    try:
        yield
    finally:
        _UNSERVED_LOSS.reset(token)


def watch_decoder(decoder, uattn, owner, tag: str, adopt=None) -> None:
    """Hooks around the decoder's forward: its position_ids are judged before Transformers could
    invent local ones, and a forward that never reached the SP attention is an error, not plain
    data parallelism (a model that chose its attention path at construction, say). A decoder an
    earlier registration watched (a model built under one global registration and registered again,
    as a second Trainer in the same process does) gets this registration's hooks instead. The hooks
    are undone with the registration's ``tag``, as belonging to ``owner`` (the model registered by
    object; None for a global registration).

    The hooks travel with copies of the model (``copy.deepcopy``, pickling), sharing ``uattn``; at each SP
    forward the pre-hook calls ``adopt(uattn, decoder)`` (a picklable callable), which lets the registration
    serve a copy it has not seen as it serves the original. Once the registration is undone (``uattn`` retired,
    or absent in a process that unpickled the model), a copy's hooks do nothing."""
    for handle in decoder.__dict__.get("_ulysses_hooks", (None,))[1:]:
        handle.remove()
    before = decoder.register_forward_pre_hook(functools.partial(_check_positions, uattn, adopt), with_kwargs=True)
    after = decoder.register_forward_hook(functools.partial(_check_sp_ran, uattn))
    taken = [child.register_forward_pre_hook(functools.partial(_note_positions_taken, uattn), with_kwargs=True)
             for child in decoder.children()]
    decoder.__dict__["_ulysses_hooks"] = (uattn, before, after, *taken)
    decoder.__dict__["_ulysses_watched"] = uattn.watch.step
    for handle in (before, after, *taken):
        PATCHES.on_undo(handle.remove, tag, owner=owner)
    PATCHES.on_undo(lambda: [decoder.__dict__.pop(k, None) for k in ("_ulysses_watched", "_ulysses_hooks")], tag,
                    owner=owner)


def _live(uattn) -> bool:
    """Whether a hook's registration still stands (see :func:`watch_decoder`)."""
    return uattn is not None and not uattn.retired


def sp_active(uattn, module) -> bool:
    return _live(uattn) and uattn.serves(module)


def _check_sp_ran(uattn, module, args, output):
    if not _live(uattn):
        return
    _await_backward(uattn, module, output)
    if sp_active(uattn, module) and uattn.watch.step == module.__dict__.get("_ulysses_watched"):
        raise ValueError(
            f"model not servable by Ulysses SP: {type(module).__name__}.forward ran without the SP attention: none "
            f"of its layers called Transformers' attention function '{uattn.core_attn_implementation}' (the model "
            "computes attention itself on this path, as Falcon does under sdpa), so every rank attended only to its "
            "own shard; expected the model to look its attention up by that name at every call; fix: build the "
            f"model with attn_implementation='{uattn.core_attn_implementation}' before registering SP, try another "
            "core (flash_attention_2), or train this model without sequence parallelism")


def _await_backward(uattn, module, output) -> None:
    """After a training forward whose attention calls took the model call's position_ids, under gradient
    checkpointing: its backward, once it reaches the decoder's output, is refused if another forward has
    begun since (:func:`_backward_reached`), before any layer is recomputed."""
    hidden = output[0] if isinstance(output, (tuple, ModelOutput)) else output
    if (uattn.call_positions_served and torch.is_tensor(hidden) and hidden.requires_grad
            and checkpointing_on(module)):
        hidden.register_hook(functools.partial(_backward_reached, uattn, uattn.forwards, type(module).__name__))


def _backward_reached(uattn, forward, owner, grad):
    """The recompute in backward takes the positions of the latest forward: silently wrong for an earlier one,
    so its backward raises on every rank (each ran the same forwards). A forward left without backward (its
    loss raised, say) costs nothing: only its own backward is refused."""
    if uattn.forwards != forward:
        raise ValueError(
            f"Ulysses SP cannot back-propagate a forward of {owner} after another forward of it has begun: its "
            "attention calls get no position_ids, so SP takes the model call's, and gradient checkpointing "
            "recomputes the attention in backward with the latest forward's, silently wrong for an earlier one; "
            "expected backward on each forward's loss before the next forward (gradient accumulation does so); "
            "fix: call backward before the next forward, evaluation included, or turn gradient checkpointing off")


def _note_positions_taken(uattn, module, args, kwargs):
    """Pre-hook of the decoder's own modules: did one (a position or rotary embedding) take the model call's
    position_ids tensor itself? Then the model places its tokens by them, and an attention call that gets
    none may use them (:meth:`~ds_ulysses.sp.attention.UlyssesAttention._gather_positions`)."""
    given = uattn.call_positions if _live(uattn) else None
    if given is not None and any(x is given for x in (*args, *kwargs.values())):
        uattn.call_positions_taken = True


def _check_positions(uattn, adopt, module, args, kwargs):
    """Decoder pre-hook: judge the call's position_ids before the model uses them.

    The verdict reaches every SP rank through the attention's first gather. A mis-shaped tensor is
    swapped for a local stand-in so this rank gets that far (RoPE would raise here, alone). The
    attention's gathered positions are scoped to this forward (gradient-checkpointing recomputes in
    backward still reuse them). An input the data adapter yielded as a shard runs SP in eval mode too
    (``disable_in_eval`` serves whole samples): a model left in eval mode (``from_pretrained`` returns one)
    trains as in train mode, and a reference model scores the shards its policy trains on.
    """
    if not _live(uattn):
        return None
    ids = args[0] if args else kwargs.get("input_ids")
    uattn.shard_input = (uattn.world_size > 1 and uattn.disable_in_eval and not module.training
                         and SHARDS.yielded(uattn.process_group, ids))
    if not uattn.serves(module):
        return None
    if adopt is not None:
        adopt(uattn, module)
    owner = _UNSERVED_LOSS.get()
    if owner is not None and (module.training or torch.is_grad_enabled()):
        raise ValueError(
            f"Ulysses SP (sp_size={uattn.world_size}) cannot serve {owner}: it computes its training loss without "
            "Trainer.compute_loss, so that loss reads each rank's shard of a sample as the whole sample (a "
            "per-sample sum of log-probabilities, a preference margin, a reward at the last token), silently wrong; "
            "expected the loss of Trainer.compute_loss, whose SP branch is the whole sequence's token loss (TRL's "
            f"SFTTrainer calls it); fix: train without sequence parallelism (no \"ulysses\" section, no "
            f"parallelism_config sp_size), or have {owner} return super().compute_loss(...)")
    uattn.new_forward()
    module.__dict__["_ulysses_watched"] = uattn.watch.step
    uattn.shard_verdict = SHARDS.verdict(uattn.process_group, ids)
    positional = len(args) > 2  # forward(input_ids, attention_mask, position_ids, ...)
    given = args[2] if positional else kwargs.get("position_ids")
    ref = ids if torch.is_tensor(ids) else kwargs.get("inputs_embeds")
    if not torch.is_tensor(ref) or ref.dim() < 2:
        return None
    bs, sl_l = ref.shape[:2]
    mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
    if torch.is_tensor(mask) and mask.shape == (bs, sl_l) and not bool(mask.all()):
        uattn.call_padding = mask == 0  # [bs sl_l]: rides in the attention's position gather
    uattn.input_verdict = check_positions(given, bs, sl_l)
    if uattn.input_verdict.ok:
        uattn.call_positions = given
    if uattn.input_verdict.ok or given is None:
        return None
    standin = torch.arange(sl_l, device=ref.device).expand(bs, sl_l)
    if positional:
        return (*args[:2], standin, *args[3:]), kwargs
    return args, {**kwargs, "position_ids": standin}

"""The SP loss on a Transformers causal LM: ``model(**batch).loss`` is the sample's global token mean.

Transformers computes a loss only from ``labels``; the adapter's batches carry pre-shifted, sharded
``shift_labels`` instead. :func:`enable_sp_loss` wraps the model's ``forward`` so such a batch gets
:func:`~ds_ulysses.sp.loss.sp_loss_from_logits` on the model's own logits (or a ``loss_fn`` such as
:func:`tiled_causal_lm_loss`, which never materialises the whole logits and applies the model's own
logits transform, :mod:`ds_ulysses.hf.head`); a call asking for TRL's fused LM head (``fused_lm_head=True``)
gets the global mean of that head's per-token log-probs. A MoE router's load-balancing loss is added as the
model (or TRL's head) adds it, computed over the whole sequence (:mod:`ds_ulysses.hf.router_loss`); a router
loss of another form is refused by name.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from ..constants import IGNORE_INDEX
from ..distributed.watch import GroupWatch
from ..memory.fused_ce import TileBuffers, fusable_head, linear_cross_entropy_sum
from ..memory.tiled_loss import TiledFusedLogitsLoss
from ..memory.tiles import resolve_loss_shards, zero3_whole
from ..patching import PATCHES
from ..patching import ProcessLocal
from ..sp.loss import GlobalTokenMean, TokenCounts, mask_bad_labels, sp_loss_from_logits
from .head import logits_transform
from .model_facts import vocab_size
from .router_loss import router_coef, router_facts, sp_router_scope, whole_router_loss
from .servable import decoder_of

__all__ = ["enable_sp_loss", "disable_sp_loss", "tiled_causal_lm_loss", "TiledCausalLMLoss"]

_TAG = "sp_loss"


class TiledCausalLMLoss(ProcessLocal):
    """A ``loss_fn`` for :func:`enable_sp_loss`: decoder -> hidden states -> TiledFusedLogitsLoss.

    The ``[bs sl_l V]`` logits are never materialised whole: lm_head, the model's own logits transform
    and cross-entropy run one tile at a time, which is what takes ALST from 32K to 160K tokens on one
    GPU. When the tile count comes to 1 (``"auto"`` with logits within one tile's budget, or
    ``shards=1``) tiling would save nothing, so the loss runs untiled. The returned output has
    ``loss``, no ``logits``, and the decoder's ``router_logits`` (for a MoE router's loss). :meth:`prepare`
    measures the model's logits transform (and refuses a model whose head it cannot reproduce);
    :func:`enable_sp_loss` calls it at setup. ``watch`` (the mesh's ``sp_watch``) names the group and
    step if the loss all_reduce fails.
    """

    def __init__(self, shards="auto", watch: GroupWatch | None = None):
        self.shards, self.watch = shards, watch
        self._transforms: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def prepare(self, model) -> None:
        if model not in self._transforms:
            self._transforms[model] = (logits_transform(model, zero3_whole),)

    def __call__(self, model, args, kwargs, shift_labels, group, grad_scale):
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast

        self.prepare(model)
        (transform,) = self._transforms[model]
        kwargs = {k: v for k, v in kwargs.items() if k not in ("labels", "logits_to_keep")}
        decoded = decoder_of(model)(*args, **kwargs)
        hidden = decoded.last_hidden_state  # [bs sl_l h]
        head = model.get_output_embeddings()
        vocab = vocab_size(model, output=True)
        labels, bad = mask_bad_labels(shift_labels.to(hidden.device), vocab)
        tiles = resolve_loss_shards(self.shards, labels.numel(), vocab)  # here, to know whether tiling pays
        if tiles == 1:
            local_sum = _token_ce_sum(transform, head, hidden.flatten(0, -2), labels.flatten())  # [n h], [n]
        else:
            tile_sum = (functools.partial(_fused_token_ce_sum, transform, TileBuffers()) if fusable_head(head)
                        else functools.partial(_token_ce_sum, transform))
            local_sum = TiledFusedLogitsLoss.apply(tile_sum, head, hidden, labels, None, tiles, None, "sum")
        counts = TokenCounts(int((labels != IGNORE_INDEX).sum()), int(bad), group, grad_scale, vocab, self.watch)
        return MoeCausalLMOutputWithPast(loss=GlobalTokenMean.apply(local_sum.reshape(()), counts),
                                         router_logits=getattr(decoded, "router_logits", None))


def _token_ce_sum(transform, head, x, y):
    """Summed cross-entropy of one tile: ``[n_t h]`` hidden states, ``[n_t]`` labels."""
    logits = head(x)  # [n_t V]
    if transform is not None:
        logits = transform(logits)
    return F.cross_entropy(logits.float(), y, ignore_index=IGNORE_INDEX, reduction="sum")


def _fused_token_ce_sum(transform, buffers, head, x, y):
    """:func:`_token_ce_sum` for a plain linear head, in one ``[n_t V]`` buffer that the tiles share
    (`buffers`, see :mod:`ds_ulysses.memory.fused_ce`); inside the tiled loss, which keeps the head's
    weight whole and runs each tile's backward before the next tile."""
    scale, softcap = (1.0, None) if transform is None else (transform.scale, transform.softcap)
    return linear_cross_entropy_sum(x, head.weight, head.bias, y, scale, softcap, IGNORE_INDEX, buffers)


def tiled_causal_lm_loss(shards="auto", watch: GroupWatch | None = None) -> TiledCausalLMLoss:
    """The tiled SP loss (see :class:`TiledCausalLMLoss`)."""
    return TiledCausalLMLoss(shards, watch)


def enable_sp_loss(model, group=None, grad_scale: float = 1.0, loss_fn=None, watch: GroupWatch | None = None) -> None:
    """Make ``model(**batch)`` compute the SP loss when the batch carries ``shift_labels``.

    ``loss_fn(model, args, kwargs, shift_labels, group, grad_scale) -> outputs`` replaces the default
    (logits -> :func:`~ds_ulysses.sp.loss.sp_loss_from_logits`), e.g. :func:`tiled_causal_lm_loss`.
    ``watch`` (the mesh's ``sp_watch``) names the group and step if the loss all_reduce fails.
    Idempotent: enabling again updates group and scale, and wraps ``forward`` again only if something
    replaced it since (TRL's SFTTrainer sets a fused-head ``forward`` on the model each time one is
    created; over ours, it would compute the shard's own loss). Undone by :func:`disable_sp_loss` or
    ``ds_ulysses.uninstall``. A copy of the model (``copy.deepcopy``, a pickle) computes the same SP loss
    on its own weights (:class:`_SPLossForward`).
    """
    router = router_facts(model)
    if loss_fn is not None and hasattr(loss_fn, "prepare"):
        loss_fn.prepare(model)  # a loss_fn that must know the model learns it now, so refusals come at setup
    state = model.__dict__.get("_ulysses_loss")
    if state is None:
        state = _LossSettings()
        PATCHES.set_attr(model, "_ulysses_loss", state, _TAG, owner=model)
        PATCHES.on_undo(state.retire, _TAG, owner=model)
    state.group, state.grad_scale, state.loss_fn, state.watch, state.router = group, grad_scale, loss_fn, watch, router
    current = model.__dict__.get("forward")
    if isinstance(current, _SPLossForward) and current.model is model:
        return
    PATCHES.set_attr(model, "forward", _SPLossForward(model, model.forward, state), _TAG, owner=model)


class _LossSettings(ProcessLocal):
    """What the SP loss of a model needs besides the model: the SP group and the loss's settings, shared
    by the model's copies (it holds the process group). Once the SP loss is undone (``disable_sp_loss``,
    ``uninstall``) it is retired: copies made before then compute their own plain forward."""

    group = grad_scale = loss_fn = watch = router = None
    retired = False

    def retire(self) -> None:
        self.retired = True


class _SPLossForward:
    """``model.forward`` under the SP loss: a batch with ``shift_labels`` gets the whole sequence's token
    mean; any other call is the model's own forward.

    An object rather than a closure, so a copy of the model gets one of its own: ``copy.deepcopy`` binds
    the copy's to the copy (a closure would keep computing with the original's weights), pickling names
    the model's own ``forward`` function, and both share the :class:`_LossSettings`."""

    def __init__(self, model, original, settings: _LossSettings):
        self.model, self.settings = model, settings
        # a method of the model is kept as its function, so that copies and pickles call it on themselves
        bound = getattr(original, "__self__", None) is model
        self._function, self._other = (original.__func__, None) if bound else (None, original)
        for name in ("__module__", "__name__", "__qualname__", "__doc__"):
            if hasattr(original, name):
                setattr(self, name, getattr(original, name))

    @property
    def __wrapped__(self):
        """The wrapped forward, for ``inspect.signature`` (the Trainer reads its parameters); a property, as a
        bound method kept here would not follow the model into a copy."""
        return self.original

    @property
    def original(self):
        return self._other if self._function is None else self._function.__get__(self.model)

    def __call__(self, *args, **kwargs):
        model, state, original = self.model, self.settings, self.original
        if state is None or state.retired:  # unpickled in another process, or the SP loss was undone
            return original(*args, **kwargs)
        shift_labels = kwargs.pop("shift_labels", None)
        if shift_labels is None:
            return original(*args, **kwargs)
        kwargs.pop("labels", None)  # shift_labels are these labels already shifted (and sharded): they win
        fused = bool(kwargs.get("fused_lm_head"))
        with sp_router_scope(state.group, state.grad_scale, state.watch):
            if fused:
                outputs = _fused_head_loss(model, original, args, kwargs, shift_labels, state)
            elif state.loss_fn is not None:
                outputs = state.loss_fn(model, args, kwargs, shift_labels, state.group, state.grad_scale)
            else:
                outputs = original(*args, **kwargs)
                outputs.loss = sp_loss_from_logits(outputs.logits, shift_labels, state.group, state.grad_scale,
                                                   watch=state.watch)
            from_decoder = not fused and state.loss_fn is not None
            return _with_router_loss(model, outputs, kwargs.get("attention_mask"), state.router, fused, from_decoder)


def _fused_head_loss(model, original, args, kwargs, shift_labels, state):
    """A forward asked for TRL's fused LM head (``fused_lm_head=True``: ``trl.trainer.utils.add_fused_lm_head``,
    what TRL's ``SFTTrainer`` trains with). That head scores pre-shifted ``shift_labels`` itself, without
    the whole logits, and returns per-token ``log_probs`` (0 where ignored) and ``label_mask`` besides a
    loss that is this shard's own token mean; the SP loss is the sample's global token mean of the same
    log-probs. TRL's fields (accuracy, entropy) stay per token, so its metrics are whole-sample ones."""
    vocab = vocab_size(model, output=True)
    labels, bad = mask_bad_labels(shift_labels, vocab)
    outputs = original(*args, shift_labels=labels, **kwargs)
    log_probs, mask = getattr(outputs, "log_probs", None), getattr(outputs, "label_mask", None)
    if not torch.is_tensor(log_probs) or not torch.is_tensor(mask):
        raise ValueError(
            f"the model's forward took fused_lm_head=True but returned {type(outputs).__name__} without per-token "
            "'log_probs' and 'label_mask' tensors; expected TRL's fused LM head output (FusedCausalLMOutput), whose "
            "per-token log-probs the SP loss reduces over the SP group; fix: add the head with "
            "trl.trainer.utils.add_fused_lm_head, or call the model without fused_lm_head")
    counts = TokenCounts(int(mask.sum()), int(bad), state.group, state.grad_scale, vocab, state.watch)
    outputs.loss = GlobalTokenMean.apply(-log_probs.sum(), counts)
    return outputs


def _with_router_loss(model, outputs, attention_mask, router, fused, from_decoder):
    """``outputs`` with the router's load-balancing loss added as the model adds it (``coef * aux_loss``),
    when the call computed one: the whole sequence's loss, which the forward computed itself inside the
    router scope or, ``from_decoder`` (a loss_fn ran the decoder, not the model's forward), which is
    computed here from the decoder's router logits."""
    aux = getattr(outputs, "aux_loss", None)
    logits = getattr(outputs, "router_logits", None)
    if from_decoder and router is not None and isinstance(logits, (tuple, list)) and logits:
        if not router.servable or router.num_experts is None or router.top_k is None:
            raise ValueError(
                f"the SP loss got router logits from {type(model).__name__}'s decoder but cannot compute its "
                f"load-balancing loss: expected a Switch Transformer loss with the model's expert count and top-k "
                f"(found {router}); fix: set config.output_router_logits = False, or turn tiled_loss off")
        aux = whole_router_loss(logits, router, attention_mask)
        outputs.aux_loss = aux
    if not torch.is_tensor(aux):
        return outputs
    if router is None or not router.servable:
        raise ValueError(
            f"{type(model).__name__} computed a router load-balancing loss in an SP forward, but its function is not "
            "one the SP loss serves, so it saw only this rank's shard; expected output_router_logits off for this "
            "model under SP; fix: do not pass output_router_logits=True, or train without sequence parallelism")
    if outputs.loss.requires_grad and not aux.requires_grad:
        # without SP the loss would train nothing silently; a user who turned it on wants it trained
        raise ValueError(
            f"{type(model).__name__}'s router logits reached the SP loss without a gradient, so its router "
            "load-balancing loss would train nothing (reentrant gradient checkpointing, or a tiled MLP applied by "
            "hand rather than by the ulysses section's tiled_mlp, runs the MoE block's forward without autograd and "
            "recomputes it in backward); expected router logits from an autograd forward; fix: "
            "gradient_checkpointing_kwargs={'use_reentrant': False}, tile the MLPs with the section's tiled_mlp, or "
            "set config.output_router_logits = False")
    outputs.loss = outputs.loss + router_coef(model, fused) * aux.to(outputs.loss.device)
    return outputs


def disable_sp_loss(model) -> None:
    PATCHES.undo(_TAG, owner=model)

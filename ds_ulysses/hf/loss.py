"""The SP loss on a Transformers causal LM: ``model(**batch).loss`` is the sample's global token mean.

Transformers computes a loss only from ``labels``; the adapter's batches carry pre-shifted, sharded
``shift_labels`` instead. :func:`enable_sp_loss` wraps the model's ``forward`` so such a batch gets
:func:`~ds_ulysses.sp.loss.sp_loss_from_logits` on the model's own logits (or a ``loss_fn`` such as
:func:`tiled_causal_lm_loss`, which never materialises the whole logits and applies the model's own
logits transform, :mod:`ds_ulysses.hf.head`); a call asking for TRL's fused LM head (``fused_lm_head=True``)
gets the global mean of that head's per-token log-probs. Whatever the model adds to its loss beyond the token
cross-entropy (a MoE router's load-balancing loss) is refused by name: the SP loss would drop it.
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
from ..sp.loss import GlobalTokenMean, TokenCounts, mask_bad_labels, sp_loss_from_logits
from .head import logits_transform
from .model_facts import text_config, vocab_size
from .servable import decoder_of

__all__ = ["enable_sp_loss", "disable_sp_loss", "tiled_causal_lm_loss", "TiledCausalLMLoss", "check_loss_complete"]

_TAG = "sp_loss"


class TiledCausalLMLoss:
    """A ``loss_fn`` for :func:`enable_sp_loss`: decoder -> hidden states -> TiledFusedLogitsLoss.

    The ``[bs sl_l V]`` logits are never materialised whole: lm_head, the model's own logits transform
    and cross-entropy run one tile at a time, which is what takes ALST from 32K to 160K tokens on one
    GPU. When the tile count comes to 1 (``"auto"`` with logits within one tile's budget, or
    ``shards=1``) tiling would save nothing, so the loss runs untiled. The returned output has
    ``loss`` and no ``logits``. :meth:`prepare` measures the model's logits transform (and refuses a
    model whose head it cannot reproduce); :func:`enable_sp_loss` calls it at setup. ``watch`` (the
    mesh's ``sp_watch``) names the group and step if the loss all_reduce fails.
    """

    def __init__(self, shards="auto", watch: GroupWatch | None = None):
        self.shards, self.watch = shards, watch
        self._transforms: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def prepare(self, model) -> None:
        if model not in self._transforms:
            self._transforms[model] = (logits_transform(model, zero3_whole),)

    def __call__(self, model, args, kwargs, shift_labels, group, grad_scale):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        self.prepare(model)
        (transform,) = self._transforms[model]
        kwargs = {k: v for k, v in kwargs.items() if k not in ("labels", "logits_to_keep")}
        hidden = decoder_of(model)(*args, **kwargs).last_hidden_state  # [bs sl_l h]
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
        return CausalLMOutputWithPast(loss=GlobalTokenMean.apply(local_sum.reshape(()), counts))


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


def check_loss_complete(model) -> None:
    """Refuse a model whose own training loss adds a term the SP loss would drop."""
    text = text_config(model)
    if getattr(text, "output_router_logits", False):
        raise ValueError(
            f"the SP loss cannot serve {getattr(text, 'model_type', type(model).__name__)!r} with "
            "output_router_logits=True: the model adds a router load-balancing loss computed from the routing "
            "statistics of the whole sequence, which each SP rank sees only a shard of, and the SP loss (the "
            "token cross-entropy) would drop it; fix: set config.output_router_logits = False (no auxiliary "
            "loss; TRL's SFTTrainer sets it from its router_aux_loss_coef: pass router_aux_loss_coef=0.0 in "
            "SFTConfig), or train this model without sequence parallelism")


def enable_sp_loss(model, group=None, grad_scale: float = 1.0, loss_fn=None, watch: GroupWatch | None = None) -> None:
    """Make ``model(**batch)`` compute the SP loss when the batch carries ``shift_labels``.

    ``loss_fn(model, args, kwargs, shift_labels, group, grad_scale) -> outputs`` replaces the default
    (logits -> :func:`~ds_ulysses.sp.loss.sp_loss_from_logits`), e.g. :func:`tiled_causal_lm_loss`.
    ``watch`` (the mesh's ``sp_watch``) names the group and step if the loss all_reduce fails.
    Idempotent: enabling again updates group and scale, and wraps ``forward`` again only if something
    replaced it since (TRL's SFTTrainer sets a fused-head ``forward`` on the model each time one is
    created; over ours, it would compute the shard's own loss). Undone by :func:`disable_sp_loss` or
    ``ds_ulysses.uninstall``.
    """
    check_loss_complete(model)
    if loss_fn is not None and hasattr(loss_fn, "prepare"):
        loss_fn.prepare(model)  # a loss_fn that must know the model learns it now, so refusals come at setup
    state = model.__dict__.get("_ulysses_loss")
    if state is None:
        state = {}
        PATCHES.set_attr(model, "_ulysses_loss", state, _TAG, owner=model)
    state.update(group=group, grad_scale=grad_scale, loss_fn=loss_fn, watch=watch)
    if state.get("forward") is not None and model.__dict__.get("forward") is state["forward"]:
        return
    original = model.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        shift_labels = kwargs.pop("shift_labels", None)
        if shift_labels is None:
            return original(*args, **kwargs)
        kwargs.pop("labels", None)  # shift_labels are these labels already shifted (and sharded): they win
        if kwargs.get("fused_lm_head"):
            return _fused_head_loss(model, original, args, kwargs, shift_labels, state)
        if state["loss_fn"] is not None:
            return state["loss_fn"](model, args, kwargs, shift_labels, state["group"], state["grad_scale"])
        outputs = original(*args, **kwargs)
        outputs.loss = sp_loss_from_logits(outputs.logits, shift_labels, state["group"], state["grad_scale"],
                                           watch=state["watch"])
        return outputs

    state["forward"] = forward
    PATCHES.set_attr(model, "forward", forward, _TAG, owner=model)


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
    counts = TokenCounts(int(mask.sum()), int(bad), state["group"], state["grad_scale"], vocab, state["watch"])
    outputs.loss = GlobalTokenMean.apply(-log_probs.sum(), counts)
    return outputs


def disable_sp_loss(model) -> None:
    PATCHES.undo(_TAG, owner=model)

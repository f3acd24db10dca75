"""The SP loss on a Transformers causal LM: ``model(**batch).loss`` is the sample's global token mean.

Transformers computes a loss only from ``labels``; the adapter's batches carry pre-shifted, sharded
``shift_labels`` instead. :func:`enable_sp_loss` wraps the model's ``forward`` so such a batch gets
:func:`~ds_ulysses.sp.loss.sp_loss_from_logits` (or a ``loss_fn`` such as
:func:`tiled_causal_lm_loss`, which never materialises the whole logits).
"""

from __future__ import annotations

import functools

import torch.nn.functional as F

from ..constants import IGNORE_INDEX
from ..distributed.watch import GroupWatch
from ..memory.tiled_loss import TiledFusedLogitsLoss
from ..memory.tiles import resolve_loss_shards
from ..patching import PATCHES
from ..sp.loss import GlobalTokenMean, TokenCounts, mask_bad_labels, sp_loss_from_logits
from .model_facts import vocab_size

__all__ = ["enable_sp_loss", "disable_sp_loss", "tiled_causal_lm_loss"]

_TAG = "sp_loss"


def _token_ce_sum(head, x, y):
    return F.cross_entropy(head(x).float(), y, ignore_index=IGNORE_INDEX, reduction="sum")


def tiled_causal_lm_loss(shards="auto", watch: GroupWatch | None = None):
    """A ``loss_fn`` for :func:`enable_sp_loss`: decoder -> hidden states -> TiledFusedLogitsLoss.

    The ``[bs sl_l V]`` logits are never materialised whole: lm_head and cross-entropy run one tile
    at a time (forward and recompute in backward), which is what takes ALST from 32K to 160K tokens
    on one GPU. When the tile count comes to 1 (``"auto"`` with logits within one tile's budget, or
    ``shards=1``) tiling would save nothing and still pay the recompute, so the loss runs untiled.
    The returned output has ``loss`` and no ``logits``. For heads that are a plain linear layer (no
    logit soft-capping or scaling after lm_head). ``watch`` (the mesh's ``sp_watch``) names the
    group and step if the loss all_reduce fails.
    """

    def loss_fn(model, args, kwargs, shift_labels, group, grad_scale):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs = {k: v for k, v in kwargs.items() if k not in ("labels", "logits_to_keep")}
        hidden = model.get_decoder()(*args, **kwargs).last_hidden_state  # [bs sl_l h]
        head = model.get_output_embeddings()
        vocab = vocab_size(model, output=True)
        labels, bad = mask_bad_labels(shift_labels.to(hidden.device), vocab)
        tiles = resolve_loss_shards(shards, labels.numel(), vocab)  # here, to know whether tiling pays
        if tiles == 1:
            local_sum = _token_ce_sum(head, hidden.flatten(0, -2), labels.flatten())  # [n h], [n]
        else:
            local_sum = TiledFusedLogitsLoss.apply(_token_ce_sum, head, hidden, labels, None, tiles, None, "sum")
        counts = TokenCounts(int((labels != IGNORE_INDEX).sum()), int(bad), group, grad_scale, vocab, watch)
        return CausalLMOutputWithPast(loss=GlobalTokenMean.apply(local_sum.reshape(()), counts))

    return loss_fn


def enable_sp_loss(model, group=None, grad_scale: float = 1.0, loss_fn=None, watch: GroupWatch | None = None) -> None:
    """Make ``model(**batch)`` compute the SP loss when the batch carries ``shift_labels``.

    ``loss_fn(model, args, kwargs, shift_labels, group, grad_scale) -> outputs`` replaces the default
    (logits -> :func:`~ds_ulysses.sp.loss.sp_loss_from_logits`), e.g. :func:`tiled_causal_lm_loss`.
    ``watch`` (the mesh's ``sp_watch``) names the group and step if the loss all_reduce fails.
    Idempotent: enabling again updates group and scale. Undone by :func:`disable_sp_loss` or
    ``ds_ulysses.uninstall``.
    """
    state = model.__dict__.get("_ulysses_loss")
    if state is not None:
        state.update(group=group, grad_scale=grad_scale, loss_fn=loss_fn, watch=watch)
        return
    state = {"group": group, "grad_scale": grad_scale, "loss_fn": loss_fn, "watch": watch}
    original = model.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        shift_labels = kwargs.pop("shift_labels", None)
        if shift_labels is None or kwargs.get("labels") is not None:
            return original(*args, **kwargs)
        if state["loss_fn"] is not None:
            return state["loss_fn"](model, args, kwargs, shift_labels, state["group"], state["grad_scale"])
        outputs = original(*args, **kwargs)
        outputs.loss = sp_loss_from_logits(outputs.logits, shift_labels, state["group"], state["grad_scale"],
                                           watch=state["watch"])
        return outputs

    PATCHES.set_attr(model, "_ulysses_loss", state, _TAG, owner=model)
    PATCHES.set_attr(model, "forward", forward, _TAG, owner=model)


def disable_sp_loss(model) -> None:
    PATCHES.undo(_TAG, owner=model)

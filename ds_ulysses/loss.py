"""The SP loss: each rank's shard of a sample -> the sample's token-mean loss, exact in backward.

Dimension legend::  bs batch   sl_l local sequence length   V vocabulary

A sample's loss is ``sum over its valid tokens / number of valid tokens``, and its tokens are spread
over the SP group. Each rank computes the sum over its own tokens; one all_reduce of
``(sum, count)`` gives every rank the same global mean (a rank with no valid label contributes 0,
never NaN). In backward, each rank's share gets ``grad_scale / count``: summed over the SP group
that is exactly the non-SP gradient, because the all-to-all backward already routes every token's
gradient to the rank that owns the weights' inputs.

How DeepSpeed combines the ranks' gradients decides ``grad_scale``: when it sums over SP peers
(ZeRO-0/1/2, and ZeRO-3 with ``reduce_scatter: false``: it pre-divides by the DP size only) the
scale is 1; when it averages over all SP x DP ranks (ZeRO-3's reduce-scatter) the scale is sp.
:func:`ds_ulysses.engine.initialize` picks it from the config; nothing has to guess.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["GlobalTokenMean", "sp_loss_from_logits", "tiled_causal_lm_loss", "enable_sp_loss", "disable_sp_loss"]


class GlobalTokenMean(torch.autograd.Function):
    """Local loss sum -> global token mean in forward; ``grad * grad_scale / count`` in backward."""

    @staticmethod
    def forward(ctx, local_sum: torch.Tensor, local_count: torch.Tensor, group, grad_scale: float):
        totals = torch.stack([local_sum.detach().float(), local_count.float()])  # [2]
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(totals, group=group)
        count = totals[1].clamp(min=1.0)
        ctx.scale = grad_scale / count
        return (totals[0] / count).to(local_sum.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None, None, None


def sp_loss_from_logits(logits: torch.Tensor, shift_labels: torch.Tensor, group=None,
                        grad_scale: float = 1.0, ignore_index: int = -100) -> torch.Tensor:
    """Global token-mean cross-entropy from this rank's ``logits [bs sl_l V]`` and ``shift_labels [bs sl_l]``.

    ``group=None`` means no SP (a plain token mean). Logits are upcast to fp32 as Transformers does.
    """
    if logits.shape[:2] != shift_labels.shape[:2]:
        raise ValueError(
            f"logits {list(logits.shape)} and shift_labels {list(shift_labels.shape)} disagree on "
            "[bs, sl]; pass the shard's shift_labels from UlyssesSPDataLoaderAdapter")
    local_sum = F.cross_entropy(logits.float().flatten(0, 1), shift_labels.flatten().to(logits.device),
                                ignore_index=ignore_index, reduction="sum")
    local_count = (shift_labels != ignore_index).sum()
    return GlobalTokenMean.apply(local_sum, local_count.to(local_sum.device), group, grad_scale)


def _token_ce_sum(head, x, y):
    return F.cross_entropy(head(x).float(), y, ignore_index=-100, reduction="sum")


def tiled_causal_lm_loss(shards="auto"):
    """A ``loss_fn`` for :func:`enable_sp_loss`: decoder -> hidden states -> TiledFusedLogitsLoss.

    The ``[bs sl_l V]`` logits are never materialised whole: lm_head and cross-entropy run one tile
    at a time (forward and recompute in backward), which is what takes ALST from 32K to 160K tokens
    on one GPU. The returned output has ``loss`` and no ``logits``. For heads that are a plain
    linear layer (no logit soft-capping or scaling after lm_head).
    """
    from .tiled import TiledFusedLogitsLoss

    def loss_fn(model, args, kwargs, shift_labels, group, grad_scale):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs = {k: v for k, v in kwargs.items() if k not in ("labels", "logits_to_keep")}
        hidden = model.get_decoder()(*args, **kwargs).last_hidden_state  # [bs sl_l h]
        labels = shift_labels.to(hidden.device)
        local_sum = TiledFusedLogitsLoss.apply(_token_ce_sum, model.get_output_embeddings(), hidden, labels,
                                               None, shards, None, "sum")
        loss = GlobalTokenMean.apply(local_sum.reshape(()), (labels != -100).sum(), group, grad_scale)
        return CausalLMOutputWithPast(loss=loss)

    return loss_fn


def enable_sp_loss(model, group=None, grad_scale: float = 1.0, loss_fn=None) -> None:
    """Make ``model(**batch)`` compute the SP loss when the batch carries ``shift_labels``.

    Transformers computes a loss only from ``labels``; the adapter's batches carry pre-shifted,
    sharded ``shift_labels`` instead. ``loss_fn(model, args, kwargs, shift_labels, group,
    grad_scale) -> outputs`` replaces the default (logits -> :func:`sp_loss_from_logits`), e.g.
    :func:`tiled_causal_lm_loss`, which never builds the whole logits.
    Idempotent: enabling again updates group and scale.
    """
    state = model.__dict__.get("_ulysses_loss")
    if state is not None:
        state.update(group=group, grad_scale=grad_scale, loss_fn=loss_fn)
        return
    state = {"group": group, "grad_scale": grad_scale, "loss_fn": loss_fn, "forward": model.forward}
    model.__dict__["_ulysses_loss"] = state
    original = model.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        shift_labels = kwargs.pop("shift_labels", None)
        if shift_labels is None or kwargs.get("labels") is not None:
            return original(*args, **kwargs)
        if state["loss_fn"] is not None:
            return state["loss_fn"](model, args, kwargs, shift_labels, state["group"], state["grad_scale"])
        outputs = original(*args, **kwargs)
        outputs.loss = sp_loss_from_logits(outputs.logits, shift_labels, state["group"], state["grad_scale"])
        return outputs

    model.forward = forward


def disable_sp_loss(model) -> None:
    state = model.__dict__.pop("_ulysses_loss", None)
    if state is not None:
        model.forward = state["forward"]

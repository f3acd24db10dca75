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

A label outside ``[0, V)`` (other than the ignore index) would make cross-entropy raise on its rank
alone while the others wait in the all_reduce. Instead each rank masks such labels, counts them,
and the count rides in the same all_reduce, so every rank raises the same error.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .watch import GroupWatch

__all__ = ["GlobalTokenMean", "sp_loss_from_logits", "tiled_causal_lm_loss", "enable_sp_loss", "disable_sp_loss"]


class GlobalTokenMean(torch.autograd.Function):
    """Local loss sum -> global token mean in forward; ``grad * grad_scale / count`` in backward.

    ``local_bad`` counts this rank's labels that were out of range (and masked); any across the
    group makes every rank raise. ``watch`` names the group if the all_reduce fails.
    """

    @staticmethod
    def forward(ctx, local_sum: torch.Tensor, local_count: torch.Tensor, group, grad_scale: float,
                local_bad: torch.Tensor, vocab_size: int, watch: GroupWatch | None):
        totals = torch.stack([local_sum.detach().float(), local_count.float(),
                              local_bad.to(local_sum.device).float()])  # [3]
        if group is not None and dist.get_world_size(group) > 1:
            watch = watch if watch is not None else GroupWatch.of_group(group)
            with watch.collective("the SP loss all_reduce"):
                dist.all_reduce(totals, group=group)
        if totals[2] > 0:
            where = f"across SP group ranks {watch.ranks}" if watch is not None else "in this batch"
            raise ValueError(
                f"shift_labels out of range: {int(totals[2])} label(s) {where} are neither -100 nor in "
                f"[0, {vocab_size}) (the model's vocabulary); fix: check that the tokenizer matches the "
                "model, and label ignored tokens -100")
        count = totals[1].clamp(min=1.0)
        ctx.scale = grad_scale / count
        return (totals[0] / count).to(local_sum.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None, None, None, None, None, None


def _mask_bad_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int):
    """(labels with out-of-range entries set to ignore_index, how many there were)."""
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        every = torch.tensor(labels.numel(), device=labels.device)
        return torch.full_like(labels, ignore_index, dtype=torch.long), every
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    return labels.masked_fill(bad, ignore_index), bad.sum()


def sp_loss_from_logits(logits: torch.Tensor, shift_labels: torch.Tensor, group=None,
                        grad_scale: float = 1.0, ignore_index: int = -100,
                        watch: GroupWatch | None = None) -> torch.Tensor:
    """Global token-mean cross-entropy from this rank's ``logits [bs sl_l V]`` and ``shift_labels [bs sl_l]``.

    ``group=None`` means no SP (a plain token mean). Logits are upcast to fp32 as Transformers does.
    """
    if logits.shape[:2] != shift_labels.shape[:2]:
        raise ValueError(
            f"logits {list(logits.shape)} and shift_labels {list(shift_labels.shape)} disagree on "
            "[bs, sl]; pass the shard's shift_labels from UlyssesSPDataLoaderAdapter")
    vocab = logits.shape[-1]
    labels, bad = _mask_bad_labels(shift_labels.to(logits.device), vocab, ignore_index)
    local_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                ignore_index=ignore_index, reduction="sum")
    local_count = (labels != ignore_index).sum()
    return GlobalTokenMean.apply(local_sum, local_count.to(local_sum.device), group, grad_scale,
                                 bad.to(local_sum.device), vocab, watch)


def _token_ce_sum(head, x, y):
    return F.cross_entropy(head(x).float(), y, ignore_index=-100, reduction="sum")


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
    from .tiled import TiledFusedLogitsLoss, resolve_loss_shards

    def loss_fn(model, args, kwargs, shift_labels, group, grad_scale):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs = {k: v for k, v in kwargs.items() if k not in ("labels", "logits_to_keep")}
        hidden = model.get_decoder()(*args, **kwargs).last_hidden_state  # [bs sl_l h]
        head = model.get_output_embeddings()
        vocab = getattr(head, "out_features", None) or model.config.get_text_config().vocab_size
        labels, bad = _mask_bad_labels(shift_labels.to(hidden.device), vocab, -100)
        tiles = resolve_loss_shards(shards, labels.numel(), vocab)  # here, to know whether tiling pays
        if tiles == 1:
            local_sum = _token_ce_sum(head, hidden.flatten(0, -2), labels.flatten())  # [n h], [n]
        else:
            local_sum = TiledFusedLogitsLoss.apply(_token_ce_sum, head, hidden, labels, None, tiles, None, "sum")
        loss = GlobalTokenMean.apply(local_sum.reshape(()), (labels != -100).sum(), group, grad_scale, bad,
                                     vocab, watch)
        return CausalLMOutputWithPast(loss=loss)

    return loss_fn


def enable_sp_loss(model, group=None, grad_scale: float = 1.0, loss_fn=None, watch: GroupWatch | None = None) -> None:
    """Make ``model(**batch)`` compute the SP loss when the batch carries ``shift_labels``.

    Transformers computes a loss only from ``labels``; the adapter's batches carry pre-shifted,
    sharded ``shift_labels`` instead. ``loss_fn(model, args, kwargs, shift_labels, group,
    grad_scale) -> outputs`` replaces the default (logits -> :func:`sp_loss_from_logits`), e.g.
    :func:`tiled_causal_lm_loss`, which never builds the whole logits. ``watch`` (the mesh's
    ``sp_watch``) names the group and step if the loss all_reduce fails.
    Idempotent: enabling again updates group and scale.
    """
    state = model.__dict__.get("_ulysses_loss")
    if state is not None:
        state.update(group=group, grad_scale=grad_scale, loss_fn=loss_fn, watch=watch)
        return
    state = {"group": group, "grad_scale": grad_scale, "loss_fn": loss_fn, "forward": model.forward,
             "watch": watch}
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
        outputs.loss = sp_loss_from_logits(outputs.logits, shift_labels, state["group"], state["grad_scale"],
                                           watch=state["watch"])
        return outputs

    model.forward = forward


def disable_sp_loss(model) -> None:
    state = model.__dict__.pop("_ulysses_loss", None)
    if state is not None:
        model.forward = state["forward"]

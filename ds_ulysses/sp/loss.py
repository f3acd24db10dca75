"""The SP loss: each rank's shard of a sample -> the sample's token-mean loss, exact in backward.

Dimension legend::  bs batch   sl_l local sequence length   V vocabulary

A sample's loss is ``sum over its valid tokens / number of valid tokens``, and its tokens are spread
over the SP group. Each rank computes the sum over its own tokens; one all_reduce of
``(sum, count)`` gives every rank the same global mean (a rank with no valid label contributes 0,
never NaN). In backward, each rank's share gets ``grad_scale / count``: summed over the SP group
that is exactly the non-SP gradient, because the all-to-all backward already routes every token's
gradient to the rank that owns the weights' inputs.

How DeepSpeed combines the ranks' gradients decides ``grad_scale``: when it sums over SP peers
(ZeRO-0/1/2: it pre-divides by the DP size only) the scale is 1; when it averages over all SP x DP
ranks (ZeRO-3's reduce-scatter) the scale is sp. :func:`ds_ulysses.engine.loss_grad_scale` picks it
from the config (and refuses ZeRO-3 without reduce-scatter, which does either); nothing has to guess.

A label outside ``[0, V)`` (other than the ignore index) would make cross-entropy raise on its rank
alone while the others wait in the all_reduce. Instead each rank masks such labels, counts them,
and the count rides in the same all_reduce, so every rank raises the same error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..constants import IGNORE_INDEX
from ..distributed.collectives import collective_device, group_size
from ..distributed.watch import GroupWatch

__all__ = ["TokenCounts", "GlobalTokenMean", "sp_loss_from_logits", "mask_bad_labels", "LogitsCrossEntropySum",
           "logits_cross_entropy_sum"]

_CHUNK_ELEMENTS = 1 << 22  # 16 MiB of fp32: the cross-entropy's temporary per chunk of rows


@dataclass(frozen=True)
class TokenCounts:
    """What :class:`GlobalTokenMean` needs besides the loss sum: this rank's valid and out-of-range
    label counts, and the group, scale and vocabulary they are judged by."""

    valid: int
    bad: int
    group: object = None
    grad_scale: float = 1.0
    vocab_size: int = 0
    watch: GroupWatch | None = None


class GlobalTokenMean(torch.autograd.Function):
    """Local loss sum -> global token mean in forward; ``grad * grad_scale / count`` in backward.

    ``counts.bad`` counts this rank's labels that were out of range (and masked); any across the
    group makes every rank raise. ``counts.watch`` names the group if the all_reduce fails.
    """

    @staticmethod
    def forward(ctx, local_sum: torch.Tensor, counts: TokenCounts):
        group, watch = counts.group, counts.watch
        totals = torch.tensor([float(local_sum.detach()), float(counts.valid), float(counts.bad)],
                              dtype=torch.float64, device=collective_device(group))  # [3]
        if group is not None and group_size(group) > 1:
            watch = watch if watch is not None else GroupWatch.of_group(group)
            with watch.collective("the SP loss all_reduce"):
                dist.all_reduce(totals, group=group)
        if totals[2] > 0:
            where = f"across SP group ranks {watch.ranks}" if watch is not None else "in this batch"
            raise ValueError(
                f"shift_labels out of range: {int(totals[2])} label(s) {where} are neither -100 nor in "
                f"[0, {counts.vocab_size}) (the model's vocabulary); fix: check that the tokenizer matches the "
                "model, and label ignored tokens -100")
        count = max(float(totals[1]), 1.0)
        ctx.scale = counts.grad_scale / count
        return local_sum.new_tensor(float(totals[0]) / count)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None  # local_sum, counts


def mask_bad_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int = IGNORE_INDEX):
    """(labels with out-of-range entries set to ignore_index, how many there were)."""
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        every = torch.tensor(labels.numel(), device=labels.device)
        return torch.full_like(labels, ignore_index, dtype=torch.long), every
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    return labels.masked_fill(bad, ignore_index), bad.sum()


def logits_cross_entropy_sum(logits: torch.Tensor, y: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), y, ignore_index=ignore_index, reduction="sum")`` for ``[n V]``
    logits of any float dtype and ``[n]`` labels, in fp32, keeping for backward only the logits themselves
    (no copy) and one log-sum-exp per token, where autograd's ``log_softmax`` keeps an ``[n V]`` output
    of its own: the loss can be taken beside logits its caller keeps (and takes a loss of its own from)
    at no extra ``[n V]``. The gradient is formed in backward, a chunk of rows at a time in fp32, into one
    tensor of the logits' dtype."""
    return LogitsCrossEntropySum.apply(logits, y, ignore_index)


class LogitsCrossEntropySum(torch.autograd.Function):
    """Forward: ``logsumexp(z) - z[y]`` summed over the valid tokens. Backward: ``(softmax(z) - onehot(y))
    * grad`` on the valid rows, zero on the ignored ones."""

    @staticmethod
    def forward(ctx, logits, y, ignore_index):
        valid = y != ignore_index  # [n]
        targets = y.masked_fill(~valid, 0).unsqueeze(1)  # [n 1], any in-range index where ignored
        rows = max(1, _CHUNK_ELEMENTS // max(logits.shape[1], 1))
        lse = logits.new_empty(logits.shape[0], 1, dtype=torch.float32)  # [n 1]
        for i in range(0, logits.shape[0], rows):
            torch.logsumexp(logits[i:i + rows].float(), 1, keepdim=True, out=lse[i:i + rows])
        ctx.save_for_backward(logits, lse, targets, valid)
        ctx.rows = rows
        return (lse - logits.gather(1, targets).float()).squeeze(1).masked_fill_(~valid, 0).sum()

    @staticmethod
    def backward(ctx, grad_out):
        logits, lse, targets, valid = ctx.saved_tensors
        grad = torch.empty_like(logits)  # [n V]
        weight = valid.to(torch.float32).mul_(grad_out.float()).unsqueeze(1)  # [n 1]: 0 on ignored rows
        for i in range(0, logits.shape[0], ctx.rows):
            probs = logits[i:i + ctx.rows].to(torch.float32, copy=True).sub_(lse[i:i + ctx.rows]).exp_()  # [r V]
            probs.scatter_add_(1, targets[i:i + ctx.rows], probs.new_full((probs.shape[0], 1), -1.0))
            grad[i:i + ctx.rows] = probs.mul_(weight[i:i + ctx.rows])
        return grad, None, None


def sp_loss_from_logits(logits: torch.Tensor, shift_labels: torch.Tensor, group=None,
                        grad_scale: float = 1.0, ignore_index: int = IGNORE_INDEX,
                        watch: GroupWatch | None = None) -> torch.Tensor:
    """Global token-mean cross-entropy from this rank's ``logits [bs sl_l V]`` and ``shift_labels [bs sl_l]``.

    ``group=None`` means no SP (a plain token mean). Logits are upcast to fp32 as Transformers does.
    """
    if logits.shape[:2] != shift_labels.shape[:2]:
        raise ValueError(
            f"logits {list(logits.shape)} and shift_labels {list(shift_labels.shape)} disagree on "
            "[bs, sl]; pass the shard's shift_labels from UlyssesSPDataLoaderAdapter")
    vocab = logits.shape[-1]
    labels, bad = mask_bad_labels(shift_labels.to(logits.device), vocab, ignore_index)
    local_sum = logits_cross_entropy_sum(logits.flatten(0, 1), labels.flatten(), ignore_index)
    counts = TokenCounts(int((labels != ignore_index).sum()), int(bad), group, grad_scale, vocab, watch)
    return GlobalTokenMean.apply(local_sum, counts)

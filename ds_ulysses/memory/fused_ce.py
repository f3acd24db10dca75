"""The summed token cross-entropy of a linear head, holding one ``[n, V]`` buffer where autograd holds three.

Autograd's ``lm_head -> log_softmax -> nll_loss`` keeps, during its backward, the log-probabilities it
saved, nll's gradient and log_softmax's gradient: three ``[n, V]`` fp32 tensors per tile of the tiled
loss (at 128K vocabulary, 384 MiB for 256 tokens). :class:`LinearCrossEntropySum` computes the logits
into a buffer it owns, applies the model's scale and soft cap to it in place, reduces it to the loss,
and overwrites it with the gradient of the loss with respect to the logits: one ``[n, V]`` tensor from
the head's matmul to its backward, and fewer passes over it. It is the same maths as the model's own
head and ``F.cross_entropy(logits.float(), y, reduction="sum")``, up to floating-point order (a
log-sum-exp per token, not a log_softmax per logit).

It needs the head to be a plain linear map (weight, optional bias): :func:`fusable_head` says when it
is; anything else (a LoRA head, a quantised one, a head with a user's forward hook) keeps the module
call. Callers keep ZeRO-3 parameters whole around it (the tiled loss does).

The tiles of one tiled loss can share their buffers (:class:`TileBuffers`): a fresh ``[n, V]``
tensor per tile is a fresh mapping from the host allocator (glibc maps every block of 32 MiB or more
afresh), and faulting in its pages cost about 40-50 ms per 128 MiB tile here, 13% of the tile's
head and loss. A buffer is handed out again only when nothing holds a view of it any more (the
tile's backward has run), so a caller that keeps two tiles' graphs alive gets two buffers.

Dimensions: n tokens, h hidden, V vocabulary, r rows of one chunk.
"""

import functools

import torch
import torch.nn.functional as F

from ..constants import IGNORE_INDEX
from .tile_grads import add_product_to_grad
from .tiles import one_grad_per_input, storage_holders

__all__ = ["LinearCrossEntropySum", "linear_cross_entropy_sum", "fusable_head", "TileBuffers"]

_CHUNK_ELEMENTS = 1 << 22  # 16 MiB of fp32: the soft-capped path's temporary per chunk of rows


def fusable_head(head) -> bool:
    """True when ``head(x)`` is exactly ``F.linear(x, head.weight, head.bias)``: an ``nn.Linear`` itself
    (not a subclass), its ``forward`` not replaced on the instance (Accelerate's device hooks do that),
    with no forward hooks but DeepSpeed's (ZeRO-3 gathers parameters in them, which the caller does
    instead)."""
    if type(head) is not torch.nn.Linear or "forward" in vars(head):
        return False
    from torch.nn.modules import module as module_globals

    hooks = [*head._forward_hooks.values(), *head._forward_pre_hooks.values(),
             *module_globals._global_forward_hooks.values(), *module_globals._global_forward_pre_hooks.values()]
    return all(getattr(hook, "__module__", "").startswith("deepspeed.") for hook in hooks)


class TileBuffers:
    """The ``[n, V]`` buffers the tiles of one loss share, one per dtype: the first (largest) tile's, or a
    new one when a later tile is larger or something still holds a view of the last one."""

    def __init__(self):
        self._buffers = {}

    def get(self, rows, cols, dtype, device):
        """A ``[rows, cols]`` tensor of `dtype` on `device`, its contents undefined."""
        buffer = self._buffers.get(dtype)
        if (buffer is None or buffer.device != device or buffer.shape[0] < rows or buffer.shape[1] != cols
                or not _unheld(buffer)):
            buffer = self._buffers[dtype] = torch.empty(rows, cols, dtype=dtype, device=device)
        return buffer[:rows]  # a view: while it (or a view of it) lives, the buffer is not handed out again


def _unheld(tensor):
    """Whether nothing but `tensor` itself holds its memory (no view of it lives); False where this torch
    cannot count."""
    holders = storage_holders(tensor)
    return holders is not None and holders == _sole_storage_holders()


@functools.lru_cache(maxsize=None)
def _sole_storage_holders():
    """:func:`storage_holders` of a tensor nothing else holds, taken through the same code."""
    return storage_holders(torch.empty(1))


def linear_cross_entropy_sum(x, weight, bias, y, scale=1.0, softcap=None, ignore_index=IGNORE_INDEX, buffers=None):
    """``F.cross_entropy(softcap(scale * F.linear(x, weight, bias)).float(), y, reduction="sum")``.

    `x` is ``[n, h]``, `y` ``[n]`` (labels, `ignore_index` where none). The scale and the soft cap
    ``c * tanh(z / c)`` run in the logits' dtype, as the model's forward runs them; the loss in fp32.
    `buffers` (a :class:`TileBuffers`) lends the ``[n, V]`` buffers; None makes fresh ones.
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return LinearCrossEntropySum.apply(x, weight, bias, y, scale, softcap, ignore_index, buffers)
    with torch.no_grad():
        return _loss_and_grad(x, weight, bias, y, scale, softcap, ignore_index, buffers, with_grad=False)[0]


class LinearCrossEntropySum(torch.autograd.Function):
    """Forward: the summed cross-entropy, and the logits' gradient left in the logits' buffer.
    Backward: that gradient times the incoming one, through the scale and the linear map."""

    @staticmethod
    def forward(ctx, x, weight, bias, y, scale, softcap, ignore_index, buffers):
        loss, grad = _loss_and_grad(x, weight, bias, y, scale, softcap, ignore_index, buffers, with_grad=True)
        ctx.save_for_backward(x, weight, grad)
        ctx.scale, ctx.dtype, ctx.has_bias = scale, x.dtype, bias is not None
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, grad = ctx.saved_tensors
        grad = grad.mul_(grad_out).to(ctx.dtype)  # [n V], d loss / d (scaled) logits, in the head's dtype
        if ctx.scale != 1.0:
            grad = grad.mul_(ctx.scale)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # [V n] @ [n h] -> [V h]: inside a tiled loss, added into the tiles' sum in place (no second [V h])
        weight_grad = None if not need_w or add_product_to_grad(weight, grad.t(), x) else grad.t() @ x
        return one_grad_per_input(
            LinearCrossEntropySum.forward,
            x=grad @ weight if need_x else None,  # [n V] @ [V h] -> [n h]
            weight=weight_grad,
            bias=grad.sum(0) if need_b and ctx.has_bias else None)  # [n V] -> [V]


def _loss_and_grad(x, weight, bias, y, scale, softcap, ignore_index, buffers, with_grad):
    """(summed loss, d loss / d softcapped logits [n V] fp32 or None), through one ``[n V]`` buffer."""
    logits = _linear(x, weight, bias, buffers)  # [n V], a buffer of our own
    if scale != 1.0:
        logits.mul_(scale)
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    if logits.dtype != torch.float32 and buffers is not None:
        logits = buffers.get(*logits.shape, torch.float32, logits.device).copy_(logits)
    logits = logits.float()  # the same buffer when the head is fp32
    valid = y != ignore_index  # [n]
    targets = y.masked_fill(~valid, 0).unsqueeze(1)  # [n 1], any in-range index where ignored
    minus_one = valid.to(logits.dtype).neg_().unsqueeze(1)  # [n 1]: -1 at each valid token's label
    picked = logits.gather(1, targets)  # [n 1]
    if softcap is None:
        lse = _softmax_(logits)  # logits -> probabilities, in place
        grad = logits.scatter_add_(1, targets, minus_one) if with_grad else None
    else:
        lse, grad = _capped_softmax_grad_(logits, targets, minus_one, softcap, with_grad)
    loss = (lse - picked).squeeze(1).masked_fill_(~valid, 0).sum()
    return loss, None if grad is None else grad.masked_fill_(~valid.unsqueeze(1), 0)


def _linear(x, weight, bias, buffers):
    """``F.linear(x, weight, bias)`` for a ``[n, h]`` `x`, into a buffer from `buffers` when given (the
    same kernels ``F.linear`` runs: ``addmm`` with a bias, ``mm`` without; autocast keeps ``F.linear``,
    whose dtype it picks)."""
    if buffers is None or x.dim() != 2 or torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight, bias)
    out = buffers.get(x.shape[0], weight.shape[0], torch.result_type(x, weight), x.device)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def _softmax_(logits):
    """Overwrite ``[n V]`` logits with their softmax; return the log-sum-exp ``[n 1]``. No temporary
    of the buffer's size: exp(z - max) in place, its row sums, a division in place."""
    top = logits.amax(1, keepdim=True) if logits.numel() else logits.new_zeros(logits.shape[0], 1)  # [n 1]
    total = logits.sub_(top).exp_().sum(1, keepdim=True)  # [n 1]
    logits.div_(total)
    return top + total.log()


def _capped_softmax_grad_(logits, targets, minus_one, softcap, with_grad):
    """(log-sum-exp [n 1], gradient or None) for soft-capped logits: the cap's derivative
    ``1 - (capped / c)^2`` reads the capped logits while the softmax is formed, so each chunk of rows
    has one temporary of its size."""
    n, vocab = logits.shape
    rows = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    lse = torch.cat([torch.logsumexp(logits[i:i + rows], 1, keepdim=True) for i in range(0, n, rows)]) if n \
        else logits.new_zeros(0, 1)  # [n 1]
    if not with_grad:
        return lse, None
    for i in range(0, n, rows):
        chunk = logits[i:i + rows]  # [r V], a view: written in place
        probs = (chunk - lse[i:i + rows]).exp_().scatter_add_(1, targets[i:i + rows], minus_one[i:i + rows])
        chunk.div_(softcap).square_().neg_().add_(1).mul_(probs)
    return lse, logits

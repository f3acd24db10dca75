"""TiledFusedLogitsLoss: lm_head + loss over tiles of tokens, never holding more than one tile's logits
(ALST's fused logits loss; at 128K vocabulary the full logits are the largest activation).

The loss is the last computation of the forward, so its backward runs inside the forward, tile by
tile, while each tile's logits exist: no logits are recomputed later. The input and parameter
gradients this produces are kept, and the Function's backward only multiplies them by the incoming
gradient, so ``0.5 * loss``, gradient accumulation and loss scaling get exactly scaled gradients.
(DeepSpeed's module scales only the input gradient, and only when the incoming gradient is not 1;
its parameter gradients ignore it.)

Dimensions: bs batch, sl sequence, h hidden, n = bs*sl flattened tokens, n_t one tile of them.
"""

import torch
from torch.autograd import Function

from .tile_grads import TileGrads
from .tiles import one_grad_per_input, positive_int, resolve_loss_shards, tile_bounds, trainable_params, weight_rows, \
    zero3_whole

__all__ = ["TiledFusedLogitsLoss"]


class TiledFusedLogitsLoss(Function):
    """The loss of `fn` over tiles of tokens, its gradients computed tile by tile in forward.

    `x` is `[..., h]` (e.g. `[bs, sl, h]`) and `y` has `x.shape[:-1]` (e.g. `shift_labels`); both are
    flattened to `n = bs*sl` tokens and tiled with `torch.tensor_split`'s sizes. DeepSpeed's `fn`
    contract: `fn(module, x_tile [n_t, h], y_tile [n_t])`, plus `mask_tile [n_t]` as a 4th argument when
    `mask` is given, returns the tile's loss as a 1-element tensor, however the user computes it
    (DeepSpeed's examples: `torch.nn.CrossEntropyLoss()`, the mean over the tile's valid tokens).

    `output_reduction="sum"` adds the tile losses. `"mean"` weights each tile's loss by its share of
    the tokens, n_t / n: with equal tiles that is DeepSpeed's mean of the tile losses, and with
    unequal ones (n % shards != 0) it is the exact token mean of per-token losses where DeepSpeed's
    is biased towards the shorter tiles. (Tiles with different numbers of ignored labels are weighted by
    their size too; for the exact mean over valid tokens, return a sum from `fn`, use "sum", and divide
    by the valid count, as `ds_ulysses.hf.tiled_causal_lm_loss` does.) A tile without tokens adds
    nothing, but `fn` still runs on it, so every rank makes the same calls under ZeRO-3.

    `shards` is an int >= 1 or "auto" (`auto_loss_shards(n, module.weight.shape[0])`, agreed over
    ranks). `compute_params` lists the trainable parameters `fn` uses (e.g. `[lm_head.weight]`, as in
    DeepSpeed's call from a hooked model `forward`); None means every trainable parameter of `module`.
    Their per-tile gradients are summed and leave the Function once, in its backward, so ZeRO reduces
    each once, after every use (an lm_head tied to the embedding included). The gradients live from
    forward to backward: the `[n, h]` input gradient and, per parameter, one gradient of its size.
    """

    @classmethod
    def apply(cls, fn, module, x, y, mask, shards, compute_params, output_reduction):
        params = trainable_params(compute_params, [module])
        with zero3_whole(params):
            if not torch.is_grad_enabled():  # evaluation: the loss value only, no gradients in forward
                return _tiled_loss(fn, module, x, y, mask, shards, output_reduction)[0]
            return super().apply(fn, module, x, y, mask, shards, compute_params, output_reduction, *params)

    @staticmethod
    def forward(ctx, fn, module, x, y, mask, shards, compute_params, output_reduction, *params):
        grads = TileGrads("TiledFusedLogitsLoss", params, [module])
        with grads.hooked():
            total, x_grad = _tiled_loss(fn, module, x, y, mask, shards, output_reduction, grads,
                                        ctx.needs_input_grad[2])
        ctx.grads, ctx.x_grad, ctx.x_shape = grads, x_grad, x.shape
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError("TiledFusedLogitsLoss: backward ran twice through the same loss; its gradients are "
                               "computed once, in forward: run the forward again for a second backward")
        grads, x_grad, ctx.grads, ctx.x_grad = ctx.grads, ctx.x_grad, None, None
        if x_grad is not None:
            x_grad = x_grad.mul_(grad_out).view(ctx.x_shape)  # [n, h] -> [bs, sl, h]
        grads.write_undeclared(grad_out)
        return one_grad_per_input(TiledFusedLogitsLoss.forward, x=x_grad, varargs=grads.declared_grads(grad_out))


def _tiled_loss(fn, module, x, y, mask, shards, output_reduction, grads=None, needs_x=False):
    """(loss, x_grad [n, h] or None): the reduced tile losses, and with `grads` (a TileGrads) each tile
    backpropagated right after its loss, weighted as the reduction weights it."""
    if output_reduction not in ("mean", "sum"):
        raise ValueError(f"TiledFusedLogitsLoss: output_reduction must be 'mean' or 'sum', got {output_reduction!r}")
    if x.dim() < 2 or tuple(y.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"TiledFusedLogitsLoss: expected x [..., h] and y of shape x.shape[:-1], got x "
                         f"{tuple(x.shape)} and y {tuple(y.shape)}; pass shift_labels aligned with x")
    if mask is not None and tuple(mask.shape) != tuple(y.shape):
        raise ValueError(f"TiledFusedLogitsLoss: mask must have y's shape {tuple(y.shape)}, got "
                         f"{tuple(mask.shape)}; pass mask=None if there is none")
    x_flat, y_flat = x.detach().reshape(-1, x.shape[-1]), y.reshape(-1)  # [bs, sl, h] -> [n, h], [bs, sl] -> [n]
    mask_flat = None if mask is None else mask.reshape(-1)  # [bs, sl] -> [n]
    n = y_flat.numel()
    if shards == "auto":
        shards = resolve_loss_shards(shards, n, weight_rows(module))
    x_grad = torch.empty_like(x_flat) if grads is not None and needs_x else None  # [n, h]
    total = None
    bounds = tile_bounds(n, positive_int(shards, "shards"))
    for start, stop in bounds:
        tile = x_flat[start:stop].requires_grad_(x_grad is not None)  # [n_t, h]
        masks = () if mask is None else (mask_flat[start:stop],)
        with torch.set_grad_enabled(grads is not None):
            loss = fn(module, tile, y_flat[start:stop], *masks)
        if not torch.is_tensor(loss) or loss.numel() != 1:
            got = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
            raise ValueError(f"TiledFusedLogitsLoss: fn must return the tile's loss as a 1-element tensor, got "
                             f"{got}; reduce it in fn, e.g. with torch.nn.CrossEntropyLoss()")
        weight = (stop - start) / n if output_reduction == "mean" else 1.0
        if grads is not None:  # on an empty tile too, so that every rank makes the same ZeRO-3 calls
            into = None if x_grad is None else x_grad[start:stop]
            grads.backprop(loss, torch.ones_like(loss), tile, into, weight, keep=stop > start)
        loss = loss.detach().reshape(())
        if total is None:  # summed in fp32 (or wider), returned in fn's dtype
            total = torch.zeros((), dtype=torch.promote_types(loss.dtype, torch.float32), device=loss.device)
        if stop > start:
            total += weight * loss.to(total.dtype)
    return total.to(loss.dtype), x_grad

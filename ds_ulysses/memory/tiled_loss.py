"""TiledFusedLogitsLoss: lm_head + loss over tiles of tokens, never holding more than one tile's logits
(ALST's fused logits loss; at 128K vocabulary the full logits are the largest activation)."""

import torch

from ..constants import IGNORE_INDEX
from .tiles import gathered, one_grad_per_input, param_grads, positive_int, recompute_tiles, resolve_loss_shards, \
    tile_bounds, trainable_params, weight_rows

__all__ = ["TiledFusedLogitsLoss"]


class TiledFusedLogitsLoss(torch.autograd.Function):
    """Token-mean (or sum) loss of `fn` over tiles of tokens, never holding more than one tile's logits.

    Contract: `x` is `[..., h]` (e.g. `[bs, sl, h]`), `y` is `x.shape[:-1]` (e.g. `shift_labels`); both
    are flattened to `n = bs*sl` tokens and tiled on that dim. `fn(module, x_tile [n_t, h], y_tile [n_t])`
    (plus `mask_tile [n_t]` as a 4th argument when `mask` is given, as in DeepSpeed) must return the SUM
    of the per-token losses over the tile's valid tokens, as a 1-element tensor (e.g.
    `F.cross_entropy(module(x_t).float(), y_t, reduction="sum")`), and 0 for a tile without valid
    tokens. Valid tokens are `mask != 0`, or `y != -100` when `mask` is None.

    `output_reduction="sum"` returns the summed loss; "mean" divides it by the number of valid tokens
    over all tiles (a true token mean, not a mean of tile means), and returns 0, not NaN, when there
    is none. `shards` is an int >= 1 or "auto" (`auto_loss_shards(n, module.weight.shape[0])`, agreed
    over ranks). Backward recomputes each tile and scales every gradient, input and parameters alike,
    by the incoming gradient, so `0.5 * loss` and loss scaling give exactly scaled gradients.
    """

    @classmethod
    def apply(cls, fn, module, x, y, mask, shards, compute_params, output_reduction):
        params = trainable_params(compute_params, [module])
        with gathered(params):
            return super().apply(fn, module, x, y, mask, shards, compute_params, output_reduction, *params)

    @staticmethod
    def forward(ctx, fn, module, x, y, mask, shards, compute_params, output_reduction, *params):
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"TiledFusedLogitsLoss: output_reduction must be 'mean' or 'sum', got "
                             f"{output_reduction!r}")
        if x.dim() < 2 or tuple(y.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"TiledFusedLogitsLoss: expected x [..., h] and y of shape x.shape[:-1], got x "
                             f"{tuple(x.shape)} and y {tuple(y.shape)}; pass shift_labels aligned with x")
        if mask is not None and tuple(mask.shape) != tuple(y.shape):
            raise ValueError(f"TiledFusedLogitsLoss: mask must have y's shape {tuple(y.shape)}, got "
                             f"{tuple(mask.shape)}; pass mask=None to use y != -100")
        x_flat, y_flat = x.reshape(-1, x.shape[-1]), y.reshape(-1)  # [bs, sl, h] -> [n, h], [bs, sl] -> [n]
        mask_flat = None if mask is None else mask.reshape(-1)  # [bs, sl] -> [n]
        if shards == "auto":
            shards = resolve_loss_shards(shards, y_flat.numel(), weight_rows(module))
        ctx.fn, ctx.module, ctx.reduction = fn, module, output_reduction
        ctx.bounds = tile_bounds(y_flat.numel(), positive_int(shards, "shards"))
        ctx.params = params
        ctx.x_shape = x.shape
        ctx.save_for_backward(x_flat, y_flat, *([] if mask is None else [mask_flat]))

        valid = (mask_flat != 0) if mask is not None else (y_flat != IGNORE_INDEX)
        ctx.denom = valid.sum().clamp(min=1) if output_reduction == "mean" else None
        total = None
        with torch.no_grad():
            for start, stop in ctx.bounds:
                masks = () if mask is None else (mask_flat[start:stop],)
                loss = fn(module, x_flat[start:stop], y_flat[start:stop], *masks)  # [n_t, h], [n_t]
                if not torch.is_tensor(loss) or loss.numel() != 1:
                    got = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
                    raise ValueError(f"TiledFusedLogitsLoss: fn must return the tile's summed loss as a "
                                     f"1-element tensor, got {got}; use reduction='sum' in fn")
                loss = loss.reshape(())
                total = loss if total is None else total + loss
        return total / ctx.denom.to(total.dtype) if ctx.denom is not None else total

    @staticmethod
    def backward(ctx, grad_out):
        x, y, *mask = ctx.saved_tensors  # [n, h], [n], [n]
        scale = grad_out / ctx.denom.to(grad_out.dtype) if ctx.denom is not None else grad_out

        def recompute(i, start, stop, tile):  # tile: [n_t, h]
            loss = ctx.fn(ctx.module, tile, y[start:stop], *(m[start:stop] for m in mask))
            return loss, scale.to(loss.dtype).expand_as(loss)

        x_grad = recompute_tiles(ctx.params, ctx.bounds, x, 0, ctx.needs_input_grad[2], recompute)
        if x_grad is not None:
            x_grad = x_grad.view(ctx.x_shape)  # [n, h] -> [bs, sl, h]
        return one_grad_per_input(TiledFusedLogitsLoss.forward, x=x_grad, varargs=param_grads(ctx))

"""TiledMLP: an MLP over sequence tiles, so its ``[bs, sl, intermediate]`` activations exist one tile at a
time (ALST's TiledMLP); backward recomputes each tile."""

import torch

from .tiles import agree_on_shards, auto_mlp_shards, gathered, one_grad_per_input, param_grads, positive_int, \
    recompute_tiles, tile_bounds, trainable_params

__all__ = ["TiledMLP"]


class TiledMLP(torch.autograd.Function):
    """`fn(module, x_tile) -> y_tile` over sequence tiles of `x` (`[bs, sl, h]` or `[sl, h]`, tiled on dim -2).

    Output is the tiles concatenated on dim -2. `shards` is an int >= 1 or "auto"
    (`agree_on_shards(auto_mlp_shards(sl, h))`). `compute_params=None` means every trainable
    parameter of `module`. Tiles are contiguous, so `fn` may `.view` them.
    """

    @classmethod
    def apply(cls, fn, module, x, shards, compute_params):
        params = trainable_params(compute_params, [module])
        with gathered(params):
            return super().apply(fn, module, x, shards, compute_params, *params)

    @staticmethod
    def forward(ctx, fn, module, x, shards, compute_params, *params):
        if x.dim() < 2:
            raise ValueError(f"TiledMLP: x must be [bs, sl, h] or [sl, h], got shape {tuple(x.shape)}; pass the "
                             "hidden states with their sequence dim")
        if shards == "auto":
            shards = agree_on_shards(auto_mlp_shards(max(1, x.shape[-2]), x.shape[-1]))
        ctx.fn, ctx.module, ctx.bounds = fn, module, tile_bounds(x.shape[-2], positive_int(shards, "shards"))
        ctx.params = params
        ctx.save_for_backward(x)
        out = None
        with torch.no_grad():
            for start, stop in ctx.bounds:
                y = fn(module, x[..., start:stop, :].contiguous())  # [bs, sl_t, h_out]
                if not torch.is_tensor(y) or y.dim() != x.dim() or y.shape[-2] != stop - start:
                    got = tuple(y.shape) if torch.is_tensor(y) else type(y).__name__
                    raise ValueError(f"TiledMLP: fn must map a [..., {stop - start}, h] tile to one tensor "
                                     f"[..., {stop - start}, h_out], got {got}; wrap fn so it returns the "
                                     "hidden states only")
                if out is None:
                    out = y.new_empty(*y.shape[:-2], x.shape[-2], y.shape[-1])  # [bs, sl, h_out]
                out[..., start:stop, :] = y
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors

        def recompute(i, start, stop, tile):  # tile: [bs, sl_t, h]
            return ctx.fn(ctx.module, tile), grad_out[..., start:stop, :]

        x_grad = recompute_tiles(ctx.params, ctx.bounds, x, -2, ctx.needs_input_grad[2], recompute)
        return one_grad_per_input(TiledMLP.forward, x=x_grad, varargs=param_grads(ctx))

"""TiledMLP: an MLP over sequence tiles, so its ``[bs, sl, intermediate]`` activations exist one tile at a
time (ALST's TiledMLP); backward recomputes each tile, the price of never holding them all.

Dimensions: bs batch, sl sequence, sl_t one tile of it, h hidden, h_out the MLP's output width,
n = bs*sl flattened tokens, n_t one tile of them.
"""

import torch
from torch.autograd import Function

from .tile_grads import TileGrads
from .tiles import agree_on_shards, auto_mlp_shards, one_grad_per_input, positive_int, seq_tile, tile_bounds, \
    trainable_params, zero3_fetch_with, zero3_whole

__all__ = ["TiledMLP", "AutogradComputeMLP"]


class TiledMLP(Function):
    """`fn(module, x_tile) -> y_tile` over sequence tiles of `x` (`[bs, sl, h]` or `[sl, h]`, tiled on dim -2).

    Output is the tiles concatenated on dim -2. `shards` is an int >= 1 or "auto"
    (`agree_on_shards(auto_mlp_shards(sl, h))`); tiles have `torch.tensor_split`'s sizes. Backward
    recomputes on as many `[n_t, h]` tiles of the flattened tokens (`n = bs * sl`), as DeepSpeed's
    does: `fn` must be token-wise and take both ranks (a 2-D matmul per tile is also cheaper than a
    batched one). Tiles are contiguous, so `fn` may `.view` them. `compute_params` lists the
    trainable parameters `fn` uses (DeepSpeed's call: `TiledMLP.apply(fn, self, x, shards,
    [self.up_proj.weight, ...])`, also from inside the MLP's own hooked `forward` under ZeRO-3); None
    means every trainable parameter of `module`. Their gradients leave the Function once per backward
    (see `tile_grads`); a trainable parameter `fn` uses that is not listed gets its gradient in `.grad`
    directly, which is refused under DeepSpeed ZeRO. Under ZeRO-3 the declared parameters are fetched
    with `module` from its second call on (`tiles.zero3_fetch_with`), as ZeRO fetches DeepSpeed's.
    """

    @classmethod
    def apply(cls, fn, module, x, shards, compute_params):
        params = trainable_params(compute_params, [module])
        zero3_fetch_with(module, params)
        with zero3_whole(params):
            return super().apply(fn, module, x, shards, compute_params, *params)

    @staticmethod
    def forward(ctx, fn, module, x, shards, compute_params, *params):
        if not torch.is_tensor(x) or x.dim() < 2:
            raise ValueError(f"TiledMLP: x must be [bs, sl, h] or [sl, h], got shape {tuple(getattr(x, 'shape', ()))}; "
                             "pass the hidden states with their sequence dim")
        if shards == "auto":
            shards = agree_on_shards(auto_mlp_shards(max(1, x.shape[-2]), x.shape[-1]))
        ctx.fn, ctx.module, ctx.bounds = fn, module, tile_bounds(x.shape[-2], positive_int(shards, "shards"))
        ctx.params = params
        ctx.save_for_backward(x)
        out = None
        with torch.no_grad():
            for start, stop in ctx.bounds:
                y = fn(module, seq_tile(x, start, stop, -2))  # [bs, sl_t, h_out]
                if not torch.is_tensor(y) or y.dim() != x.dim() or y.shape[-2] != stop - start:
                    got = tuple(y.shape) if torch.is_tensor(y) else type(y).__name__
                    raise ValueError(f"TiledMLP: fn must map a [..., {stop - start}, h] tile to one tensor "
                                     f"[..., {stop - start}, h_out], got {got}; wrap fn so it returns the "
                                     "hidden states only")
                if out is None:
                    out = y.new_empty(*y.shape[:-2], x.shape[-2], y.shape[-1])  # [bs, sl, h_out]
                out.narrow(-2, start, stop - start).copy_(y)  # a slice assignment takes a slower copy
                del y  # not alive through the next tile's fn
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors  # [bs, sl, h]
        shape = x.shape
        x = x.detach().reshape(-1, shape[-1])  # [n, h]
        grad_out = grad_out.reshape(-1, grad_out.shape[-1])  # [n, h_out]
        x_grad = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        bounds = tile_bounds(x.shape[0], len(ctx.bounds))
        grads = TileGrads("TiledMLP", ctx.params, [ctx.module])
        with zero3_whole(ctx.params), grads.hooked():
            for start, stop in bounds:
                tile = x[start:stop].requires_grad_(x_grad is not None)  # [n_t, h]
                with torch.enable_grad():
                    y = ctx.fn(ctx.module, tile)  # [n_t, h_out]
                into = None if x_grad is None else x_grad[start:stop]
                grads.backprop(y, grad_out[start:stop], tile, into)
                del tile, y, into  # not alive through the next tile's fn
        grads.write_undeclared()
        x_grad = None if x_grad is None else x_grad.view(shape)
        return one_grad_per_input(TiledMLP.forward, x=x_grad, varargs=grads.declared_grads())


class AutogradComputeMLP:
    """DeepSpeed's ``AutogradComputeMLP``: ``AutogradComputeMLP.apply(fn, module, x)`` is ``fn(module, x)``
    without its activations kept for backward, which recomputes it. It is :class:`TiledMLP` with one tile:
    ``fn`` sees ``x`` with its own shape in forward and in backward (where TiledMLP passes flattened
    tokens), and the gradients of ``module``'s trainable parameters reach autograd once per backward, as
    ZeRO-3 needs."""

    @staticmethod
    def apply(fn, module, x):
        def whole(mod, tile):
            if tile.shape == x.shape:
                return fn(mod, tile)
            return fn(mod, tile.view(x.shape)).reshape(tile.shape[0], -1)  # backward's [n, h] tokens

        return TiledMLP.apply(whole, module, x, 1, None)

"""TiledMLP: an MLP over sequence tiles, so its ``[bs, sl, intermediate]`` activations exist one tile at a
time (ALST's TiledMLP); backward recomputes each tile, the price of never holding them all.

Dimensions: bs batch, sl sequence, sl_t one tile of it, h hidden, h_out the MLP's output width,
n = bs*sl flattened tokens, n_t one tile of them.
"""

import contextlib

import torch
from torch.autograd import Function

from .rebuild import kept_input, rebuilding, rebuilt
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

    `side` (ours, not DeepSpeed's) serves what `fn` hands its model besides its return value: a MoE
    block's router logits, which the model records from inside the block to compute its load-balancing
    loss. It is an object with ``recording(backward)``, a context manager yielding the list of tensors the
    `fn` calls inside it recorded (taking them from where the model keeps them), and ``keep(tensors)``,
    which puts tensors there. The tiles' recordings are put back as one tensor per recording site, the
    tiles joined in token order as the untiled block records it, and those tensors are outputs of the
    Function: their gradients reach its backward, which records the same sites in each recompute and
    backpropagates them with the tile's output.
    """

    @classmethod
    def apply(cls, fn, module, x, shards, compute_params, side=None):
        params = trainable_params(compute_params, [module])
        zero3_fetch_with(module, params)
        with zero3_whole(params):
            out = super().apply(fn, module, x, shards, compute_params, side, *params)
        return out[0] if isinstance(out, tuple) else out

    @staticmethod
    def forward(ctx, fn, module, x, shards, compute_params, side, *params):
        if not torch.is_tensor(x) or x.dim() < 2:
            raise ValueError(f"TiledMLP: x must be [bs, sl, h] or [sl, h], got shape {tuple(getattr(x, 'shape', ()))}; "
                             "pass the hidden states with their sequence dim")
        if shards == "auto":
            shards = agree_on_shards(auto_mlp_shards(max(1, x.shape[-2]), x.shape[-1]))
        ctx.fn, ctx.module, ctx.bounds = fn, module, tile_bounds(x.shape[-2], positive_int(shards, "shards"))
        ctx.params = params
        kept, ctx.rebuild = kept_input(x)  # a norm's output is kept as the norm's input (see .rebuild)
        ctx.save_for_backward(kept)
        out, recorded = None, []
        with torch.no_grad():
            for start, stop in ctx.bounds:
                with _recording(side, backward=False) as got:
                    y = fn(module, seq_tile(x, start, stop, -2))  # [bs, sl_t, h_out]
                recorded.append(got)
                if not torch.is_tensor(y) or y.dim() != x.dim() or y.shape[-2] != stop - start:
                    got = tuple(y.shape) if torch.is_tensor(y) else type(y).__name__
                    raise ValueError(f"TiledMLP: fn must map a [..., {stop - start}, h] tile to one tensor "
                                     f"[..., {stop - start}, h_out], got {got}; wrap fn so it returns the "
                                     "hidden states only")
                if out is None:
                    out = y.new_empty(*y.shape[:-2], x.shape[-2], y.shape[-1])  # [bs, sl, h_out]
                out.narrow(-2, start, stop - start).copy_(y)  # a slice assignment takes a slower copy
                del y  # not alive through the next tile's fn
            joined = _join_tiles(recorded, ctx.bounds, x.shape[:-1])
        ctx.side, ctx.side_count = side, len(joined)
        if not joined:
            return out
        side.keep(joined)
        return (out, *joined)

    @staticmethod
    def backward(ctx, grad_out, *side_grads):
        (kept,) = ctx.saved_tensors  # [bs, sl, h]: x, or the source x is rebuilt from
        shape = kept.shape
        kept = kept.detach().reshape(-1, shape[-1])  # [n, h]
        grad_out = grad_out.reshape(-1, grad_out.shape[-1])  # [n, h_out]
        x_grad = torch.empty_like(kept) if ctx.needs_input_grad[2] else None
        bounds = tile_bounds(kept.shape[0], len(ctx.bounds))
        grads = TileGrads("TiledMLP", ctx.params, [ctx.module])
        with zero3_whole(ctx.params), rebuilding(ctx.rebuild), grads.hooked():
            for start, stop in bounds:
                tile = rebuilt(kept[start:stop], ctx.rebuild).requires_grad_(x_grad is not None)  # [n_t, h]
                with _recording(ctx.side if ctx.side_count else None, backward=True) as got, torch.enable_grad():
                    y = ctx.fn(ctx.module, tile)  # [n_t, h_out]
                if len(got) != ctx.side_count:
                    raise RuntimeError(f"TiledMLP: a recompute recorded {len(got)} side outputs where the forward "
                                       f"recorded {ctx.side_count}; fn must record the same sites every call")
                into = None if x_grad is None else x_grad[start:stop]
                grads.backprop([y, *got], [grad_out[start:stop], *(g[start:stop] for g in side_grads)], tile, into)
                del tile, y, into, got  # not alive through the next tile's fn
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


def _recording(side, backward: bool):
    return contextlib.nullcontext([]) if side is None else side.recording(backward)


def _join_tiles(recorded: list, bounds: list, lead: torch.Size) -> list:
    """One tensor per recording site from the tiles' recordings (each ``[rows_t, ...]``, one row per token of
    its ``[bs, sl_t]`` tile, batch-major as a block flattens its tokens; ``lead`` is ``[bs, sl]``): the tiles
    joined on the sequence, batch-major as the untiled block would record them, ``[bs * sl, ...]``, each a
    tensor of its own (not a view), as a Function's output must be to carry the Function's gradient."""
    counts = sorted({len(got) for got in recorded})
    if counts == [0]:
        return []
    if len(counts) != 1:
        raise ValueError(f"TiledMLP: the tiles of one call recorded {counts} side outputs; expected the same "
                         "recording sites in every tile (a block whose routing records per tile differently "
                         "cannot be tiled); fix: set \"tiled_mlp\": {\"enabled\": false}")
    joined = []
    for site in range(counts[0]):
        first = recorded[0][site]
        whole = first.new_empty(lead.numel(), *first.shape[1:])
        grid = whole.view(*lead, *first.shape[1:])  # [bs, sl, ...]
        for got, (start, stop) in zip(recorded, bounds):
            tensor, rows = got[site], lead[:-1].numel() * (stop - start)
            if tensor.dim() < 1 or tensor.shape[0] != rows or tensor.shape[1:] != first.shape[1:]:
                raise ValueError(f"TiledMLP: a tile of {rows} tokens recorded a side output of shape "
                                 f"{tuple(tensor.shape)}; expected one row per token, the same for every tile "
                                 f"(router logits [{rows}, experts]); fix: set \"tiled_mlp\": {{\"enabled\": false}}")
            grid.narrow(len(lead) - 1, start, stop - start).copy_(tensor.view(*lead[:-1], stop - start,
                                                                              *tensor.shape[1:]))
        joined.append(whole)
    return joined

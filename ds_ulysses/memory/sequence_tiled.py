"""Tiled compute along the sequence for any token-wise function (ALST paper, "Sequence Tiling").

A token-wise computation over a long sequence holds intermediates proportional to the sequence
length. Running it tile by tile under ``torch.no_grad()`` in forward and recomputing one tile at a
time in backward bounds those intermediates to one tile, for the price of one extra forward. Only the
input gradient buffer is preallocated at full size.

Dimensions: bs batch, sl sequence, sl_t one tile of it.
"""

import torch
from torch.autograd import Function

from .tile_grads import TileGrads
from .tiles import input_names, one_grad_per_input, positive_int, seq_tile, tile_bounds, trainable_params, zero3_whole

__all__ = ["SequenceTiledCompute", "sequence_tiled_compute"]

_REDUCTIONS = (None, "mean", "sum")


class SequenceTiledCompute(Function):
    """Run `fn` over sequence tiles of the `[bs, sl, ...]` tensors in `args`; recompute per tile in backward.

    Called through `sequence_tiled_compute`, which takes dicts; see there for the contract.
    """

    @classmethod
    def apply(cls, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
              output_unshard_dimension, output_reduction, *args):
        params = trainable_params(compute_params, [fn, *args[len(keys_to_shard):]])
        with zero3_whole(params):
            return super().apply(fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key,
                                 compute_params, output_unshard_dimension, output_reduction, *args, *params)

    @staticmethod
    def forward(ctx, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key,
                compute_params, output_unshard_dimension, output_reduction, *args_then_params):
        keys = list(keys_to_shard) + list(keys_to_pass)
        args, ctx.params = args_then_params[:len(keys)], args_then_params[len(keys):]
        if grad_requiring_tensor_key not in keys_to_shard:
            raise ValueError(f"sequence_tiled_compute: grad_requiring_tensor_key must name a tensor in "
                             f"kwargs_to_shard {list(keys_to_shard)}, got {grad_requiring_tensor_key!r}; "
                             "shard the tensor whose gradient you need")
        if output_reduction not in _REDUCTIONS:
            raise ValueError(f"sequence_tiled_compute: output_reduction must be one of {_REDUCTIONS}, got "
                             f"{output_reduction!r}")
        shards = positive_int(shards, "shards")
        for key, value in zip(keys_to_shard, args):
            if not torch.is_tensor(value) or value.dim() < 2 or value.shape[1] != seqlen:
                shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
                raise ValueError(f"sequence_tiled_compute: kwargs_to_shard[{key!r}] must be a [bs, seqlen, ...] "
                                 f"tensor with seqlen={seqlen}, got {shape}; pass the true seqlen")
        ctx.fn, ctx.keys, ctx.n_shard = fn, keys, len(keys_to_shard)
        ctx.grad_key, ctx.dim, ctx.reduction = grad_requiring_tensor_key, output_unshard_dimension, output_reduction
        ctx.bounds = tile_bounds(seqlen, shards)
        tensor_at = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.tensor_at, ctx.others = tensor_at, [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in tensor_at))

        with torch.no_grad():
            outs = [fn(**_tile_kwargs(keys, args, ctx.n_shard, start, stop)) for start, stop in ctx.bounds]
        if not all(torch.is_tensor(out) for out in outs):
            got = sorted({type(out).__name__ for out in outs})
            raise ValueError(f"sequence_tiled_compute: fn must return one tensor per tile, got {got}; wrap fn so "
                             "it returns the tensor to concatenate (or a 0-dim value per tile)")
        ctx.per_tile = outs[0].dim() == 0
        if ctx.per_tile:  # one value per tile: [shards], reduced with each tile weighted by its length
            ctx.weights = [(stop - start) / seqlen if output_reduction == "mean" else 1.0 for start, stop in ctx.bounds]
            if output_reduction is None:
                return torch.stack(outs)
            total = torch.zeros((), dtype=torch.promote_types(outs[0].dtype, torch.float32), device=outs[0].device)
            for out, weight, (start, stop) in zip(outs, ctx.weights, ctx.bounds):
                if stop > start:  # a tile without tokens adds nothing
                    total += weight * out.to(total.dtype)
            return total.to(outs[0].dtype)
        out = torch.cat(outs, dim=output_unshard_dimension)  # [bs, sl, ...] (on output_unshard_dimension)
        sizes = [o.shape[output_unshard_dimension] for o in outs]
        ctx.out_bounds = [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]
        ctx.numel = out.numel()
        if output_reduction == "mean":
            return out.mean()
        return out.sum() if output_reduction == "sum" else out

    @staticmethod
    def backward(ctx, grad_out):
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            args[i] = t if t.is_leaf else t.detach()  # leaves (weights) keep their edges; no outer graph
        grad_at = ctx.keys.index(ctx.grad_key)
        needs_grad = ctx.needs_input_grad[len(input_names(SequenceTiledCompute.forward)) + grad_at]
        source = args[grad_at].detach()  # [bs, sl, ...]
        source_grad = torch.empty_like(source) if needs_grad else None
        owners = [ctx.fn, *args[ctx.n_shard:]]
        grads = TileGrads("sequence_tiled_compute", ctx.params, owners)
        with zero3_whole(ctx.params), grads.hooked():
            for i in range(len(ctx.bounds)):
                _backprop_tile(ctx, grads, args, source, source_grad, grad_out, i)
        grads.write_undeclared()
        arg_grads = [source_grad if key == ctx.grad_key else None for key in ctx.keys]
        return one_grad_per_input(SequenceTiledCompute.forward, varargs=arg_grads + grads.declared_grads())


def _backprop_tile(ctx, grads, args, source, source_grad, grad_out, i):
    """Recomputes tile `i` with autograd and backpropagates it (its tensors die on return)."""
    start, stop = ctx.bounds[i]
    tile = seq_tile(source, start, stop, 1).requires_grad_(source_grad is not None)  # [bs, sl_t, ...]
    kwargs = _tile_kwargs(ctx.keys, args, ctx.n_shard, start, stop, {ctx.grad_key: tile})
    with torch.enable_grad():
        out = ctx.fn(**kwargs)
    adds_nothing = ctx.per_tile and ctx.reduction is not None and stop == start
    tile_grad_out, weight = _tile_grad_out(ctx, grad_out, i, out)
    into = None if source_grad is None else source_grad[:, start:stop]
    grads.backprop(out, tile_grad_out, tile, into, weight, keep=not adds_nothing)


def _tile_grad_out(ctx, grad_out, i, out):
    """(gradient, weight): what tile `i`'s output `out` receives of the incoming gradient, as a tensor
    shaped like `out` and a float factor (kept apart so a bf16 gradient does not round it)."""
    if ctx.per_tile:
        return (grad_out[i], 1.0) if ctx.reduction is None else (grad_out.expand_as(out), ctx.weights[i])
    if ctx.reduction is not None:
        return grad_out.expand_as(out), 1 / ctx.numel if ctx.reduction == "mean" else 1.0
    offset, size = ctx.out_bounds[i]
    return grad_out.narrow(ctx.dim, offset, size), 1.0


def _tile_kwargs(keys, args, n_shard, start, stop, given=None):
    """kwargs for one tile: the first `n_shard` args sliced `[:, start:stop]` (contiguous, as fn may
    `.view` them; a copy when bs > 1), the rest passed whole; `given` ({key: tile}) holds tiles made
    already, which are not sliced again."""
    given = given or {}
    return {k: given[k] if k in given else seq_tile(a, start, stop, 1) if i < n_shard else a
            for i, (k, a) in enumerate(zip(keys, args))}


def sequence_tiled_compute(fn, seqlen, shards, kwargs_to_shard, kwargs_to_pass, grad_requiring_tensor_key,
                           compute_params=None, output_unshard_dimension=1, output_reduction="mean"):
    """`fn(**kwargs_to_shard, **kwargs_to_pass)` computed tile by tile along the sequence (DeepSpeed's call).

    `kwargs_to_shard` values are `[bs, seqlen, ...]` tensors split on dim 1 with `torch.tensor_split`
    sizes (unequal when seqlen % shards != 0; empty tiles when shards > seqlen, so `fn` must accept a
    zero-length tile). Only the tensor under `grad_requiring_tensor_key` gets an input gradient; other
    non-leaf tensors are constants.

    `fn` returns per tile either a tensor, concatenated on `output_unshard_dimension` (then "mean" and
    "sum" reduce over all its elements), or a 0-dim value such as a tile's loss, stacked into
    `[shards]` with `output_reduction=None`; "sum" adds the values, and "mean" weights each by its
    tile's share of the sequence, `sl_t / seqlen`: DeepSpeed's mean of the tile values when the tiles
    are equal, the exact token mean of a per-token mean when they are not (DeepSpeed's is biased
    there). A tile without tokens adds nothing to "mean" or "sum".

    `compute_params` lists the trainable parameters `fn` uses (required by DeepSpeed under ZeRO); None
    means every trainable parameter of `fn` if it is a module and of the modules in `kwargs_to_pass`,
    plus parameters passed there directly. Declared parameters are inputs of the Function, and their
    gradients, summed over the backward's tile recomputes, leave it once, so ZeRO reduces each once
    (see `tile_grads`). A trainable parameter `fn` uses that is not declared gets its gradient in `.grad`
    directly, which is refused under DeepSpeed ZeRO.
    """
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())

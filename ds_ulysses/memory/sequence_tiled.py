"""Tiled compute along the sequence for any token-wise function (ALST paper, "Sequence Tiling").

A token-wise computation over a long sequence holds intermediates proportional to the sequence
length. Running it tile by tile under ``torch.no_grad()`` in forward and recomputing one tile at a
time in backward bounds those intermediates to one tile, for the price of one extra forward. Only the
input gradient buffer is preallocated at full size.

Parameter gradients reach ``param.grad`` from the per-tile recomputes, not through the returned graph,
so train with ``loss.backward()`` / ``engine.backward(loss)``; ``torch.autograd.grad(loss, params)``
does not see them.
"""

import torch

from .tiles import gathered, input_names, one_grad_per_input, param_grads, positive_int, recompute_tiles, \
    tile_bounds, trainable_params

__all__ = ["SequenceTiledCompute", "sequence_tiled_compute"]

_REDUCTIONS = (None, "mean", "sum")


class SequenceTiledCompute(torch.autograd.Function):
    """Run `fn` over sequence tiles of the `[bs, sl, ...]` tensors in `args`; recompute per tile in backward.

    `fn` returns either a tensor that is concatenated on `output_unshard_dimension`, or a 0-dim tensor
    per tile, stacked into `[shards]`; then `output_reduction` (None, "mean", "sum") applies to the
    whole. Only the tensor under `grad_requiring_tensor_key` gets an input gradient; other non-leaf
    tensors are constants, and leaves `fn` uses (parameters) accumulate their gradients as usual. Called through
    `sequence_tiled_compute`, which takes dicts.
    """

    @classmethod
    def apply(cls, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
              output_unshard_dimension, output_reduction, *args):
        params = trainable_params(compute_params, [fn, *args[len(keys_to_shard):]])
        with gathered(params):
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
        ctx.stacked = outs[0].dim() == 0
        out = torch.stack(outs) if ctx.stacked else torch.cat(outs, dim=output_unshard_dimension)
        sizes = [1 if ctx.stacked else o.shape[output_unshard_dimension] for o in outs]
        ctx.out_bounds = [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]
        ctx.numel = out.numel()
        if output_reduction == "mean":
            return out.mean()
        return out.sum() if output_reduction == "sum" else out

    @staticmethod
    def backward(ctx, grad_out):
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            args[i] = t if t.is_leaf else t.detach()  # leaves (weights) still get .grad; no outer graph
        grad_at = ctx.keys.index(ctx.grad_key)
        needs_grad = ctx.needs_input_grad[len(input_names(SequenceTiledCompute.forward)) + grad_at]
        if ctx.reduction == "mean":
            grad_out = grad_out / ctx.numel

        def recompute(i, start, stop, tile):
            kwargs = _tile_kwargs(ctx.keys, args, ctx.n_shard, start, stop)
            out = ctx.fn(**{**kwargs, ctx.grad_key: tile})
            if ctx.reduction is not None:
                return out, grad_out.expand_as(out)
            offset, size = ctx.out_bounds[i]
            return out, grad_out[offset] if ctx.stacked else grad_out.narrow(ctx.dim, offset, size)

        input_grad = recompute_tiles(ctx.params, ctx.bounds, args[grad_at], 1, needs_grad, recompute)
        arg_grads = [input_grad if key == ctx.grad_key else None for key in ctx.keys]
        return one_grad_per_input(SequenceTiledCompute.forward, varargs=arg_grads + param_grads(ctx))


def _tile_kwargs(keys, args, n_shard, start, stop):
    """kwargs for one tile: the first `n_shard` args sliced `[:, start:stop]` (contiguous, as fn may
    `.view` them), the rest passed whole."""
    return {k: (a[:, start:stop].contiguous() if i < n_shard else a) for i, (k, a) in enumerate(zip(keys, args))}


def sequence_tiled_compute(fn, seqlen, shards, kwargs_to_shard, kwargs_to_pass, grad_requiring_tensor_key,
                           compute_params=None, output_unshard_dimension=1, output_reduction="mean"):
    """Tiled `fn(**kwargs_to_shard, **kwargs_to_pass)`; see `SequenceTiledCompute`.

    `kwargs_to_shard` values are `[bs, seqlen, ...]` tensors split on dim 1 with `torch.tensor_split`
    sizes (unequal when seqlen % shards != 0; empty tiles when shards > seqlen, so `fn` must accept a
    zero-length tile). `compute_params=None` means every trainable parameter of `fn` if it is a module
    and of the modules in `kwargs_to_pass`, plus parameters passed there directly; otherwise list the parameters `fn` uses, and only those:
    they become inputs of the Function, which is how ZeRO reduces each gradient once (plain torch also
    accumulates unlisted ones while the sharded input requires grad). With 0-dim tile outputs "mean"
    averages the tile values with equal weight; for a token-mean loss use `TiledFusedLogitsLoss`.
    """
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())

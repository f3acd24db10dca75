"""Tiled compute along the sequence: the ALST memory tools for MLPs, fused logits+loss and any token-wise fn.

A token-wise computation over a long sequence (an MLP, the lm_head + cross-entropy) holds intermediates
proportional to the sequence length: `[bs, sl, intermediate]` for an MLP, `[bs*sl, vocab]` logits for
the loss. Running it tile by tile under `torch.no_grad()` in forward and recomputing one tile at a time
in backward bounds those intermediates to one tile (ALST paper, "Sequence Tiling"), for the price of
one extra forward of the tiled op. Only the input gradient buffer is preallocated at full size.

Under DeepSpeed ZeRO-3 the parameters used by the tiles are gathered once for the whole backward.
While the tiles run, `ds_grad_is_ready` is False, so ZeRO's per-parameter gradient hook (ZeRO-1/2/3)
lets `param.grad` accumulate every tile; the parameters are inputs of the autograd Function, so their
own AccumulateGrad runs once afterwards in the outer backward and fires the hook once, after all uses
of the parameter (a tied lm_head/embedding weight included). Without DeepSpeed both are no-ops. Under
ZeRO-3 every rank must run the same number of tiles (parameter gathers are collective): resolve
`shards` with `agree_on_shards`.

Parameter gradients reach `param.grad` from the per-tile recomputes, not through the returned graph,
so train with `loss.backward()` / `engine.backward(loss)`; `torch.autograd.grad(loss, params)` does
not see them.

Dimensions: bs batch, sl sequence, sl_t one tile of the sequence, h hidden, v vocab,
n = bs*sl flattened tokens, n_t one tile of them.
"""

import contextlib
import functools
import inspect
import math
import operator

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["SequenceTiledCompute", "sequence_tiled_compute", "TiledMLP", "TiledFusedLogitsLoss", "auto_mlp_shards",
           "auto_loss_shards", "resolve_loss_shards", "agree_on_shards"]

IGNORE_INDEX = -100
# 128 MiB of logits per tile (2**25 fp32 values): 1024 tokens at a 32K vocab, 256 at 128K, still a
# large matmul on a GPU, while the tile's logits, log-softmax and grad stay small beside the activations
DEFAULT_LOGITS_BUDGET_BYTES = 1 << 27
_REDUCTIONS = (None, "mean", "sum")
_MISSING = object()


def auto_mlp_shards(seqlen, hidden_size):
    """ceil(seqlen / hidden_size): each tile's `[sl_t, intermediate]` activations are then about the
    size of one `[h, intermediate]` weight, the ALST paper's rule of thumb."""
    seqlen, hidden_size = _positive_int(seqlen, "seqlen"), _positive_int(hidden_size, "hidden_size")
    return max(1, math.ceil(seqlen / hidden_size))


def auto_loss_shards(seqlen, vocab_size, budget_bytes=DEFAULT_LOGITS_BUDGET_BYTES, dtype=torch.float32):
    """Fewest tiles whose `[n_t, v]` logits fit in `budget_bytes` (default 128 MiB, i.e. 2**25 fp32 logits).

    `seqlen` is the number of tokens the loss sees (bs * sl for a batch). Cross-entropy upcasts
    logits to fp32, so pass the dtype the loss actually materialises.
    """
    seqlen, vocab_size = _positive_int(seqlen, "seqlen"), _positive_int(vocab_size, "vocab_size")
    budget_bytes = _positive_int(budget_bytes, "budget_bytes")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(1, math.ceil(seqlen * vocab_size * itemsize / budget_bytes))


def resolve_loss_shards(shards, tokens, vocab_size):
    """`shards` as an int: "auto" becomes `auto_loss_shards(tokens, vocab_size)`, agreed across ranks
    (every rank must call this, as it is collective for "auto")."""
    if shards != "auto":
        return shards
    return agree_on_shards(auto_loss_shards(max(1, tokens), vocab_size))


def agree_on_shards(n, group=None):
    """The max of `n` over the ranks of `group`, so ZeRO-3 ranks with different sequence lengths run the
    same number of tiles (each tile gathers parameters collectively; a mismatch deadlocks)."""
    n = _positive_int(n, "n")
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return n
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


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
        params = _trainable_params(compute_params, [fn, *args[len(keys_to_shard):]])
        with _gathered(params):
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
        shards = _positive_int(shards, "shards")
        for key, value in zip(keys_to_shard, args):
            if not torch.is_tensor(value) or value.dim() < 2 or value.shape[1] != seqlen:
                shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
                raise ValueError(f"sequence_tiled_compute: kwargs_to_shard[{key!r}] must be a [bs, seqlen, ...] "
                                 f"tensor with seqlen={seqlen}, got {shape}; pass the true seqlen")
        ctx.fn, ctx.keys, ctx.n_shard = fn, keys, len(keys_to_shard)
        ctx.grad_key, ctx.dim, ctx.reduction = grad_requiring_tensor_key, output_unshard_dimension, output_reduction
        ctx.bounds = _tile_bounds(seqlen, shards)
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
        needs_grad = ctx.needs_input_grad[len(_input_names(SequenceTiledCompute.forward)) + grad_at]
        if ctx.reduction == "mean":
            grad_out = grad_out / ctx.numel

        def recompute(i, start, stop, tile):
            kwargs = _tile_kwargs(ctx.keys, args, ctx.n_shard, start, stop)
            out = ctx.fn(**{**kwargs, ctx.grad_key: tile})
            if ctx.reduction is not None:
                return out, grad_out.expand_as(out)
            offset, size = ctx.out_bounds[i]
            return out, grad_out[offset] if ctx.stacked else grad_out.narrow(ctx.dim, offset, size)

        input_grad = _recompute_tiles(ctx.params, ctx.bounds, args[grad_at], 1, needs_grad, recompute)
        arg_grads = [input_grad if key == ctx.grad_key else None for key in ctx.keys]
        return _one_grad_per_input(SequenceTiledCompute.forward, varargs=arg_grads + _param_grads(ctx))


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


class TiledMLP(torch.autograd.Function):
    """`fn(module, x_tile) -> y_tile` over sequence tiles of `x` (`[bs, sl, h]` or `[sl, h]`, tiled on dim -2).

    Output is the tiles concatenated on dim -2. `shards` is an int >= 1 or "auto"
    (`agree_on_shards(auto_mlp_shards(sl, h))`). `compute_params=None` means every trainable
    parameter of `module`. Tiles are contiguous, so `fn` may `.view` them.
    """

    @classmethod
    def apply(cls, fn, module, x, shards, compute_params):
        params = _trainable_params(compute_params, [module])
        with _gathered(params):
            return super().apply(fn, module, x, shards, compute_params, *params)

    @staticmethod
    def forward(ctx, fn, module, x, shards, compute_params, *params):
        if x.dim() < 2:
            raise ValueError(f"TiledMLP: x must be [bs, sl, h] or [sl, h], got shape {tuple(x.shape)}; pass the "
                             "hidden states with their sequence dim")
        if shards == "auto":
            shards = agree_on_shards(auto_mlp_shards(max(1, x.shape[-2]), x.shape[-1]))
        ctx.fn, ctx.module, ctx.bounds = fn, module, _tile_bounds(x.shape[-2], _positive_int(shards, "shards"))
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

        x_grad = _recompute_tiles(ctx.params, ctx.bounds, x, -2, ctx.needs_input_grad[2], recompute)
        return _one_grad_per_input(TiledMLP.forward, x=x_grad, varargs=_param_grads(ctx))


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
        params = _trainable_params(compute_params, [module])
        with _gathered(params):
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
            shards = resolve_loss_shards(shards, y_flat.numel(), _vocab_size(module))
        ctx.fn, ctx.module, ctx.reduction = fn, module, output_reduction
        ctx.bounds = _tile_bounds(y_flat.numel(), _positive_int(shards, "shards"))
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

        x_grad = _recompute_tiles(ctx.params, ctx.bounds, x, 0, ctx.needs_input_grad[2], recompute)
        if x_grad is not None:
            x_grad = x_grad.view(ctx.x_shape)  # [n, h] -> [bs, sl, h]
        return _one_grad_per_input(TiledFusedLogitsLoss.forward, x=x_grad, varargs=_param_grads(ctx))


def _vocab_size(module):
    weight = getattr(module, "weight", None)
    if not torch.is_tensor(weight) or weight.dim() != 2:
        raise ValueError(f"TiledFusedLogitsLoss: shards='auto' reads the vocab size from module.weight "
                         f"[v, h], but {type(module).__name__} has none; pass an int (see auto_loss_shards)")
    return weight.ds_shape[0] if hasattr(weight, "ds_shape") else weight.shape[0]


def _tile_bounds(length, shards):
    """[start, stop) per tile with `torch.tensor_split`'s sizes: the first `length % shards` tiles are one
    longer, and tiles past the end are empty, so every rank runs `shards` tiles whatever its length."""
    small, extra = divmod(length, shards)
    edges = [i * small + min(i, extra) for i in range(shards + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _trainable_params(compute_params, owners):
    """The parameters ZeRO must coordinate: `compute_params`, or with None every trainable parameter of
    the modules among `owners` (LoRA adapters included, frozen base weights excluded)."""
    if compute_params is None:
        compute_params = [p for o in owners if isinstance(o, nn.Module) for p in o.parameters()]
        compute_params += [o for o in owners if isinstance(o, nn.Parameter)]
    unique = {id(p): p for p in compute_params if p.requires_grad}
    return list(unique.values())


def _param_grads(ctx):
    """None for every parameter input: the recompute has already accumulated into `param.grad`, and
    the parameter's own AccumulateGrad still runs once in the outer backward, firing ZeRO's hook."""
    return [None for _ in ctx.params]


def _recompute_tiles(params, bounds, source, dim, needs_grad, recompute):
    """The backward shared by the three Functions: per tile of `source` (split on `dim`), recompute
    `(out, out_grad) = recompute(i, start, stop, tile)` with grad enabled, backpropagate it, and copy
    the tile's input gradient into one preallocated buffer (returned; None if not `needs_grad`).

    ZeRO-3 `params` are gathered once for all tiles, and `ds_grad_is_ready` is False during the tiles
    so ZeRO's per-parameter hook lets `param.grad` accumulate them. The flags are restored before the
    Function returns; the hook then fires once, from the parameter's AccumulateGrad in the outer
    backward (the parameters are Function inputs), after every use of the parameter, so a weight
    also used outside the tiles (an lm_head tied to the embedding) is reduced once, in full.
    """
    source = source.detach()
    source_grad = torch.zeros_like(source) if needs_grad else None
    before = [(p, p.__dict__.get("ds_grad_is_ready", _MISSING)) for p in params]
    try:
        for p in params:
            p.ds_grad_is_ready = False
        with _gathered(params):
            for i, (start, stop) in enumerate(bounds):
                tile = source.narrow(dim, start, stop - start).contiguous().requires_grad_(needs_grad)
                with torch.enable_grad():
                    out, out_grad = recompute(i, start, stop, tile)
                if out.requires_grad:  # a tile may depend on nothing trainable
                    torch.autograd.backward(out, out_grad)
                if needs_grad and tile.grad is not None:
                    source_grad.narrow(dim, start, stop - start).copy_(tile.grad)
    finally:
        for p, flag in before:
            if flag is _MISSING:
                p.__dict__.pop("ds_grad_is_ready", None)
            else:
                p.ds_grad_is_ready = flag
    return source_grad


def _gathered(params):
    """Gather the ZeRO-3 partitioned `params` for a whole pass over the tiles (once, not per tile).
    In forward this also makes the parameters' autograd edges record their full shapes."""
    zero3 = [p for p in params if hasattr(p, "ds_id")]
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed  # ZeRO-3 parameters exist only once deepspeed has been imported

    return deepspeed.zero.GatheredParameters(zero3)


@functools.lru_cache(maxsize=None)
def _input_names(forward):
    """forward's input names after ctx, without its `*args`."""
    params = list(inspect.signature(forward).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL)


def _one_grad_per_input(forward, varargs=(), **grads):
    """backward's return value, built from `forward`'s own signature: one entry per named input
    (the gradient given by name, else None), then one per `*args` input."""
    if not set(grads) <= set(_input_names(forward)):
        raise ValueError(f"gradients given for {sorted(grads)}, but {forward.__qualname__} takes "
                         f"{_input_names(forward)}; name inputs of forward")
    return tuple(grads.get(name) for name in _input_names(forward)) + tuple(varargs)


def _positive_int(value, name):
    if isinstance(value, bool) or not hasattr(value, "__index__") or operator.index(value) < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}; pass e.g. {name}=4")
    return operator.index(value)

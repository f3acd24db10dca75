"""What the tiled Functions share: tile counts, tile bounds, and the backward that recomputes tiles.

Under DeepSpeed ZeRO-3 the parameters used by the tiles are gathered once for the whole backward.
While the tiles run, ``ds_grad_is_ready`` is False, so ZeRO's per-parameter gradient hook (ZeRO-1/2/3)
lets ``param.grad`` accumulate every tile; the parameters are inputs of the autograd Function, so their
own AccumulateGrad runs once afterwards in the outer backward and fires the hook once, after all uses
of the parameter (a tied lm_head/embedding weight included). Without DeepSpeed both are no-ops. Under
ZeRO-3 every rank must run the same number of tiles (parameter gathers are collective): resolve
``shards`` with :func:`agree_on_shards`.

Dimensions: bs batch, sl sequence, sl_t one tile of the sequence, h hidden, v vocab,
n = bs*sl flattened tokens, n_t one tile of them.
"""

import contextlib
import functools
import inspect
import math
import operator

import torch
from torch import nn

from ..distributed.collectives import all_reduce_max

__all__ = ["DEFAULT_LOGITS_BUDGET_BYTES", "auto_mlp_shards", "auto_loss_shards", "resolve_loss_shards",
           "agree_on_shards", "weight_rows", "tile_bounds", "trainable_params", "param_grads", "recompute_tiles", "gathered",
           "one_grad_per_input", "positive_int"]

# 128 MiB of logits per tile (2**25 fp32 values): 1024 tokens at a 32K vocab, 256 at 128K, still a
# large matmul on a GPU, while the tile's logits, log-softmax and grad stay small beside the activations
DEFAULT_LOGITS_BUDGET_BYTES = 1 << 27
_MISSING = object()


def auto_mlp_shards(seqlen, hidden_size):
    """ceil(seqlen / hidden_size): each tile's `[sl_t, intermediate]` activations are then about the
    size of one `[h, intermediate]` weight, the ALST paper's rule of thumb."""
    seqlen, hidden_size = positive_int(seqlen, "seqlen"), positive_int(hidden_size, "hidden_size")
    return max(1, math.ceil(seqlen / hidden_size))


def auto_loss_shards(seqlen, vocab_size, budget_bytes=DEFAULT_LOGITS_BUDGET_BYTES, dtype=torch.float32):
    """Fewest tiles whose `[n_t, v]` logits fit in `budget_bytes` (default 128 MiB, i.e. 2**25 fp32 logits).

    `seqlen` is the number of tokens the loss sees (bs * sl for a batch). Cross-entropy upcasts
    logits to fp32, so pass the dtype the loss actually materialises.
    """
    seqlen, vocab_size = positive_int(seqlen, "seqlen"), positive_int(vocab_size, "vocab_size")
    budget_bytes = positive_int(budget_bytes, "budget_bytes")
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
    return all_reduce_max(positive_int(n, "n"), group)


def weight_rows(module):
    """Rows of ``module.weight`` (``[v, h]``: the vocabulary of an lm_head), also when ZeRO-3 has
    partitioned it (then its full shape is ``ds_shape``)."""
    weight = getattr(module, "weight", None)
    shape = getattr(weight, "ds_shape", None) or getattr(weight, "shape", ())
    if not torch.is_tensor(weight) or len(shape) != 2:
        raise ValueError(f"expected a module with a 2-D weight [v, h] (an lm_head) to read the vocabulary size "
                         f"from, got {type(module).__name__} without one; pass the tile count as an int "
                         "(see auto_loss_shards)")
    return shape[0]


def tile_bounds(length, shards):
    """[start, stop) per tile with `torch.tensor_split`'s sizes: the first `length % shards` tiles are one
    longer, and tiles past the end are empty, so every rank runs `shards` tiles whatever its length."""
    small, extra = divmod(length, shards)
    edges = [i * small + min(i, extra) for i in range(shards + 1)]
    return list(zip(edges[:-1], edges[1:]))


def trainable_params(compute_params, owners):
    """The parameters ZeRO must coordinate: `compute_params`, or with None every trainable parameter of
    the modules among `owners` (LoRA adapters included, frozen base weights excluded)."""
    if compute_params is None:
        compute_params = [p for o in owners if isinstance(o, nn.Module) for p in o.parameters()]
        compute_params += [o for o in owners if isinstance(o, nn.Parameter)]
    unique = {id(p): p for p in compute_params if p.requires_grad}
    return list(unique.values())


def param_grads(ctx):
    """None for every parameter input: the recompute has already accumulated into `param.grad`, and
    the parameter's own AccumulateGrad still runs once in the outer backward, firing ZeRO's hook."""
    return [None for _ in ctx.params]


def recompute_tiles(params, bounds, source, dim, needs_grad, recompute):
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
        with gathered(params):
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


def gathered(params):
    """Gather the ZeRO-3 partitioned `params` for a whole pass over the tiles (once, not per tile).
    In forward this also makes the parameters' autograd edges record their full shapes."""
    zero3 = [p for p in params if hasattr(p, "ds_id")]
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed  # ZeRO-3 parameters exist only once deepspeed has been imported

    return deepspeed.zero.GatheredParameters(zero3)


@functools.lru_cache(maxsize=None)
def input_names(forward):
    """forward's input names after ctx, without its `*args`."""
    params = list(inspect.signature(forward).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL)


def one_grad_per_input(forward, varargs=(), **grads):
    """backward's return value, built from `forward`'s own signature: one entry per named input
    (the gradient given by name, else None), then one per `*args` input."""
    if not set(grads) <= set(input_names(forward)):
        raise ValueError(f"gradients given for {sorted(grads)}, but {forward.__qualname__} takes "
                         f"{input_names(forward)}; name inputs of forward")
    return tuple(grads.get(name) for name in input_names(forward)) + tuple(varargs)


def positive_int(value, name):
    if isinstance(value, bool) or not hasattr(value, "__index__") or operator.index(value) < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}; pass e.g. {name}=4")
    return operator.index(value)

"""What the tiled Functions share: tile counts, tile bounds, declared parameters, ZeRO-3 gathering.
(The per-tile backward and its gradient sums are in :mod:`.tile_grads`.)

ZeRO-3: a declared parameter must be whole while the Function records its inputs (autograd checks a
returned gradient against the shape it saw) and while the tiles run. :func:`zero3_whole` gathers only
the declared parameters ZeRO has not made available itself and partitions only those afterwards;
the ones ZeRO's module hooks fetched (the enclosing module's, when the Function runs inside a hooked
``forward``) stay under ZeRO's control. :func:`zero3_fetch_with` hands a TiledMLP's weights to ZeRO's
fetching with its module, so that from the second call on there is nothing left for it to gather.
Each tile's submodule calls still go through ZeRO's hooks, which may gather collectively, so every
rank must run the same number of tiles: resolve ``shards`` with :func:`agree_on_shards`; tiles are
never skipped, empty ones included.

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
           "agree_on_shards", "weight_rows", "seq_tile", "tile_bounds", "trainable_params", "zero3_fetch_with",
           "zero3_whole", "zero3_whole_at_accumulation", "one_grad_per_input", "positive_int", "storage_holders"]

# 128 MiB of logits per tile (2**25 fp32 values): 1024 tokens at a 32K vocab, 256 at 128K, still a
# large matmul on a GPU, while the tile's logits, log-softmax and grad stay small beside the activations
DEFAULT_LOGITS_BUDGET_BYTES = 1 << 27


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


def seq_tile(t, start, stop, dim):
    """`t`'s `[start, stop)` slice on `dim` as a contiguous tensor with a fresh tensor's strides (fn may
    `.view` it). A slice of a `[1, sl, h]` tensor is contiguous already but keeps the whole sequence's
    batch stride, and matmul then runs `[1, sl_t, h] @ [h, h_out]` as a batched product instead of one
    matrix product: slower, and its weight gradient takes one more weight-sized buffer."""
    tile = t.narrow(dim, start, stop - start).contiguous()
    return tile.view(tile.shape)


def tile_bounds(length, shards):
    """[start, stop) per tile with `torch.tensor_split`'s sizes: the first `length % shards` tiles are one
    longer, and tiles past the end are empty, so every rank runs `shards` tiles whatever its length."""
    small, extra = divmod(length, shards)
    edges = [i * small + min(i, extra) for i in range(shards + 1)]
    return list(zip(edges[:-1], edges[1:]))


def trainable_params(compute_params, owners):
    """The parameters a tiled Function declares: `compute_params`, or with None every trainable parameter
    of the modules among `owners` (LoRA adapters included, frozen base weights excluded), plus
    parameters among `owners` themselves. Frozen ones are dropped, duplicates (tied weights) kept once."""
    if compute_params is None:
        compute_params = [p for o in owners if isinstance(o, nn.Module) for p in o.parameters()]
        compute_params += [o for o in owners if isinstance(o, nn.Parameter)]
    elif torch.is_tensor(compute_params) or not all(torch.is_tensor(p) for p in compute_params):
        raise ValueError(f"compute_params must be a list of the parameters fn uses, or None, got "
                         f"{_describe(compute_params)}; pass e.g. [module.weight]")
    unique = {id(p): p for p in compute_params if p.requires_grad}
    return list(unique.values())


@contextlib.contextmanager
def zero3_whole(params):
    """Keep the ZeRO-3 partitioned `params` whole for the block (a no-op for other tensors).

    Gathers only the parameters that are NOT_AVAILABLE, sorted by ZeRO id so every rank issues the same
    collective; on exit partitions only those, and only if they are still whole and no module is using
    them. Parameters ZeRO's hooks already made available (those of the module whose ``forward`` calls
    the Function, external parameters it reads) are never touched: partitioning one of those is what
    ``deepspeed.zero.GatheredParameters`` does on exit, and what fails with "Cannot free a ZeRO-3
    parameter while it is still active in submodules".
    """
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed  # imported already: ZeRO-3 parameters exist

    status = deepspeed.zero.ZeroParamStatus
    missing = sorted((p for p in partitioned if p.ds_status == status.NOT_AVAILABLE), key=lambda p: p.ds_id)
    if missing:
        missing[0].all_gather(param_list=missing)
    try:
        yield
    finally:
        ours = [p for p in missing if p.ds_status == status.AVAILABLE and not p.ds_active_sub_modules]
        if ours:
            ours[0].partition(param_list=ours)


def zero3_fetch_with(module, params):
    """From the next call on, have ZeRO-3 fetch the partitioned `params` together with `module`'s own
    parameters, before its forward and before its backward, and release them when the module is done
    (``deepspeed.zero.register_external_parameter``; ZeRO does the same by itself when a module's forward
    reads another module's partitioned parameter, which is how DeepSpeed's TiledMLP recipe gets it).
    For a TiledMLP whose declared weights belong to the MLP's submodules this means one coalesced,
    prefetchable gather per pass instead of a blocking one (``param.all_gather`` synchronizes the
    device) when the Function starts, one per tile and submodule call when ZeRO releases after each,
    and one more per weight when autograd accumulates its gradient after ZeRO has released it. The
    call inside the module's forward that registers them is served by :func:`zero3_whole`. A no-op
    without ZeRO-3 parameters or for a module ZeRO does not manage."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned or not isinstance(module, nn.Module) or not hasattr(module, "ds_id"):
        return
    import deepspeed  # imported already: ZeRO-3 parameters exist

    own = {id(p) for p in module.parameters(recurse=False)}
    for param in partitioned:
        if id(param) not in own:
            deepspeed.zero.register_external_parameter(module, param)


def zero3_whole_at_accumulation(params):
    """Make each ZeRO-3 partitioned parameter of `params` whole just before autograd accumulates the
    gradient a Function returned for it, and partition it again right after (only if it was
    partitioned then, and no module is using it).

    Call from backward with the parameters that get a gradient. Autograd copies an incoming gradient
    into ``.grad`` with the parameter's own layout, which a partitioned parameter (data ``[0]``) has
    lost; ZeRO's module hooks keep a module's parameters whole across their accumulation, but nothing
    does for a Function's parameter inputs. The accumulation may come long after this backward (a
    weight tied to the embedding accumulates after the embedding's backward), so the parameter is
    gathered then, not now, exactly as ZeRO's own hooks would have it.
    """
    for param in params:
        if hasattr(param, "ds_id"):
            _gather_around_accumulation(param)


def _gather_around_accumulation(param):
    import deepspeed  # imported already: ZeRO-3 parameters exist

    status, handles, gathered = deepspeed.zero.ZeroParamStatus, [], []

    def gather(grad_outputs):
        if param.ds_status == status.NOT_AVAILABLE:
            param.all_gather()
            gathered.append(param)

    def release(_):
        for handle in handles:
            handle.remove()
        if gathered and param.ds_status == status.AVAILABLE and not param.ds_active_sub_modules:
            param.partition()

    handles.append(torch.autograd.graph.get_gradient_edge(param).node.register_prehook(gather))
    handles.append(param.register_post_accumulate_grad_hook(release))


def _describe(value):
    return f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else repr(value)[:80]


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


def storage_holders(tensor):
    """How many tensors (views included), and torch's own references, hold `tensor`'s memory; None where
    this torch cannot count."""
    if not hasattr(torch._C, "_storage_Use_Count"):
        return None
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)

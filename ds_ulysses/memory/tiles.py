"""What the tiled Functions share: tile counts, tile bounds, ZeRO-3 gathering, and the per-tile backward.

How a parameter's gradient gets out of the tiles. A tiled Function runs `fn` once per tile, so a
parameter used by `fn` collects one gradient per tile. Writing each into ``param.grad`` as it comes
(plain ``backward`` per tile) would fire the parameter's post-accumulate-grad hook once per tile, and
DeepSpeed ZeRO (stages 1-3) reduces a gradient from that hook: it would be reduced per tile, before
the other uses of the parameter (an lm_head tied to the embedding) have added theirs. So the
parameters a Function declares (``compute_params``, or with None every trainable parameter of its
module) are inputs of the autograd Function; :class:`TileGrads` takes each tile's gradients with
``torch.autograd.grad`` (which accumulates nothing and fires no hook) and sums them, and the
Function's backward returns the sums as those inputs' gradients. Autograd's own AccumulateGrad then
adds them to every other use of the parameter and fires ZeRO's hook once per backward, after the
last use. No ``ds_grad_is_ready`` switching is needed, and none is done.

A trainable tensor `fn` uses without declaring it gets its gradient written into ``.grad`` directly,
which is exact in plain PyTorch; if the tensor has gradient hooks (ZeRO registers one on every
trainable parameter) that write would bypass them, so that is refused with an error naming it.

ZeRO-3: a declared parameter must be whole while the Function records its inputs (autograd checks a
returned gradient against the shape it saw) and while the tiles run. :func:`zero3_whole` gathers only
the declared parameters ZeRO has not made available itself and partitions only those afterwards;
the ones ZeRO's module hooks fetched (the enclosing module's, when the Function runs inside a hooked
``forward``) stay under ZeRO's control. Each tile's submodule calls still go through ZeRO's hooks,
which may gather collectively, so every rank must run the same number of tiles: resolve ``shards``
with :func:`agree_on_shards`; tiles are never skipped, empty ones included.

Dimensions: bs batch, sl sequence, sl_t one tile of the sequence, h hidden, v vocab,
n = bs*sl flattened tokens, n_t one tile of them.
"""

import contextlib
import functools
import inspect
import math
import operator
import sys

import torch
from torch import nn

from ..distributed.collectives import all_reduce_max

__all__ = ["DEFAULT_LOGITS_BUDGET_BYTES", "auto_mlp_shards", "auto_loss_shards", "resolve_loss_shards",
           "agree_on_shards", "weight_rows", "seq_tile", "tile_bounds", "trainable_params", "zero3_whole",
           "zero3_whole_at_accumulation", "TileGrads", "one_grad_per_input", "positive_int"]

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


class TileGrads:
    """Backpropagates a tiled Function's tiles one at a time and sums the parameter gradients over them.

    `declared` are the Function's parameter inputs: their sums become the Function's gradients for
    those inputs (see the module docstring). Trainable leaves `fn` reaches that are not declared are
    summed too and written into their ``.grad`` by :meth:`write_undeclared`; one with gradient hooks
    (DeepSpeed ZeRO registers one on every trainable parameter) is refused, since writing ``.grad``
    would bypass the hook. `owners` are the modules whose parameter names the error uses.

    The tiles run inside ``with grads.hooked():``, which puts the hook that takes each leaf's gradient
    (see :meth:`_taking`) on it once for all the tiles, not once per tile.
    """

    def __init__(self, who, declared, owners=()):
        self.who, self.declared, self.owners = who, list(declared), owners
        self.sums = [_Sum() for _ in self.declared]
        self.undeclared = {}  # id -> (leaf, _Sum)
        self._handles, self._weight, self._keep = None, None, True

    @contextlib.contextmanager
    def hooked(self):
        """The block the tiles' :meth:`backprop` calls run in: the declared parameters' hooks are
        registered on entry, an undeclared leaf's when a tile first reaches it, all removed on exit."""
        self._handles = [p.register_hook(self._taking(total)) for p, total in zip(self.declared, self.sums)]
        try:
            yield self
        finally:
            handles, self._handles = self._handles, None
            for handle in handles:
                handle.remove()

    def backprop(self, out, grad_out, tile=None, into=None, weight=1.0, keep=True):
        """Backpropagates one tile's `out` given `grad_out`, its gradients times `weight`: the parameter
        gradients are added to the sums (when `keep`), and the gradient of the tile input `tile` (when
        it requires grad) is written into `into` (the tile's slice of the input's gradient). `weight` (a
        float) is applied to the gradients, not folded into `grad_out`, so it is not rounded to a bf16
        `grad_out`'s precision first (213/425 would become 0.5)."""
        if self._handles is None:
            raise RuntimeError(f"{self.who}: TileGrads.backprop runs inside `with grads.hooked():`, or the "
                               "parameter gradients would be dropped")
        if not out.requires_grad:
            return
        wants_tile = tile is not None and tile.requires_grad
        known = {id(t) for t in self.declared} | ({id(tile)} if wants_tile else set())
        others = [leaf for leaf in _leaves(out) if id(leaf) not in known]
        for leaf in others:
            self._check_undeclared(leaf)
            if id(leaf) not in self.undeclared:
                self.undeclared[id(leaf)] = leaf, _Sum()
                self._handles.append(leaf.register_hook(self._taking(self.undeclared[id(leaf)][1])))
        self._weight, self._keep = weight, keep
        try:
            got = torch.autograd.grad(out, ([tile] if wants_tile else []) + self.declared + others, grad_out,
                                      allow_unused=True)
        finally:
            self._weight = None
        if wants_tile and got[0] is not None:
            _write(into, got[0], weight)

    def declared_grads(self, scale=None):
        """What backward returns for the declared parameters: their summed gradients (None where a
        parameter got none), times `scale`. Once only, after the tiles' block: the sums are handed over.
        ZeRO-3 parameters are set up to be whole when autograd accumulates these
        (:func:`zero3_whole_at_accumulation`)."""
        sums, self.sums = self.sums, [_Sum() for _ in self.declared]
        grads = [total.take(scale) for total in sums]
        zero3_whole_at_accumulation([p for p, grad in zip(self.declared, grads) if grad is not None])
        return grads

    def write_undeclared(self, scale=None):
        """Add the summed gradients of the undeclared leaves, times `scale`, into their ``.grad``."""
        for leaf, total in self.undeclared.values():
            grad = total.take(scale)
            if grad is not None:
                leaf.grad = grad if leaf.grad is None else leaf.grad + grad
        self.undeclared = {}

    def _taking(self, total):
        """A leaf's gradient hook for the tiles: the gradient is added, times the tile's weight, to the
        leaf's sum `total` the moment autograd has it, and autograd gets a zero in its place (one
        element seen through stride 0). Gradients that ``autograd.grad`` returned would all live until
        the tile's whole backward is done, where autograd's own accumulation into ``.grad`` frees each
        at once. A tile that adds nothing (`keep` false) leaves the sums alone; a backward that is not
        a tile's (none runs inside the block, but fn could start one) gets the gradient untouched."""

        def hook(grad):
            if self._weight is None:
                return None
            if self._keep:
                total.add(grad, weight=self._weight)
            if grad.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True)) cannot be expanded
                return torch.zeros_like(grad)
            return grad.new_zeros(()).expand_as(grad)

        return hook

    def _check_undeclared(self, leaf):
        if hasattr(leaf, "ds_id") or getattr(leaf, "_post_accumulate_grad_hooks", None):
            names = {id(p): n for o in self.owners if isinstance(o, nn.Module) for n, p in o.named_parameters()}
            name = names.get(id(leaf), "a tensor")
            shape = tuple(getattr(leaf, "ds_shape", None) or leaf.shape)
            raise ValueError(
                f"{self.who}: fn uses {name} {list(shape)}, which requires grad and has gradient hooks "
                "(DeepSpeed ZeRO registers one on every trainable parameter) but is not in compute_params; its "
                "gradient must reach the hook once, after all its uses, which only a declared parameter's does: "
                "add it to compute_params, or pass compute_params=None to declare every trainable parameter "
                "of the module")


def _write(into, grad, weight=1.0):
    into.copy_(grad)
    if weight != 1:
        into.mul_(weight)


class _Sum:
    """A running weighted sum of gradients that never writes into a tensor someone else can see (a
    gradient may alias the incoming gradient, another output or a tensor a user's hook kept).

    The first gradient is kept as autograd handed it (or scaled into a new tensor). When a second one
    comes (a later tile's: autograd has long let go of the first by then), the sum becomes a tensor
    of its own, to add into in place: autograd's first gradient itself when nothing else holds it or
    its memory (a matmul's weight gradient, the usual case: no copy, as autograd's own accumulation
    into ``.grad`` steals it), else a copy of it. So at most two parameter-sized buffers are alive at
    a time (the sum and the newest gradient), as with autograd's accumulation into ``.grad``."""

    def __init__(self):
        self.total, self.owned = None, False

    def add(self, grad, weight=1.0):
        if grad is None:
            return
        if self.total is None:
            self.total, self.owned = (grad * weight, True) if weight != 1 else (grad, False)
            return
        if not self.owned:
            self.total, self.owned = (self.total if self._sole_holder() else self.total.clone()), True
        self.total.add_(grad, alpha=weight)

    def take(self, scale=None):
        total, owned = self.total, self.owned
        self.total, self.owned = None, False
        if total is None or scale is None:
            return total
        return total.mul_(scale) if owned else total * scale

    def _sole_holder(self):
        """Whether this sum is all that holds its tensor: no other Python reference (a user's hook may
        keep the gradient), no other C++ one (autograd), no view of it or other tensor on its memory,
        and, if it is a view (a matmul's weight gradient often is, of a base of its own shape), nothing
        else holding its base. Writing into it then changes nothing anyone can read. Decided by
        comparing the counts with those of a fresh tensor, and of a view of one, that a sum alone
        holds, taken through this same code, so it follows the way this torch and Python count; False
        where torch cannot count, and for a sparse gradient or a tensor subclass (whose memory lies in
        tensors these counts do not see)."""
        if type(self.total) is not torch.Tensor or self.total.layout != torch.strided:
            return False
        return self._holders() in _sole_holder_counts()

    def _holders(self):
        total = self.total
        counts = (sys.getrefcount(total), total._use_count(),
                  torch._C._storage_Use_Count(total.untyped_storage()._cdata))
        base = total._base
        return counts if base is None else counts + (sys.getrefcount(base), base._use_count())


@functools.lru_cache(maxsize=None)
def _sole_holder_counts():
    """:meth:`_Sum._holders` of a sum that alone holds a fresh tensor, and a view of one whose base
    only the view holds (nothing where torch cannot count)."""
    if not (hasattr(torch.Tensor, "_use_count") and hasattr(torch._C, "_storage_Use_Count")):
        return ()
    counts = []
    for fresh in (lambda: torch.empty(1), lambda: torch.empty(1).view(1)):
        probe = _Sum()
        probe.total = fresh()
        counts.append(probe._holders())
    return tuple(counts)


def _leaves(out):
    """The tensors requiring grad that `out`'s autograd graph accumulates into (its AccumulateGrad nodes);
    `out` itself when it is one (fn returned a leaf)."""
    root = out.grad_fn
    if root is None:
        return [out]
    seen, stack, leaves = {root}, [root], []
    while stack:
        node = stack.pop()
        leaf = getattr(node, "variable", None)
        if leaf is not None:
            leaves.append(leaf)
            continue
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return leaves


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

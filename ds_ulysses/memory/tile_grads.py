"""The per-tile backward of the tiled Functions: :class:`TileGrads`.

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
"""

import contextlib
import functools
import sys

import torch
import torch.utils.checkpoint
from torch import nn

from .tiles import storage_holders, zero3_whole_at_accumulation

__all__ = ["TileGrads", "add_product_to_grad"]


class TileGrads:
    """Backpropagates a tiled Function's tiles one at a time and sums the parameter gradients over them.

    `declared` are the Function's parameter inputs: their sums become the Function's gradients for
    those inputs (see the module docstring). Trainable leaves `fn` reaches that are not declared are
    summed too and written into their ``.grad`` by :meth:`write_undeclared`; one with gradient hooks
    (DeepSpeed ZeRO registers one on every trainable parameter) is refused, since writing ``.grad``
    would bypass the hook. `owners` are the modules whose parameter names the error uses.

    The tiles run inside ``with grads.hooked():``, which puts the hook that takes each leaf's gradient
    (see :meth:`_taking`) on it once for all the tiles, not once per tile. A user's own gradient hooks
    (``register_hook``) on a declared parameter are set aside for that block, so they run once, on the
    gradient the Function returns summed with the parameter's other uses, as without tiles; left in
    place they would run on every tile's gradient and then on the sum again (a hook that halves the
    gradient would quarter it). An undeclared leaf with such hooks is refused like one with ZeRO's.
    """

    def __init__(self, who, declared, owners=()):
        self.who, self.declared, self.owners = who, list(declared), owners
        self.sums = [_Sum() for _ in self.declared]
        self._declared_ids = {id(p) for p in self.declared}
        self.undeclared = {}  # id -> (leaf, _Sum)
        self._handles, self._weight, self._keep = None, None, True

    @contextlib.contextmanager
    def hooked(self):
        """The block the tiles' :meth:`backprop` calls run in: the declared parameters' hooks are
        registered on entry (their users' hooks set aside), an undeclared leaf's when a tile first
        reaches it; on exit ours are removed and the users' put back."""
        set_aside = [_set_aside_hooks(p) for p in self.declared]
        outer_sinks = [vars(p).get(_SINK) for p in self.declared]
        try:
            self._handles = [p.register_hook(self._taking(total)) for p, total in zip(self.declared, self.sums)]
            for p, total in zip(self.declared, self.sums):
                vars(p)[_SINK] = (self, total)
            yield self
        finally:
            handles, self._handles = self._handles or [], None
            for handle in handles:
                handle.remove()
            for p, hooks, outer in zip(self.declared, set_aside, outer_sinks):
                _put_back_hooks(p, hooks)
                if outer is None:
                    vars(p).pop(_SINK, None)
                else:
                    vars(p)[_SINK] = outer

    def backprop(self, out, grad_out, tile=None, into=None, weight=1.0, keep=True, accumulate=False):
        """Backpropagates one tile's `out` given `grad_out`, its gradients times `weight`: the parameter
        gradients are added to the sums (when `keep`), and the gradient of the tile input `tile` (when
        it requires grad) is written into `into` (the tile's slice of the input's gradient), every
        element of it, zeros where the tile's input got none: so the input's gradient can be allocated
        uninitialised, and no pass zero-fills it first. `weight` (a float) is applied to the gradients,
        not folded into `grad_out`, so it is not rounded to a bf16 `grad_out`'s precision first
        (213/425 would become 0.5). `out` and `grad_out` may be lists (a tile's several outputs, in one
        backward). `accumulate` adds the tile input's gradient into `into` instead (a tiled Function whose tiles
        all read the whole input, as head groups do)."""
        if self._handles is None:
            raise RuntimeError(f"{self.who}: TileGrads.backprop runs inside `with grads.hooked():`, or the "
                               "parameter gradients would be dropped")
        wants_tile = tile is not None and tile.requires_grad
        pairs = [(o, g) for o, g in (zip(out, grad_out) if isinstance(out, (list, tuple)) else [(out, grad_out)])
                 if o.requires_grad]
        if not pairs:
            if wants_tile and not accumulate:
                into.zero_()
            return
        outs, grads_out = [o for o, _ in pairs], [g for _, g in pairs]
        others = list({id(leaf): leaf for o in outs for leaf in _leaves(o, self.who)
                       if id(leaf) not in self._declared_ids and leaf is not tile}.values())
        for leaf in others:
            if id(leaf) not in self.undeclared:
                self._check_undeclared(leaf)
                self.undeclared[id(leaf)] = leaf, _Sum()
                self._handles.append(leaf.register_hook(self._taking(self.undeclared[id(leaf)][1])))
        self._weight, self._keep = weight, keep
        try:
            got = torch.autograd.grad(outs, ([tile] if wants_tile else []) + self.declared + others, grads_out,
                                      allow_unused=True)
        finally:
            self._weight = None
        if not wants_tile or (got[0] is None and accumulate):
            return
        if got[0] is None:
            into.zero_()
        elif accumulate:
            into.add_(got[0], alpha=weight)
        else:
            into.copy_(got[0])
            if weight != 1:
                into.mul_(weight)

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
        element seen through stride 0, for a plain tensor the process's zero of that dtype and device,
        so a backward allocates nothing for it: a leaf's gradient has the leaf's shape, dtype and
        device, and ``autograd.grad`` only returns it to be dropped). Gradients that ``autograd.grad``
        returned would all live until the tile's whole backward is done, where autograd's own
        accumulation into ``.grad`` frees each at once. A tile that adds nothing (`keep` false) leaves
        the sums alone; a backward that is not a tile's (none runs inside the block, but fn could start
        one) gets the gradient untouched."""
        zero = None

        def hook(grad):
            nonlocal zero
            if self._weight is None or grad is None:  # None: a Function added its part itself (add_product_to_grad)
                return None
            if self._keep:
                total.add(grad, weight=self._weight)
            if grad.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True)) cannot be expanded
                return torch.zeros_like(grad)
            if zero is None:
                one = _zero(grad.dtype, grad.device) if type(grad) is torch.Tensor else grad.new_zeros(())
                zero = one.expand_as(grad)
            return zero

        return hook

    def _check_undeclared(self, leaf):
        if hasattr(leaf, "ds_id") or getattr(leaf, "_post_accumulate_grad_hooks", None) or leaf._backward_hooks:
            names = {id(p): n for o in self.owners if isinstance(o, nn.Module) for n, p in o.named_parameters()}
            name = names.get(id(leaf), "a tensor")
            shape = tuple(getattr(leaf, "ds_shape", None) or leaf.shape)
            raise ValueError(
                f"{self.who}: fn uses {name} {list(shape)}, which requires grad and has gradient hooks "
                "(DeepSpeed ZeRO registers one on every trainable parameter) but is not in compute_params; its "
                "gradient must reach the hook once, after all its uses, which only a declared parameter's does: "
                "add it to compute_params, or pass compute_params=None to declare every trainable parameter "
                "of the module")


_REENTRANT_CHECKPOINT = torch.utils.checkpoint.CheckpointFunction._backward_cls
_SINK = "_ds_ulysses_tile_sum"  # on a declared parameter inside hooked(): (its TileGrads, its running sum)


def add_product_to_grad(param, a, b) -> bool:
    """For a Function's backward whose gradient for ``param`` is a matmul ``a @ b`` (a linear head's weight:
    ``[V, n] @ [n, h]``): inside a tile's :meth:`TileGrads.backprop`, add it, times the tile's weight, into
    the tiles' running sum for ``param`` in place (``addmm_``) and return True, so the Function returns None
    for ``param``; False anywhere else, where it returns the product. The sum then never stands beside a
    tile's own parameter-sized gradient: for an lm_head, one ``[V, h]`` tensor at the loss's peak, not two."""
    held = vars(param).get(_SINK)
    if held is None or held[0]._weight is None:
        return False
    grads, total = held
    if grads._keep:
        total.add_product(a, b, grads._weight)
    return True


@functools.lru_cache(maxsize=None)
def _zero(dtype, device):
    """A 0-dim zero, one per dtype and device for the process; the hooks hand autograd stride-0 views of it."""
    return torch.zeros((), dtype=dtype, device=device)


def _set_aside_hooks(param):
    """Empties `param`'s gradient hook table (``register_hook``'s, which autograd reads when it runs
    them) and returns what it held. The table itself stays, so the users' handles still remove from it."""
    hooks = param._backward_hooks
    held = list(hooks.items()) if hooks else []
    if held:
        hooks.clear()
    return held


def _put_back_hooks(param, held):
    """Puts the hooks :func:`_set_aside_hooks` took back first, before any registered in between."""
    if held:
        hooks = param._backward_hooks
        added = list(hooks.items())
        hooks.clear()
        hooks.update(held)
        hooks.update(added)


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

    def add_product(self, a, b, weight=1.0):
        """Add ``weight * (a @ b)`` without a product-sized temporary once the sum owns its tensor."""
        if self.total is None:
            self.total, self.owned = torch.mm(a, b), True
            if weight != 1:
                self.total.mul_(weight)
            return
        if not self.owned:
            self.total, self.owned = (self.total if self._sole_holder() else self.total.clone()), True
        self.total.addmm_(a, b, alpha=weight)

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
        counts = (sys.getrefcount(total), total._use_count(), storage_holders(total))
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


def _leaves(out, who):
    """The tensors requiring grad that `out`'s autograd graph accumulates into (its AccumulateGrad nodes);
    `out` itself when it is one (fn returned a leaf). A reentrant checkpoint in the graph is refused:
    the parameters it uses are not in the graph (its backward recomputes its segment into a graph of
    its own and runs a plain backward on that, which torch refuses under ``autograd.grad``)."""
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
        if isinstance(node, _REENTRANT_CHECKPOINT):
            raise ValueError(
                f"{who}: fn runs torch.utils.checkpoint with use_reentrant=True, whose backward is a plain "
                "backward of its own that the tiles cannot take each parameter's gradient from (torch refuses it "
                "inside torch.autograd.grad); pass use_reentrant=False to the checkpoint inside fn (exact), or "
                "checkpoint around the tiled call instead (as gradient checkpointing of the decoder layer does)")
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return leaves

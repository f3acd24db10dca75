"""Kept attention kernels: a tiled block's core attention runs once per group in forward and is not run again
when backward recomputes the group.

Backward must rebuild a group's autograd graph, and everything in it is cheap to recompute (projections, RoPE,
the all-to-alls) except the core attention, O(S^2). So the forward keeps what the kernel returned (the attention
output and its log-sum-exp: over all groups one hidden-sized tensor per local token, the same size as the
block's output), and the recompute gets those outputs back from the same kernel call, below autograd: autograd
records the kernel's own node with the recomputed q/k/v as its inputs and the kept outputs, and its backward is
the kernel's. A kernel call whose arguments differ from the kept one's runs again (correct, only slower). The
kept outputs cannot have changed since: autograd saves a kernel's outputs too and refuses an in-place write.

Only the fused kernels are kept (the aten ops ``scaled_dot_product_attention`` dispatches to, and flash-attn's
operators where the installed version registers them): the math fallback's ops are recomputed as before.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["KeptKernels", "KERNELS"]

# the fused attention kernels whose outputs a group keeps (schema names; absent ones never match)
KERNELS = frozenset({
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "flash_attn::_flash_attn_forward",
    "flash_attn::_flash_attn_varlen_forward",
    "flash_attn_3::fwd",
})


_TENSOR = object()  # a tensor output's place among a call's recorded leaves


def _is_kernel(func) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is not None and schema.name in KERNELS


def _key(args, kwargs):
    """What a kernel call must repeat to get the kept outputs back: each tensor argument's shape, dtype and
    device, every other argument's value."""
    return [(tuple(a.shape), a.dtype, a.device) if torch.is_tensor(a) else a
            for a in pytree.tree_leaves((args, kwargs))]


class KeptKernels:
    """One group's kernel calls, in call order: recorded under :meth:`recording` (the forward), their outputs
    handed back once each under :meth:`replaying` (backward's recompute of the same group).

    The outputs are not held here: :meth:`hand_over` gives them to the Function, which saves them for backward
    (so that a checkpointed layer drops them with everything else it saves, and its recompute makes them again)
    and gives them back to :meth:`replaying`.
    """

    def __init__(self):
        self.calls: list[tuple] = []  # (kernel, call key, the outputs' tree spec, their leaves, tensors marked)
        self._outputs: list[torch.Tensor] = []  # the calls' tensor outputs, detached, until handed over

    @property
    def count(self) -> int:
        """How many tensors the recorded calls returned."""
        return sum(leaf is _TENSOR for *_, leaves in self.calls for leaf in leaves)

    def record(self, func, args, kwargs, out) -> None:
        leaves, spec = pytree.tree_flatten(out)
        self.calls.append((func, _key(args, kwargs), spec, [_TENSOR if torch.is_tensor(v) else v for v in leaves]))
        self._outputs += [v.detach() for v in leaves if torch.is_tensor(v)]

    def hand_over(self) -> list[torch.Tensor]:
        outputs, self._outputs = self._outputs, []
        return outputs

    def recording(self) -> TorchDispatchMode:
        return _Recording(self)

    def replaying(self, outputs) -> TorchDispatchMode:
        """Hands back ``outputs`` (what :meth:`hand_over` gave, from the Function's saved tensors)."""
        return _Replaying(self.calls, list(outputs))


class _Recording(TorchDispatchMode):
    supports_higher_order_operators = True  # flex_attention and other such operators pass through, run as they are

    def __init__(self, store: KeptKernels):
        super().__init__()
        self.store = store

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _is_kernel(func):
            self.store.record(func, args, kwargs, out)
        return out


class _Replaying(TorchDispatchMode):
    supports_higher_order_operators = True

    def __init__(self, calls: list, outputs: list):
        super().__init__()
        self.calls, self.outputs = iter(calls), outputs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _is_kernel(func):
            return func(*args, **kwargs)
        kernel, key, spec, leaves = next(self.calls, (None, None, None, []))
        count = sum(leaf is _TENSOR for leaf in leaves)
        kept, self.outputs[:count] = self.outputs[:count], []  # handed back once
        if kernel is not func or key != _key(args, kwargs):
            return func(*args, **kwargs)
        kept = iter(kept)
        return pytree.tree_unflatten([next(kept).detach() if leaf is _TENSOR else leaf for leaf in leaves], spec)

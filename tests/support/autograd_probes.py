"""What tests of the tiled Functions look at beside values: the tensors autograd holds for backward after a
forward, and the fused attention kernels that ran (torch's dispatch, below autograd)."""

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_ulysses.memory.kept_kernels import KERNELS

__all__ = ["held_after_forward", "KernelCalls"]


class _Held:
    def __init__(self, tensor):
        self.tensor = tensor.detach()  # a saved output's history would hold its holder: a cycle gc cannot see


def held_after_forward(make_output):
    """``(make_output(), the tensors autograd still holds for backward once it has returned)``, detached: a graph
    built and dropped inside it holds nothing."""
    holders = []

    def pack(t):
        holder = _Held(t)
        holders.append(weakref.ref(holder))
        return holder

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda holder: holder.tensor):
        y = make_output()
    gc.collect()
    return y, [ref().tensor for ref in holders if ref() is not None]


class KernelCalls(TorchDispatchMode):
    """Counts the fused attention kernels dispatched inside it and keeps their outputs (detached aliases)."""

    def __init__(self):
        super().__init__()
        self.calls, self.outputs = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name in KERNELS:
            self.calls += 1
            self.outputs += [t.detach() for t in out if torch.is_tensor(t)]  # not the graph's own tensor
        return out

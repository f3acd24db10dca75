"""Inputs a tiled Function rebuilds in backward instead of keeping: a norm's output, kept as the norm's input.

A decoder layer feeds its attention and its MLP through a norm: ``attention(norm(x))``. A tiled block keeps
its input for backward, and the norm keeps its own normalised copy (an fp32 upcast under bf16) for its
weight's gradient, so each norm costs the layer two or more full-sequence tensors at its peak while the norm's
input, the residual stream, is alive anyway. A norm run through :mod:`ds_ulysses.hf.norm_tiling` keeps only
its input and marks its output as rebuildable from it; a tiled block given such an output keeps the norm's
input instead and recomputes the norm (a token-wise, elementwise-cheap op) in its own backward, tile by tile.
The output is then freed as soon as the layer's forward drops it: two hidden-sized tensors per token less per
norm, same values (the same ops on the same input), nothing new kept.

Dimensions: bs batch, sl sequence, h hidden, n = bs*sl flattened tokens, n_t one tile of them.
"""

from __future__ import annotations

import contextlib

import torch

from .tiles import zero3_whole

__all__ = ["Rebuild", "mark_rebuildable", "kept_input", "rebuilt", "rebuilding"]

_ATTR = "_ds_ulysses_rebuild"


class Rebuild:
    """How to compute a marked tensor again from the tensor it was made of: ``fn(module, source_tile)`` (a
    token-wise function: any ``[..., h]`` tile of the source to the same tile of the output), which reads
    ``params`` (gathered around it under ZeRO-3). ``view`` and ``version`` identify the marked tensor (its
    shape, strides, storage offset and in-place version). Holds no tensor, so a Function may keep it on its
    ctx."""

    __slots__ = ("fn", "module", "params", "view", "version")

    def __init__(self, fn, module, params, marked: torch.Tensor):
        self.fn, self.module, self.params = fn, module, list(params)
        self.view = (marked.shape, marked.stride(), marked.storage_offset(), marked.dtype)
        self.version = marked._version

    def rows(self, source: torch.Tensor) -> torch.Tensor:
        """The output for ``source`` (a tile of the marked tensor's source), without autograd."""
        with torch.no_grad(), zero3_whole(self.params):
            return self.fn(self.module, source)


def mark_rebuildable(out: torch.Tensor, fn, module, source: torch.Tensor, params) -> torch.Tensor:
    """Mark ``out`` (``fn(module, source)``, same shape) as rebuildable from ``source``; returns ``out``.

    The mark sits on ``out``'s storage, not on the tensor object: a module hook may hand the block another
    tensor object on the same memory (ZeRO-3's forward hooks pass every module output through an autograd
    Function that returns ``output.detach()``), which is still the same values as long as it is the same
    view at the same version."""
    setattr(out.untyped_storage(), _ATTR, (Rebuild(fn, module, params, out), source))
    return out


def kept_input(x: torch.Tensor) -> tuple[torch.Tensor, Rebuild | None]:
    """What a tiled Function keeps for backward in place of its input ``x``: the source ``x`` was marked
    rebuildable from and how to rebuild it, or ``x`` itself and None (an unmarked input; another view of a
    marked one's memory; one changed in place since it was made; a source of another shape or dtype, whose
    gradient buffer would not be ``x``'s)."""
    marked = getattr(x.untyped_storage(), _ATTR, None)
    if marked is None:
        return x, None
    how, source = marked
    same_view = (x.shape, x.stride(), x.storage_offset(), x.dtype) == how.view and x._version == how.version
    if not same_view or source.shape != x.shape or source.dtype != x.dtype:
        return x, None
    return source, how


def rebuilt(kept: torch.Tensor, how: Rebuild | None) -> torch.Tensor:
    """The input a tiled Function kept as ``kept_input`` gave it (``kept`` from its saved tensors), detached."""
    return kept.detach() if how is None else how.rows(kept.detach())


def rebuilding(how: Rebuild | None):
    """Around a backward that rebuilds tile by tile: the rebuild's parameters gathered once, not per tile."""
    return contextlib.nullcontext() if how is None else zero3_whole(how.params)

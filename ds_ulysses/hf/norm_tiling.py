"""Tiled norms: the decoder's norms keep only their input for backward, and the tiled blocks they feed keep
it too, instead of the norm's output (:mod:`ds_ulysses.memory.rebuild`), without editing model code.

Each decoder layer normalises the residual stream before its attention and before its MLP (and a sandwich
layer, Gemma's, after them too). Autograd keeps, per norm, the normalised tensor for the weight's gradient
(an fp32 copy under bf16) and the output for the block it feeds: about two hidden-sized tensors per token,
four to eight bytes each, per norm, while the norm's input is alive anyway. Run through
:class:`~ds_ulysses.memory.tiled_mlp.TiledMLP` a norm keeps only its input and is recomputed over sequence
tiles in backward; its output is marked rebuildable, so a tiled attention or MLP block it feeds keeps the
norm's input and recomputes the norm in its own backward. Exact: the same ops on the same input. A norm is
a module of the decoder itself (its final norm) or of one of its layers whose class name ends in ``RMSNorm``
or ``LayerNorm`` (Transformers' names, and torch's own), called on one hidden-states tensor; per-head norms
inside attention blocks stay the attention's (a tiled block recomputes them already).

Dimensions: bs batch, sl sequence, h hidden.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..memory.mlp_tiling import token_wise
from ..memory.rebuild import mark_rebuildable
from ..memory.tiled_mlp import TiledMLP
from ..memory.tiles import auto_mlp_shards
from ..patching import PATCHES
from .servable import decoder_of

__all__ = ["tile_norms", "untile_norms", "norm_modules"]

_TAG = "tiled_norms"
_NORM_CLASSES = ("RMSNorm", "LayerNorm")


def norm_modules(model) -> list[tuple[str, nn.Module]]:
    """The norms :func:`tile_norms` tiles, as ``(name, module)``: the decoder's own and its layers'."""
    decoder = decoder_of(model)
    layers = {id(layer) for child in decoder.children() if isinstance(child, nn.ModuleList) for layer in child}
    owners = [("", decoder)] + [(name, m) for name, m in decoder.named_modules() if id(m) in layers]
    return [(f"{owner}.{name}".lstrip("."), child) for owner, module in owners
            for name, child in module.named_children() if type(child).__name__.endswith(_NORM_CLASSES)]


def tile_norms(model) -> int:
    """Recompute every decoder norm of ``model`` from its input in backward (see the module docstring).
    Idempotent; returns how many norms run tiled. Undone by :func:`untile_norms` or ``ds_ulysses.uninstall``."""
    norms = norm_modules(model)
    for _, module in norms:
        if not PATCHES.has(_TAG, owner=module):
            PATCHES.set_attr(module, "forward", functools.partial(_tiled_norm_forward, module, module.forward), _TAG,
                             module)
    return len(norms)


def untile_norms(model) -> int:
    """Undo :func:`tile_norms`. Idempotent; returns how many norms were restored."""
    return sum(1 for module in model.modules() if PATCHES.undo(_TAG, owner=module))


def _tiled_norm_forward(module, forward, *args, **kwargs):
    """The norm through TiledMLP when autograd records it and it is called on one hidden-states tensor (a
    gated norm's second input, say, takes the norm's own path), its output marked rebuildable."""
    x = args[0] if len(args) == 1 and not kwargs else None
    if not torch.is_grad_enabled() or not torch.is_tensor(x) or x.dim() < 2:
        return forward(*args, **kwargs)
    per_tile = token_wise(forward, x.dim())
    # a norm runs no collective, so ranks need not agree on its tile count (TiledMLP's "auto" would)
    shards = auto_mlp_shards(max(1, x.shape[-2]), x.shape[-1])
    out = TiledMLP.apply(per_tile, module, x, shards, None)  # [bs sl h]
    return mark_rebuildable(out, per_tile, module, x, module.parameters())

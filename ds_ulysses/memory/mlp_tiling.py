"""Tiling a model's MLPs without editing model code: every module named ``mlp`` runs through
:class:`~ds_ulysses.memory.tiled_mlp.TiledMLP`, so its ``[bs sl intermediate]`` activations exist one
tile at a time (ALST's TiledMLP, the step from 1.1M to 3.7M tokens on 8 H100s in the paper).
"""

import functools

from ..patching import PATCHES
from .tiled_mlp import TiledMLP
from .tiles import positive_int

__all__ = ["tile_mlps", "untile_mlps", "mlp_modules", "token_wise"]

_TAG = "tiled_mlp"


def tile_mlps(model, shards="auto", side=None):
    """Run every module named `mlp` in `model` through `TiledMLP`, without editing model code.

    Each MLP's own forward is called per tile (gate/up/down Llama MLPs and any token-wise MLP alike)
    with the rank of its input (backward's flattened `[n_t, h]` tiles as `[1, n_t, h]`), through an
    instance attribute that shadows the class's forward, so other models of the same class are
    untouched. `shards` is an int or "auto" (`ceil(sl / h)`, agreed over ranks). The MLP must
    return one tensor (MoE blocks that also return router logits are not supported; router logits
    the model records from inside the block are, through `side`: see `TiledMLP`). Idempotent;
    returns how many MLPs run tiled after the call. Undone by `untile_mlps` or `ds_ulysses.uninstall`.
    """
    if shards != "auto":
        positive_int(shards, "shards")
    count = 0
    for _, module in mlp_modules(model):
        if not PATCHES.has(_TAG, owner=module):
            untiled = module.forward
            PATCHES.set_attr(module, "forward", functools.partial(_tiled_mlp_forward, module, untiled), _TAG, module)
        PATCHES.set_attr(module, "_ds_ulysses_shards", shards, _TAG, module)
        PATCHES.set_attr(module, "_ds_ulysses_side", side, _TAG, module)
        count += 1
    return count


def mlp_modules(model) -> list:
    """The modules :func:`tile_mlps` tiles, every one in `model` named ``mlp``, as ``(name, module)``."""
    return [(name, module) for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp"]


def untile_mlps(model):
    """Undo `tile_mlps`: restore each MLP's forward. Idempotent; returns how many were restored."""
    count = 0
    for module in model.modules():
        if PATCHES.undo(_TAG, owner=module):
            count += 1
    return count


def _tiled_mlp_forward(module, forward, x, *args, **kwargs):
    per_tile = token_wise(forward, x.dim(), *args, **kwargs)
    return TiledMLP.apply(per_tile, module, x, module._ds_ulysses_shards, None, module._ds_ulysses_side)


def token_wise(forward, rank: int, *args, **kwargs):
    """A module's own ``forward`` (with the call's other arguments) as TiledMLP's ``fn(module, tile)``, for an
    input of ``rank`` dims: backward's flattened ``[n_t, h]`` tiles reach it with the rank it was written for."""

    def per_tile(_module, tile):
        if tile.dim() == rank:
            return forward(tile, *args, **kwargs)
        lifted = tile.view((1,) * (rank - 2) + tuple(tile.shape))  # [n_t h] -> [1 n_t h]
        return forward(lifted, *args, **kwargs).reshape(tile.shape[0], -1)

    return per_tile

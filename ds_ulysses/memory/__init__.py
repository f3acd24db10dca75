"""The ALST memory tools: tiled compute along the sequence (:func:`sequence_tiled_compute`,
:class:`TiledMLP`, :class:`TiledFusedLogitsLoss`, :func:`tile_mlps`), activation-checkpoint offload, and
:func:`trim_host_heap` (the host heap's freed pages back to the OS between steps).
Imports torch, and DeepSpeed's ZeRO helpers only when parameters are ZeRO-3 partitioned."""

from .host import trim_host_heap
from .mlp_tiling import tile_mlps, untile_mlps
from .offload import OffloadedCheckpoint
from .sequence_tiled import SequenceTiledCompute, sequence_tiled_compute
from .tiled_heads import TiledHeads
from .tiled_loss import TiledFusedLogitsLoss
from .tiled_mlp import AutogradComputeMLP, TiledMLP
from .tiles import agree_on_shards, auto_loss_shards, auto_mlp_shards, resolve_loss_shards

__all__ = ["tile_mlps", "untile_mlps", "OffloadedCheckpoint", "SequenceTiledCompute", "sequence_tiled_compute",
           "TiledFusedLogitsLoss", "TiledHeads", "TiledMLP", "AutogradComputeMLP", "agree_on_shards", "auto_loss_shards",
           "auto_mlp_shards", "resolve_loss_shards", "trim_host_heap"]

"""ds_ulysses: Ulysses sequence parallelism and the ALST memory tools for HuggingFace causal LMs.

Entry points:

- :func:`initialize` / :func:`install`: DeepSpeed with SP set up from the config's ``"ulysses"`` section;
  :func:`uninstall` undoes every change the package made to the process.
- :class:`UlyssesSPAttentionHF` (``register_with_transformers``), :class:`UlyssesSPDataLoaderAdapter`:
  the drop-in API of DeepSpeed's ALST module.
- :func:`sequence_tiled_compute`, :class:`TiledMLP`, :class:`TiledFusedLogitsLoss`: tiled compute
  (:class:`AutogradComputeMLP`: DeepSpeed's recompute-in-backward MLP, one tile); :func:`tile_attention`:
  each attention block a group of heads at a time; :func:`tile_norms`: the decoder's norms recomputed from
  their input.
"""

from .config import UlyssesConfig, UlyssesConfigError, load_schema, parse_ds_config
from .distributed import Mesh, SPCommError, build_mesh
from .engine import initialize, install, uninstall
from .hf import (UlyssesSPAttentionHF, disable_activation_checkpoint_offload, enable_activation_checkpoint_offload,
                 enable_sp_loss, register_with_transformers, tile_attention, tile_norms, tiled_causal_lm_loss,
                 unregister_from_transformers, untile_attention, untile_norms)
from .memory import (AutogradComputeMLP, SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute,
                     tile_mlps, untile_mlps)
from .sp import UlyssesSPDataLoaderAdapter, sp_loss_from_logits

__all__ = [
    "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute", "SequenceTiledCompute",
    "TiledMLP", "TiledFusedLogitsLoss", "AutogradComputeMLP", "initialize", "install", "uninstall",
    "UlyssesConfig", "UlyssesConfigError", "SPCommError", "parse_ds_config", "load_schema", "Mesh", "build_mesh",
    "register_with_transformers", "unregister_from_transformers", "enable_sp_loss", "sp_loss_from_logits",
    "tiled_causal_lm_loss", "tile_mlps", "untile_mlps", "tile_attention", "untile_attention",
    "tile_norms", "untile_norms", "enable_activation_checkpoint_offload",
    "disable_activation_checkpoint_offload",
]

"""ds_ulysses: Ulysses sequence parallelism and the ALST memory tools for HuggingFace causal LMs.

Entry points:

- :func:`initialize` / :func:`install`: DeepSpeed with SP set up from the config's ``"ulysses"`` section.
- :class:`UlyssesSPAttentionHF` (``register_with_transformers``), :class:`UlyssesSPDataLoaderAdapter`:
  the drop-in API of DeepSpeed's ALST module.
- :func:`sequence_tiled_compute`, :class:`TiledMLP`, :class:`TiledFusedLogitsLoss`: tiled compute.
"""

from .attention import UlyssesSPAttentionHF
from .data import UlyssesSPDataLoaderAdapter
from .loss import sp_loss_from_logits
from .mesh import Mesh, build_mesh
from .register import register_with_transformers, unregister_from_transformers

__all__ = [
    "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "Mesh", "build_mesh",
    "register_with_transformers", "unregister_from_transformers", "sp_loss_from_logits",
]

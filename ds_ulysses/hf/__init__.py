"""Transformers integration: registering the SP attention (and undoing it), deciding which models SP
serves exactly, the SP loss on a causal LM, and checkpoint offload on its layers. The only library
layer that imports transformers."""

from .attention_tiling import tile_attention, untile_attention
from .checkpointing import disable_activation_checkpoint_offload, enable_activation_checkpoint_offload
from .loss import disable_sp_loss, enable_sp_loss, tiled_causal_lm_loss
from .norm_tiling import tile_norms, untile_norms
from .register import UlyssesSPAttentionHF, register_with_transformers, unregister_from_transformers
from .servable import check_model_servable

__all__ = ["disable_activation_checkpoint_offload", "enable_activation_checkpoint_offload", "disable_sp_loss",
           "enable_sp_loss", "tiled_causal_lm_loss", "UlyssesSPAttentionHF", "register_with_transformers",
           "unregister_from_transformers", "check_model_servable", "tile_attention", "untile_attention",
           "tile_norms", "untile_norms"]

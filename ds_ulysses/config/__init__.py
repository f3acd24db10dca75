"""The DeepSpeed config's ``"ulysses"`` section: its JSON Schema (the single source of truth), the
validation that names every error, and the typed frozen :class:`UlyssesConfig` built from it."""

from .schema import SECTION_KEY, UlyssesConfigError, attn_implementations, load_schema
from .section import (ActivationCheckpointOffloadConfig, TiledAttentionConfig, TiledLossConfig, TiledMLPConfig,
                      UlyssesConfig, parse_ds_config, resolve_ring_size)

__all__ = ["SECTION_KEY", "UlyssesConfigError", "attn_implementations", "load_schema",
           "ActivationCheckpointOffloadConfig", "TiledAttentionConfig", "TiledLossConfig", "TiledMLPConfig",
           "UlyssesConfig", "parse_ds_config", "resolve_ring_size"]

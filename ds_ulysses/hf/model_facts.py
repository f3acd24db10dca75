"""Facts read off a Transformers model, each looked up in one place."""

from __future__ import annotations

from ..memory.tiles import weight_rows

__all__ = ["text_config", "config_value", "vocab_size", "linear_width", "layout_facts", "base_model"]


def config_value(config, name: str, default=None):
    """``config.name``, also for a per-layer attribute of a heterogeneous config (Gemma 4's head_dim),
    which Transformers refuses to read globally: its global (default) value is returned then. SP
    needs such numbers only for checks and reports; each layer's real head layout comes from the
    tensors its attention call brings."""
    try:
        return getattr(config, name, default)
    except RuntimeError as err:  # Transformers' AmbiguousGlobalPerLayerAttributeError (newer releases only)
        if type(err).__name__ != "AmbiguousGlobalPerLayerAttributeError":
            raise
        return vars(config).get(name, default)


def base_model(model):
    """The Transformers model under a PEFT wrapper (the model itself otherwise)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def text_config(model_or_config):
    """The language model's config (the text sub-config of a multimodal model)."""
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def vocab_size(model, output: bool = False) -> int | None:
    """Rows of the input embedding (what token ids index) or, with ``output``, of the output head
    (what labels index); the config's ``vocab_size`` when the model has no such layer."""
    get = getattr(model, "get_output_embeddings" if output else "get_input_embeddings", None)
    layer = get() if callable(get) else None
    rows = getattr(layer, "out_features" if output else "num_embeddings", None)
    if rows is None and layer is not None and getattr(layer, "weight", None) is not None:
        rows = weight_rows(layer)
    if rows is None:
        rows = config_value(text_config(model), "vocab_size")
    return rows if isinstance(rows, int) else None


def linear_width(linear, side: str = "out") -> int:
    """An ``nn.Linear``'s output (``side="out"``) or input width, from its attributes: whole also where ZeRO-3
    has partitioned its weight."""
    return getattr(linear, f"{side}_features")


def layout_facts(model) -> dict:
    """The model facts SP peers must agree on (head layout, depth, vocabulary)."""
    text = text_config(model)
    names = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "num_hidden_layers")
    return {**{n: config_value(text, n) for n in names}, "vocab": vocab_size(model)}

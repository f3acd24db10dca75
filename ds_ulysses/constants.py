"""Facts the whole package shares, each defined here once."""

__all__ = ["IGNORE_INDEX", "GIB"]

IGNORE_INDEX = -100
"""Label of a token that adds nothing to the loss (PyTorch's and Transformers' default)."""

GIB = 1 << 30
"""Bytes per GiB."""

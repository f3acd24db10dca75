"""What a causal LM does to its logits after ``lm_head``, found once at setup so every loss path that
computes logits itself (the tiled loss, evaluation by position) gives the model's own numbers.

Models transform the head's output in their ``forward``: Cohere multiplies by ``logit_scale``, Granite
divides by ``logits_scaling``, MiniCPM scales the hidden states before the head, Gemma 2/3 soft-cap
with ``final_logit_softcapping``, and more appear with every release. Rather than a list of names that
goes stale, :func:`logits_transform` *measures* it: the model's own ``forward`` runs once on a short
random probe of hidden states (its decoder swapped for a stub that returns them), and its logits are
compared with ``lm_head(hidden)``. A scale (read back as the config value it matches, so it is exact)
and the config's soft cap are the forms recognised; the result is verified on the probe, and a model
whose head does anything else is refused by name, never served approximately.

Dimension legend::  T probe tokens   h hidden size   V vocabulary
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch

from .model_facts import config_value, text_config
from .servable import decoder_of

__all__ = ["LogitsTransform", "logits_transform"]

_PROBE_TOKENS = 8


@dataclass(frozen=True)
class LogitsTransform:
    """``logits -> softcap(logits * scale)``, in the logits' own dtype, as the model's forward does."""

    scale: float = 1.0
    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@functools.cache
def _probe_output_class():
    from dataclasses import dataclass as model_output
    from transformers.modeling_outputs import BaseModelOutputWithPast

    @model_output
    class ProbeOutput(BaseModelOutputWithPast):
        """The decoder's output during the probe: the hidden states, and None for anything else a model's
        forward reads from it (router logits, auxiliary losses, caches)."""

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return ProbeOutput


class _Stub(torch.nn.Module):
    """Stands in for the decoder during the probe: returns the probe's hidden states, and hands any
    other attribute the model's forward reads (a multiplier, a config) to the real decoder."""

    def __init__(self, hidden: torch.Tensor, decoder):
        super().__init__()
        self.hidden = hidden
        self.__dict__["decoder"] = decoder  # not a submodule

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["decoder"], name)

    def forward(self, *args, **kwargs):
        return _probe_output_class()(last_hidden_state=self.hidden)


def _swap_decoder(model, hidden):
    """Context manager: a stub returning ``hidden`` replaces the decoder submodule ``model.forward`` calls."""
    decoder = decoder_of(model)
    stub = _Stub(hidden, decoder)
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is decoder:
                return _swapped(parent, name, stub)
    return None


@contextlib.contextmanager
def _swapped(parent, name, stub):
    original = parent._modules[name]
    parent._modules[name] = stub
    try:
        yield
    finally:
        parent._modules[name] = original


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    tol = 1e-5 if a.dtype in (torch.float32, torch.float64) else 2e-2
    return bool((a.float() - b.float()).abs().max() <= tol * b.float().abs().max().clamp(min=1e-6))


def _config_constant(model, value: float) -> float:
    """The config's own number when ``value`` is one of its floats (or a reciprocal), else ``value``."""
    for attr, candidate in vars(text_config(model)).items():
        if isinstance(candidate, bool) or not isinstance(candidate, (int, float)) or not candidate:
            continue
        for exact in (float(candidate), 1.0 / float(candidate)):
            if math.isclose(value, exact, rel_tol=1e-3):
                return exact
    return value


def logits_transform(model, gathered=contextlib.nullcontext) -> LogitsTransform | None:
    """The transform the model applies after ``lm_head`` (None when it applies none).

    ``gathered(params)`` is a context manager making ZeRO-3 partitioned parameters whole for the
    probe (the head's, and anything else outside the decoder the forward may touch). Raises
    ValueError naming the model type when its head does something other than a scale and a soft cap.
    """
    head = model.get_output_embeddings()
    text = text_config(model)
    model_type = getattr(text, "model_type", type(model).__name__)
    inside = {id(p) for p in decoder_of(model).parameters()}
    outside = {id(p): p for p in model.parameters() if id(p) not in inside}
    outside.update((id(p), p) for p in head.parameters())  # a head tied to the embedding included
    outside = list(outside.values())
    with gathered(outside), torch.no_grad():
        weight = head.weight
        width = config_value(text, "hidden_size") or weight.shape[1]  # what the decoder hands the head
        g = torch.Generator(device="cpu").manual_seed(0)
        hidden = torch.randn(1, _PROBE_TOKENS, width, generator=g).to(weight.device, weight.dtype)  # [1 T h]
        try:
            base = head(hidden)  # [1 T V]
        except RuntimeError as err:
            raise ValueError(_refusal(model_type,
                                      f"lm_head does not take the decoder's hidden states ({err})")) from err
        swap = _swap_decoder(model, hidden)
        if swap is None:
            raise ValueError(_refusal(model_type, "its decoder is not a submodule its forward calls"))
        ids = torch.zeros(1, _PROBE_TOKENS, dtype=torch.long, device=weight.device)
        with swap:
            try:
                got = type(model).forward(model, input_ids=ids).logits  # [1 T V], the model's own head
            except Exception as err:  # whatever the model's own forward raises on stand-in hidden states
                raise ValueError(_refusal(model_type, f"its forward does not run on the decoder's hidden states "
                                                      f"alone ({type(err).__name__}: {err})")) from err
    if got.shape != base.shape:
        raise ValueError(_refusal(model_type, f"its logits have shape {list(got.shape)}, lm_head's {list(base.shape)}"))
    if _close(got, base):
        return None
    cap = config_value(text, "final_logit_softcapping") or None
    pre = got.double() if cap is None else cap * torch.atanh((got.double() / cap).clamp(-1 + 1e-12, 1 - 1e-12))
    scale = float((pre * base.double()).sum() / (base.double() ** 2).sum().clamp(min=1e-30))
    transform = LogitsTransform(_config_constant(model, scale), cap)
    if not _close(transform(base), got):
        raise ValueError(_refusal(model_type, "its logits are not a scale and soft cap of lm_head's output"))
    return transform


def _refusal(model_type: str, why: str) -> str:
    return (f"the tiled loss cannot serve {model_type!r} exactly: its forward transforms the logits after lm_head "
            f"and {why}, so computing lm_head tile by tile would train on other logits; expected logits = "
            "softcap(scale * lm_head(hidden)); fix: set \"tiled_loss\": {\"enabled\": false} in the ulysses section "
            "(the SP loss then uses the model's own logits)")

"""A Transformers MoE model's router load-balancing loss under SP: the whole sequence's, on every rank.

Transformers' MoE causal LMs (``output_router_logits=True``) return ``aux_loss =
load_balancing_loss_func(router_logits, E, k, attention_mask)``, a function of their own module, and add
``router_aux_loss_coef * aux_loss`` to a loss computed from ``labels``; TRL's fused LM head does the same with
Mixtral's function and the text config's coefficient. Under SP each call sees one shard's routing.

:func:`router_facts` checks at setup that the model's function is the Switch loss (numerically, against
:func:`~ds_ulysses.sp.router_loss.load_balancing_loss` on random routing, with and without a mask: a family
whose loss has another form is refused by name, never approximated) and puts a dispatcher in its place, in
the model's module and in Mixtral's (where TRL imports it from at call time). Inside :func:`sp_router_scope`
(the SP loss's forward) the dispatcher computes the whole sequence's loss from the SP group's summed
statistics; anywhere else it is the original, so other models and evaluation are untouched.

Under ``tiled_mlp`` a MoE block runs tile by tile without autograd; :func:`router_logits_tiles` gives
:class:`~ds_ulysses.memory.tiled_mlp.TiledMLP` what it needs to hand the model router logits that carry
the gradient (the tiles' recordings, joined, as outputs of the tiled Function).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import sys
from dataclasses import dataclass

import torch

from ..distributed.watch import GroupWatch
from ..patching import PATCHES
from ..sp.router_loss import load_balancing_loss
from .model_facts import base_model, config_value, text_config

__all__ = ["RouterFacts", "router_facts", "sp_router_scope", "router_coef", "whole_router_loss",
           "router_logits_tiles"]

_TAG = "sp_router_loss"
_FUNCTION = "load_balancing_loss_func"
_TRL_SOURCE = "transformers.models.mixtral.modeling_mixtral"  # TRL's fused head imports the function from here
_SCOPE: contextvars.ContextVar = contextvars.ContextVar("ulysses_router_scope", default=None)


@dataclass(frozen=True)
class RouterFacts:
    """A model's router loss: whether SP serves its form, and its expert count and top-k (None where the
    model does not say; only the tiled loss, which runs the decoder itself, needs them)."""

    servable: bool
    num_experts: int | None
    top_k: int | None


def router_facts(model) -> RouterFacts | None:
    """The model's router-loss facts, its function replaced by the SP dispatcher when SP serves it; None for
    a model whose module has no load-balancing function (a dense model). A function that is not the Switch
    loss is refused when the model's config turns the loss on (``output_router_logits``), and marked not
    servable otherwise (a call that turns it on is refused then)."""
    base = base_model(model)
    module = sys.modules.get(type(base).__module__)
    original = getattr(module, _FUNCTION, None)
    if not callable(original):
        return None
    original = getattr(original, "ulysses_original", original)
    if not _is_switch_loss(original):
        if getattr(text_config(model), "output_router_logits", False):
            raise ValueError(
                f"the SP loss cannot serve {type(base).__name__}'s router load-balancing loss "
                f"({module.__name__}.{_FUNCTION}): it is not Switch Transformer's loss (the form ds_ulysses computes "
                "over the whole sequence from each SP rank's shard), and the shards' own losses would train "
                "silently wrong; expected a Mixtral-style load_balancing_loss_func; fix: set "
                "config.output_router_logits = False (no auxiliary loss; in TRL's SFTConfig, "
                "router_aux_loss_coef=0.0), or train this model without sequence parallelism")
        return RouterFacts(False, None, None)
    for target in (module, importlib.import_module(_TRL_SOURCE)):
        _install(target)
    text = text_config(model)
    experts = _first_int(getattr(base, "num_experts", None), config_value(text, "num_local_experts"),
                         config_value(text, "num_experts"))
    top_k = _first_int(getattr(base, "num_experts_per_tok", None), config_value(text, "num_experts_per_tok"))
    return RouterFacts(True, experts, top_k)


def router_coef(model, fused_head: bool) -> float:
    """The weight of the router loss in the model's loss: its own ``router_aux_loss_coef`` (or
    ``aux_loss_coef``), set at construction; TRL's fused head reads the text config's (TRL writes its
    ``router_aux_loss_coef`` there)."""
    text = text_config(model)
    if not fused_head:
        base = base_model(model)
        for name in ("router_aux_loss_coef", "aux_loss_coef"):
            if isinstance(getattr(base, name, None), (int, float)):
                return float(getattr(base, name))
    return float(config_value(text, "router_aux_loss_coef", 0.0) or 0.0)


@contextlib.contextmanager
def sp_router_scope(group, grad_scale: float, watch: GroupWatch | None):
    """Within it, the models' router losses are the whole sequence's over ``group``."""
    token = _SCOPE.set((group, grad_scale, watch))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def whole_router_loss(router_logits, facts: RouterFacts, attention_mask) -> torch.Tensor:
    """The sequence's router loss from this rank's ``router_logits`` (inside :func:`sp_router_scope`)."""
    return load_balancing_loss(tuple(router_logits), facts.num_experts, facts.top_k, attention_mask, *_SCOPE.get())


class _RouterLogitsTiles:
    """TiledMLP's ``side`` for router logits, which Transformers' output-capturing hooks record from inside a
    MoE block into the collector of the model call (``collector``, its context variable)."""

    KEY = "router_logits"

    def __init__(self, collector):
        self.collector = collector

    @contextlib.contextmanager
    def recording(self, backward: bool):
        """The router logits the calls inside record, taken from the call's collector; in backward (no model
        call is collecting then) from a collector of its own."""
        token, active = None, self.collector.get()
        if backward:
            active = {self.KEY: []}
            token = self.collector.set(active)
        elif active is None or self.KEY not in active:
            yield []  # the call records no router logits: nothing to serve
            return
        start, got = len(active[self.KEY]), []
        try:
            yield got
        finally:
            got.extend(active[self.KEY][start:])
            del active[self.KEY][start:]
            if token is not None:
                self.collector.reset(token)

    def keep(self, tensors) -> None:
        self.collector.get()[self.KEY].extend(tensors)


def router_logits_tiles():
    """TiledMLP's ``side`` for the router logits of Transformers' MoE blocks; None where this Transformers
    records them some other way than its output-capturing collector."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _RouterLogitsTiles(_active_collector)


def _dispatch(original, gate_logits, num_experts=None, top_k=2, attention_mask=None):
    scope = _SCOPE.get()
    if scope is None or not isinstance(gate_logits, tuple):
        return original(gate_logits, num_experts, top_k, attention_mask)
    return load_balancing_loss(gate_logits, num_experts, top_k, attention_mask, *scope)


def _install(module) -> None:
    current = getattr(module, _FUNCTION)
    if getattr(current, "ulysses_original", None) is not None:
        return
    dispatch = functools.wraps(current)(functools.partial(_dispatch, current))
    dispatch.ulysses_original = current
    PATCHES.set_attr(module, _FUNCTION, dispatch, _TAG)


def _is_switch_loss(function) -> bool:
    """Whether ``function(gate_logits, E, k, mask)`` is the Switch loss, on random routing with and without
    a padding mask (checked on one process: the SP group plays no part)."""
    generator = torch.Generator().manual_seed(0)
    gates = tuple(torch.randn(12, 5, generator=generator, dtype=torch.float64) for _ in range(2))  # [n E] x 2
    mask = torch.ones(2, 6, dtype=torch.long)  # [bs sl]
    mask[1, 4:] = 0
    try:
        for m in (None, mask):
            got = function(gates, 5, 2, m)
            want = load_balancing_loss(gates, 5, 2, m)
            if not torch.is_tensor(got) or not torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-8):
                return False
    except (TypeError, ValueError, RuntimeError, IndexError):  # another signature or form: not the one served
        return False
    return True


def _first_int(*values) -> int | None:
    return next((v for v in values if isinstance(v, int) and not isinstance(v, bool)), None)

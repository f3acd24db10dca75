"""Tiled attention: every decoder attention block computed a group of heads at a time
(:class:`~ds_ulysses.memory.tiled_heads.TiledHeads`), without editing model code.

A group's share of the block is the block's own ``forward`` run with its four projections narrowed to the
group: q_proj, k_proj and v_proj to the group's rows (its heads' features, whole KV groups), the output
projection (o_proj; Phi's dense, GPT-J's out_proj) to the same columns, its bias in group 0's share only; the
head counts a forward reads from the block (``num_heads``...) are the group's while it runs. Everything
between (RoPE, per-head q/k norms, the SP all-to-alls, the core attention) is the model's and SP's own code on
fewer heads. Under sdpa and flash attention a group's fused kernel outputs are kept from forward to backward
(:mod:`~ds_ulysses.memory.kept_kernels`), so backward recomputes the group around its core attention, not the
core itself. The split is exact wherever the block is a sum over heads, and a block that is not is refused
by name at setup: one projection for q, k and v together, a q_proj that also yields a gate, a norm over all
heads' features or one norm per head, a parameter of the block outside its projections (attention sinks),
dropout on the attention probabilities (backward's recompute would draw other masks), projections that are not
plain ``nn.Linear`` (LoRA adapters, quantized layers).

Dimensions: hc query heads, hc_kv KV heads, hs head size, G groups, P the SP degree.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..config import attn_implementations
from ..memory.tiled_heads import TiledHeads
from ..patching import PATCHES
from ..sp.heads import plan_attention_groups
from .model_facts import linear_width, text_config
from .servable import decoder_of

__all__ = ["tile_attention", "untile_attention", "plan_attention_tiling", "apply_attention_tiling", "attention_blocks"]

_TAG = "tiled_attention"
_INPUTS = ("q_proj", "k_proj", "v_proj")
_OUTPUTS = ("o_proj", "dense", "out_proj")  # the output projection's names (Llama's; Phi's; GPT-J's)
# per-head norms over hs features (Qwen 3's, Gemma 3's; Phi's): one weight shared by every head, so by every group
_HEAD_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm")
_FIX = "fix: set \"tiled_attention\": {\"enabled\": false}"


def _keeps_kernels(core) -> bool:
    """Whether a group keeps its fused kernels' outputs from forward to backward (:mod:`..memory.kept_kernels`)
    under the core attention ``core``: the section's cores but flex_attention, which compiles itself and cannot run
    under a dispatch mode; eager and Hub kernels run their core again in backward."""
    return core in attn_implementations() and core != "flex_attention"


def attention_blocks(model) -> list[tuple[str, nn.Module]]:
    """The text decoder's attention blocks, as ``(name, module)``: modules whose class name ends in
    ``Attention`` (Transformers' convention), outermost only."""
    found = []
    for name, module in decoder_of(model).named_modules():
        if type(module).__name__.endswith("Attention") and not any(name.startswith(f"{n}.") for n, _ in found):
            found.append((name, module))
    return found


def _block_layout(name: str, module: nn.Module, config) -> tuple[int, int, int, str]:
    """``(hc, hc_kv, hs, name of the output projection)`` of a block that splits by heads exactly; otherwise the
    refusal naming why."""
    who = f"tiled_attention cannot split {name} ({type(module).__name__}) by heads"
    children = ", ".join(n for n, _ in module.named_children()) or "none"
    missing = [p for p in _INPUTS if not isinstance(getattr(module, p, None), nn.Module)]
    if missing:
        raise ValueError(f"{who}: it has no {', '.join(missing)} (its parts: {children}), so q, k and v do not come "
                         f"from a projection each; expected q_proj, k_proj and v_proj; {_FIX}")
    out = next((p for p in _OUTPUTS if isinstance(getattr(module, p, None), nn.Module)), None)
    if out is None:
        raise ValueError(f"{who}: it has no output projection named {', '.join(_OUTPUTS)} (its parts: {children}); "
                         f"expected one to narrow to each group's columns; {_FIX}")
    projections = (*_INPUTS, out)
    for p in projections:
        if type(getattr(module, p)) is not nn.Linear:
            raise ValueError(f"{who}: its {p} is a {type(getattr(module, p)).__name__}, not a plain nn.Linear "
                             f"(LoRA adapters and quantized layers cannot be narrowed to a group's rows); {_FIX}, or "
                             "leave the attention projections out of the adapter's target modules")
    hs = getattr(module, "head_dim", None) or getattr(config, "head_dim", None) \
        or config.hidden_size // config.num_attention_heads
    hc = config.num_attention_heads
    hc_kv = getattr(config, "num_key_value_heads", None) or hc
    expect = {"q_proj": ("out", hc * hs), "k_proj": ("out", hc_kv * hs), "v_proj": ("out", hc_kv * hs),
              out: ("in", hc * hs)}
    for p, (side, want) in expect.items():
        got = linear_width(getattr(module, p), side)
        if got != want:
            extra = " (a per-head output gate rides in q_proj)" if p == "q_proj" and got == 2 * want else ""
            raise ValueError(f"{who}: {p}.{side}_features is {got}, expected {want} for {hc} query / {hc_kv} KV "
                             f"heads of {hs}{extra}; {_FIX}")
    for pname, param in module.named_parameters():
        owner, _, leaf = pname.partition(".")
        if owner in projections:
            continue
        if owner in _HEAD_NORMS and leaf in ("weight", "bias") and param.numel() == hs:
            continue
        if owner in _HEAD_NORMS and leaf not in ("weight", "bias"):
            raise ValueError(f"{who}: its {owner} keeps a norm per head ({pname}), which this split does not narrow "
                             f"to a group's heads; {_FIX}")
        if owner in _HEAD_NORMS:
            raise ValueError(f"{who}: its {owner} normalises every head's features together ({pname} has "
                             f"{param.numel()} entries, a head {hs}), so a group's share would normalise over its "
                             f"own heads only; {_FIX}")
        what = "attention sinks, one logit per head" if "sink" in pname else f"a parameter of shape {list(param.shape)}"
        raise ValueError(f"{who}: it holds {pname} ({what}) outside its q/k/v/o projections, which a group's "
                         f"share would not narrow; {_FIX}")
    dropout = float(getattr(module, "attention_dropout", 0.0) or 0.0)
    if dropout > 0:
        raise ValueError(f"{who}: attention_dropout={dropout} draws its masks again when backward recomputes each "
                         f"group, so the gradients would not be the forward's; expected attention_dropout=0.0 "
                         f"(what long-context fine-tuning uses); set config.attention_dropout = 0.0, or {_FIX}")
    return hc, hc_kv, hs, out


def tile_attention(model, sp: int = 1, shards="auto") -> int:
    """Compute every decoder attention block of ``model`` a group of heads at a time (``sp``: the SP degree
    the groups must split over). Refuses, before changing anything, a block that cannot be split exactly (see
    the module docstring) and a ``shards`` no block can use. Idempotent; returns how many blocks are tiled.
    Undone by :func:`untile_attention` or ``ds_ulysses.uninstall``."""
    return apply_attention_tiling(plan_attention_tiling(model, sp, shards))


def plan_attention_tiling(model, sp: int = 1, shards="auto") -> list[tuple]:
    """What :func:`tile_attention` will do, checked, with nothing changed yet: per block ``(module, (groups,
    query heads per KV head, hs, the output projection's name))``."""
    config = text_config(model)
    blocks = attention_blocks(model)
    if not blocks:
        raise ValueError(f"tiled_attention is enabled but {type(model).__name__}'s decoder has no attention block "
                         f"(no module class named *Attention) to tile; {_FIX}")
    plans = []
    for name, module in blocks:
        hc, hc_kv, hs, out = _block_layout(name, module, config)
        plans.append((module, (plan_attention_groups(hc, hc_kv, sp, shards), hc // hc_kv, hs, out)))
    return plans


def apply_attention_tiling(plans: list[tuple]) -> int:
    """Tile the blocks :func:`plan_attention_tiling` planned; returns how many."""
    for module, layout in plans:
        if not PATCHES.has(_TAG, owner=module):
            PATCHES.set_attr(module, "forward", functools.partial(_tiled_forward, module, module.forward), _TAG,
                             module)
        PATCHES.set_attr(module, "_ds_ulysses_head_groups", layout, _TAG, module)
    return len(plans)


def untile_attention(model) -> int:
    """Undo :func:`tile_attention`. Idempotent; returns how many blocks were restored."""
    return sum(1 for module in model.modules() if PATCHES.undo(_TAG, owner=module))


def _tiled_forward(module, forward, *args, **kwargs):
    """The block's forward over head groups when autograd records it (training); whole otherwise (evaluation,
    generation). A KV cache the model made while training (``use_cache`` defaults to true) gets no entry from a
    tiled block: a group's keys appended to it would be read back by the next group as more sequence."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            kwargs[name] = None
    if "hidden_states" in kwargs:
        x = kwargs.pop("hidden_states")
    else:
        x, args = args[0], args[1:]
    groups, ratio, hs, out = module._ds_ulysses_head_groups
    projections = (*_INPUTS, out)

    def share(mod, x_in, g):  # group g's heads through the block: [bs sl_l h]
        with _Narrowing(mod, g, groups, ratio, hs, out):
            try:
                return forward(x_in, *args, **kwargs)[0]
            except RuntimeError as err:  # a count of heads the block's forward takes from elsewhere
                raise ValueError(
                    f"tiled_attention cannot split {type(mod).__name__} by heads: its forward failed on a group of "
                    f"{linear_width(mod.q_proj) // hs} query heads ({err}); expected a forward that takes its head "
                    f"counts from its projections or its num_heads / num_key_value_heads attributes; {_FIX}") from err

    params = [getattr(module, p).weight for p in projections] + \
        [p for p in (getattr(module, p).bias for p in projections) if p is not None] + \
        [p for n in _HEAD_NORMS if isinstance(getattr(module, n, None), nn.Module)
         for p in getattr(module, n).parameters()]
    core = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return TiledHeads.apply(share, module, x, groups, params, keep_kernels=_keeps_kernels(core)), None


class _Narrowed(nn.Module):
    """A linear layer seen through a slice of its weight: ``rows`` of its output (q/k/v) or ``cols`` of its
    input (o_proj, whose bias only group 0 adds)."""

    def __init__(self, linear: nn.Linear, rows: slice | None = None, cols: slice | None = None,
                 bias: bool = True):
        super().__init__()
        object.__setattr__(self, "linear", linear)  # not a submodule: the block keeps owning it
        self.rows, self.cols, self.with_bias = rows, cols, bias

    def forward(self, x):
        weight, bias = self.linear.weight, self.linear.bias if self.with_bias else None
        if self.rows is not None:
            weight, bias = weight[self.rows], None if bias is None else bias[self.rows]
        if self.cols is not None:
            weight = weight[:, self.cols]
        return F.linear(x, weight, bias)


class _Narrowing:
    """Within the block: the four projections narrowed to group ``g`` of ``groups``, and the head counts a
    forward may read from the block itself (StableLM's views use ``num_heads``) set to the group's."""

    def __init__(self, module, g: int, groups: int, ratio: int, hs: int, out: str):
        self.module = module
        kv = linear_width(module.k_proj) // hs // groups  # KV heads per group
        q_rows = slice(g * kv * ratio * hs, (g + 1) * kv * ratio * hs)
        kv_rows = slice(g * kv * hs, (g + 1) * kv * hs)
        self.views = {"q_proj": _Narrowed(module.q_proj, rows=q_rows), "k_proj": _Narrowed(module.k_proj, rows=kv_rows),
                      "v_proj": _Narrowed(module.v_proj, rows=kv_rows),
                      out: _Narrowed(getattr(module, out), cols=q_rows, bias=g == 0)}
        whole = {"num_heads": kv * ratio * groups, "num_attention_heads": kv * ratio * groups,
                 "num_key_value_heads": kv * groups, "hidden_size": kv * ratio * groups * hs}
        part = {"num_heads": kv * ratio, "num_attention_heads": kv * ratio, "num_key_value_heads": kv,
                "hidden_size": kv * ratio * hs}
        self.counts = {name: part[name] for name, value in whole.items()
                       if type(vars(module).get(name)) is int and vars(module)[name] == value}

    def __enter__(self):
        self.saved = {name: self.module._modules[name] for name in self.views}
        self.saved_counts = {name: vars(self.module)[name] for name in self.counts}
        self.module._modules.update(self.views)
        vars(self.module).update(self.counts)
        return self

    def __exit__(self, *exc):
        self.module._modules.update(self.saved)
        vars(self.module).update(self.saved_counts)
        return False

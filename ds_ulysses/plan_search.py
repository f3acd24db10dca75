"""``ds-ulysses plan``'s search: the cheapest setup (sp, ring, tile counts, the ALST switches) that fits a
device and host budget, and the longest sequence some setup fits, under the memory model of
:mod:`ds_ulysses.planner`; the ``"ulysses"`` section that runs a setup.

Cheapest means least time: small sp first, then the switches ordered by what each costs in a step (the weights
in :func:`_candidates`: checkpointing's recompute most, the tiled loss least). Under a host budget the
checkpoint offload is limited to the first layers the host holds (:func:`host_fitted`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from .config import resolve_ring_size
from .constants import GIB
from .memory.tiles import auto_loss_shards, auto_mlp_shards
from .planner import INDEX_LIMIT, NODE_GPUS, RECIPES, ModelDims, Setup, breakdown, fits
from .sp.heads import plan_attention_groups

__all__ = ["recommend", "host_fitted", "max_seq_len", "ulysses_section"]


def _candidates(dims: ModelDims, seq_len: int, gpus: int, act_bytes: int, recipe: str = "ours"):
    """Every setup, cheapest first: small sp, then the switches ordered by what they cost in time. DeepSpeed's
    recipe has its tools always on (ArcticTraining's setup, the one measured) and no ring."""
    sps = [sp for sp in range(1, gpus + 1) if gpus % sp == 0 and (recipe == "ours" or sp <= dims.heads)]
    out = []
    for sp, ckpt, mlp, loss, offload, opt, par, att, norms in itertools.product(
            sps, (False, True), (False, True), (False, True), (False, True), (False, True), (False, True),
            (False, True), (False, True)):
        if (offload and not ckpt) or (recipe != "ours" and (not (ckpt and mlp and loss) or att or norms)):
            continue
        local = max(1, seq_len // sp)
        ring = 1 if sp <= dims.heads else resolve_ring_size("auto", sp, [dims.heads], NODE_GPUS)
        groups = plan_attention_groups(dims.heads, dims.kv_heads, sp // ring) if att else 1
        if att and groups == 1:
            continue  # no split of the heads: the same setup as without
        setup = Setup(seq_len, gpus, sp, act_bytes, ckpt, offload,
                      auto_mlp_shards(local, dims.hidden) if mlp else 1,
                      auto_loss_shards(local, dims.vocab) if loss else 1, opt, par, ring, recipe=recipe,
                      tiled_attention=groups, tiled_norms=norms)
        cost = (math.log2(sp) * 1.0 + math.log2(ring) * 0.5 + ckpt * 1.0 + mlp * 0.3 + att * 0.4 + loss * 0.1
                + norms * 0.2 + offload * 0.5 + opt * 0.6 + par * 2.0)
        out.append((cost, setup))
    out.sort(key=lambda cs: cs[0])
    return [s for _, s in out]


def recommend(dims: ModelDims, seq_len: int, gpus: int, gpu_mem: float, cpu_mem: float | None = None,
              act_bytes: int = 2, overhead: float = 4 * GIB, recipe: str = "ours",
              index_limit: int | None = INDEX_LIMIT) -> Setup | None:
    """The cheapest setup that fits, or None when nothing does."""
    if recipe not in RECIPES:
        raise ValueError(f"expected a recipe in {RECIPES}, got {recipe!r}")
    candidates = (host_fitted(dims, s, cpu_mem) for s in _candidates(dims, seq_len, gpus, act_bytes, recipe))
    return next((s for s in candidates if fits(dims, s, gpu_mem, cpu_mem, overhead, index_limit=index_limit)), None)


def host_fitted(dims: ModelDims, setup: Setup, cpu_mem: float | None, gpus_per_node: int = NODE_GPUS) -> Setup:
    """``setup`` with checkpoint offload limited to the first layers whose checkpoints the host holds
    (``activation_checkpoint_offload.layers``), when ``cpu_mem`` per node cannot hold every layer's: the host
    keeps what else it holds (offloaded optimizer states and parameters) and the rest of its budget goes to
    checkpoints, one hidden-sized tensor per layer and token of each of the node's ranks; the other layers keep
    theirs on the device. Unchanged without offload, without a host budget, or when every layer fits."""
    if not setup.ckpt_offload or cpu_mem is None:
        return setup
    ranks = min(setup.gpus, gpus_per_node)
    every = replace(setup, offload_layers=None)
    if sum(h for _, h in breakdown(dims, every).values()) * ranks <= cpu_mem:
        return every
    other = sum(h for _, h in breakdown(dims, replace(setup, offload_layers=0)).values())
    per_layer = setup.local * dims.hidden * setup.act_bytes
    layers = max(0, min(dims.layers - 1, math.floor((cpu_mem / ranks - other) / per_layer)))
    return replace(setup, offload_layers=layers)


def max_seq_len(dims: ModelDims, gpus: int, gpu_mem: float, cpu_mem: float | None = None, act_bytes: int = 2,
                overhead: float = 4 * GIB, recipe: str = "ours",
                index_limit: int | None = INDEX_LIMIT) -> tuple[int, Setup | None]:
    """The longest S (to 1K) that some setup fits, with every switch on and sp = gpus at the limit."""
    def ok(s):
        return recommend(dims, s, gpus, gpu_mem, cpu_mem, act_bytes, overhead, recipe, index_limit) is not None

    lo, hi = 0, 1 << 10
    while ok(hi * 1024):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid * 1024) else (lo, mid)
    s = lo * 1024
    return s, (recommend(dims, s, gpus, gpu_mem, cpu_mem, act_bytes, overhead, recipe, index_limit) if s else None)


def ulysses_section(setup: Setup) -> dict:
    """The ``"ulysses"`` section for a setup, validated by :class:`ds_ulysses.config.UlyssesConfig`."""
    from .config import UlyssesConfig

    section = {
        "sequence_parallel_size": setup.sp,
        **({"ring_size": setup.ring} if setup.ring > 1 else {}),
        "tiled_mlp": {"enabled": setup.tiled_mlp > 1, "shards": setup.tiled_mlp if setup.tiled_mlp > 1 else "auto"},
        "tiled_attention": {"enabled": setup.tiled_attention > 1,
                            "shards": setup.tiled_attention if setup.tiled_attention > 1 else "auto"},
        "tiled_loss": {"enabled": setup.tiled_loss > 1, "shards": setup.tiled_loss if setup.tiled_loss > 1 else "auto"},
        "activation_checkpoint_offload": {"enabled": setup.ckpt_offload, **(
            {} if setup.offload_layers is None else {"layers": setup.offload_layers})},
        "tiled_norms": {"enabled": setup.tiled_norms},
    }
    UlyssesConfig.from_dict(section)
    return section

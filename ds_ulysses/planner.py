"""``ds-ulysses plan``'s memory model: what one rank holds, per term, for a setup (sp, tile counts, the ALST
switches); :mod:`ds_ulysses.plan_search` picks the setup and the longest sequence with it.

Dimension legend::

    S   global sequence length     sl_l = S / sp  tokens per rank    h  hidden   I  MLP intermediate
    L   layers   V  vocab   P  parameters   N  GPUs (ranks)   b  bytes per activation element

Why these terms (ALST, arXiv 2506.13996, section 3): at long S the model states are small next to the
activations, and the activations that matter are (1) the hidden states each layer keeps for its
recompute (``L sl_l h b``; moved to the host by checkpoint offload), (2) one layer's working set
while it is recomputed and differentiated (about 20 hidden-sized tensors, see
:func:`layer_units`), (3) the MLP intermediates (``sl_l I``; bounded to a tile by TiledMLP), and (4)
the logits (``sl_l V`` in fp32: logits + log-softmax + gradient untiled; the tiled loss holds one
tile's buffer, :mod:`ds_ulysses.memory.fused_ce`). Ulysses divides all four by sp. ZeRO-3 divides
parameters (b_p P), gradients and Adam states (12 P in fp32) by N, or moves them to the host with
offload.

Past the head count (sp > heads) the plan takes a ring (:mod:`ds_ulysses.sp.ring`): the smallest ring that keeps
the Ulysses degree within the heads and a node of 8 GPUs (within the heads it keeps Ulysses alone, across nodes
too, as ALST measured it). Its activations are Ulysses' (each rank still holds
``sl_l`` tokens' worth of q, k, v) plus the blocks in flight (:func:`breakdown`), and its price is traffic
(:func:`layer_traffic`): the ring sends key/value blocks where Ulysses sends all four of q, k, v and the output.

Measured terms (issue 67): with checkpointing and the tiled MLP and loss on, the activation terms are not
estimates but fitted to what a training step holds at its peaks (``python -m benchmarks.breakdown``:
live tensors by segment, tensor by tensor; :data:`MEASURED_TERMS`, with the record they came from). A
step's segments peak at different moments (the loss while the decoder's checkpoints are held; each
layer's recompute and backward while the loss is long gone), so the step's activation peak is the
*largest* segment, not their sum (:func:`segment_peaks`). Without checkpointing or with an untiled MLP
the planner keeps the estimates of :func:`layer_units` (no record measures those).

On CPU there is no separate device memory: the prediction for a CPU run is one process's RSS high
water mark = a measured runtime baseline (Python, torch, DeepSpeed, Transformers, communication
buffers: ``--cpu-baseline``) + model states on both "sides" + the activation peak. Without
checkpointing every layer keeps its saved tensors until backward (:func:`layer_units` x L).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .constants import GIB
from .memory.tiles import auto_loss_shards, auto_mlp_shards

__all__ = ["parse_size", "ModelDims", "Setup", "KNOWN_MODELS", "load_dims", "layer_units", "SegmentTerms",
           "MEASURED_TERMS", "TILED_NORMS_FIT", "RECIPES", "NODE_GPUS", "tile_rows", "tiled_attention_units",
           "INDEX_LIMIT", "largest_tensor", "segment_peaks", "step_peak", "breakdown", "fits", "cpu_rss",
           "layer_traffic"]

NODE_GPUS = 8  # GPUs per node the plan keeps each Ulysses group within

def parse_size(text: str) -> int:
    """``4096``, ``4K``/``4k`` (x1024) or ``1M`` (x1024^2) -> int."""
    text = str(text).strip()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:].lower(), 1)
    try:
        value = int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise ValueError(f"expected a size like 4096, 16K or 1M, got {text!r}") from None
    if value < 1:
        raise ValueError(f"expected a positive size, got {text!r}")
    return value


@dataclass(frozen=True)
class ModelDims:
    """The shape numbers the memory model needs, from a HF config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False

    @property
    def params(self) -> int:
        h, hs = self.hidden, self.head_dim
        attn = h * self.heads * hs * 2 + h * self.kv_heads * hs * 2
        layer = attn + 3 * h * self.intermediate + 2 * h
        return self.layers * layer + self.vocab * h * (1 if self.tied else 2) + h

    @property
    def layer_params(self) -> int:
        return (self.params - self.vocab * self.hidden * (1 if self.tied else 2) - self.hidden) // self.layers


KNOWN_MODELS = {  # config numbers baked in so planning needs no download
    "llama-3.1-8b": ModelDims(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128,
                              vocab=128256),
    "llama-3.1-70b": ModelDims(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, head_dim=128,
                               vocab=128256),
    "ds-ulysses-bench": ModelDims(hidden=256, intermediate=688, layers=4, heads=8, kv_heads=2, head_dim=32,
                                  vocab=32000),
}


def load_dims(model: str) -> ModelDims:
    """A known name (``llama-3.1-8b``, ``meta-llama/Llama-3.1-8B``), a config.json, or a model directory."""
    key = model.lower().rsplit("/", 1)[-1].replace("meta-", "")
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key]
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {model!r} is neither a known name ({', '.join(KNOWN_MODELS)}) nor a HF "
                         "config.json or a directory holding one; pass a local path (nothing is downloaded)")
    cfg = json.loads(path.read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    return ModelDims(hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"],
                     layers=cfg["num_hidden_layers"], heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
                     head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab=cfg["vocab_size"],
                     tied=bool(cfg.get("tie_word_embeddings", False)))


@dataclass(frozen=True)
class Setup:
    """One candidate: mesh, precision and every memory switch."""

    seq_len: int
    gpus: int
    sp: int
    act_bytes: int = 2            # bf16 activations on GPU; 4 for fp32 (the CPU runs)
    checkpointing: bool = True    # HF gradient checkpointing (one saved input per layer)
    ckpt_offload: bool = False    # ulysses.activation_checkpoint_offload
    tiled_mlp: int = 1            # MLP tiles (1 = untiled)
    tiled_loss: int = 1           # logits tiles (1 = untiled)
    offload_optimizer: bool = True
    offload_param: bool = False
    ring: int = 1                 # ulysses.ring_size (sp / ring ranks split heads)
    recipe: str = "ours"          # whose tools: "ours" or DeepSpeed's ALST recipe, "deepspeed-alst" (RECIPES)
    tiled_attention: int = 1      # attention head groups computed one at a time (1 = untiled)
    tiled_norms: bool = False     # ulysses.tiled_norms (norms keep only their input; blocks rebuild their output)
    offload_layers: int | None = None  # activation_checkpoint_offload.layers: None = all, else the first N

    @property
    def local(self) -> float:
        return self.seq_len / self.sp


def layer_units(dims: ModelDims, setup: Setup) -> float:
    """Hidden-sized tensors (``sl_l x h``) one decoder layer holds from forward to its backward.

    Attention: q, k, v (1 + 2r, r = kv/heads), their RoPE'd copies (1 + r), the head-sharded copies
    after the all-to-all (1 + 2r), the kernel's output and its all-to-all back (2), o_proj output and
    residual (2). Two RMSNorms (2 each, 3 when a bf16 input is upcast to fp32). MLP output and
    residual (2); the MLP intermediates are :func:`mlp_units`.
    """
    r = dims.kv_heads / dims.heads
    norm = 2 + (1 if setup.act_bytes < 4 else 0)
    return (1 + 2 * r) + (1 + r) + (1 + 2 * r) + 2 + 2 + 2 * norm + 2


def mlp_units(dims: ModelDims, setup: Setup) -> float:
    """gate, up, act(gate), act*up: ``4 I`` per token, of which a tiled MLP holds one tile at a time."""
    return 4 * dims.intermediate / dims.hidden / setup.tiled_mlp


@dataclass(frozen=True)
class SegmentTerms:
    """The activations one segment of a training step holds at its peak, counted in a measured breakdown
    (``benchmarks.breakdown_fit.planner_terms``): ``(units + checkpoints + layers) sl_l h b + mlp_tiles rows_m I b +
    loss_tiles rows_l V 4 + head_weights V h 4 + norm_units sl_l h 4``. ZeRO-3's gathered parameters are the
    parameter term's. RMSNorm's tensors count at fp32 size whatever the activation dtype: measured in fp32 as two
    per norm (its normalised input and output), in bf16 the norm keeps an fp32 upcast of its input beside
    bf16 ones, the same bytes."""

    units: float         # hidden-sized tensors per local token besides the checkpoints
    checkpoints: float   # checkpointed hidden states beyond one per layer (the last layer's output, ...)
    mlp_tiles: float     # [rows_m, I] tensors of the tiled MLP
    loss_tiles: float    # [rows_l, V] fp32 tensors of the tiled loss
    head_weights: float  # [V, h] fp32 tensors the loss computes: the lm_head's gradient (and its buffers)
    norm_units: float = 0.0  # hidden-sized tensors per local token an RMSNorm holds (fp32-sized)


RECIPES = ("ours", "deepspeed-alst")
# ArcticTraining's tiled loss (DeepSpeed's ALST recipe): about 1 GiB of fp32 logits a tile
_ARCTIC_LOSS_TILE_BYTES = GIB

# Fitted by ``python -m benchmarks.breakdown --terms`` from benchmarks/results/breakdown.jsonl (the record named in
# "source"): recipe -> "sp1" | "sp>1" (Ulysses' all-to-all buffers exist only with sp > 1) -> segment -> terms.
MEASURED_TERMS: dict = {  # segment -> SegmentTerms(units, checkpoints, mlp_tiles, loss_tiles, head_weights, norm_units)
    "source": ("benchmarks/results/breakdown.jsonl ("
               "deepspeed-alst sp 1: 2026-12-02 16:39 at a561b25+changes, S 3072/4096/5120; "
               "deepspeed-alst sp 2: 2026-12-02 16:17 at a561b25+changes, S 3072/4096/5120; "
               "ours sp 1: 2026-12-03 06:32 at df83df6+changes, S 3072/4096/5120; "
               "ours sp 2: 2026-12-03 06:22 at df83df6, S 3072/4096/5120)"),
    "terms": {
        "deepspeed-alst": {
            "sp1": {
                "forward": SegmentTerms(4.75, 0.0, 0.0, 0.0, 0.0, 1.0),
                "loss": SegmentTerms(1.25, 1.0, 0.0, 3.0, 0.0, 2.001),
                "layer": SegmentTerms(5.758, 0.0, 7.0, 0.0, 0.0, 4.002),
            },
            "sp>1": {
                "forward": SegmentTerms(0.0, -1.0, 0.0, 0.0, 0.0, 0.0),
                "loss": SegmentTerms(1.25, 1.0, 0.0, 3.0, 0.0, 2.001),
                "head backward": SegmentTerms(5.25, 1.0, 0.0, 0.0, 0.0, 0.0),
                "layer": SegmentTerms(6.758, 0.0, 5.0, 0.0, 0.0, 4.002),
            },
        },
        "ours": {
            "sp1": {
                "forward": SegmentTerms(4.75, 0.0, 0.0, 0.0, 0.0, 1.0),
                "loss": SegmentTerms(1.252, 1.0, 0.0, 1.0, 1.0, 2.001),
                "head backward": SegmentTerms(1.25, 1.0, 0.0, 0.0, 1.0, 1.001),
                "layer": SegmentTerms(5.758, 0.0, 7.0, 0.0, 0.0, 4.002),
            },
            "sp>1": {
                "forward": SegmentTerms(0.0, -1.0, 0.0, 0.0, 0.0, 0.0),
                "loss": SegmentTerms(1.256, 1.0, 0.0, 1.0, 1.0, 2.001),
                "head backward": SegmentTerms(1.254, 1.0, 0.0, 0.0, 1.0, 1.001),
                "layer": SegmentTerms(6.762, 0.0, 4.994, 0.0, 0.0, 4.002),
            },
        },
    },
}


def tile_rows(dims: ModelDims, setup: Setup) -> tuple[int, int]:
    """(MLP tile rows, loss tile rows) on one rank: the setup's tile counts, or DeepSpeed's recipe's rules
    (``ceil(sl_l / h)`` MLP tiles, about 1 GiB of fp32 logits a loss tile)."""
    local = max(1, math.ceil(setup.local))
    if setup.recipe == "deepspeed-alst":
        mlp, loss = math.ceil(local / dims.hidden), max(1, math.ceil(local * dims.vocab * 4 / _ARCTIC_LOSS_TILE_BYTES))
    else:
        mlp, loss = setup.tiled_mlp, setup.tiled_loss
    return math.ceil(local / mlp), math.ceil(local / loss)


# What tiled attention takes off a layer's recompute and backward, fitted from benchmarks/results/breakdown.jsonl
# (ours and ours[tiled_attention] at sp 2, S 3072/4096/5120, one run, 2 head groups of issue 67's
# Llama-3.1-8B-shaped model, fp32, head_dim 128: per-token units at the layer's peak 6.76 -> 4.26): 2.50 units at 2
# groups, of which the kept kernel outputs (1 + 4 / (128 * 4) units, see tiled_attention_units) give back 1.01, so
# the attention's own full-sequence tensors are 2 * (2.50 + 1.01) = 7.02 units at kv heads / heads = 0.25
_TILED_ATTENTION_FIT = (7.02, 0.25)


# What tiled norms take off each segment, fitted from benchmarks/results/breakdown.jsonl (ours[tiled_attention] and
# ours[tiled_attention,tiled_norms] at sp 2, S 3072/4096/5120, one run): segment -> (per-token units, norm units).
# A layer's two norms keep only their input, which the residual stream holds anyway (norm 4 -> 0); the final
# norm's output in the loss and the head's backward is rebuilt per tile (1 -> 0 in each).
TILED_NORMS_FIT = {"layer": (0.0, 4.0), "loss": (0.0, 1.0), "head backward": (0.0, 1.0)}


def tiled_attention_units(dims: ModelDims, shards: int, act_bytes: int) -> float:
    """Hidden-sized tensors per token a layer's recompute and backward no longer holds when its attention runs
    ``shards`` head groups one at a time (0 at 1 shard): the attention's full-sequence tensors A, of which one
    group's share ``A / shards`` stays alive, less what the groups keep from forward to backward so that backward
    does not run the core attention again (:mod:`ds_ulysses.memory.kept_kernels`): the kernels' output (one unit)
    and log-sum-exp (one fp32 value per head and token: ``4 / (head_dim * act_bytes)`` units).

    A is the measured figure (:data:`_TILED_ATTENTION_FIT`) carried to other head layouts by what scales with
    them: q, the output and their copies (4 of the 4 + 4 r the layout predicts at r = kv heads / heads) do not
    depend on r, k and v with theirs do.
    """
    if shards < 1:
        raise ValueError(f"expected a positive tiled_attention shard count, got {shards}")
    if shards == 1:
        return 0.0
    measured, at_ratio = _TILED_ATTENTION_FIT
    r = dims.kv_heads / dims.heads
    units = measured * (4 + 4 * r) / (4 + 4 * at_ratio)
    return units * (1 - 1 / shards) - (1 + 4 / (dims.head_dim * act_bytes))


# Elements of one tensor past which kernels that index with 32-bit integers fail: ALST's 1-GPU recipe dies at
# 555K tokens of Llama-3.1-8B with an illegal memory access ([555K, 4096] passes 2**31), and its published maxima
# (500K on 1, 3.7M on 8, 15M on 32 H100) all sit just under this wall (issue 67)
INDEX_LIMIT = 1 << 31


def largest_tensor(dims: ModelDims, setup: Setup) -> int:
    """Elements of the largest activation one rank creates: a hidden-sized tensor of its tokens, q of its head
    group over the whole sequence after the all-to-all (of one head group at a time with tiled attention),
    an MLP tile's ``[rows, I]`` and a loss tile's ``[rows, V]``. With a ring the all-to-all spans the Ulysses
    degree (sp / ring) and gathers the ring block's S / ring tokens."""
    local = max(1, math.ceil(setup.local))
    heads = math.ceil(dims.heads / (setup.sp // setup.ring) / setup.tiled_attention)
    rows_m, rows_l = tile_rows(dims, setup)
    return max(local * dims.hidden, local * dims.heads * dims.head_dim,
               math.ceil(setup.seq_len / setup.ring) * heads * dims.head_dim,
               rows_m * dims.intermediate, rows_l * dims.vocab)


def _measured(dims: ModelDims, setup: Setup) -> dict | None:
    """The fitted terms that apply to ``setup`` (checkpointing, a tiled MLP and a tiled loss), or None."""
    if not (setup.checkpointing and setup.tiled_mlp > 1 and setup.tiled_loss > 1) and setup.recipe == "ours":
        return None
    if setup.recipe not in MEASURED_TERMS.get("terms", {}):
        raise ValueError(f"expected a recipe in {sorted(MEASURED_TERMS.get('terms', {}))}, got {setup.recipe!r}")
    return MEASURED_TERMS["terms"][setup.recipe]["sp1" if setup.sp == 1 else "sp>1"]


def segment_peaks(dims: ModelDims, setup: Setup) -> dict[str, tuple[float, float]] | None:
    """segment -> (device bytes, host bytes) at its peak on one rank, activations only, from the measured
    terms; None where no record measures the setup. The checkpoints are on the host with checkpoint offload."""
    measured = _measured(dims, setup)
    if measured is None:
        return None
    b = setup.act_bytes
    unit = setup.local * dims.hidden * b
    rows_m, rows_l = tile_rows(dims, setup)
    out = {}
    for name, t in measured.items():
        terms = t if isinstance(t, SegmentTerms) else SegmentTerms(**t)
        units = terms.units - (tiled_attention_units(dims, setup.tiled_attention, b) if name == "layer" else 0.0)
        norm_units = terms.norm_units
        if setup.tiled_norms:
            fewer_units, fewer_norms = TILED_NORMS_FIT.get(name, (0.0, 0.0))
            units, norm_units = units - fewer_units, norm_units - fewer_norms
        ckpt = (terms.checkpoints + dims.layers) * unit
        working = (units * unit + terms.mlp_tiles * rows_m * dims.intermediate * b
                   + terms.loss_tiles * rows_l * dims.vocab * 4 + terms.head_weights * dims.vocab * dims.hidden * 4
                   + norm_units * setup.local * dims.hidden * 4)
        host = _host_checkpoints(dims, setup, ckpt, unit)
        out[name] = (working + ckpt - host, host)
    return out


def _host_checkpoints(dims: ModelDims, setup: Setup, ckpt: float, unit: float) -> float:
    """Bytes of ``ckpt`` (every checkpoint) on the host: all of them when every layer offloads, one layer's
    input per offloaded layer when only the first N do, none without offload."""
    if not setup.ckpt_offload:
        return 0.0
    if setup.offload_layers is None or setup.offload_layers >= dims.layers:
        return ckpt
    return setup.offload_layers * unit


def step_peak(dims: ModelDims, setup: Setup) -> float:
    """A training step's activation peak on one rank, device and host together: what ``benchmarks.breakdown``
    measures on CPU (``activation_peak``: its largest segment, ZeRO-3's gathered parameters aside)."""
    segments = segment_peaks(dims, setup)
    if segments is None:
        raise ValueError(f"no measured terms for {setup}: expected checkpointing with a tiled MLP and loss "
                         "(recipe 'ours'), or recipe 'deepspeed-alst'")
    return max(d + h for d, h in segments.values())


def breakdown(dims: ModelDims, setup: Setup) -> dict[str, tuple[float, float]]:
    """term -> (device bytes, host bytes) per rank. Where measured terms apply, the activation rows are the
    checkpoints and the largest segment's working set (:func:`segment_peaks`), the other segments'
    working sets reported beside it at zero (they peak at other moments)."""
    n, p, b = setup.gpus, dims.params, setup.act_bytes
    u = setup.local * dims.hidden * b  # one hidden-sized activation on this rank
    param_bytes = 2 if b < 4 else 4
    segments = segment_peaks(dims, setup)
    working = 2 * dims.layer_params * param_bytes + dims.vocab * dims.hidden * param_bytes  # gathered: 2 layers + head
    out = {"parameters (ZeRO-3)": (working + (0 if setup.offload_param else p * param_bytes / n),
                                   p * param_bytes / n if setup.offload_param else 0.0)}
    states = p * (12 if param_bytes < 4 else 8) / n + p * 4 / n  # fp32 master (bf16 only) + Adam m, v + fp32 grads
    out["gradients + optimizer states"] = (0.0, states) if setup.offload_optimizer else (states, 0.0)
    if segments is not None:
        saved = dims.layers * u
        host = _host_checkpoints(dims, setup, saved, u)
        out["checkpointed layer inputs"] = (saved - host, host)
        on_device = {name: d - (saved - host) for name, (d, _) in segments.items()}
        peak = max(on_device, key=on_device.get)
        out[f"step working set (measured; peak: {peak})"] = (on_device[peak], 0.0)
        return out
    per_layer = (layer_units(dims, setup) + mlp_units(dims, setup)) * u
    if setup.checkpointing:
        saved = dims.layers * u
        host = _host_checkpoints(dims, setup, saved, u)
        out["checkpointed layer inputs"] = (saved - host, host)
        out["layer recompute + backward"] = (per_layer + 4 * u, 0.0)  # + incoming and produced grads
    else:
        out["saved activations (all layers)"] = (dims.layers * per_layer + 4 * u, 0.0)
    if setup.tiled_loss == 1:
        logits_bytes = 12 + (4 if b < 4 else 0)  # fp32 logits, log-softmax, grad (+ bf16 logits and upcast)
    else:
        logits_bytes = 4 + (2 if b < 4 else 0)  # one fp32 buffer, logits then gradient (+ the bf16 logits it upcasts)
    out["logits + loss"] = (math.ceil(setup.local / setup.tiled_loss) * dims.vocab * logits_bytes, 0.0)
    if setup.ring > 1:
        # backward holds a received K/V block (2 r u), the K/V gradient being accumulated and the one in flight
        # (fp32: 2 x 2 r u x 4/b) and the fp32 query gradient (u x 4/b); the forward holds less
        r = dims.kv_heads / dims.heads
        out["ring blocks in flight"] = (2 * r * u + (4 * r + 1) * u * 4 / b, 0.0)
    return out


def layer_traffic(dims: ModelDims, setup: Setup) -> dict[str, float]:
    """Bytes one rank sends per decoder layer, forward and backward together: ``"ulysses"`` (the all-to-alls of
    q, k, v and the output, and of their gradients: the (U-1)/U of each that leaves the rank, KV heads counted
    once per Ulysses rank that reads them) and ``"ring"``
    (key/value blocks of ``S / ring`` tokens over this rank's KV heads, ``ring - 1`` times forward and backward,
    and their fp32 gradients ``ring`` times)."""
    b, hd = setup.act_bytes, dims.head_dim
    ulysses = setup.sp // setup.ring
    # a KV head shared by several Ulysses ranks is sent to each (2 KV heads over 4 ranks: 4 sent)
    qkvo = setup.local * hd * (2 * dims.heads + 2 * max(dims.kv_heads, ulysses))
    out = {"ulysses": 2 * qkvo * (ulysses - 1) / ulysses * b, "ring": 0.0}
    if setup.ring > 1:
        block = 2 * math.ceil(dims.kv_heads / ulysses) * setup.seq_len / setup.ring * hd  # K and V elements
        out["ring"] = 2 * (setup.ring - 1) * block * b + setup.ring * block * 4
    return out


def fits(dims: ModelDims, setup: Setup, gpu_mem: float, cpu_mem: float | None, overhead: float,
         gpus_per_node: int = 8, index_limit: int | None = INDEX_LIMIT) -> bool:
    """Device: every term plus ``overhead``. Host (``cpu_mem``, per node): every rank's host terms on its node,
    the offloaded checkpoints among them (one hidden-sized tensor per layer per token). No tensor past
    ``index_limit`` elements (None: no limit)."""
    if index_limit is not None and largest_tensor(dims, setup) > index_limit:
        return False
    terms = breakdown(dims, setup)
    device = sum(d for d, _ in terms.values()) + overhead
    host = sum(h for _, h in terms.values()) * min(setup.gpus, gpus_per_node)
    return device <= gpu_mem and (cpu_mem is None or host <= cpu_mem)


def cpu_rss(dims: ModelDims, seq_len: int, sp: int, section: dict, baseline: float) -> float:
    """Predicted RSS high-water mark of one CPU rank training with ``section`` (fp32, ZeRO-3 with
    parameters and optimizer offloaded, as in ``ds-ulysses bench``).

    CPU memory is device and host at once, so both sides add up, plus ``baseline`` (the measured RSS
    of the runtime itself: interpreter, torch, DeepSpeed, Transformers, gloo) and the unpartitioned
    fp32 model every rank builds before ZeRO-3 partitions it (DeepSpeed #7458). The "auto" tile
    counts are the package's own rules (``auto_mlp_shards``, ``auto_loss_shards``).
    """
    from .config import UlyssesConfig

    cfg = UlyssesConfig.from_dict({**section, "sequence_parallel_size": sp})
    local = max(1, seq_len // sp)

    def tiles(tool, auto):
        if not tool.enabled:
            return 1
        return auto if tool.shards == "auto" else int(tool.shards)

    offload = cfg.activation_checkpoint_offload.enabled
    setup = Setup(seq_len, sp, sp, 4, checkpointing=offload, ckpt_offload=offload,
                  tiled_mlp=tiles(cfg.tiled_mlp, auto_mlp_shards(local, dims.hidden)),
                  tiled_loss=tiles(cfg.tiled_loss, auto_loss_shards(local, dims.vocab)),
                  offload_optimizer=True, offload_param=True, tiled_norms=cfg.tiled_norms.enabled)
    terms = breakdown(dims, setup)
    return baseline + 4 * dims.params + sum(d + h for d, h in terms.values())

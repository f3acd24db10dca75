"""One rank of ``python -m benchmarks.breakdown``: the engine loop's recipes, trained at several lengths, with
every tensor a measured step allocates followed (:class:`benchmarks.measure.LiveTensors`).

Dimension legend::

    S  global sequence length   sl_l = S / sp  tokens per rank   h  hidden   I  MLP intermediate   V  vocab
    unit  one hidden-sized fp32 tensor of this rank's tokens: sl_l * h * 4 bytes

The step is cut into *segments*, because the loss and the layers peak at different moments (their working
sets do not add up): ``forward`` (embedding and decoder layers), ``loss`` (from the decoder's output to the
loss; our fused loss and DeepSpeed's TiledFusedLogitsLoss both do their backward here), ``head backward``
(backward before the first layer's recompute), ``layer i`` (layer i's recompute and backward, until the next
layer's recompute starts), ``backward epilogue`` (from the first allocation after the last layer's backward
outside any module or autograd node: ZeRO's gradient handling) and ``step`` (the optimizer). Each segment's peak
is kept with a snapshot of what was live then: which op in which module allocated it, in which segment, its
shape. Each live tensor is then sorted into a *family* (:func:`classify`) by its shape, so that the counts carry
over to other model sizes:

- ``checkpoint``: a per-token tensor allocated in ``forward`` at a decoder layer's input (one per layer),
- ``norm``: a per-token tensor an RMSNorm allocated (in bf16 these stay fp32-sized: the norm keeps an fp32
  upcast of its input), counted in units,
- ``per token``: any other tensor with a dimension of sl_l or S tokens, counted in units,
- ``mlp tile`` / ``loss tile``: ``[rows, I]`` / ``[rows, V]`` tensors, rows being the recipe's tile rows,
  counted in tiles,
- ``head weight``: ``[V, h]`` (the lm_head's gathered weight or its gradient), counted in such tensors,
- ``fixed``: the rest (ZeRO-3's gathered weights, the weights' gradients, small buffers), in bytes.
"""

from __future__ import annotations

import math
import time

import torch

from .arms import MODEL_DEFAULTS
from .measure import LiveTensors
from .profile import Regions
from .recipes import RECIPES, arctic_loss_shards, build_model, make_dataset
from .tap import CollectiveTap

__all__ = ["tile_rows", "classify", "run"]


def tile_rows(recipe: str, local: int, hidden: int, vocab: int, section: dict | None = None) -> tuple[int, int]:
    """(MLP tile rows, loss tile rows) of one recipe at ``local`` tokens per rank: ours from the section (its
    tile counts, or the "auto" rules), DeepSpeed's from its recipe (``ceil(sl_l / h)`` MLP tiles, about 1 GiB
    of fp32 logits a loss tile)."""
    from ds_ulysses.memory.tiles import auto_loss_shards, auto_mlp_shards

    if recipe == "ours":
        def shards(tool, auto):
            given = (section or {}).get(tool, {}).get("shards", "auto")
            return auto if given == "auto" else int(given)
        mlp = shards("tiled_mlp", auto_mlp_shards(local, hidden))
        loss = shards("tiled_loss", auto_loss_shards(local, vocab))
    else:
        mlp, loss = math.ceil(local / hidden), arctic_loss_shards(local, vocab)
    return math.ceil(local / mlp), math.ceil(local / loss)


def classify(entry: tuple, local: int, seq_len: int, dims: dict, rows: tuple[int, int]) -> tuple[str, float]:
    """(family, amount) of one live tensor (module docstring): amounts in units, tiles, ``[V, h]`` tensors or
    bytes."""
    nbytes, shape, _, segment, where, _ = entry
    h, vocab, inter = dims["hidden"], dims["vocab"], dims["intermediate"]
    mlp_rows, loss_rows = rows
    unit = local * h * 4
    numel_ok = len(shape) >= 2
    if numel_ok and shape[-1] == inter and any(d in (mlp_rows, mlp_rows - 1) for d in shape[:-1]):
        return "mlp tile", nbytes / (mlp_rows * inter * 4)
    if numel_ok and shape[-1] == vocab and any(d in (loss_rows, loss_rows - 1) for d in shape[:-1]):
        return "loss tile", nbytes / (loss_rows * vocab * 4)
    if len(shape) == 2 and sorted(shape) == sorted((vocab, h)):
        return "head weight", nbytes / (vocab * h * 4)
    if any(d in (local, seq_len) for d in shape):
        if segment == "forward" and shape[-1] == h and (where.endswith("embed_tokens") or _layer_output(where)):
            return "checkpoint", nbytes / unit
        if where.endswith("norm"):
            return "norm", nbytes / unit
        return "per token", nbytes / unit
    return "fixed", float(nbytes)


def _layer_output(where: str) -> bool:
    """An allocation by a decoder layer itself (its residual add: the next layer's input), not a submodule's."""
    parts = where.split(".")
    return len(parts) >= 2 and parts[-2] == "layers" and parts[-1].isdigit()


def run(spec: dict) -> dict:
    """One rank: an arm of :data:`benchmarks.recipes.RECIPES`, trained at each of ``spec["seq_lens"]`` (``warmup``
    steps, then ``steps`` measured under :class:`LiveTensors`); per length the segments' peaks and what was live
    then."""
    import deepspeed
    import torch.distributed as dist

    torch.set_num_threads(spec.get("threads", 1))
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    sp = spec["sp"]
    dims = {**MODEL_DEFAULTS, **spec.get("model", {})}
    per_len = sp * math.ceil((spec["warmup"] + spec["steps"]) / sp)  # whole refill cycles per length
    data = []
    for seq_len in spec["seq_lens"]:
        data += make_dataset(world * per_len // sp, seq_len, dims["vocab"], seed=seq_len)
    model = build_model(dims).train()
    engine, loader, loss_fn = RECIPES[spec["impl"]](model, spec, data, CollectiveTap().install(), Regions())
    recipe = "ours" if spec["impl"] == "ours" else "deepspeed-alst"
    tracker = LiveTensors()
    handles = tracker.hook(model)
    lengths = []
    for seq_len in spec["seq_lens"]:
        local = seq_len // sp
        rows = tile_rows(recipe, local, dims["hidden"], dims["vocab"], spec.get("section"))
        steps = []
        for i in range(per_len):
            dist.barrier()
            measured = i >= per_len - spec["steps"]
            tracker.reset()
            begin = time.perf_counter()
            batch = next(loader)
            if measured:
                tracker.set_segment("forward")
                tracker.__enter__()
            try:
                loss = loss_fn(engine, batch)
                tracker.set_segment("head backward")
                engine.backward(loss)
                tracker.set_segment("step")
                engine.step()
            finally:
                if measured:
                    tracker.__exit__(None, None, None)
            tracker.close()
            if not measured:
                continue
            segments = {}
            for name, (peak, live) in tracker.peaks.items():
                families: dict[str, float] = {}
                groups: dict[tuple, list] = {}
                for entry in live:
                    family, amount = classify(entry, local, seq_len, dims, rows)
                    families[family] = families.get(family, 0.0) + amount
                    key = (family, entry[3], entry[4], entry[5], entry[2], "x".join(map(str, entry[1])))
                    groups.setdefault(key, [0, 0])
                    groups[key][0] += 1
                    groups[key][1] += entry[0]
                segments[name] = {"peak": peak, "families": families,
                                  "live": sorted(([*k, n, b] for k, (n, b) in groups.items()), key=lambda r: -r[-1])}
            steps.append({"loss": float(loss.detach()), "seconds": time.perf_counter() - begin,
                          "segments": segments})
        lengths.append({"seq_len": seq_len, "local": local, "rows": rows, "steps": steps})
    for handle in handles:
        handle.remove()
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "lengths": lengths}

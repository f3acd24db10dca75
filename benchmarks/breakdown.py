"""``python -m benchmarks.breakdown``: what a training step holds at its peak, tensor by tensor, for DeepSpeed's
ALST recipe and ours, at several lengths; the per-token slope and the fitted terms the planner uses.

Dimension legend::

    S  global sequence length   sl_l = S / sp  tokens per rank   h  hidden   I  MLP intermediate   V  vocab
    unit  one hidden-sized fp32 tensor of this rank's tokens: sl_l * h * 4 bytes

How it measures (on CPU, where RSS mixes the allocator's caching with what is live): every tensor an aten op
allocates during a measured step is tracked through a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
(an op's output whose storage is none of its inputs' is a fresh allocation) and untracked when its storage is
freed (a weakref finalizer on the storage; torch keeps one Python object per storage, so the finalizer runs
exactly when the memory goes). The live bytes allocated since the step began are followed op by op; tensors
that already existed at the step's start (weights, optimizer states, ZeRO's buffers) are not counted, so the
figure is the step's own working memory, exact to the byte and free of allocator noise.

The step is cut into *segments*, because the loss and the layers peak at different moments (their working
sets do not add up): ``forward`` (embedding and decoder layers), ``loss`` (from the decoder's output to the
loss; our fused loss and DeepSpeed's TiledFusedLogitsLoss both do their backward here), ``head backward``
(backward before the first layer's recompute), ``layer i`` (layer i's recompute and backward, until the next
layer's recompute starts), ``backward epilogue`` (from the first allocation after the last layer's backward
outside any module or autograd node: ZeRO's gradient handling) and ``step`` (the optimizer). Each segment's peak
is kept with a snapshot of what was live then: which op in which module allocated it, in which segment, its shape. Each live tensor is then sorted
into a *family* (:func:`classify`) by its shape, so that the counts carry over to other model sizes:

- ``checkpoint``: a per-token tensor allocated in ``forward`` at a decoder layer's input (one per layer),
- ``norm``: a per-token tensor an RMSNorm allocated (in bf16 these stay fp32-sized: the norm keeps an fp32
  upcast of its input), counted in units,
- ``per token``: any other tensor with a dimension of sl_l or S tokens, counted in units,
- ``mlp tile`` / ``loss tile``: ``[rows, I]`` / ``[rows, V]`` tensors, rows being the recipe's tile rows,
  counted in tiles,
- ``head weight``: ``[V, h]`` (the lm_head's gathered weight or its gradient), counted in such tensors,
- ``fixed``: the rest (ZeRO-3's gathered weights, the weights' gradients, small buffers), in bytes.

:func:`fit` gives each segment's peak and per-token slope over the lengths; :func:`planner_terms` the family
counts that ``ds_ulysses.planner`` holds with the record they came from (``MEASURED_TERMS``).

Arms: ``deepspeed-alst`` (benchmarks.rank's ArcticTraining setup: DeepSpeed's TiledMLP, TiledFusedLogitsLoss,
gradient checkpointing) and ``ours`` with the section's ALST switches (``tiled_mlp`` and
``activation_checkpoint_offload`` on, ``tiled_loss`` on by default); ``--tiled-attention N`` adds
``ours[tiled_attention]`` with ``"tiled_attention": {"enabled": true, "shards": N}`` on top, and
``--tiled-norms`` one more arm with ``"tiled_norms": {"enabled": true}`` on top of the last.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .rank import arctic_loss_shards

__all__ = ["LiveTensors", "ALST_SECTION", "LLAMA8B_SHAPED", "tile_rows", "classify", "families", "run",
           "run_breakdown", "fit", "dims_of", "ACTIVATION_SEGMENTS", "activation_peak", "planner_terms",
           "measured_terms", "slopes", "format_breakdown", "main"]

ALST_SECTION = {"tiled_mlp": {"enabled": True}, "activation_checkpoint_offload": {"enabled": True}}
# Llama-3.1-8B's per-layer proportions (h : I : kv : V) scaled down to a CPU: issue 67's model
LLAMA8B_SHAPED = {"vocab": 32000, "hidden": 1024, "intermediate": 3584, "layers": 2, "heads": 8, "kv_heads": 2}
RECIPES = ("ours", "deepspeed-alst")


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


class LiveTensors(TorchDispatchMode):
    """Live bytes of the tensors allocated while it is active, with each segment's peak and what was live then.

    ``segment`` is set from outside (the step loop and module hooks); ``where`` is the innermost module running
    (its qualified name), or in backward the autograd node that allocated.
    """

    def __init__(self):
        super().__init__()
        self.modules: list[str] = []
        self.reset()

    def reset(self) -> None:
        """Forget everything tracked (a new step)."""
        self.live: dict[int, tuple] = {}  # storage address -> (bytes, shape, dtype, segment, where, op)
        self.total = 0
        self.segment = "setup"
        self.peaks: dict[str, tuple[int, list]] = {}
        self._rising = False

    def set_segment(self, name: str) -> None:
        self._settle()
        self.segment = name

    def _settle(self) -> None:
        """Snapshot the live set when the total stops rising at a new high for its segment."""
        if self._rising:
            self._rising = False
            best = self.peaks.get(self.segment, (-1, None))[0]
            if self.total > best:
                self.peaks[self.segment] = (self.total, list(self.live.values()))

    def _free(self, key: int, nbytes: int) -> None:
        if key in self.live:
            self._settle()  # the live set before this free is the peak's
            del self.live[key]
            self.total -= nbytes

    def _where(self) -> str:
        if self.modules:
            return self.modules[-1]
        node = torch._C._current_autograd_node()
        return f"autograd {node.name()}" if node is not None else "-"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.layout == torch.strided}
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self.live:
                continue
            where = self._where()
            if where == "-" and self.segment.startswith("layer "):
                self.set_segment("backward epilogue")  # autograd is done: ZeRO's gradient handling
            self.live[key] = (nbytes, tuple(t.shape), str(t.dtype).removeprefix("torch."), self.segment,
                              where, func.__name__)
            self.total += nbytes
            self._rising = True
            weakref.finalize(storage, self._free, key, nbytes)
        return out

    def close(self) -> None:
        self._settle()

    def hook(self, model) -> list:
        """Follow which decoder module runs, and cut segments at the decoder's layers and at the
        decoder's end. A layer's submodule running in backward is that layer's recompute (Transformers
        checkpoints a layer's ``forward``, so the layer's own hooks stay outside and only its submodules' run
        again)."""
        handles = []
        decoder = model.model
        layer_of = {}
        for i, layer in enumerate(decoder.layers):
            layer_of.update({id(sub): i for sub in layer.modules()})

        # the decoder's modules only: a hook on the lm_head would make our loss refuse to fuse it (it fuses only a
        # head without hooks but DeepSpeed's, ds_ulysses.memory.fused_ce.fusable_head)
        for name, module in decoder.named_modules(prefix="model"):
            def enter(mod, args, _name=name):
                i = layer_of.get(id(mod))
                if i is not None and self.segment not in ("forward", "loss", f"layer {i}"):
                    self.set_segment(f"layer {i}")
                self.modules.append(_name)

            def leave(mod, args, out):
                if self.modules:
                    self.modules.pop()
                if mod is decoder and self.segment == "forward":
                    self.set_segment("loss")
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave, always_call=True))
        return handles


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
    """One rank: the recipe of benchmarks.rank, trained at each of ``spec["seq_lens"]`` (``warmup`` steps, then
    ``steps`` measured under :class:`LiveTensors`); per length the segments' peaks and what was live then."""
    import deepspeed
    import torch.distributed as dist

    from . import rank as bench_rank
    from .profile import Regions
    from .tap import CollectiveTap

    torch.set_num_threads(spec.get("threads", 1))
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    sp = spec["sp"]
    dims = {**bench_rank.MODEL_DEFAULTS, **spec.get("model", {})}
    per_len = sp * math.ceil((spec["warmup"] + spec["steps"]) / sp)  # whole refill cycles per length
    data = []
    for seq_len in spec["seq_lens"]:
        data += bench_rank.make_dataset(world * per_len // sp, seq_len, dims["vocab"], seed=seq_len)
    model = bench_rank.build_model(dims).train()
    engine, loader, loss_fn = bench_rank.RECIPES[spec["impl"]](model, spec, data, CollectiveTap().install(),
                                                               Regions())
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


def run_breakdown(seq_lens, sps, arms: dict, out: Path, model: dict, warmup: int = 1, steps: int = 1,
                  timeout: float = 3600.0, log=print) -> list[dict]:
    """One launch per (arm, sp), each training every length; one record per launch appended to ``out``."""
    from .bench import _workdir, launch, stamp

    records = []
    out.parent.mkdir(parents=True, exist_ok=True)
    for sp in sps:
        for name, (impl, section) in arms.items():
            spec = {"impl": impl, "loop": "breakdown", "seq_len": max(seq_lens), "seq_lens": list(seq_lens),
                    "sp": sp, "model": model, "section": section, "warmup": warmup, "steps": steps}
            begin = time.monotonic()
            record = {"kind": "breakdown", "name": name, **spec, **stamp()}
            try:
                record["ranks"] = launch(spec, sp, _workdir(), timeout)
            except RuntimeError as exc:
                record["error"] = str(exc)[-2000:]
                log(f"{name} sp={sp}: FAILED ({str(exc).splitlines()[-1]})")
            record["wall"] = time.monotonic() - begin
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
            if "error" not in record:
                records.append(record)
                log(f"{name} sp={sp}: {len(seq_lens)} lengths in {record['wall']:.0f}s")
    return records


def _step_of(record: dict, length_index: int) -> tuple[dict, dict]:
    """The measured step of the rank with the largest peak at one length: (length entry, step)."""
    best = None
    for rank in record["ranks"]:
        entry = rank["lengths"][length_index]
        for step in entry["steps"]:
            peak = max(seg["peak"] for seg in step["segments"].values())
            if best is None or peak > best[0]:
                best = (peak, entry, step)
    return best[1], best[2]


def _segment_kind(name: str) -> str:
    return "layer" if name.startswith("layer ") else name


def fit(record: dict) -> dict:
    """Per segment kind, its peak at each length and their least-squares slope in units per local token:
    the activation segments (``layer`` = the first layer recomputed), ``activation peak`` (the step's
    activation peak, :func:`activation_peak`) and ``step peak`` (every segment's largest, ZeRO-3's gathered
    parameters, its gradient epilogue and the optimizer step included); with the families at the largest
    length."""
    dims = _dims(record)
    points: dict[str, list] = {}
    for i in range(len(record["seq_lens"])):
        entry, step = _step_of(record, i)
        kinds = dict(_activation_segments(step, dims["layers"]))
        for name in ("backward epilogue", "step"):
            if name in step["segments"]:
                kinds[name] = step["segments"][name]
        kinds["step peak"] = max(step["segments"].values(), key=lambda seg: seg["peak"])
        for kind, seg in kinds.items():
            points.setdefault(kind, []).append((entry["local"], seg["peak"], families(seg, entry, dims)))
        points.setdefault("activation peak", []).append(
            (entry["local"], activation_peak(step, dims["layers"], entry, dims), {}))
    unit = dims["hidden"] * 4
    return {kind: {"slope_units": _slope([r[0] for r in rows], [r[1] for r in rows]) / unit,
                   "peaks": [r[1] for r in rows], "locals": [r[0] for r in rows], "families": rows[-1][2]}
            for kind, rows in points.items()}


def _dims(record: dict) -> dict:
    from .rank import MODEL_DEFAULTS

    return {**MODEL_DEFAULTS, **record.get("model", {})}


def _slope(xs, ys) -> float:
    if len(xs) < 2:
        return float("nan")
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def dims_of(record: dict):
    """The measured model as the planner's :class:`~ds_ulysses.planner.ModelDims`."""
    from ds_ulysses.planner import ModelDims

    d = _dims(record)
    return ModelDims(hidden=d["hidden"], intermediate=d["intermediate"], layers=d["layers"], heads=d["heads"],
                     kv_heads=d["kv_heads"], head_dim=d["hidden"] // d["heads"], vocab=d["vocab"])


ACTIVATION_SEGMENTS = ("forward", "loss", "head backward", "layer")


def _activation_segments(step: dict, layers: int) -> dict[str, dict]:
    """The segments whose peaks are the step's activations: ``layer`` is the first layer recomputed
    (``layer L-1``, every checkpoint still held; the layers' working sets are alike), the optimizer step and
    ZeRO's gradient epilogue are model states, not activations."""
    names = {"forward": "forward", "loss": "loss", "head backward": "head backward", "layer": f"layer {layers - 1}"}
    return {kind: step["segments"][name] for kind, name in names.items() if name in step["segments"]}


def families(seg: dict, entry: dict, dims: dict) -> dict[str, float]:
    """A segment's live tensors at its peak sorted into families again (:func:`classify`, so that a record keeps
    serving when the families are refined): family -> amount."""
    out: dict[str, float] = {}
    for _, segment, where, op, dtype, shape, n, nbytes in seg["live"]:
        dims_ = tuple(int(d) for d in shape.split("x")) if shape else ()
        family, amount = classify((nbytes / n, dims_, dtype, segment, where, op), entry["local"], entry["seq_len"],
                                  dims, tuple(entry["rows"]))
        out[family] = out.get(family, 0.0) + amount * n
    return out


def activation_peak(step: dict, layers: int, entry: dict, dims: dict) -> float:
    """The step's activation peak: the largest activation segment's peak less the fixed-size items live then
    (ZeRO-3's gathered parameters and buffers, whose prefetching varies from step to step; the planner holds
    them in its parameter terms)."""
    return max(seg["peak"] - families(seg, entry, dims).get("fixed", 0.0)
               for seg in _activation_segments(step, layers).values())


def planner_terms(record: dict) -> dict:
    """The planner's fitted terms (:class:`ds_ulysses.planner.SegmentTerms`' fields) per activation segment, from
    one record: each family's count at the segment's peak at the largest length (the one nearest the long
    sequences the planner is for), checkpoints counted beyond one per layer."""
    dims = dims_of(record)
    entry, step = _step_of(record, len(record["seq_lens"]) - 1)
    out = {}
    for kind, seg in _activation_segments(step, dims.layers).items():
        fam = families(seg, entry, _dims(record))
        out[kind] = {"units": round(fam.get("per token", 0.0), 3),
                     "checkpoints": round(fam.get("checkpoint", 0.0) - dims.layers, 3),
                     "mlp_tiles": round(fam.get("mlp tile", 0.0), 3), "loss_tiles": round(fam.get("loss tile", 0.0), 3),
                     "head_weights": round(fam.get("head weight", 0.0), 3),
                     "norm_units": round(fam.get("norm", 0.0), 3)}
    return out


def measured_terms(records: list[dict], path: str) -> dict:
    """``ds_ulysses.planner.MEASURED_TERMS``: per recipe the terms of its latest sp 1 and sp > 1 records, with the
    records named (file, date, commit, lengths)."""
    latest = {}
    for record in records:
        if record["name"] in RECIPES:
            latest[(record["name"], "sp1" if record["sp"] == 1 else "sp>1")] = record
    source = "; ".join(f"{name} sp {r['sp']}: {r['date']} at {r['commit']}, S {'/'.join(map(str, r['seq_lens']))}"
                       for (name, _), r in sorted(latest.items()))
    terms: dict = {}
    for (name, sp_class), record in sorted(latest.items()):
        terms.setdefault(name, {})[sp_class] = planner_terms(record)
    return {"source": f"{path} ({source})", "terms": terms}


def slopes(records: list[dict]) -> dict:
    """(name, sp) -> :func:`fit`."""
    return {(r["name"], r["sp"]): fit(r) for r in records if "error" not in r}


def format_breakdown(records: list[dict]) -> str:
    """The Markdown tables: per arm and sp the peaks and per-token slopes by segment, then what is live at the
    step's peak at the largest length, in units."""
    lines = ["| arm | sp | segment | peak at each sl_l (MiB) | slope (units / token) | families at the largest "
             "(units; tiles; [V,h]; fixed MiB) |", "|---|---|---|---|---|---|"]
    for (name, sp), kinds in slopes(records).items():
        for kind in ("activation peak", "step peak", *ACTIVATION_SEGMENTS, "backward epilogue", "step"):
            if kind not in kinds:
                continue
            k = kinds[kind]
            fam = ", ".join(f"{f} {v / 2**20:.1f}" if f == "fixed" else f"{f} {v:.2f}"
                            for f, v in sorted(k["families"].items()))
            lines.append(f"| {name} | {sp} | {kind} | " + " / ".join(f"{p / 2**20:.0f}" for p in k["peaks"])
                         + f" (sl_l {'/'.join(map(str, k['locals']))}) | {k['slope_units']:.2f} | {fam} |")
    for record in (r for r in records if "error" not in r):
        dims = _dims(record)
        entry, step = _step_of(record, len(record["seq_lens"]) - 1)
        name, seg = max(_activation_segments(step, dims["layers"]).items(), key=lambda kv: kv[1]["peak"])
        unit = entry["local"] * dims["hidden"] * 4
        lines += ["", f"**{record['name']}, sp {record['sp']}, S {entry['seq_len']} (sl_l {entry['local']}): live at "
                      f"the step's activation peak ({seg['peak'] / 2**20:.0f} MiB, {seg['peak'] / unit:.2f} units, in "
                      f"segment {name})**", "",
                  "| family | allocated in | by (module or autograd node) | op | dtype | shape | tensors | units |",
                  "|---|---|---|---|---|---|---|---|"]
        for _, segment, where, op, dtype, shape, n, nbytes in seg["live"]:
            if nbytes / unit < 0.05:
                continue
            family = next(iter(families({"live": [[None, segment, where, op, dtype, shape, n, nbytes]]}, entry, dims)))
            lines.append(f"| {family} | {segment} | {where} | {op} | {dtype} | {shape} | {n} | {nbytes / unit:.2f} |")
        small = sum(row[-1] for row in seg["live"] if row[-1] / unit < 0.05)
        lines.append(f"| (smaller items) | | | | | | | {small / unit:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ds_ulysses.planner import parse_size
    from ds_ulysses.train import ops

    from .bench import _parse_pairs

    parser = argparse.ArgumentParser(prog="python -m benchmarks.breakdown", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", nargs="+", default=["4K", "8K", "12K"], help="global lengths (three or more)")
    parser.add_argument("--sp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--arm", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--tiled-attention", type=int, default=0, metavar="N",
                        help="add an arm ours[tiled_attention] with \"tiled_attention\": {\"enabled\": true, "
                             "\"shards\": N} (needs a ds_ulysses whose section has that field)")
    parser.add_argument("--tiled-norms", action="store_true",
                        help="add an arm with \"tiled_norms\": {\"enabled\": true} on top of ours (of "
                             "ours[tiled_attention] with --tiled-attention)")
    parser.add_argument("--model", action="append", default=[], metavar="KEY=INT",
                        help="model overrides on issue 67's Llama-3.1-8B-shaped model (hidden 1024, ...)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/breakdown.jsonl")
    parser.add_argument("--report-only", action="store_true", help="print the tables of the records in --out")
    parser.add_argument("--terms", action="store_true", help="also print the planner's fitted terms (as "
                                                             "ds_ulysses.planner.MEASURED_TERMS holds them)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not args.report_only:
        try:
            seq_lens = [parse_size(s) for s in args.seq_len]
            model = {**LLAMA8B_SHAPED, **_parse_pairs(args.model, "--model", int)}
        except ValueError as exc:
            print(f"breakdown: {exc}", file=sys.stderr)
            return 2
        if len(seq_lens) < 3:
            print(f"breakdown: a slope needs three lengths or more, got {args.seq_len}", file=sys.stderr)
            return 2
        arms = {arm: (arm, ALST_SECTION if arm == "ours" else {}) for arm in args.arm}
        if args.tiled_attention:
            arms["ours[tiled_attention]"] = ("ours", {**ALST_SECTION, "tiled_attention": {
                "enabled": True, "shards": args.tiled_attention}})
        if args.tiled_norms:  # on top of the tiled-attention arm when there is one
            base = arms["ours[tiled_attention]"][1] if args.tiled_attention else ALST_SECTION
            name = "ours[tiled_attention,tiled_norms]" if args.tiled_attention else "ours[tiled_norms]"
            arms[name] = ("ours", {**base, "tiled_norms": {"enabled": True}})
        ops.use_venv_cache()
        ops.build()
        run_breakdown(sorted(seq_lens), args.sp, arms, out, model, args.warmup, args.steps)
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("kind") == "breakdown" and "error" not in r]
    print(format_breakdown(records))
    if args.terms:
        print(json.dumps(measured_terms(records, str(out)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

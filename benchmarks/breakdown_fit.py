"""What ``python -m benchmarks.breakdown``'s records say: each segment's peak and per-token slope over the
lengths, and the planner's fitted terms.

:func:`fit` gives each segment's peak and per-token slope over the lengths (:mod:`benchmarks.breakdown_loop`
names the segments and the families); :func:`planner_terms` the family counts that ``ds_ulysses.planner``
holds with the record they came from (``MEASURED_TERMS``, :func:`measured_terms`); :func:`format_breakdown`
the Markdown tables.
"""

from __future__ import annotations

import statistics

from .arms import BREAKDOWN_RECIPES, MODEL_DEFAULTS
from .breakdown_loop import classify

__all__ = ["fit", "dims_of", "ACTIVATION_SEGMENTS", "activation_peak", "families", "planner_terms", "measured_terms",
           "slopes", "format_breakdown"]


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
        if record["name"] in BREAKDOWN_RECIPES:
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

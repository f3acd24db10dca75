"""The tables of the modes other than training steps: the attention layer alone (``--layer-iters``), the tiled
operations at equal shards (``--tiled-iters``) and the longest sequence in a memory budget (``--max-seq``).

Each is judged as the training steps are (:mod:`benchmarks.tables`): ours / DeepSpeed per launch or process,
the median over them with its spread, against the noise arm's largest distance from DeepSpeed.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ds_ulysses.constants import GIB

from .arms import NOISE_ARM, TILED_OPS
from .tables import STYLES, md_table, noise_text, save_seq_plot, seq_text, spread, target_verdict

__all__ = ["format_layer", "format_tiled", "tiled_ratio", "format_maxseq", "latest_searches", "plot_maxseq"]


def format_layer(records: list[dict]) -> str:
    """:mod:`benchmarks.layer` results: one row per (S, sp) over its launches: each launch's median
    seconds per arm (median [min-max] over the launches), ours / DeepSpeed per launch, the noise (the
    largest ``|again / DeepSpeed - 1|`` over launches that ran the noise arm, "-" if none did) and the
    verdict against <= 1 by :func:`target_verdict`."""
    groups: dict[tuple, list[dict]] = {}
    for rec in (r for r in records if r.get("kind") == "layer" and r.get("result")):
        groups.setdefault((rec["seq_len"], rec["sp"]), []).append(rec["result"])
    rows = []
    for (seq_len, sp), results in sorted(groups.items()):
        ratios = [res["ours_s"] / res["deepspeed_s"] for res in results]
        again = [res[f"{NOISE_ARM}_s"] / res["deepspeed_s"] for res in results if f"{NOISE_ARM}_s" in res]
        noise = max(abs(r - 1) for r in again) if again else None
        seconds = [spread([res[f"{arm}_s"] for res in results], 3) for arm in ("deepspeed", "ours")]
        rows.append([seq_text(seq_len), sp, f"{len(results)} x {results[0]['iters']}", *seconds,
                     f"**{spread(ratios)}**", noise_text(noise), target_verdict(statistics.median(ratios), noise, 1.0),
                     "yes" if all(res["same_output_and_grad"] for res in results) else "NO"])
    return md_table(["S", "sp", "launches x iterations", "DeepSpeed s", "ours s", "ours / DS", "noise", "<= 1",
                   "same output and grad"], rows)


def _scaled_spread(values, scale=1.0, digits=3) -> str:
    values = [v / scale for v in values]
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def tiled_ratio(res: dict, arm: str, key: str) -> float:
    base = res[f"deepspeed_{key}"]
    return res[f"{arm}_{key}"] / base if base > 0 else float("nan")


def format_tiled(records: list[dict]) -> str:
    """One row per (operation, length): medians over the repetitions of each process's medians, ours /
    DeepSpeed per process with its spread, the noise arm's largest distance from 1, and the verdict
    against the issue's target (<= 1.0)."""
    groups: dict[tuple, list[dict]] = {}
    for rec in records:
        if rec.get("result"):
            groups.setdefault((rec["seq_len"], TILED_OPS.index(rec["op"])), []).append(rec["result"])
    rows = []
    for (seq_len, op_index), results in sorted(groups.items()):
        cells = [TILED_OPS[op_index], seq_text(seq_len), results[0]["shards"],
                 f"{len(results)} x {results[0]['iters']}"]
        for key, scale, digits, ratio_digits in (("s", 1.0, 3, 2), ("peak", 2**20, 2, 3)):
            ratios = [tiled_ratio(res, "ours", key) for res in results]
            noise = max(abs(tiled_ratio(res, NOISE_ARM, key) - 1) for res in results)
            cells += [_scaled_spread([res[f"deepspeed_{key}"] for res in results], scale, digits),
                      _scaled_spread([res[f"ours_{key}"] for res in results], scale, digits),
                      f"**{_scaled_spread(ratios, digits=ratio_digits)}**", noise_text(noise),
                      target_verdict(statistics.median(ratios), noise, 1.0)]
        rows.append(cells + _tensor_cells([res for res in results if "ours_tensor_peak" in res])
                    + ["yes" if all(res["same_output_and_grads"] for res in results) else "NO"])
    return md_table(["operation", "sl (one rank)", "shards", "processes x iterations", "DeepSpeed s", "ours s",
                   "time ours/DS", "noise", "time <= 1", "DeepSpeed peak MiB above base", "ours peak MiB",
                   "memory ours/DS", "noise", "memory <= 1", "processes with tensor peaks",
                   "DeepSpeed tensor peak MiB", "tensor peak ours - DS, bytes", "noise, bytes", "tensor peak <= DS",
                   "same output and grads"], rows)


def _tensor_cells(results: list[dict]) -> list[str]:
    """The tensor-peak cells of a row: ours - DeepSpeed in bytes per process (median [min, max]), the noise
    arm's largest distance from DeepSpeed, and the verdict on the median against it."""
    if not results:
        return ["0", "-", "-", "-", "-"]
    diffs = [res["ours_tensor_peak"] - res["deepspeed_tensor_peak"] for res in results]
    noise = max(abs(res[f"{NOISE_ARM}_tensor_peak"] - res["deepspeed_tensor_peak"]) for res in results)
    diff = statistics.median(diffs)
    verdict = ("met" if diff + noise <= 0 else f"missed by +{diff:g} B" if diff - noise > 0
               else "undecided (within noise)")
    return [str(len(results)), _scaled_spread([res["deepspeed_tensor_peak"] for res in results], 2**20, 2),
            f"**{diff:+g} [{min(diffs):+g}, {max(diffs):+g}]**", f"{noise:g}", verdict]


def format_maxseq(records: list[dict]) -> str:
    """One row per (budget, sp, steps per probe, arm): the longest S, the next length measured not to fit,
    ratios to DeepSpeed's tutorial recipe and to DeepSpeed with every ALST tool searched the same way."""
    latest = latest_searches(records)
    rows = []
    for (budget, sp, steps, model, name), rec in sorted(latest.items()):
        base = latest.get((budget, sp, steps, model, "deepspeed"))
        alst = latest.get((budget, sp, steps, model, "deepspeed-alst"))

        def ratio(other):
            if other is None or not other["max_seq"]:
                return "-"
            return f"**{rec['max_seq'] / other['max_seq']:.2f}**"

        probes = ", ".join(f"{seq_text(s)}{'' if p is not None else '✗'}" for s, p in rec["probes"])
        longest = seq_text(rec["max_seq"]) if rec["max_seq"] else "none"
        if rec["max_seq"] and rec["max_seq"] == rec.get("cap"):
            longest = f">= {longest} (the search's cap)"
        rows.append([f"{budget / GIB:.2f}", sp, steps, name, longest,
                     seq_text(rec["next_failed"]) if rec["next_failed"] else "-", ratio(base), ratio(alst), probes,
                     f"{rec['seconds'] / 60:.1f}"])
    return md_table(["budget GiB/rank", "sp", "steps per probe", "arm", "longest S that fits", "next S (over budget)",
                   "vs DeepSpeed tutorial", "vs DeepSpeed + ALST tools", "probes (✗: over budget)", "minutes"], rows)


def latest_searches(records: list[dict]) -> dict:
    """(budget, sp, steps per probe, model, arm) -> that arm's latest search: what the table and plot show."""
    latest = {}
    for rec in records:
        key = (rec["budget"], rec["sp"], rec.get("probe_steps", 1), json.dumps(rec.get("model", {}), sort_keys=True))
        latest[(*key, rec["name"])] = rec
    return latest


def plot_maxseq(records: list[dict], path: Path) -> Path:
    """Peak RSS of every probe that fitted against S, per arm's latest search (as in the table), with the
    budget line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    records = [rec for _, rec in sorted(latest_searches(records).items())]
    for rec in records:
        points = sorted((s, p / GIB) for s, p in rec["probes"] if p is not None)
        ax.plot([p[0] for p in points], [p[1] for p in points], STYLES.get(rec["name"], "x-"),
                label=f"{rec['name']} sp={rec['sp']}: {rec['max_seq']}")
    for budget in sorted({rec["budget"] for rec in records}):
        ax.axhline(budget / GIB, color="grey", lw=0.8, ls="--")
    return save_seq_plot(fig, ax, "peak RSS per rank (GiB), probes that fit", path)

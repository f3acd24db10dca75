"""The records: one JSON line per launch, appended as it ends, and what a launch's figures are.

Every suite appends one record per launch to its results file (``benchmarks/results/*.jsonl``), stamped with
when, where and at what code it ran (:func:`stamp`), so long suites survive interruption and the report rebuilds
every table from the file. This module reads and writes those lines and holds the rules that turn a record into
figures: a launch's step time (:func:`launch_time`: its fastest adapter refill cycle), work (:func:`launch_cpu`),
memory (:func:`launch_peak`), whether it ran in a steal spell (:func:`calm`), its configuration
(:func:`setup_key`), and the pairing of each launch with DeepSpeed's of the same run and repetition
(:func:`paired_launches`), which every ratio in the report is taken over.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from ds_ulysses.constants import GIB

from .arms import NOISE_ARM

__all__ = ["append_record", "read_records", "stamp", "machine", "commit", "launch_time", "launch_cpu",
           "launch_faults", "launch_peak", "calm", "STEAL_LIMIT", "model_key", "setup_key", "summarize",
           "every_pair", "calm_pair", "paired_launches", "paired", "screened", "noise_of"]

# A launch during which the host stole more than this share of the machine's CPU time ran in a steal spell: the
# report leaves out the pairs it enters (:func:`calm`). Calm launches here stole 0.1-2.2%, spells 5.7-31.7% (2026-11-29)
STEAL_LIMIT = 0.05


def append_record(out: Path, record: dict) -> None:
    """Append one record to the results file ``out`` as one JSON line (the moment its launch ends)."""
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_records(path: Path) -> list[dict]:
    """Every record of a results file, in the order written."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def machine() -> str:
    """What ran a launch: the CPU model, the CPUs this process may use and the memory, e.g.
    ``Intel(R) Xeon(R) Processor, 2 CPUs, 23.4 GiB`` (sessions here have had different CPU models)."""
    model = "unknown CPU"
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), model)
        kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return f"{model}, {len(os.sched_getaffinity(0))} CPUs"
    return f"{model}, {len(os.sched_getaffinity(0))} CPUs, {kib * 1024 / GIB:.1f} GiB"


def commit(root: Path | None = None) -> str:
    """The checkout's commit (short hash, ``+changes`` when its tracked files differ from it), or ``unknown``.
    The results under ``benchmarks/results`` are not the code measured: a suite appending to the tracked
    ``runs.jsonl`` left every record after its first marked ``+changes``."""
    root = root or Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"], cwd=root, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def stamp() -> dict:
    """The fields every record carries to say when, where and at what code it was measured."""
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "commit": commit()}


def launch_time(record: dict) -> float:
    """A launch's step time: the fastest adapter refill cycle's mean step (the slowest rank's step).

    Any ``sp`` consecutive steps hold exactly one refill, so each cycle costs what a user's loop costs;
    the fastest cycle is the one least disturbed by whatever else the machine ran meanwhile (the
    reasoning of ``timeit``'s minimum). A launch shorter than a cycle, or with a partial last one,
    counts every measured step.
    """
    return _fastest_cycle([max(t) for t in zip(*(r["times"] for r in record["ranks"]))], record.get("sp", 1))


def _fastest_cycle(steps: list[float], sp: int) -> float:
    if not steps:
        return float("nan")
    if len(steps) % sp:
        return statistics.mean(steps)
    return min(statistics.mean(steps[i:i + sp]) for i in range(0, len(steps), sp))


def launch_cpu(record: dict) -> float | None:
    """A launch's work per step: the CPU seconds of all its ranks' processes per step, over the adapter refill
    cycle that took the fewest (as :func:`launch_time` picks its fastest). Unlike the step time it holds no
    waiting for a peer and no time the host took the virtual CPUs away. None for a record measured before
    ranks took it (2026-11-29)."""
    if not all("cpu_times" in r for r in record["ranks"]):
        return None
    return _fastest_cycle([sum(t) for t in zip(*(r["cpu_times"] for r in record["ranks"]))], record.get("sp", 1))


def launch_faults(record: dict) -> float | None:
    """A launch's minor page faults per step, all ranks together (median over its measured steps): the pages
    a step touched fresh, each a trip through the guest's kernel that both libraries' allocations pay alike.
    None for a record measured before ranks counted them (2026-11-29 09:05)."""
    if not all("minor_faults" in r for r in record["ranks"]):
        return None
    return statistics.median(sum(f) for f in zip(*(r["minor_faults"] for r in record["ranks"])))


def calm(record: dict) -> bool:
    """Whether a launch ran outside a steal spell: the host took at most :data:`STEAL_LIMIT` of the machine's CPU
    time while it ran. A spell slowed identical steps by 22-41% here while their work moved 5-7%, so a ratio over
    such a launch measures the host. Records from before 2026-11-29 carry no ``stolen`` and count as calm."""
    return not record.get("stolen", 0.0) > STEAL_LIMIT


def launch_peak(record: dict) -> int:
    """A launch's memory: the largest rank's peak RSS (setup and measured steps)."""
    return max(r["peak"] for r in record["ranks"])


def model_key(model: dict | None) -> str:
    """A short tag of the model overrides ('' for the default model)."""
    return ",".join(f"{k}={v}" for k, v in sorted((model or {}).items()))


def setup_key(record: dict) -> str:
    """A configuration's tag beyond S, sp and packing: its model overrides and the allocator settings its ranks ran
    with (``env NAME=VALUE``); '' for the default model in the default environment."""
    env = [f"env {name}={value}" for name, value in sorted(record.get("host_env", {}).items())]
    return " ".join(filter(None, [model_key(record.get("model")), *env]))


def summarize(records: list[dict], kind: str = "step") -> dict:
    """(name, S, sp, packed, :func:`setup_key`) -> pooled medians and per-layer communication (every launch of `kind`:
    ``step`` for the engine loop, ``trainer`` for the Trainer's, ``accelerate`` for the plain
    Accelerate loop's, ``trl`` for SFTTrainer's)."""
    groups: dict = {}
    for rec in (r for r in records if "error" not in r and r.get("kind", "step") == kind):
        key = (rec["name"], rec["seq_len"], rec["sp"], rec.get("packed_docs", 0), setup_key(rec))
        groups.setdefault(key, []).append(rec)
    out = {}
    for key, recs in groups.items():
        r0 = recs[0]["ranks"][0]
        layers = max(1, r0["attn_forward_calls"])
        out[key] = {
            "time": statistics.median(launch_time(rec) for rec in recs),
            "phases": [statistics.median(p[i] for rec in recs for r in rec["ranks"] for p in r["phases"])
                       for i in range(len(r0["phases"][0]))] if r0["phases"] else [],
            "peak": statistics.median(launch_peak(rec) for rec in recs),
            "steps_peak": statistics.median(max(r["steps_peak"] or r["peak"] for r in rec["ranks"]) for rec in recs),
            "launches": len(recs), "steps": sum(len(rec["ranks"][0]["times"]) for rec in recs),
            "loss": recs[0]["ranks"][0]["losses"][0],
            "attn_calls": {k: v / layers for k, v in r0["attn_forward"]["calls"].items()},
            "attn_sent": sum(r0["attn_forward"]["sent"].values()) / layers,
            "attn_off_rank": sum(r0["attn_forward"]["off_rank"].values()) / layers,
            "bwd_a2a": r0["backward"]["calls"].get("all_to_all_single", 0) / layers,
            "refill_received": sum(r0["refill"]["received"].values()) / max(1, r0["refills"]),
            "refill_calls": {k: v / max(1, r0["refills"]) for k, v in r0["refill"]["calls"].items()},
            "model": recs[0].get("model", {}),
            "section": recs[0].get("section", {}),
        }
    return out


def _config(rec: dict) -> tuple:
    return rec["seq_len"], rec["sp"], rec.get("packed_docs", 0), setup_key(rec)


def every_pair(records: list[dict], kind: str) -> dict:
    runs = [r for r in records if "error" not in r and r.get("kind", "step") == kind and "rep" in r]
    base = {(r.get("run"), r["rep"], *_config(r)): r for r in runs if r["name"] == "deepspeed"}
    out: dict = {}
    for rec in runs:
        ds = base.get((rec.get("run"), rec["rep"], *_config(rec)))
        if rec["name"] != "deepspeed" and ds is not None:
            out.setdefault((rec["name"], *_config(rec)), []).append((rec, ds))
    return out


def calm_pair(rec: dict, ds: dict) -> bool:
    return calm(rec) and calm(ds)


def paired_launches(records: list[dict], kind: str = "step") -> dict:
    """(name, S, sp, packed, model) -> [(launch, deepspeed launch)], one per repetition: each launch with
    the ``deepspeed`` launch of the same run and repetition, among the launches of `kind` (``step``: the
    engine loop; ``trainer``: the Trainer's; ``accelerate``: the plain Accelerate loop's; ``trl``: SFTTrainer's).
    A pair with a launch in a steal spell (:func:`calm`) is left out (:func:`benchmarks.report.spell_notes` names
    it)."""
    out: dict = {}
    for key, pairs in every_pair(records, kind).items():
        kept = [pair for pair in pairs if calm_pair(*pair)]
        if kept:
            out[key] = kept
    return out


def screened(records: list[dict]) -> list[dict]:
    """The launches that recorded the host's stolen share (since 2026-11-29): the only ones a steal spell can
    be told in. An older launch counts as calm (:func:`calm`) but may have run in a spell, so
    a configuration judged on these alone has its ratios and its noise equally free of one."""
    return [r for r in records if r.get("stolen") is not None]


def paired(records: list[dict], kind: str = "step") -> dict:
    """(name, S, sp, packed, model) -> [(time ratio, memory ratio)], one per repetition."""
    return {key: [(launch_time(rec) / launch_time(ds), launch_peak(rec) / launch_peak(ds)) for rec, ds in launches]
            for key, launches in paired_launches(records, kind).items()}


def noise_of(pairs: dict, config: tuple) -> tuple[float, float, int] | None:
    """(time noise, memory noise, repetitions) of a configuration: max |ratio - 1| of the noise arm."""
    same = pairs.get((NOISE_ARM, *config))
    if not same:
        return None
    return max(abs(t - 1) for t, _ in same), max(abs(m - 1) for _, m in same), len(same)

"""What each mode of the harness runs: its launches, in which order, and the record each one leaves.

- :func:`run_suite` (``ds-ulysses bench``): every configuration (S, sp) runs each arm once per repetition, in
  an order rotated per repetition (A B C D, B C D A, ...), each launch a fresh process group; each ratio is
  later taken within a repetition, so slow drifts in machine load cancel. It runs the engine loop or, with
  ``loop``, the Trainer's, a plain Accelerate loop or TRL's SFTTrainer (records of kind ``step``, ``trainer``,
  ``accelerate``, ``trl``), and prints each configuration's tables as it ends (:func:`benchmarks.report.format_group`);
- :func:`run_layer_suite` (``--layer-iters``): the attention layer alone (:mod:`benchmarks.layer`);
- :func:`run_tiled_suite` (``--tiled-iters``): the tiled operations, one process each (:mod:`benchmarks.tiled`);
- :func:`run_breakdown` (``python -m benchmarks.breakdown``): one launch per arm and sp, training every length
  under live-tensor tracking (:mod:`benchmarks.breakdown_loop`).

The longest-sequence search (``--max-seq``) is :mod:`benchmarks.maxseq`. Every launch appends its record the
moment it ends (:func:`benchmarks.records.append_record`), so a long suite survives interruption; a launch that
fails is recorded with its error and the suite goes on.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ds_ulysses.constants import GIB

from .arms import LOOPS, NOISE_ARM, TILED_OPS, arms
from .launch import ALLOCATOR_ENV, launch, workdir
from .measure import cpu_ticks, loadavg, stolen
from .records import STEAL_LIMIT, append_record, calm, launch_cpu, launch_faults, launch_peak, launch_time, stamp
from .report import format_group

__all__ = ["run_suite", "run_layer_suite", "run_tiled_suite", "run_breakdown", "MALLOC_ENV"]

# the tiled operations' processes: freed tensors leave the RSS at once, so each arm's RSS mark is its own
# (glibc would otherwise keep one implementation's freed blocks resident and hand them to the other for free)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 17), "MALLOC_TRIM_THRESHOLD_": str(1 << 17)}


def run_suite(seq_lens, sps, impls, reps: int, steps: int | None, warmup: int, out: Path, packed_docs: int = 0,
              model: dict | None = None, variants: dict | None = None, timeout: float = 1800.0,
              noise: bool = True, profile_reps: int = 1, cycles: int = 1, warm_up: bool = True,
              log=print, loop: str = "engine", host_env: dict | None = None) -> list[dict]:
    """Every (S, sp) with every arm, ``reps`` rotations; each launch appended to ``out``.

    With ``warm_up``, one launch of the first arm and configuration runs first and is not recorded:
    on this kind of machine the first launch after an idle spell runs every step about 15% slower.

    ``steps`` None means ``cycles`` adapter refill cycles of sp steps; ``variants`` maps a name to a ``"ulysses"``
    section override for an extra ``ours`` arm; the first ``profile_reps`` repetitions also profile
    one adapter refill cycle (sp steps) per launch (:mod:`benchmarks.profile`). ``loop`` "trainer" trains
    each arm through Transformers' Trainer (:mod:`benchmarks.trainer`), "accelerate" through a plain
    Accelerate loop (:mod:`benchmarks.accelerate_loop`), "trl" through TRL's SFTTrainer
    (:mod:`benchmarks.trl_loop`). ``host_env`` (names to values) is set in every rank of every arm; each record
    names it beside the :data:`ALLOCATOR_ENV` settings the ranks inherit (``host_env``).
    """
    entries = arms(impls, variants, noise)
    run_id = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    records = []
    out.parent.mkdir(parents=True, exist_ok=True)
    ranks_env = {**{name: os.environ[name] for name in ALLOCATOR_ENV if name in os.environ}, **(host_env or {})}

    def spec_of(impl, seq_len, sp, section, profile):
        return {"impl": impl, "loop": loop, "seq_len": seq_len, "sp": sp, "steps": steps or cycles * sp,
                "warmup": warmup, "packed_docs": packed_docs, "model": model or {}, "section": section,
                "profile": profile, "host_env": ranks_env}

    if warm_up:
        name, impl, _, section = entries[0]
        begin = time.monotonic()
        try:
            launch(spec_of(impl, seq_lens[0], sps[0], section, False), sps[0], workdir(), timeout)
            outcome = "not recorded"
        except RuntimeError as exc:  # it only warms the machine: a failure here must not void the suite
            outcome = f"FAILED ({str(exc).splitlines()[-1]}), going on"
        log(f"{name:>24} S={seq_lens[0]:>6} sp={sps[0]}: machine warm-up launch, {outcome} "
            f"({time.monotonic() - begin:.0f}s)")
    for seq_len in seq_lens:
        for sp in sps:
            group = []
            for rep in range(reps):
                shift = rep % len(entries)
                for order, (name, impl, variant, section) in enumerate(entries[shift:] + entries[:shift]):
                    spec = spec_of(impl, seq_len, sp, section, rep < profile_reps)
                    begin, ticks = time.monotonic(), cpu_ticks()
                    record = {"kind": LOOPS[loop], **spec, "variant": variant, "name": name, "rep": rep, "order": order,
                              "run": run_id, **stamp(), "load_before": loadavg()}
                    try:
                        record["ranks"] = launch(spec, sp, workdir(), timeout)
                    except RuntimeError as exc:  # keep going: one broken configuration must not void the suite
                        record["error"] = str(exc)[-2000:]
                        log(f"{name:>24} S={seq_len:>6} sp={sp} rep={rep}: FAILED ({str(exc).splitlines()[-1]})")
                    record["load_after"] = loadavg()
                    record["wall"], record["stolen"] = time.monotonic() - begin, stolen(ticks)
                    append_record(out, record)
                    if "error" in record:
                        continue
                    records.append(record)
                    group.append(record)
                    log(f"{name:>24} S={seq_len:>6} sp={sp} packed={packed_docs} rep={rep}: "
                        f"step {launch_time(record):.2f}s, work {launch_cpu(record):.2f} CPU s, "
                        f"faults {launch_faults(record) / 1e6:.2f}M/step, "
                        f"peak {launch_peak(record) / GIB:.2f} GiB, launch {record['wall']:.0f}s, "
                        f"load {record['load_before']:.1f}->{record['load_after']:.1f}, "
                        f"stolen {record['stolen']:.1%}"
                        + ("" if calm(record) else f" (a steal spell, over {STEAL_LIMIT:.0%}: left out of the "
                                                   "ratios it enters)"))
            if group:
                log(format_group(group, LOOPS[loop]))
    return records


def run_layer_suite(seq_lens, sps, iters: int, out: Path, timeout: float = 1800.0, log=print,
                    reps: int = 1) -> list[dict]:
    """The attention layer alone (:mod:`benchmarks.layer`): DeepSpeed's wrapper, its noise arm and ours
    interleaved per iteration, one launch per length and sp in each of ``reps`` repetitions (every
    configuration once per repetition, so a configuration's launches are minutes apart)."""
    records = []
    out.parent.mkdir(parents=True, exist_ok=True)
    for rep in range(reps):
        for seq_len in seq_lens:
            for sp in sps:
                spec = {"impl": "layer", "seq_len": seq_len, "sp": sp, "iters": iters}
                result = launch(spec, sp, workdir(), timeout)[0]
                record = {**spec, "kind": "layer", "name": "layer", "rep": rep, "result": result, **stamp()}
                append_record(out, record)
                records.append(record)
                log(f"rep {rep} attention layer S={seq_len} sp={sp}: " + ", ".join(
                    f"{k[:-2]} {v:.3f}s" for k, v in result.items() if k.endswith("_s")))
    return records


def run_tiled_suite(seq_lens, iters: int, out: Path, timeout: float = 1800.0, ops=TILED_OPS, log=print,
                    reps: int = 3) -> list[dict]:
    """Each operation at each per-rank length, in its own process, ``reps`` times (every operation and
    length once per repetition, so a repetition's processes are minutes apart)."""
    records = []
    out.parent.mkdir(parents=True, exist_ok=True)
    saved = {k: os.environ.get(k) for k in MALLOC_ENV}
    os.environ.update(MALLOC_ENV)
    try:
        for rep in range(reps):
            for seq_len in seq_lens:
                for op in ops:
                    spec = {"impl": "tiled", "op": op, "seq_len": seq_len, "sp": 1, "iters": iters}
                    record = {"kind": "tiled", **spec, "name": op, "rep": rep, **stamp()}
                    try:
                        record["result"] = launch(spec, 1, workdir(), timeout)[0]
                    except RuntimeError as exc:
                        record["error"] = str(exc)[-2000:]
                    append_record(out, record)
                    if "error" in record:
                        log(f"rep {rep} {op} sl={seq_len}: FAILED ({record['error'].splitlines()[-1]})")
                        continue
                    records.append(record)
                    res = record["result"]
                    log(f"rep {rep} {op} sl={seq_len} shards={res['shards']}: " + ", ".join(
                        f"{name} {res[f'{name}_s']:.3f}s {res[f'{name}_peak'] / 2**20:.0f} MiB"
                        for name in ("deepspeed", NOISE_ARM, "ours")))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return records


def run_breakdown(seq_lens, sps, arm_sections: dict, out: Path, model: dict, warmup: int = 1, steps: int = 1,
                  timeout: float = 3600.0, log=print) -> list[dict]:
    """One launch per (arm, sp), each training every length; one record per launch appended to ``out``.
    ``arm_sections``: arm name -> (implementation, ``"ulysses"`` section)."""
    records = []
    out.parent.mkdir(parents=True, exist_ok=True)
    for sp in sps:
        for name, (impl, section) in arm_sections.items():
            spec = {"impl": impl, "loop": "breakdown", "seq_len": max(seq_lens), "seq_lens": list(seq_lens),
                    "sp": sp, "model": model, "section": section, "warmup": warmup, "steps": steps}
            begin = time.monotonic()
            record = {"kind": "breakdown", "name": name, **spec, **stamp()}
            try:
                record["ranks"] = launch(spec, sp, workdir(), timeout)
            except RuntimeError as exc:
                record["error"] = str(exc)[-2000:]
                log(f"{name} sp={sp}: FAILED ({str(exc).splitlines()[-1]})")
            record["wall"] = time.monotonic() - begin
            append_record(out, record)
            if "error" not in record:
                records.append(record)
                log(f"{name} sp={sp}: {len(seq_lens)} lengths in {record['wall']:.0f}s")
    return records

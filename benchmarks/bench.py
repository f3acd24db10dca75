"""``ds-ulysses bench`` (or ``python -m benchmarks.bench``): DeepSpeed's ALST module and ours, side by
side, in alternating fresh launches, with the benchmark's own noise measured in the same run.

Every configuration (S, sp) runs each *arm* once per repetition, in an order rotated per repetition
(A B C D, B C D A, ...), each launch a fresh process group of ``sp`` processes
(:mod:`benchmarks.rank`). The arms: ``deepspeed`` (DeepSpeed's module + tutorial recipe), the
same again as ``deepspeed[again]`` (the noise arm: identical code, so its ratio to ``deepspeed`` is
what this machine does to a ratio), ``ours-dropin``, ``ours`` and any ``ours[variant]``. A launch's
step time is the fastest of its measured adapter refill cycles (sp steps each, ``--cycles``), as the
mean of the slowest rank's whole user-loop steps; its memory is the largest rank's peak RSS; its work the
CPU seconds of all ranks per step (:func:`launch_cpu`), beside which the record keeps the share of the
machine's CPU time the host stole while it ran (``stolen``, from ``/proc/stat``). Each ratio is taken
within a repetition (arm / ``deepspeed`` of the same repetition), so slow drifts in machine load cancel,
and is reported as the median over repetitions with its spread (:mod:`benchmarks.report`). Launches whose ranks
ran with other memory-allocator settings (``--host-env``, or inherited: :data:`ALLOCATOR_ENV`) are a configuration
of their own (:func:`setup_key`).

``--loop trainer`` runs the same arms through Transformers' Trainer (:mod:`benchmarks.trainer`) and
``--loop accelerate`` through a plain Accelerate loop (:mod:`benchmarks.accelerate_loop`) and ``--loop trl``
through TRL's SFTTrainer (:mod:`benchmarks.trl_loop`): DeepSpeed's through the documented
``parallelism_config``, ours through the section; their records are kind ``trainer``, ``accelerate`` and
``trl``, each reported apart from the engine loop's.

Other modes: ``--layer-iters`` (the attention layer alone, :mod:`benchmarks.layer`), ``--tiled-iters``
(TiledMLP and sequence_tiled_compute against DeepSpeed's, :mod:`benchmarks.tiled`) and
``--max-seq BUDGET`` (the longest sequence whose step fits a per-rank RSS budget,
:mod:`benchmarks.maxseq`). Every launch appends one JSON line to the results file, so long suites
survive interruption and :mod:`benchmarks.report` rebuilds the tables and plots from it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ds_ulysses.constants import GIB
from ds_ulysses.planner import parse_size

__all__ = ["add_arguments", "run_command", "main", "launch", "OverBudget", "run_suite", "run_layer_suite", "summarize",
           "impl_name", "arms", "parse_bytes", "launch_time", "launch_cpu", "launch_faults", "launch_peak", "calm",
           "stamp", "setup_key", "NOISE_ARM", "STEAL_LIMIT", "TILED_OPS", "ALLOCATOR_ENV",
           "HARNESS_ENV"]

_IMPLS = ("deepspeed", "ours-dropin", "ours", "deepspeed-alst")
LOOPS = {"engine": "step", "trainer": "trainer", "accelerate": "accelerate", "trl": "trl"}  # --loop -> records' kind
NOISE_ARM = "deepspeed[again]"
# A launch during which the host stole more than this share of the machine's CPU time ran in a steal spell: the
# report leaves out the pairs it enters (:func:`calm`). Calm launches here stole 0.1-2.2%, spells 5.7-31.7% (2026-11-29)
STEAL_LIMIT = 0.05
TILED_OPS = ("tiled_mlp", "stc_mlp", "stc_loss", "fused_loss")  # --tiled-iters' operations (benchmarks.tiled)
# The memory allocator's settings a launch inherits: each record names those set (``host_env``), and launches run
# with different ones are different configurations in the report (:func:`setup_key`). Here glibc's mmap off took 8%
# off DeepSpeed's CPU work for 50-65% more memory (2026-11-29): as much as the differences measured between arms
ALLOCATOR_ENV = ("THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_",
                 "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_")


def _rank_env(rank: int, world: int, port: int, pythonpath: str, threads: int) -> dict[str, str]:
    """What :func:`launch` sets for every rank itself, on top of the host environment."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "PYTHONPATH": pythonpath,
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(threads)}


# --host-env cannot override these
HARNESS_ENV = tuple(_rank_env(0, 1, 0, "", 1))


def impl_name(impl: str, variant: str | None) -> str:
    return impl if not variant else f"{impl}[{variant}]"


def arms(impls, variants: dict | None = None, noise: bool = True) -> list[tuple[str, str, str | None, dict]]:
    """(name, impl, variant, section) per arm: the implementations, the noise arm after ``deepspeed``,
    then one ``ours[variant]`` per variant."""
    out = []
    for impl in impls:
        out.append((impl, impl, None, {}))
        if impl == "deepspeed" and noise:
            out.append((NOISE_ARM, "deepspeed", "again", {}))
    out += [(impl_name("ours", name), "ours", name, section) for name, section in (variants or {}).items()]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def _cpu_ticks() -> tuple[int, int]:
    """(stolen, all) clock ticks of this machine's CPUs so far (``/proc/stat``): ``stolen`` is the time the
    host ran something else on the virtual CPUs while they had work."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def _stolen(before: tuple[int, int]) -> float:
    """The share of the machine's CPU time stolen by the host since ``before`` (:func:`_cpu_ticks`)."""
    stolen, total = _cpu_ticks()
    return (stolen - before[0]) / (total - before[1]) if total > before[1] else float("nan")


class OverBudget(RuntimeError):
    """A launch stopped because a rank's RSS high-water mark passed the limit it was given."""

    def __init__(self, rank: int, peak: int):
        super().__init__(f"rank {rank} reached {peak / GIB:.2f} GiB of RSS, over the budget")
        self.rank, self.peak = rank, peak


def _hwm_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def launch(spec: dict, world: int, workdir: Path, timeout: float = 1800.0, rss_limit: int | None = None) -> list[dict]:
    """Run one implementation on ``world`` fresh processes; return every rank's measurements. The ranks inherit
    this process's environment with ``spec["host_env"]`` (names to values) set on top.

    With ``rss_limit`` (bytes), the ranks are stopped as soon as one's RSS high-water mark passes it
    (read from ``/proc``, so no spike between two looks is missed), raising :class:`OverBudget`.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="spec-", suffix=".json", dir=workdir)
    with os.fdopen(fd, "w") as f:
        json.dump(spec, f)
    port = _free_port()
    root = str(Path(__file__).resolve().parent.parent)  # the ranks import this checkout's benchmarks and ds_ulysses
    path_env = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    procs, logs = [], []
    for rank in range(world):
        env = {**os.environ, **spec.get("host_env", {}),
               **_rank_env(rank, world, port, path_env, spec.get("threads", 1))}
        log = open(f"{path}.rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.rank", path], env=env, cwd=root,
                                      stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    failed = over = None
    try:
        while any(p.poll() is None for p in procs) and failed is None:
            failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if time.monotonic() > deadline:
                failed = "timeout"
            if rss_limit is not None:
                peaks = [_hwm_of(p.pid) for p in procs]
                if max(peaks) > rss_limit:
                    over = OverBudget(peaks.index(max(peaks)), max(peaks))
                    break
            time.sleep(0.1)
        failed = failed if failed is not None else next((r for r, p in enumerate(procs) if p.returncode), None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if over is not None:
        for leftover in workdir.glob(Path(path).name + "*"):
            leftover.unlink()
        raise over
    if failed is not None:
        rank = 0 if failed == "timeout" else failed
        tail = Path(f"{path}.rank{rank}.log").read_text()[-3000:]
        raise RuntimeError(f"benchmark launch of {spec['impl']} (S={spec['seq_len']}, sp={world}) failed "
                           f"({'timed out' if failed == 'timeout' else f'rank {rank} exited non-zero'}); "
                           f"log tail:\n{tail}")
    results = [json.loads(Path(f"{path}.rank{r}.json").read_text()) for r in range(world)]
    for leftover in workdir.glob(Path(path).name + "*"):
        leftover.unlink()
    Path(path).unlink(missing_ok=True)
    return results


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


def _workdir() -> Path:
    return Path(tempfile.gettempdir()) / "ds_ulysses_bench"


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
    from .report import format_group

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
            launch(spec_of(impl, seq_lens[0], sps[0], section, False), sps[0], _workdir(), timeout)
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
                    begin, ticks = time.monotonic(), _cpu_ticks()
                    record = {"kind": LOOPS[loop], **spec, "variant": variant, "name": name, "rep": rep, "order": order,
                              "run": run_id, **stamp(), "load_before": _loadavg()}
                    try:
                        record["ranks"] = launch(spec, sp, _workdir(), timeout)
                    except RuntimeError as exc:  # keep going: one broken configuration must not void the suite
                        record["error"] = str(exc)[-2000:]
                        log(f"{name:>24} S={seq_len:>6} sp={sp} rep={rep}: FAILED ({str(exc).splitlines()[-1]})")
                    record["load_after"] = _loadavg()
                    record["wall"], record["stolen"] = time.monotonic() - begin, _stolen(ticks)
                    with open(out, "a") as f:
                        f.write(json.dumps(record) + "\n")
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
                result = launch(spec, sp, _workdir(), timeout)[0]
                record = {**spec, "kind": "layer", "name": "layer", "rep": rep, "result": result, **stamp()}
                with open(out, "a") as f:
                    f.write(json.dumps(record) + "\n")
                records.append(record)
                log(f"rep {rep} attention layer S={seq_len} sp={sp}: " + ", ".join(
                    f"{k[:-2]} {v:.3f}s" for k, v in result.items() if k.endswith("_s")))
    return records


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-len", nargs="+", default=["4K"], help="global sequence lengths (4096, 16K, ...)")
    parser.add_argument("--sp", nargs="+", type=int, default=[2], help="sequence-parallel sizes (= processes)")
    parser.add_argument("--impl", nargs="*", choices=_IMPLS, default=["deepspeed", "ours-dropin", "ours"],
                        help="deepspeed: DeepSpeed's module + tutorial recipe; ours-dropin: our drop-in API with "
                             "the same user code; ours: ds_ulysses.initialize with the section's defaults; "
                             "deepspeed-alst: DeepSpeed with TiledMLP, TiledFusedLogitsLoss and checkpointing "
                             "(ArcticTraining's setup)")
    parser.add_argument("--loop", choices=sorted(LOOPS), default="engine",
                        help="engine: the user loop of engine(**batch), engine.backward, engine.step (DeepSpeed's "
                             "tutorial); trainer: the same arms through Transformers' Trainer (deepspeed: its "
                             "parallelism_config; ours: ds_ulysses.install() and the section; ours-dropin: "
                             "install() and the parallelism_config, which then takes our section defaults); "
                             "accelerate: the same three arms in a plain Accelerate loop (accelerator.prepare, "
                             "accelerator.backward; DeepSpeed's user's loss as Accelerate's guide writes it); "
                             "trl: the Trainer's arms through TRL's SFTTrainer (SFTConfig's defaults, gradient "
                             "checkpointing included, in fp32)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="an extra 'ours' arm with this \"ulysses\" section override, e.g. "
                             "'mlp={\"tiled_mlp\": {\"enabled\": true}}' (repeatable)")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="leave out the unrecorded first launch that warms the machine up")
    parser.add_argument("--no-noise", dest="noise", action="store_false",
                        help="leave out the noise arm (DeepSpeed launched twice per repetition)")
    parser.add_argument("--packed-docs", type=int, default=0, help="documents packed per sample (0: one)")
    parser.add_argument("--reps", type=int, default=3,
                        help="launches per arm, in rotating order (with --tiled-iters: processes per operation "
                             "and length; with --layer-iters: launches per length and sp)")
    parser.add_argument("--cycles", type=int, default=1, help="measured adapter refill cycles (sp steps each) per "
                                                              "launch; the launch's time is the fastest cycle's")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per launch (overrides --cycles)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps per launch")
    parser.add_argument("--profile-reps", type=int, default=1, metavar="N",
                        help="profile one extra refill cycle (sp steps) per launch in the first N repetitions "
                             "(0: none; default 1)")
    parser.add_argument("--model", action="append", default=[], metavar="KEY=INT",
                        help="model size override: vocab, hidden, intermediate, layers, heads, kv_heads")
    parser.add_argument("--host-env", action="append", default=[], metavar="NAME=VALUE",
                        help="set NAME=VALUE in every rank of every arm (repeatable), e.g. THP_MEM_ALLOC_ENABLE=1 "
                             "(torch's CPU buffers in huge pages); such launches are a configuration of their own in "
                             "the report, tagged 'env NAME=VALUE' in its model column")
    parser.add_argument("--out", default="benchmarks/results/runs.jsonl", help="JSON lines file to append to")
    parser.add_argument("--report", metavar="DIR", help="after running, write the Markdown report and plots of "
                                                        "every record in --out to DIR")
    parser.add_argument("--report-only", action="store_true", help="skip running; only --report")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    parser.add_argument("--layer-iters", type=int, default=0, metavar="N",
                        help="instead of training steps, time the attention layer alone (DeepSpeed's wrapper, "
                             "its noise arm and ours interleaved in one process group) for N iterations")
    parser.add_argument("--tiled-iters", type=int, default=0, metavar="N",
                        help="instead of training steps, time TiledMLP and sequence_tiled_compute against "
                             "DeepSpeed's (and DeepSpeed's against itself: the noise) at equal shards, N "
                             "interleaved iterations per process, --reps processes per operation and length")
    parser.add_argument("--tiled-ops", nargs="+", choices=TILED_OPS, default=list(TILED_OPS),
                        help="with --tiled-iters: the operations to time (all by default)")
    parser.add_argument("--max-seq", metavar="BUDGET", default=None,
                        help="instead of a fixed S, search the longest S whose step fits BUDGET of RSS per rank "
                             "(e.g. 4G) for each --impl / --variant")
    parser.add_argument("--max-seq-step", default="1K", help="granularity of the --max-seq search")
    parser.add_argument("--max-seq-steps", type=int, default=3, metavar="N",
                        help="training steps per --max-seq probe (its peak is the largest over all of them)")


def parse_bytes(text: str) -> int:
    """A memory budget: ``3G``, ``2.5GiB``, ``3000M``, ``512MiB`` (binary units) or plain bytes."""
    text = str(text).strip()
    number = text.rstrip("BbIi")
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(number[-1:].lower(), 1)
    try:
        value = float(number[:-1] if scale > 1 else number) * scale
    except ValueError:
        raise ValueError(f"expected a memory budget like 3G, 2.5GiB or 3000M, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"expected a positive memory budget, got {text!r}")
    return int(value)


def _parse_pairs(pairs, what: str, value=json.loads) -> dict:
    out = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"{what} must look like NAME=VALUE, got {pair!r}")
        try:
            out[name] = value(text)
        except ValueError as exc:
            raise ValueError(f"{what} {name!r}: cannot parse {text!r} ({exc})") from None
    return out


def _check_loop(args: argparse.Namespace) -> None:
    """``--loop trainer``, ``accelerate`` and ``trl`` take the training-step suite's arms that a user of that
    loop can switch on; ``trl`` trains unpacked samples."""
    if args.loop == "engine":
        return
    from .trainer import IMPLEMENTATIONS  # every such loop's arms

    other = [impl for impl in args.impl if impl not in IMPLEMENTATIONS]
    if other:
        raise ValueError(f"--loop {args.loop} runs the arms {list(IMPLEMENTATIONS)}, got {other}; leave those out "
                         f"(DeepSpeed's tiled recipe has no {args.loop} switch)")
    if args.max_seq or args.tiled_iters or args.layer_iters:
        raise ValueError(f"--loop {args.loop} times training steps; it does not combine with --max-seq, "
                         "--tiled-iters or --layer-iters")
    if args.loop == "trl" and args.packed_docs:
        raise ValueError(f"--loop trl trains TRL's samples as they come, got --packed-docs {args.packed_docs}; "
                         "leave it out (TRL packs with its own SFTConfig(packing=True))")


def _parse_host_env(args: argparse.Namespace) -> dict:
    """``--host-env``'s settings: for the training-step runs only, and none the harness sets for its ranks."""
    host_env = _parse_pairs(args.host_env, "--host-env", str)
    if host_env and (args.max_seq or args.tiled_iters or args.layer_iters):
        raise ValueError(f"--host-env sets the ranks' environment of training-step runs, got it with --max-seq, "
                         f"--tiled-iters or --layer-iters; leave it out (or set {', '.join(host_env)} in the shell)")
    taken = [name for name in host_env if name in HARNESS_ENV]
    if taken:
        raise ValueError(f"--host-env cannot set {', '.join(taken)}: the harness sets it for every rank "
                         f"({', '.join(HARNESS_ENV)}); leave it out")
    return host_env


def run_command(args: argparse.Namespace) -> int:
    """The ``ds-ulysses bench`` runner: run, print this run's tables, optionally write the report."""
    from ds_ulysses.config import UlyssesConfig

    from .report import format_run, write_report

    try:
        seq_lens = [parse_size(s) for s in args.seq_len]
        model = _parse_pairs(args.model, "--model", int)
        variants = _parse_pairs(args.variant, "--variant")
        for name, section in variants.items():
            UlyssesConfig.from_dict({"sequence_parallel_size": 1, **section})
        budget = parse_bytes(args.max_seq) if args.max_seq else None
        if args.max_seq_steps < 1:
            raise ValueError(f"--max-seq-steps must be 1 or more (training steps per probe), got {args.max_seq_steps}")
        if args.cycles < 1:
            raise ValueError(f"--cycles must be 1 or more (measured refill cycles per launch), got {args.cycles}")
        granularity = parse_size(args.max_seq_step)
        _check_loop(args)
        host_env = _parse_host_env(args)
    except ValueError as exc:
        print(f"ds-ulysses bench: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.report_only:
        pass
    elif budget is not None:
        from .maxseq import format_maxseq, run_maxseq

        records = run_maxseq(budget, args.sp, args.impl, variants, out, model, granularity, args.timeout,
                             args.max_seq_steps)
        print(format_maxseq(records))
    elif args.tiled_iters > 0:
        from .tiled import format_tiled, run_tiled_suite

        print(format_tiled(run_tiled_suite(seq_lens, args.tiled_iters, out, args.timeout, ops=args.tiled_ops,
                                           reps=args.reps)))
    elif args.layer_iters > 0:
        from .report import format_layer

        print(format_layer(run_layer_suite(seq_lens, args.sp, args.layer_iters, out, args.timeout, reps=args.reps)))
    else:
        records = run_suite(seq_lens, args.sp, args.impl, args.reps, args.steps, args.warmup, out,
                            args.packed_docs, model, variants, args.timeout, args.noise, args.profile_reps,
                            args.cycles, args.warm_up, loop=args.loop, host_env=host_env)
        print(format_run(records, LOOPS[args.loop]))
    if args.report:
        lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        for path in write_report(lines, Path(args.report)):
            print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse, then build DeepSpeed's ops before the first launch, so no launch deadline covers a build
    (the ranks inherit the virtualenv's op cache through ``TORCH_EXTENSIONS_DIR``)."""
    from ds_ulysses.train import ops

    parser = argparse.ArgumentParser(prog="ds-ulysses bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    ops.use_venv_cache()
    if not args.report_only:
        ops.build()
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())

"""``ds-ulysses bench`` (or ``python -m benchmarks.bench``): DeepSpeed's ALST module and ours, side by
side, in alternating fresh launches.

Absolute CPU times mean little and a shared machine is noisy, so every configuration runs each
implementation ``reps`` times in rotating order (A B C, B C A, C A B, ...), each launch a fresh
process group of ``sp`` processes (:mod:`benchmarks.rank`), and reports medians: step time
is the median over all measured steps of the slowest rank's time, peak memory the median over
launches of the largest rank's RSS high-water mark. Every launch appends one JSON line to the
results file, so long suites survive interruption and :mod:`benchmarks.report` can rebuild
the tables and plots from it.
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

__all__ = ["add_arguments", "run_command", "main", "launch", "run_suite", "run_layer_suite", "summarize",
           "impl_name"]

_IMPLS = ("deepspeed", "ours-dropin", "ours")


def impl_name(impl: str, variant: str | None) -> str:
    return impl if not variant else f"{impl}[{variant}]"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: dict, world: int, workdir: Path, timeout: float = 1800.0) -> list[dict]:
    """Run one implementation on ``world`` fresh processes; return every rank's measurements."""
    workdir.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="spec-", suffix=".json", dir=workdir)
    with os.fdopen(fd, "w") as f:
        json.dump(spec, f)
    port = _free_port()
    root = str(Path(__file__).resolve().parent.parent)  # the ranks import this checkout's benchmarks and ds_ulysses
    path_env = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    procs, logs = [], []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "PYTHONPATH": path_env,
               "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(spec.get("threads", 1))}
        log = open(f"{path}.rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.rank", path], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    failed = None
    try:
        while any(p.poll() is None for p in procs) and failed is None:
            failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if time.monotonic() > deadline:
                failed = "timeout"
            time.sleep(0.2)
        failed = failed if failed is not None else next((r for r, p in enumerate(procs) if p.returncode), None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if failed is not None:
        rank = 0 if failed == "timeout" else failed
        tail = Path(f"{path}.rank{rank}.log").read_text()[-3000:]
        raise RuntimeError(f"benchmark launch of {spec['impl']} (S={spec['seq_len']}, sp={world}) failed "
                           f"({'timed out' if failed == 'timeout' else f'rank {rank} exited non-zero'}); "
                           f"log tail:\n{tail}")
    return [json.loads(Path(f"{path}.rank{r}.json").read_text()) for r in range(world)]


def run_suite(seq_lens, sps, impls, reps: int, steps: int, warmup: int, out: Path, packed_docs: int = 0,
              model: dict | None = None, variants: dict | None = None, timeout: float = 1800.0,
              log=print) -> list[dict]:
    """Every (S, sp) with every implementation, ``reps`` rotations; each launch appended to ``out``.

    ``variants`` maps a name to a ``"ulysses"`` section override for the ``ours`` implementation
    (the switch-by-switch memory benchmark); each variant is one more entry in the rotation.
    """
    entries = [(impl, None, {}) for impl in impls]
    entries += [("ours", name, section) for name, section in (variants or {}).items()]
    records = []
    out.parent.mkdir(parents=True, exist_ok=True)
    for seq_len in seq_lens:
        for sp in sps:
            for rep in range(reps):
                shift = rep % len(entries)
                for impl, variant, section in entries[shift:] + entries[:shift]:
                    spec = {"impl": impl, "seq_len": seq_len, "sp": sp, "steps": steps, "warmup": warmup,
                            "packed_docs": packed_docs, "model": model or {}, "section": section}
                    begin = time.monotonic()
                    record = {**spec, "variant": variant, "name": impl_name(impl, variant), "rep": rep}
                    try:
                        record["ranks"] = launch(spec, sp, Path(tempfile.gettempdir()) / "ds_ulysses_bench", timeout)
                    except RuntimeError as exc:  # keep going: one broken configuration must not void the suite
                        record["error"] = str(exc)[-2000:]
                        log(f"{record['name']:>24} S={seq_len:>6} sp={sp}: FAILED ({str(exc).splitlines()[-1]})")
                    with open(out, "a") as f:
                        f.write(json.dumps(record) + "\n")
                    if "error" in record:
                        continue
                    records.append(record)
                    ranks = record["ranks"]
                    times = [max(t) for t in zip(*(r["times"] for r in ranks))]
                    log(f"{record['name']:>24} S={seq_len:>6} sp={sp} packed={packed_docs} rep={rep}: "
                        f"step {statistics.median(times) if times else float('nan'):.2f}s, "
                        f"peak {max(r['peak'] for r in ranks) / GIB:.2f} GiB, "
                        f"launch {time.monotonic() - begin:.0f}s")
    return records


def run_layer_suite(seq_lens, sps, iters: int, out: Path, timeout: float = 1800.0, log=print) -> list[dict]:
    """The attention layer alone (:mod:`benchmarks.layer`): both wrappers interleaved per iteration."""
    records = []
    out.parent.mkdir(parents=True, exist_ok=True)
    for seq_len in seq_lens:
        for sp in sps:
            spec = {"impl": "layer", "seq_len": seq_len, "sp": sp, "iters": iters}
            result = launch(spec, sp, Path(tempfile.gettempdir()) / "ds_ulysses_bench", timeout)[0]
            record = {**spec, "kind": "layer", "name": "layer", "result": result}
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
            records.append(record)
            log(f"attention layer S={seq_len} sp={sp}: " + ", ".join(
                f"{k[:-2]} {v:.3f}s" for k, v in result.items() if k.endswith("_s")))
    return records


def summarize(records: list[dict]) -> dict:
    """(name, S, sp, packed) -> medians and per-layer communication (see the module docstring)."""
    groups: dict = {}
    for rec in (r for r in records if "error" not in r and r.get("kind") != "layer"):
        key = (rec["name"], rec["seq_len"], rec["sp"], rec.get("packed_docs", 0))
        groups.setdefault(key, []).append(rec)
    out = {}
    for key, recs in groups.items():
        times = [max(t) for rec in recs for t in zip(*(r["times"] for r in rec["ranks"]))]
        r0 = recs[0]["ranks"][0]
        layers = max(1, r0["attn_forward_calls"])
        out[key] = {
            "time": statistics.median(times) if times else float("nan"),
            "phases": [statistics.median(p[i] for rec in recs for r in rec["ranks"] for p in r["phases"])
                       for i in range(3)],
            "peak": statistics.median(max(r["peak"] for r in rec["ranks"]) for rec in recs),
            "steps_peak": statistics.median(max(r["steps_peak"] or r["peak"] for r in rec["ranks"]) for rec in recs),
            "launches": len(recs), "steps": len(times),
            "loss": recs[0]["ranks"][0]["losses"][0],
            "attn_calls": {k: v / layers for k, v in r0["attn_forward"]["calls"].items()},
            "attn_sent": sum(r0["attn_forward"]["sent"].values()) / layers,
            "attn_off_rank": sum(r0["attn_forward"]["off_rank"].values()) / layers,
            "bwd_a2a": r0["backward"]["calls"].get("all_to_all_single", 0) / layers,
            "refill_received": sum(r0["refill"]["received"].values()) / max(1, r0["refills"]),
            "refill_calls": {k: v / max(1, r0["refills"]) for k, v in r0["refill"]["calls"].items()},
            "model": recs[0].get("model", {}),
        }
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-len", nargs="+", default=["4K"], help="global sequence lengths (4096, 16K, ...)")
    parser.add_argument("--sp", nargs="+", type=int, default=[2], help="sequence-parallel sizes (= processes)")
    parser.add_argument("--impl", nargs="*", choices=_IMPLS, default=list(_IMPLS),
                        help="deepspeed: DeepSpeed's module + tutorial recipe; ours-dropin: our drop-in API with "
                             "the same user code; ours: ds_ulysses.initialize with the section's defaults")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="an extra 'ours' run with this \"ulysses\" section override, e.g. "
                             "'mlp={\"tiled_mlp\": {\"enabled\": true}}' (repeatable)")
    parser.add_argument("--packed-docs", type=int, default=0, help="documents packed per sample (0: one)")
    parser.add_argument("--reps", type=int, default=3, help="launches per implementation, alternating")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per launch")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps per launch")
    parser.add_argument("--model", action="append", default=[], metavar="KEY=INT",
                        help="model size override: vocab, hidden, intermediate, layers, heads, kv_heads")
    parser.add_argument("--out", default="benchmarks/results/runs.jsonl", help="JSON lines file to append to")
    parser.add_argument("--report", metavar="DIR", help="after running, write the Markdown report and plots of "
                                                        "every record in --out to DIR")
    parser.add_argument("--report-only", action="store_true", help="skip running; only --report")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    parser.add_argument("--layer-iters", type=int, default=0, metavar="N",
                        help="instead of training steps, time the attention layer alone (both wrappers "
                             "interleaved in one process group) for N iterations")


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


def run_command(args: argparse.Namespace) -> int:
    """The ``ds-ulysses bench`` runner: run, print this run's table, optionally write the report."""
    from ds_ulysses.config import UlyssesConfig

    from .report import format_summary, write_report

    try:
        seq_lens = [parse_size(s) for s in args.seq_len]
        model = _parse_pairs(args.model, "--model", int)
        variants = _parse_pairs(args.variant, "--variant")
        for name, section in variants.items():
            UlyssesConfig.from_dict({"sequence_parallel_size": 1, **section})
    except ValueError as exc:
        print(f"ds-ulysses bench: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.layer_iters > 0 and not args.report_only:
        run_layer_suite(seq_lens, args.sp, args.layer_iters, out, args.timeout)
    elif not args.report_only:
        records = run_suite(seq_lens, args.sp, args.impl, args.reps, args.steps, args.warmup, out,
                            args.packed_docs, model, variants, args.timeout)
        print(format_summary(summarize(records)))
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
    ops.build()
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())

"""Launching: one fresh process per rank for every launch, and what each rank's environment holds.

:func:`launch` writes a launch's spec to a file, starts ``python -m benchmarks.rank SPEC`` once per rank (a
fresh process group each time, so every arm's peak RSS is its own) and returns each rank's result; with an RSS
budget it stops the ranks the moment one passes it (:class:`OverBudget`, what ``--max-seq`` probes by). The
ranks inherit this process's environment with the spec's ``host_env`` on top, then what the harness sets itself
(:data:`HARNESS_ENV`); the allocator settings they inherit (:data:`ALLOCATOR_ENV`) make a configuration of their
own in the report.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ds_ulysses.constants import GIB

from .measure import hwm_of

__all__ = ["launch", "OverBudget", "workdir", "ALLOCATOR_ENV", "HARNESS_ENV"]

# The memory allocator's settings a launch inherits: each record names those set (``host_env``), and launches run
# with different ones are different configurations in the report (:func:`benchmarks.records.setup_key`). Here
# glibc's mmap off took 8% off DeepSpeed's CPU work for 50-65% more memory (2026-11-29): as much as the
# differences measured between arms
ALLOCATOR_ENV = ("THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_",
                 "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_")


def _rank_env(rank: int, world: int, port: int, pythonpath: str, threads: int) -> dict[str, str]:
    """What :func:`launch` sets for every rank itself, on top of the host environment."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "PYTHONPATH": pythonpath,
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(threads)}


# --host-env cannot override these
HARNESS_ENV = tuple(_rank_env(0, 1, 0, "", 1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OverBudget(RuntimeError):
    """A launch stopped because a rank's RSS high-water mark passed the limit it was given."""

    def __init__(self, rank: int, peak: int):
        super().__init__(f"rank {rank} reached {peak / GIB:.2f} GiB of RSS, over the budget")
        self.rank, self.peak = rank, peak


def workdir() -> Path:
    """Where launches write their specs, logs and results (removed as each launch ends)."""
    return Path(tempfile.gettempdir()) / "ds_ulysses_bench"


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
                peaks = [hwm_of(p.pid) for p in procs]
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

"""One rank of one benchmark launch in the engine loop: train a few steps with one arm and measure them.

The arm is set up by its recipe (:data:`benchmarks.recipes.RECIPES`); the model, the samples, the DeepSpeed
config (ZeRO-3, parameters and optimizer offloaded to CPU) and the thread count are identical for all. Each step
is timed as a user's loop runs it, after a barrier: ``next(loader)`` (the adapter, refilling every sp steps),
``engine(**batch)`` with the loss, ``engine.backward``, ``engine.step``; the slowest rank's time is the step's.
Each rank also takes the CPU time its process spent in the step (``cpu_times``, every thread: the work, without
the time spent waiting for a peer or with the virtual CPU taken away by the host). Memory is the RSS high-water
mark of the process over its setup and measured steps (:mod:`benchmarks.measure`; reset after setup for the
step-only figure). With ``profile``, one more refill cycle (sp steps) runs under ``torch.profiler``
(:mod:`benchmarks.profile`: seconds per phase and step), after the peak is read. The collectives of the
attention layers and of the adapter's refills are counted by :mod:`benchmarks.tap`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from .arms import MODEL_DEFAULTS
from .measure import hwm_bytes, minor_faults, reset_hwm
from .profile import Regions, phase_seconds
from .recipes import RECIPES, build_model, loop_dataset
from .tap import CollectiveTap

__all__ = ["run"]


def _step(engine, loader, loss_fn, tap):
    """One user-loop step: (loss, [adapter, forward, backward, optimizer] seconds)."""
    t0 = time.perf_counter()
    tap.phase = "load"
    with record_function("bench.adapter"):
        batch = next(loader)
    t1 = time.perf_counter()
    tap.phase = "forward"
    with record_function("bench.forward"):
        loss = loss_fn(engine, batch)
    t2 = time.perf_counter()
    tap.phase = "backward"
    with tap.scope("backward"), record_function("bench.backward"):
        engine.backward(loss)
    t3 = time.perf_counter()
    tap.phase = "step"
    with record_function("bench.step"):
        engine.step()
    t4 = time.perf_counter()
    return loss, [t1 - t0, t2 - t1, t3 - t2, t4 - t3]


def run(spec: dict) -> dict:
    """Set up one implementation, train ``warmup + steps`` steps (plus a profiled refill cycle, sp steps, with
    ``spec["profile"]``), return this rank's measurements."""
    import deepspeed

    torch.set_num_threads(spec.get("threads", 1))
    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's comm layer and its mpu need it
    rank, world = dist.get_rank(), dist.get_world_size()
    tap = CollectiveTap().install()
    tap.phase = "setup"
    regions = Regions()
    model_spec = {**MODEL_DEFAULTS, **spec.get("model", {})}
    model = build_model(model_spec).train()
    data = loop_dataset(spec, model_spec["vocab"], world,
                        spec["warmup"] + spec["steps"] + (spec["sp"] if spec.get("profile") else 0))
    impl = spec["impl"]
    engine, loader, loss_fn = RECIPES[impl](model, spec, data, tap, regions)
    regions.module(model.model, "bench.decoder")
    init_peak = hwm_bytes()
    reset_ok = reset_hwm()
    times, cpu_times, faults, phases, losses, step_peaks = [], [], [], [], [], []
    refill = ({}, 0)
    for i in range(spec["warmup"] + spec["steps"]):
        measured = i >= spec["warmup"]
        if measured and i == spec["warmup"]:
            refill = tap.scope_totals("refill")
            tap.reset()
        dist.barrier()
        cpu, minflt = time.process_time(), minor_faults()
        loss, split = _step(engine, loader, loss_fn, tap)
        cpu, minflt = time.process_time() - cpu, minor_faults() - minflt
        losses.append(float(loss.detach()))
        step_peaks.append(hwm_bytes())
        if measured:
            times.append(sum(split))
            cpu_times.append(cpu)
            faults.append(minflt)
            phases.append(split)
    if spec["warmup"] == 0:
        refill = tap.scope_totals("refill")
    steps_peak = hwm_bytes()
    result = {
        "rank": rank, "world": world, "times": times, "cpu_times": cpu_times, "minor_faults": faults,
        "phases": phases, "losses": losses,
        "step_peaks": step_peaks, "init_peak": init_peak, "steps_peak": steps_peak if reset_ok else None,
        "peak": max(init_peak, steps_peak),
        "attn_forward": tap.tallies["attn_forward"].as_dict(), "attn_forward_calls": tap.counts["attn_forward"],
        "attn_backward": tap.tallies["attn_backward"].as_dict(), "backward": tap.tallies["backward"].as_dict(),
        "refill": refill[0], "refills": refill[1],
    }
    if spec.get("profile"):
        profile: dict = {}
        regions.collectives()
        with phase_seconds(profile, spec["sp"]):
            for _ in range(spec["sp"]):
                dist.barrier()
                _step(engine, loader, loss_fn, tap)
        result["profile"] = profile
    regions.uninstall()
    dist.barrier()
    dist.destroy_process_group()
    return result

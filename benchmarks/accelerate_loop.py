"""One rank of one benchmark launch in a plain Accelerate loop (``ds-ulysses bench --loop accelerate``).

The same arms as :mod:`benchmarks.engine_loop`, reached the way a user of Accelerate's own loop reaches them
(``accelerator.prepare`` of model, optimizer and DataLoader, then ``accelerator.backward`` and
``optimizer.step``), with the engine loop's model, samples and ZeRO-3 + CPU offload config (the config's
optimizer, so the loop's optimizer is Accelerate's ``DummyOptim``):

- ``deepspeed``: Accelerate's documented SP path, ``Accelerator(parallelism_config=ParallelismConfig(
  sp_backend="deepspeed", sp_size=sp))``: Accelerate registers DeepSpeed's ``UlyssesSPAttentionHF`` and
  wraps the DataLoader in its ``UlyssesSPDataLoaderAdapter``; the loop is Accelerate's ALST example: the
  model's loss function on each rank's logits and ``shift_labels`` (``model(**batch).loss`` is ``None``
  there), the SP group's losses weighted by their valid-token counts through a differentiable all-gather
  (:func:`benchmarks.recipes.tutorial_loss`). Accelerate's guide finds the SP group in
  ``accelerator.torch_device_mesh``, which Accelerate 1.15 leaves ``None`` under DeepSpeed SP; the loop
  takes it from DeepSpeed's ``groups``, as Transformers' Trainer does. ds_ulysses is not imported.
- ``ours``: ``ds_ulysses.install()`` and the ``"ulysses"`` section (with the arm's overrides, our defaults
  otherwise) in the same DeepSpeed config, no ``parallelism_config``; the loop takes ``model(**batch).loss``,
  the sample's token-mean loss (README, "Accelerate").
- ``ours-dropin``: ``ds_ulysses.install()`` in front of DeepSpeed's user's code unchanged, its
  ``parallelism_config`` and its loss from the logits included. Outside the Trainer that
  ``parallelism_config`` becomes a section with ``model_loss``, the tiled loss and ``trim_host_heap`` off
  (the model returns DeepSpeed's outputs, logits and no loss, and the engine steps as DeepSpeed's; README,
  "Accelerate"), so this arm is the mechanism: our attention and adapter under DeepSpeed's user's loss.
  ``ours`` with the variant ``{"tiled_loss": {"enabled": false}, "trim_host_heap": false}`` is our
  attention, adapter and (untiled) SP loss.

A step is one turn of the loop, after a barrier: the next batch (the adapter), the forward with the loss,
``accelerator.backward`` (which runs DeepSpeed's ``backward`` and ``step``), ``optimizer.step`` and
``optimizer.zero_grad``; ``cpu_times`` is the process's CPU time over it, ``minor_faults`` its minor page
faults. ``phases`` split it as :mod:`benchmarks.trainer` does, around the engine's own methods. Memory is the
RSS high-water mark, reset after ``prepare`` (the engine is built by then). With ``spec["profile"]`` one more
refill cycle (sp steps) runs after the measured ones (and after their peak is read) under ``torch.profiler``
(:class:`benchmarks.framework_loop.StepProfile`; ``bench.forward`` is the loop's loss computation).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from .framework_loop import EngineClock, StepProfile, finish_arm, start_arm, tap_counts
from .measure import hwm_bytes, minor_faults, reset_hwm
from .recipes import ds_config, loop_dataset, tap_library, tutorial_loss

__all__ = ["run"]


def run(spec: dict) -> dict:
    """Train ``warmup + steps`` steps of a plain Accelerate loop with one arm; return this rank's
    measurements in :func:`benchmarks.engine_loop.run`'s shape."""
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedPlugin, DeepSpeedSequenceParallelConfig, DummyOptim

    impl, sp, tap, model_spec, model = start_arm(spec, "accelerate")
    config = ds_config(sp)
    if impl == "ours":
        config["ulysses"] = {"sequence_parallel_size": sp, **spec.get("section", {})}
    pc = None if impl == "ours" else ParallelismConfig(
        sp_backend="deepspeed", sp_size=sp, sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"))
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), parallelism_config=pc)
    total = spec["warmup"] + spec["steps"]
    profiler = StepProfile(model, impl == "deepspeed", sp) if spec.get("profile") else None
    data = loop_dataset(spec, model_spec["vocab"], int(os.environ["WORLD_SIZE"]),
                        total + (sp if profiler is not None else 0))
    clock = EngineClock(tap)
    tap_library(tap, deepspeed=impl == "deepspeed")
    optimizer = DummyOptim(model.parameters(), lr=config["optimizer"]["params"]["lr"])
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if impl == "ours":
        def loss_of(batch):
            return model(**batch).loss
    else:
        from deepspeed.utils import groups

        group = groups._get_sequence_parallel_group()  # as the Trainer finds it: Accelerate builds no mesh for it

        def loss_of(batch):
            return tutorial_loss(model, batch, group, labels_in_batch=True)  # Accelerate's ALST example
    init_peak = hwm_bytes()
    reset_ok = reset_hwm()
    clock.take()
    batches = iter(loader)

    def step():
        batch = next(batches)  # outside the forward: the profile's adapter region is the adapter's __next__
        with record_function("bench.forward"):
            loss = loss_of(batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    times, cpu_times, faults, phases, losses, step_peaks = [], [], [], [], [], []
    refill = ({}, 0)
    for i in range(total):
        if i == spec["warmup"]:
            refill = tap.scope_totals("refill")
            tap.reset()
        dist.barrier()
        begin, cpu, minflt = time.perf_counter(), time.process_time(), minor_faults()
        tap.phase = "load"
        loss = step()
        seconds, cpu, minflt = time.perf_counter() - begin, time.process_time() - cpu, minor_faults() - minflt
        split = clock.take()
        losses.append(float(loss.detach()))
        step_peaks.append(hwm_bytes())
        if i >= spec["warmup"]:
            times.append(seconds)
            cpu_times.append(cpu)
            faults.append(minflt)
            phases.append([seconds - sum(split), *split])
    if spec["warmup"] == 0:
        refill = tap.scope_totals("refill")
    steps_peak = hwm_bytes()
    profile, counted = {}, tap_counts(tap)
    if profiler is not None:
        profiler.start()
        for _ in range(sp):
            dist.barrier()
            step()
            profile["profile"] = profiler.step_end()  # None until the cycle's last step
    clock.uninstall()
    return finish_arm(tap, "accelerate", {
        "times": times, "cpu_times": cpu_times, "minor_faults": faults, "phases": phases, "losses": losses,
        "step_peaks": step_peaks,
        "init_peak": init_peak, "steps_peak": steps_peak if reset_ok else None, "peak": max(init_peak, steps_peak),
        "refill": refill[0], "refills": refill[1], **profile}, counted)

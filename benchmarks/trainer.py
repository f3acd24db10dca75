"""One rank of one benchmark launch on Transformers' Trainer (``ds-ulysses bench --loop trainer``).

The same arms as :mod:`benchmarks.engine_loop`, reached the way a Trainer user reaches them, with the same
model, samples and ZeRO-3 + CPU offload config (its batch fields left to the Trainer, ``"auto"``):

- ``deepspeed``: Transformers' documented SP path, ``TrainingArguments(parallelism_config=
  ParallelismConfig(sp_backend="deepspeed", sp_size=sp))``: Accelerate registers DeepSpeed's
  ``UlyssesSPAttentionHF``, wraps the loader in its ``UlyssesSPDataLoaderAdapter``, and the Trainer
  computes the loss with its SP loss. ds_ulysses is not imported.
- ``ours``: ``ds_ulysses.install()`` and the ``"ulysses"`` section (with the arm's overrides, our defaults
  otherwise) in the same DeepSpeed config, no ``parallelism_config``.
- ``ours-dropin``: ``ds_ulysses.install()`` and DeepSpeed's user's ``parallelism_config`` unchanged: what a
  Trainer user who only adds ``install()`` gets. That ``parallelism_config`` becomes a section with our
  defaults (README, "HF Trainer"), so this is the product path too, reached through DeepSpeed's switch.
  The mechanism alone (our attention, adapter and SP loss, DeepSpeed's untiled loss) is ``ours`` with the
  variant ``{"tiled_loss": {"enabled": false}, "trim_host_heap": false}``.

A step is what the Trainer's loop does between two ``on_step_end`` callbacks (each after a barrier): fetching
the batch (the adapter), the step's token count, forward, backward, the optimizer step and the Trainer's
bookkeeping; ``cpu_times`` is the process's CPU time over the same span, ``minor_faults`` its minor page
faults. ``phases`` split it as :mod:`benchmarks.engine_loop` does: the engine's ``forward``, ``backward``
and ``step`` as timed around DeepSpeed's own methods (:class:`benchmarks.framework_loop.EngineClock`), and the
rest (the adapter and the Trainer) first. Memory is the RSS high-water mark, reset when training begins (the
engine is built by then), as the engine loop resets it after its setup. With ``spec["profile"]`` one more
refill cycle (sp steps) runs after the measured ones (and after their peak is read) under ``torch.profiler``
with the regions of :mod:`benchmarks.profile` (:class:`benchmarks.framework_loop.StepProfile`): ``bench.forward``
is the Trainer's ``compute_loss`` (forward, head and the Trainer's SP loss), ``bench.adapter`` the data
adapter's ``__next__``.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch.distributed as dist
from torch.autograd.profiler import record_function

from .framework_loop import EngineClock, StepProfile, finish_arm, start_arm, tap_counts
from .measure import hwm_bytes, minor_faults, reset_hwm
from .recipes import loop_dataset, tap_library

__all__ = ["trainer_ds_config", "run", "train"]

LR = 1e-4


def trainer_ds_config(sp: int, section: dict | None) -> dict:
    """:func:`benchmarks.recipes.ds_config` as a Trainer user writes it: batch, accumulation, clipping and the
    optimizer's hyperparameters ``"auto"`` (the Trainer fills them in); with ``section``, the ``"ulysses"``
    section at ``sp``."""
    config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
        "steps_per_print": 1 << 30,
    }
    if section is not None:
        config["ulysses"] = {"sequence_parallel_size": sp, **section}
    return config

def run(spec: dict) -> dict:
    """Train ``warmup + steps`` steps of the Trainer with one arm; return this rank's measurements in
    :func:`benchmarks.engine_loop.run`'s shape."""
    from transformers import Trainer, TrainingArguments

    def build(args, model, data, callbacks, recording):
        return recording(Trainer)(model=model, args=TrainingArguments(**args), train_dataset=data, callbacks=callbacks)

    return train(spec, "trainer", build)


def train(spec: dict, loop: str, build) -> dict:
    """One arm through a Trainer: ``build(args, model, data, callbacks, recording)`` returns the Trainer
    (``recording(cls)``: ``cls`` with its loss recorded) from ``args``, the keyword arguments of its
    ``TrainingArguments``; its training's steps are measured (and sp more profiled, with ``spec["profile"]``)
    and returned in :func:`benchmarks.engine_loop.run`'s shape."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import TrainerCallback

    impl, sp, tap, model_spec, model = start_arm(spec, loop)
    total = spec["warmup"] + spec["steps"]
    profiler = StepProfile(model, impl == "deepspeed", sp) if spec.get("profile") else None
    steps_run = total + (sp if profiler is not None else 0)
    section = spec.get("section", {}) if impl == "ours" else None
    pc = None if impl == "ours" else ParallelismConfig(
        sp_backend="deepspeed", sp_size=sp, sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"))
    out_dir = tempfile.TemporaryDirectory(prefix=f"ds_ulysses_{loop}_bench-")  # the Trainer's, left empty
    args = dict(
        output_dir=out_dir.name, per_device_train_batch_size=1, gradient_accumulation_steps=1, max_steps=steps_run,
        learning_rate=LR, lr_scheduler_type="constant", logging_steps=1 << 30, report_to=[], save_strategy="no",
        deepspeed=trainer_ds_config(sp, section), parallelism_config=pc, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, train_sampling_strategy="sequential")
    clock = EngineClock(tap)
    tap_library(tap, deepspeed=impl == "deepspeed")
    data = loop_dataset(spec, model_spec["vocab"], int(os.environ["WORLD_SIZE"]), steps_run)
    marks, cpu_marks, fault_marks, phases, losses = [], [], [], [], []
    # what the callbacks read: RSS high-water marks, the refill tallies after warm-up, the losses of the measured
    # steps and the profile of the refill cycle after them
    seen = {"step_peaks": []}

    class Measure(TrainerCallback):
        def on_train_begin(self, *_, **__):
            seen["init_peak"] = hwm_bytes()
            seen["reset"] = reset_hwm()
            clock.take()
            dist.barrier()
            marks.append(time.perf_counter())
            cpu_marks.append(time.process_time())
            fault_marks.append(minor_faults())
            tap.phase = "load"

        def on_step_end(self, *_, **__):
            if profiler is not None and profiler.running:  # a profiled step: not one of the measured
                clock.take()
                profile = profiler.step_end()
                if profile is None:
                    dist.barrier()
                else:
                    seen["profile"] = profile
                return
            phases.append(clock.take())
            seen["step_peaks"].append(hwm_bytes())
            dist.barrier()
            marks.append(time.perf_counter())
            cpu_marks.append(time.process_time())
            fault_marks.append(minor_faults())
            if len(marks) == spec["warmup"] + 1:
                seen["refill"] = tap.scope_totals("refill")
                tap.reset()
            if len(phases) == total and profiler is not None:
                seen.update(steps_peak=hwm_bytes(), losses=len(losses), counted=tap_counts(tap))
                seen.setdefault("refill", tap.scope_totals("refill"))
                profiler.start()

    def recording(cls):
        class Recording(cls):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                with record_function("bench.forward"):
                    loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                losses.append(float((loss[0] if return_outputs else loss).detach()))
                return loss

        return Recording

    trainer = build(args, model, data, [Measure()], recording)
    trainer.train()
    clock.uninstall()
    out_dir.cleanup()
    times = [b - a for a, b in zip(marks, marks[1:])]
    cpu_times = [b - a for a, b in zip(cpu_marks, cpu_marks[1:])]
    faults = [b - a for a, b in zip(fault_marks, fault_marks[1:])]
    measured = slice(spec["warmup"], None)
    split = [[t - sum(p), *p] for t, p in zip(times, phases)]
    refill = seen.get("refill", tap.scope_totals("refill"))
    steps_peak = seen.get("steps_peak") or hwm_bytes()
    profile = {"profile": seen["profile"]} if "profile" in seen else {}
    return finish_arm(tap, loop, {
        "times": times[measured], "cpu_times": cpu_times[measured], "minor_faults": faults[measured],
        "phases": split[measured],
        "losses": losses[:seen.get("losses")], "step_peaks": seen["step_peaks"], "init_peak": seen["init_peak"],
        "steps_peak": steps_peak if seen["reset"] else None, "peak": max(seen["init_peak"], steps_peak),
        "refill": refill[0], "refills": refill[1], **profile}, seen.get("counted"))

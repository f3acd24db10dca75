"""One rank of one benchmark launch on Transformers' Trainer (``ds-ulysses bench --loop trainer``).

The same arms as :mod:`benchmarks.rank`, reached the way a Trainer user reaches them, with the same
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
faults. ``phases`` split it as :mod:`benchmarks.rank` does: the engine's ``forward``, ``backward`` and
``step`` as timed around DeepSpeed's own methods, and the rest (the adapter and the Trainer) first. Memory is
the RSS high-water mark, reset when training begins (the engine is built by then), as :mod:`benchmarks.rank`
resets it after its setup. With ``spec["profile"]`` one more refill cycle (sp steps) runs after the measured
ones (and after their peak is read) under ``torch.profiler`` with the regions of :mod:`benchmarks.profile`
(:class:`StepProfile`): ``bench.forward`` is the Trainer's ``compute_loss`` (forward, head and the Trainer's
SP loss), ``bench.adapter`` the data adapter's ``__next__``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from .profile import Regions, phase_seconds
from .rank import (MODEL_DEFAULTS, _hwm_bytes, _minor_faults, _reset_hwm, build_model, library_classes, loop_dataset,
                   tap_library)
from .tap import CollectiveTap

__all__ = ["IMPLEMENTATIONS", "EngineClock", "StepProfile", "start_arm", "tap_counts", "finish_arm",
           "trainer_ds_config", "run", "train"]

IMPLEMENTATIONS = ("deepspeed", "ours-dropin", "ours")
LR = 1e-4


def trainer_ds_config(sp: int, section: dict | None) -> dict:
    """:func:`benchmarks.rank.ds_config` as a Trainer user writes it: batch, accumulation, clipping and the
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


class EngineClock:
    """Seconds spent in DeepSpeed's engine ``forward``, ``backward`` and ``step`` since the last
    :meth:`take`, timed around the class's methods (both arms train through a ``DeepSpeedEngine``);
    ``backward`` and ``step`` are also the profiler's ``bench.backward`` and ``bench.step`` regions (the
    loop puts ``bench.forward`` around its whole loss computation, the engine's forward within it)."""

    PHASES = ("forward", "backward", "step")
    REGIONS = {"backward": "bench.backward", "step": "bench.step"}

    def __init__(self, tap):
        from deepspeed.runtime.engine import DeepSpeedEngine

        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self._originals = {name: getattr(DeepSpeedEngine, name) for name in self.PHASES}
        for name, original in self._originals.items():
            setattr(DeepSpeedEngine, name, self._timed(name, original, tap))

    def _timed(self, name, original, tap):
        region = self.REGIONS.get(name)

        def timed(engine, *args, **kwargs):
            tap.phase = name
            begin = time.perf_counter()
            try:
                with record_function(region) if region else contextlib.nullcontext():
                    if name == "backward":
                        with tap.scope("backward"):
                            return original(engine, *args, **kwargs)
                    return original(engine, *args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - begin
                tap.phase = "load"

        return timed

    def take(self) -> list[float]:
        out = [self.seconds[name] for name in self.PHASES]
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        return out

    def uninstall(self) -> None:
        from deepspeed.runtime.engine import DeepSpeedEngine

        for name, original in self._originals.items():
            setattr(DeepSpeedEngine, name, original)


class StepProfile:
    """``steps`` steps (the adapter's refill cycle, sp) of a loop the benchmark does not drive itself, under
    ``torch.profiler`` with the regions of :mod:`benchmarks.profile` on ``model`` (the model as built, its
    decoder ``model.model``) and on one library's attention and adapter classes: :meth:`start` installs them
    and begins, :meth:`step_end` after each step ends the profile after the last and returns
    :func:`benchmarks.profile.phases_of` of the steps (None before), the regions removed."""

    def __init__(self, model: torch.nn.Module, deepspeed: bool, steps: int):
        self.model, self.deepspeed, self.steps = model, deepspeed, steps
        self.regions, self.seconds, self._profiling, self._ran = Regions(), {}, None, 0

    @property
    def running(self) -> bool:
        return self._profiling is not None

    def start(self) -> None:
        attention, adapter, positions = library_classes(self.deepspeed)
        self.regions.attention(attention, positions).adapter(adapter).module(self.model.model, "bench.decoder")
        self.regions.collectives()
        self._profiling = phase_seconds(self.seconds, self.steps)
        self._profiling.__enter__()

    def step_end(self) -> dict | None:
        self._ran += 1
        if self._ran < self.steps:
            return None
        self._profiling.__exit__(None, None, None)
        self._profiling = None
        self.regions.uninstall()
        return self.seconds


def start_arm(spec: dict, loop: str):
    """What every arm of the Trainer's and the Accelerate loop does first: threads, Accelerate's CPU world,
    ``ds_ulysses.install()`` for ours, the collective tap, the model (built whole, before any DeepSpeed
    config exists). Returns (impl, sp, tap, model spec, model)."""
    from examples.cpu_gloo import report_gloo_world

    torch.set_num_threads(spec.get("threads", 1))
    impl, sp = spec["impl"], spec["sp"]
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"--loop {loop} runs {IMPLEMENTATIONS}, got {impl!r}; pick one of them")
    report_gloo_world()  # Accelerate on a CPU-only machine counts one process without it (examples/cpu_gloo.py)
    if impl != "deepspeed":
        import ds_ulysses

        ds_ulysses.install()
    tap = CollectiveTap().install()
    tap.phase = "setup"
    model_spec = {**MODEL_DEFAULTS, **spec.get("model", {})}
    return impl, sp, tap, model_spec, build_model(model_spec).train()


def tap_counts(tap) -> dict:
    """The tap's tallies of the attention layers' and the backward's collectives, as a result carries them."""
    return {"attn_forward": tap.tallies["attn_forward"].as_dict(), "attn_forward_calls": tap.counts["attn_forward"],
            "attn_backward": tap.tallies["attn_backward"].as_dict(), "backward": tap.tallies["backward"].as_dict()}


def finish_arm(tap, loop: str, measured: dict, counted: dict | None = None) -> dict:
    """This rank's result in :func:`benchmarks.rank.run`'s shape (``measured``: times, phases, losses and
    peaks), with the tap's tallies (``counted``, taken before a profiled step, or the tap's now) and whether
    ds_ulysses was loaded; then the process group ends."""
    result = {
        "rank": dist.get_rank(), "world": dist.get_world_size(), "loop": loop, **measured,
        **(tap_counts(tap) if counted is None else counted), "ds_ulysses_loaded": "ds_ulysses" in sys.modules,
    }
    dist.barrier()
    dist.destroy_process_group()
    return result


def run(spec: dict) -> dict:
    """Train ``warmup + steps`` steps of the Trainer with one arm; return this rank's measurements in
    :func:`benchmarks.rank.run`'s shape."""
    from transformers import Trainer, TrainingArguments

    def build(args, model, data, callbacks, recording):
        return recording(Trainer)(model=model, args=TrainingArguments(**args), train_dataset=data, callbacks=callbacks)

    return train(spec, "trainer", build)


def train(spec: dict, loop: str, build) -> dict:
    """One arm through a Trainer: ``build(args, model, data, callbacks, recording)`` returns the Trainer
    (``recording(cls)``: ``cls`` with its loss recorded) from ``args``, the keyword arguments of its
    ``TrainingArguments``; its training's steps are measured (and sp more profiled, with ``spec["profile"]``)
    and returned in :func:`benchmarks.rank.run`'s shape."""
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
            seen["init_peak"] = _hwm_bytes()
            seen["reset"] = _reset_hwm()
            clock.take()
            dist.barrier()
            marks.append(time.perf_counter())
            cpu_marks.append(time.process_time())
            fault_marks.append(_minor_faults())
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
            seen["step_peaks"].append(_hwm_bytes())
            dist.barrier()
            marks.append(time.perf_counter())
            cpu_marks.append(time.process_time())
            fault_marks.append(_minor_faults())
            if len(marks) == spec["warmup"] + 1:
                seen["refill"] = tap.scope_totals("refill")
                tap.reset()
            if len(phases) == total and profiler is not None:
                seen.update(steps_peak=_hwm_bytes(), losses=len(losses), counted=tap_counts(tap))
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
    steps_peak = seen.get("steps_peak") or _hwm_bytes()
    profile = {"profile": seen["profile"]} if "profile" in seen else {}
    return finish_arm(tap, loop, {
        "times": times[measured], "cpu_times": cpu_times[measured], "minor_faults": faults[measured],
        "phases": split[measured],
        "losses": losses[:seen.get("losses")], "step_peaks": seen["step_peaks"], "init_peak": seen["init_peak"],
        "steps_peak": steps_peak if seen["reset"] else None, "peak": max(seen["init_peak"], steps_peak),
        "refill": refill[0], "refills": refill[1], **profile}, seen.get("counted"))

"""What the loops the benchmark does not drive itself share: Transformers' Trainer, Accelerate's loop, TRL's.

Each such loop (:mod:`benchmarks.trainer`, :mod:`benchmarks.accelerate_loop`, :mod:`benchmarks.trl_loop`) starts
an arm the same way (:func:`start_arm`: threads, Accelerate's CPU world, ``ds_ulysses.install()`` for ours, the
collective tap, the model), splits a step's time around DeepSpeed's own engine methods (:class:`EngineClock`),
profiles one refill cycle after its measured steps (:class:`StepProfile`) and ends with a result in the engine
loop's shape (:func:`finish_arm`), so the report pairs and tables every loop's records alike.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from .arms import LOOP_IMPLEMENTATIONS, MODEL_DEFAULTS
from .profile import Regions, phase_seconds
from .recipes import build_model, library_classes
from .tap import CollectiveTap

__all__ = ["EngineClock", "StepProfile", "start_arm", "tap_counts", "finish_arm"]


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
    if impl not in LOOP_IMPLEMENTATIONS:
        raise ValueError(f"--loop {loop} runs {LOOP_IMPLEMENTATIONS}, got {impl!r}; pick one of them")
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
    """This rank's result in :func:`benchmarks.engine_loop.run`'s shape (``measured``: times, phases, losses and
    peaks), with the tap's tallies (``counted``, taken before a profiled step, or the tap's now) and whether
    ds_ulysses was loaded; then the process group ends."""
    result = {
        "rank": dist.get_rank(), "world": dist.get_world_size(), "loop": loop, **measured,
        **(tap_counts(tap) if counted is None else counted), "ds_ulysses_loaded": "ds_ulysses" in sys.modules,
    }
    dist.barrier()
    dist.destroy_process_group()
    return result

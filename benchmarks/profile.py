"""Where one training step spends its time, per phase, for DeepSpeed's ALST module and ours alike.

One adapter refill cycle (sp steps, so exactly one refill) after a launch's measured steps runs under
``torch.profiler`` with named regions that the benchmark puts around the same places in both
implementations (wrapping classes and modules from outside, as :mod:`benchmarks.tap` does for
collectives; nothing is added to either library). Every phase is seconds per step: the cycle's total over
its steps, as the measured step time is a cycle's mean step. (Before 2026-11-29 one step was profiled, never
a refill step at the defaults, so the adapter's phase was next to nothing.)

- ``bench.adapter``: ``next(loader)`` (the data adapter's micro-batch, a refill every sp steps);
- ``bench.forward`` / ``bench.backward`` / ``bench.step``: the user loop's three calls (in the Trainer's
  loops: its ``compute_loss`` and the engine's ``backward`` and ``step``, :mod:`benchmarks.trainer`);
- ``bench.decoder``: the decoder (embedding, layers, final norm); what ``bench.forward`` spends
  outside it is the head and the loss (lm_head, logits transform, cross-entropy, the SP aggregation);
- ``bench.ulysses``: the SP attention wrapper of a layer; inside it ``bench.core``, the core attention
  kernel (sdpa) on the full sequence, and ``bench.positions``, the global position_ids gather (ours:
  once per forward, with its input checks; DeepSpeed: its all_gather in every layer). What the
  wrapper spends outside those two is the all-to-alls with their layout copies;
- ``bench.coll.<op>``: every ``torch.distributed`` collective (the bare communication time).

Backward work is attributed to the forward region that created it: the profiler gives each backward
node the sequence number of the forward op that recorded it, so the backward of the attention
kernel, of the all-to-alls and of the loss are told apart from the rest of the layers. Backward time
no node accounts for (gradient accumulation, ZeRO's hooks and reduce-scatters) is ``backward, ZeRO``.
A checkpointed layer's forward, run again in the backward, is the time of the backward node that ran it
(mostly ``other layers``), not a second forward: the forward phases count their regions outside
``bench.backward`` only (before 2026-11-28 they counted the recomputation's attention regions too).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

__all__ = ["PHASES", "Regions", "phases_of", "phase_seconds"]

# the printed phases, in step order; each is seconds per step on one rank
PHASES = ("adapter", "positions", "a2a_fwd", "core_fwd", "layers_fwd", "loss_fwd",
          "a2a_bwd", "core_bwd", "layers_bwd", "loss_bwd", "zero_bwd", "optimizer")
_COLLECTIVES = ("all_to_all_single", "all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor",
                "broadcast")


def _region(name: str, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapped


class Regions:
    """Install the named regions of the module docstring; :meth:`uninstall` restores everything."""

    def __init__(self):
        self._undo: list = []

    def _set(self, owner, name: str, value) -> None:
        had = name in vars(owner)
        old = vars(owner).get(name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old) if had else delattr(owner, name))

    def collectives(self) -> "Regions":
        for op in _COLLECTIVES:
            if hasattr(dist, op):
                self._set(dist, op, _region(f"bench.coll.{op}", getattr(dist, op)))
        return self

    def attention(self, cls, positions_method: str | None = None) -> "Regions":
        """The wrapper class's ``forward`` as ``bench.ulysses``; each instance's core ``attn`` as
        ``bench.core`` (wrapped at its first call: DeepSpeed's instances are made inside its
        registration); ``positions_method`` (ours) as ``bench.positions``."""
        forward = cls.forward

        @functools.wraps(forward)
        def wrapped(obj, *args, **kwargs):
            if not getattr(obj, "_bench_core_wrapped", False):
                obj.attn = _region("bench.core", obj.attn)
                obj._bench_core_wrapped = True
            with record_function("bench.ulysses"):
                return forward(obj, *args, **kwargs)

        self._set(cls, "forward", wrapped)
        if positions_method is not None:
            self._set(cls, positions_method, _region("bench.positions", getattr(cls, positions_method)))
        return self

    def adapter(self, cls) -> "Regions":
        """The data adapter class's ``__next__`` as ``bench.adapter``, for the loops the benchmark does not write
        (the Trainer's) or calls ``next`` in (Accelerate's); the engine loop puts the region around its own
        ``next(loader)`` instead."""
        self._set(cls, "__next__", _region("bench.adapter", cls.__next__))
        return self

    def module(self, module: torch.nn.Module, name: str) -> "Regions":
        """A call of ``module`` as ``name``, its forward hooks included (the region opens in a pre-hook that
        runs before every other, ZeRO's parameter fetch and ds_ulysses' input checks among them, and
        closes in a hook that runs after every other)."""
        open_regions: list = []

        def enter(_module, _args):
            region = record_function(name)
            region.__enter__()
            open_regions.append(region)

        def leave(_module, _args, _output):
            open_regions.pop().__exit__(None, None, None)

        handles = (module.register_forward_pre_hook(enter, prepend=True), module.register_forward_hook(leave))
        self._undo.append(lambda: [h.remove() for h in handles])
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()


# regions of the forward pass that a checkpointed layer runs again inside the backward
_FORWARD_REGIONS = ("bench.decoder", "bench.ulysses", "bench.core", "bench.positions")


def _is_backward_node(event) -> bool:
    return event.name.startswith("autograd::engine::evaluate_function:")


def phases_of(events, steps: int = 1) -> dict:
    """Seconds per phase (:data:`PHASES`) and step of ``steps`` profiled steps, from ``torch.profiler`` events;
    ``"steps"`` says how many."""
    bench = {}  # event id -> innermost enclosing bench.* region name (None outside all)
    top_backward = []  # backward nodes evaluated by engine.backward, outermost only
    seq_region = {}  # forward op sequence number -> the innermost bench region that recorded it
    totals: dict = {}

    def enclosing(event):
        key = id(event)
        if key not in bench:
            parent = event.cpu_parent
            if parent is None:
                bench[key] = ()
            else:
                above = enclosing(parent)
                bench[key] = above + (parent.name,) if parent.name.startswith("bench.") else above
        return bench[key]

    for event in events:
        seconds = event.time_range.elapsed_us() / 1e6
        chain = enclosing(event)
        if event.name.startswith("bench."):
            if event.name in _FORWARD_REGIONS and "bench.backward" in chain:
                continue  # a checkpointed layer's recomputation: its backward node's time holds it
            totals[event.name] = totals.get(event.name, 0.0) + seconds
            if (event.name == "bench.coll.all_gather" and "bench.ulysses" in chain and "bench.positions" not in chain
                    and "bench.backward" not in chain):
                totals["positions_gather"] = totals.get("positions_gather", 0.0) + seconds  # DeepSpeed's per layer
            if event.name == "bench.coll.all_to_all_single" and "bench.adapter" not in chain:
                totals["a2a_collective"] = totals.get("a2a_collective", 0.0) + seconds
            continue
        if _is_backward_node(event):
            parent = event.cpu_parent
            while parent is not None and not _is_backward_node(parent):
                parent = parent.cpu_parent
            if parent is None and "bench.backward" in chain:
                top_backward.append((event.sequence_nr, seconds))
            continue
        if event.sequence_nr >= 0 and "bench.backward" not in chain:
            regions = [r for r in chain if r in ("bench.forward", "bench.decoder", "bench.ulysses", "bench.core")]
            if regions:
                seq_region.setdefault(event.sequence_nr, regions[-1])

    bwd = {"bench.forward": 0.0, "bench.decoder": 0.0, "bench.ulysses": 0.0, "bench.core": 0.0}
    for seq, seconds in top_backward:
        region = seq_region.get(seq)
        if region is not None:
            bwd[region] += seconds
    get = totals.get
    positions = get("bench.positions", 0.0) + get("positions_gather", 0.0)
    attributed = sum(bwd.values())
    summed = {
        "adapter": get("bench.adapter", 0.0),
        "positions": positions,
        "a2a_fwd": get("bench.ulysses", 0.0) - get("bench.core", 0.0) - positions,
        "core_fwd": get("bench.core", 0.0),
        "layers_fwd": get("bench.decoder", 0.0) - get("bench.ulysses", 0.0),
        "loss_fwd": get("bench.forward", 0.0) - get("bench.decoder", 0.0),
        "a2a_bwd": bwd["bench.ulysses"],
        "core_bwd": bwd["bench.core"],
        "layers_bwd": bwd["bench.decoder"],
        "loss_bwd": bwd["bench.forward"],
        "zero_bwd": get("bench.backward", 0.0) - attributed,
        "optimizer": get("bench.step", 0.0),
        "a2a_collective": get("a2a_collective", 0.0),
        "total": get("bench.adapter", 0.0) + get("bench.forward", 0.0) + get("bench.backward", 0.0)
        + get("bench.step", 0.0),
    }
    return {**{k: v / steps for k, v in summed.items()}, "steps": steps}


@contextlib.contextmanager
def phase_seconds(out: dict, steps: int = 1):
    """Profile the block, which runs ``steps`` steps; on exit ``out`` holds :func:`phases_of` of them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    out.update(phases_of(prof.events(), steps))

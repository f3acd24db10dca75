"""The instruments every loop of the harness measures with: time and memory as a process sees them.

- the RSS high-water mark of this process (``/proc/self/status``' ``VmHWM``, reset through
  ``/proc/self/clear_refs``) and of another one (a launched rank, read by the launcher), and its minor page faults;
- the machine's load and the share of its CPU time the host stole (``/proc/stat``): a launch in a steal spell
  measures the host, not the code;
- the RSS above a settled base and the exact peak of live tensors from the profiler's allocator events, for one
  call (the tiled operations);
- :class:`LiveTensors`: every tensor an aten op allocates during a step, followed until its storage is freed,
  with each segment's peak and what was live then (``python -m benchmarks.breakdown``).

It imports nothing of the harness (tests/unit/test_bench_layout.py): every layer above may use it.
"""

from __future__ import annotations

import ctypes
import gc
import resource
import weakref
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["minor_faults", "hwm_bytes", "reset_hwm", "hwm_of", "loadavg", "cpu_ticks", "stolen", "rss_pair",
           "settle", "tensor_peak", "LiveTensors"]


def minor_faults() -> int:
    """Page faults this process took without I/O (every thread): a fresh page's first touch. Their count is not
    their cost: huge pages cut it 25-fold here and no step's CPU work with it (README, 2026-11-29 11:08)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def hwm_bytes() -> int:
    """This process's RSS high-water mark."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_hwm() -> bool:
    """Reset this process's RSS high-water mark to its RSS now; False where the kernel does not let it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def hwm_of(pid: int) -> int:
    """Another process's RSS high-water mark (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def cpu_ticks() -> tuple[int, int]:
    """(stolen, all) clock ticks of this machine's CPUs so far (``/proc/stat``): ``stolen`` is the time the
    host ran something else on the virtual CPUs while they had work."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def stolen(before: tuple[int, int]) -> float:
    """The share of the machine's CPU time stolen by the host since ``before`` (:func:`cpu_ticks`)."""
    taken, total = cpu_ticks()
    return (taken - before[0]) / (total - before[1]) if total > before[1] else float("nan")


def rss_pair() -> tuple[int, int]:
    """(RSS, RSS high-water mark) of this process."""
    current = peak = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                current = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return current, peak


def settle() -> int:
    """Collect garbage, hand freed heap back to the system and reset the high-water mark; the RSS then."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_pair()[0]


def tensor_peak(call) -> int:
    """Peak bytes of tensors alive during `call()` above those alive before it: the running sum of the
    profiler's allocator events (+ allocated, - freed) in the order they happened."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events = [(e.start_ns(), i, e.nbytes()) for i, e in enumerate(prof.profiler.kineto_results.events())
              if e.name() == "[memory]"]
    live = peak = 0
    for _, _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    return peak


class LiveTensors(TorchDispatchMode):
    """Live bytes of the tensors allocated while it is active, with each segment's peak and what was live then.

    On CPU the RSS mixes the allocator's caching with what is live, so this follows tensors instead: an op's
    output whose storage is none of its inputs' is a fresh allocation, untracked when its storage is freed (a
    weakref finalizer on the storage; torch keeps one Python object per storage, so the finalizer runs exactly
    when the memory goes). Tensors alive before it was entered (weights, optimizer states, ZeRO's buffers) are
    not counted: the figure is a step's own working memory, exact to the byte.

    ``segment`` is set from outside (the step loop and module hooks); ``where`` is the innermost module running
    (its qualified name), or in backward the autograd node that allocated.
    """

    def __init__(self):
        super().__init__()
        self.modules: list[str] = []
        self.reset()

    def reset(self) -> None:
        """Forget everything tracked (a new step)."""
        self.live: dict[int, tuple] = {}  # storage address -> (bytes, shape, dtype, segment, where, op)
        self.total = 0
        self.segment = "setup"
        self.peaks: dict[str, tuple[int, list]] = {}
        self._rising = False

    def set_segment(self, name: str) -> None:
        self._settle()
        self.segment = name

    def _settle(self) -> None:
        """Snapshot the live set when the total stops rising at a new high for its segment."""
        if self._rising:
            self._rising = False
            best = self.peaks.get(self.segment, (-1, None))[0]
            if self.total > best:
                self.peaks[self.segment] = (self.total, list(self.live.values()))

    def _free(self, key: int, nbytes: int) -> None:
        if key in self.live:
            self._settle()  # the live set before this free is the peak's
            del self.live[key]
            self.total -= nbytes

    def _where(self) -> str:
        if self.modules:
            return self.modules[-1]
        node = torch._C._current_autograd_node()
        return f"autograd {node.name()}" if node is not None else "-"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.layout == torch.strided}
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self.live:
                continue
            where = self._where()
            if where == "-" and self.segment.startswith("layer "):
                self.set_segment("backward epilogue")  # autograd is done: ZeRO's gradient handling
            self.live[key] = (nbytes, tuple(t.shape), str(t.dtype).removeprefix("torch."), self.segment,
                              where, func.__name__)
            self.total += nbytes
            self._rising = True
            weakref.finalize(storage, self._free, key, nbytes)
        return out

    def close(self) -> None:
        self._settle()

    def hook(self, model) -> list:
        """Follow which decoder module runs, and cut segments at the decoder's layers and at the
        decoder's end. A layer's submodule running in backward is that layer's recompute (Transformers
        checkpoints a layer's ``forward``, so the layer's own hooks stay outside and only its submodules' run
        again)."""
        handles = []
        decoder = model.model
        layer_of = {}
        for i, layer in enumerate(decoder.layers):
            layer_of.update({id(sub): i for sub in layer.modules()})

        # the decoder's modules only: a hook on the lm_head would make our loss refuse to fuse it (it fuses only a
        # head without hooks but DeepSpeed's, ds_ulysses.memory.fused_ce.fusable_head)
        for name, module in decoder.named_modules(prefix="model"):
            def enter(mod, args, _name=name):
                i = layer_of.get(id(mod))
                if i is not None and self.segment not in ("forward", "loss", f"layer {i}"):
                    self.set_segment(f"layer {i}")
                self.modules.append(_name)

            def leave(mod, args, out):
                if self.modules:
                    self.modules.pop()
                if mod is decoder and self.segment == "forward":
                    self.set_segment("loss")
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave, always_call=True))
        return handles

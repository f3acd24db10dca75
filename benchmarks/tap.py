"""Counting collectives by wrapping ``torch.distributed``, the same way for both implementations.

The benchmark compares communication of DeepSpeed's ALST module and ours, so the count comes from
outside both (neither library keeps counters). Both end in ``torch.distributed.<collective>`` looked
up at call time (DeepSpeed through ``deepspeed.comm``'s torch backend), so replacing those attributes
in the benchmark process sees every call. A call is charged to the innermost active *scope*
(``attn_forward``, ``refill``, ...); calls outside any scope (ZeRO-3's parameter gathers, gradient
reduce-scatters) are not counted.

Bytes are counted two ways per call: ``sent`` is the size of the send buffer (what the Ulysses
minimum ``4 S h / sp`` per layer counts), ``off_rank`` is the part that leaves the process (the send
buffer minus this rank's own slice); ``received`` is what arrived from other ranks.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict

import torch
import torch.distributed as dist

__all__ = ["CollectiveTap", "Tally"]

_GROUP_ARG = {"all_to_all_single": 4, "all_gather": 2, "all_gather_into_tensor": 2, "all_reduce": 2,
              "all_gather_object": 2, "broadcast": 2}  # positional index of each collective's group
_OPS = tuple(_GROUP_ARG)


class Tally:
    """Calls and bytes (``sent``, ``off_rank``, ``received``) per collective, for one scope."""

    def __init__(self):
        self.calls: dict[str, int] = defaultdict(int)
        self.sent: dict[str, int] = defaultdict(int)
        self.off_rank: dict[str, int] = defaultdict(int)
        self.received: dict[str, int] = defaultdict(int)

    def as_dict(self) -> dict:
        return {"calls": dict(self.calls), "sent": dict(self.sent), "off_rank": dict(self.off_rank),
                "received": dict(self.received)}


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def _split_bytes(t, splits, ws: int) -> list[int]:
    """Bytes per rank slice of an all_to_all buffer (dim-0 splits, even when ``splits`` is None)."""
    row = _nbytes(t) // max(1, t.shape[0]) if t.dim() else _nbytes(t)
    if splits is None:
        return [_nbytes(t) // ws] * ws
    return [int(s) * row for s in splits]


class CollectiveTap:
    """Wraps the collectives of ``torch.distributed`` for this process; charge calls to scopes."""

    def __init__(self):
        self.tallies: dict[str, Tally] = defaultdict(Tally)
        self.counts: dict[str, int] = defaultdict(int)  # how often each scope was entered
        self._stack: list[str] = []
        self._originals: dict = {}

    def install(self) -> "CollectiveTap":
        for name in _OPS:
            if name not in self._originals and hasattr(dist, name):
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._originals[name]))
        return self

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    @contextlib.contextmanager
    def scope(self, name: str):
        self._stack.append(name)
        self.counts[name] += 1
        try:
            yield
        finally:
            self._stack.pop()

    def wrap_method(self, cls, method: str, scope_of) -> None:
        """Run ``cls.method`` inside ``scope_of(self_obj)`` (a scope name, or None for no scope)."""
        original = getattr(cls, method)

        @functools.wraps(original)
        def wrapped(obj, *args, **kwargs):
            name = scope_of(obj)
            if name is None:
                return original(obj, *args, **kwargs)
            with self.scope(name):
                return original(obj, *args, **kwargs)

        setattr(cls, method, wrapped)

    def scope_totals(self, name: str) -> tuple[dict, int]:
        """What scope ``name`` has sent and received so far (its tally as a dict) and how often it was entered."""
        return self.tallies[name].as_dict(), self.counts[name]

    def reset(self) -> None:
        self.tallies.clear()
        self.counts.clear()

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if self._stack:
                self._charge(name, self.tallies[self._stack[-1]], args, kwargs)
            return fn(*args, **kwargs)

        return wrapped

    def _charge(self, name: str, tally: Tally, args, kwargs) -> None:
        at = _GROUP_ARG[name]
        group = kwargs.get("group", args[at] if len(args) > at else None)
        ws = dist.get_world_size(group)
        me = dist.get_rank(group)
        tally.calls[name] += 1
        if name == "all_to_all_single":
            out, inp = (list(args) + [None, None])[:2]
            out, inp = kwargs.get("output", out), kwargs.get("input", inp)
            out_splits = kwargs.get("output_split_sizes", args[2] if len(args) > 2 else None)
            in_splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
            sent, off = _nbytes(inp), _nbytes(inp) - _split_bytes(inp, in_splits, ws)[me]
            received = _nbytes(out) - _split_bytes(out, out_splits, ws)[me]
        elif name in ("all_gather", "all_gather_into_tensor"):
            out = kwargs.get("tensor_list", kwargs.get("output_tensor", args[0] if args else None))
            inp = kwargs.get("tensor", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
            total = sum(_nbytes(t) for t in out) if isinstance(out, (list, tuple)) else _nbytes(out)
            sent, off, received = _nbytes(inp), _nbytes(inp) * (ws - 1), total - _nbytes(inp)
        elif name in ("all_reduce", "broadcast"):
            t = kwargs.get("tensor", args[0] if args else None)
            sent = off = received = _nbytes(t)
        else:  # all_gather_object: pickled sizes are not visible here
            sent = off = received = 0
        tally.sent[name] += sent
        tally.off_rank[name] += off
        tally.received[name] += received

"""The host C heap: hand the pages a training step freed back to the OS before the next step.

glibc's allocator keeps what a step frees (activations, loss tiles, gradient buffers: every block below
its mmap threshold, which rises to 32 MiB once such a block has been freed) in its arenas, and returns a
page to the OS only from the top of an arena. Blocks that live across steps (gradient partitions,
optimizer state, the loader's next batch) land above the freed ones, so the freed pages stay resident:
on CPU at 16K tokens and sp 4, after three steps 1.2 GiB of a rank's 1.8 GiB RSS is freed heap, all
of it counted in the next step's peak, which is what the OOM killer and a host-memory budget see.
``malloc_trim(0)`` gives back every free page of every arena (``madvise``) without moving a live block;
the call takes about 0.05 s, and the next step faults back in the pages it reuses, which is the rest of
the cost (benchmark, 16K tokens, sp 2: peak 2.31 GiB instead of 2.82 for a step 8% longer).
CUDA memory is untouched (torch's caching allocator keeps its own).
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["trim_host_heap", "can_trim_host_heap"]


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        fn = getattr(ctypes.CDLL(None), "malloc_trim")
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def can_trim_host_heap() -> bool:
    """Whether this process's C library can give freed heap pages back (glibc)."""
    return _malloc_trim() is not None


def trim_host_heap() -> bool:
    """Give every free page of the C heap back to the OS; True if any was given back. A no-op (False)
    where the C library cannot (:func:`can_trim_host_heap`)."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False

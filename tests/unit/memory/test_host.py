"""memory.host: the C heap's free pages go back to the OS (RSS from /proc, in a fresh interpreter)."""

import subprocess
import sys

import pytest

from ds_ulysses.memory.host import can_trim_host_heap, trim_host_heap

# 2048 blocks of 64 KiB (below glibc's 128 KiB mmap threshold, so they live in the heap), then one
# block more above them that keeps the heap's top in use, as a step's long-lived buffers do; freeing
# the 128 MiB leaves it resident until trimmed.
_SCRIPT = """
import torch
from ds_ulysses.memory.host import trim_host_heap

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

blocks = [torch.ones(16 * 1024) for _ in range(2048)]
top = torch.ones(16 * 1024)
held = rss()
del blocks
freed = rss()
trimmed = trim_host_heap()
print(held, freed, rss(), trimmed)
"""


@pytest.mark.skipif(not can_trim_host_heap(), reason="the C library has no malloc_trim (not glibc)")
def test_freed_heap_stays_resident_until_trimmed_then_goes_back():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=True).stdout
    held, freed, after, trimmed = out.split()
    held, freed, after = int(held), int(freed), int(after)
    mib = 1 << 20
    assert held - freed < 16 * mib, (held, freed)  # free() alone gives back next to nothing
    assert freed - after > 112 * mib, (freed, after)  # the trim gives back (nearly) all 128 MiB
    assert trimmed == "True"


def test_trim_is_a_no_op_that_says_so_without_malloc_trim(monkeypatch):
    from ds_ulysses.memory import host

    monkeypatch.setattr(host, "_malloc_trim", lambda: None)
    assert host.can_trim_host_heap() is False
    assert host.trim_host_heap() is False
    assert trim_host_heap is host.trim_host_heap

"""Build DeepSpeed's JIT ops once, in the pytest process, before any test spawns ranks.

DeepSpeed compiles its CPU Adam and shared-memory comm op on first use (about two minutes on two
cores), guarded by a lock file that torch's loader waits on forever. If the first use happens inside
a multi-rank test and that test's timeout kills the rank mid-build, the lock stays and every later
DeepSpeed run on the machine hangs. Building here, outside every test timeout, removes that window.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")
STALE_LOCK_SECONDS = 600  # a build holds its lock for minutes at most


def _lock_path(op_name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory  # where torch's loader keeps the op and its lock

    return Path(_get_build_directory(op_name, verbose=False)) / "lock"


def pytest_sessionstart(session: pytest.Session) -> None:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for class_name in OPS:
        builder = accelerator.create_op_builder(class_name)
        if builder is None or not builder.is_compatible():
            continue
        lock = _lock_path(builder.name)
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            raise pytest.UsageError(
                f"DeepSpeed's op build lock {lock} is {int(time.time() - lock.stat().st_mtime)} s old: a build "
                "was killed while holding it, and every DeepSpeed run would wait on it forever. Make sure no "
                f"other build is running, delete {lock}, and run the tests again.")
        builder.load(verbose=False)

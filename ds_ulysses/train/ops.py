"""DeepSpeed's JIT-built ops (CPU Adam, the shared-memory comm op): one cache per virtualenv, built once
up front, and build locks left by killed builds cleared instead of waited on forever.

DeepSpeed compiles these ops on first use with torch's extension loader, into
``TORCH_EXTENSIONS_DIR`` (default: the user-wide ``~/.cache/torch_extensions``). Two things go wrong:

- every virtualenv writes its own build file there, so checkouts with their own ``.venv`` rebuild
  each other's ops (minutes each on 2 cores): :func:`use_venv_cache` points the loader at
  ``<venv>/torch_extensions`` unless the variable is already set;
- the loader guards a build with a ``lock`` file it creates and removes, and any later load waits for
  the file to disappear, with no timeout. A build killed half-way (a test timeout, Ctrl-C) leaves it
  behind and every later DeepSpeed run hangs. The builder keeps the lock file open while it holds it,
  so a lock no live process has open (and not created in the last seconds) is stale:
  :func:`clear_stale_locks` removes it with a one-line message.

``python -m ds_ulysses.train.ops`` (run by ``make install``) builds both ops, saying what and where.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from pathlib import Path

__all__ = ["OPS", "extensions_dir", "use_venv_cache", "lock_holders", "clear_stale_locks", "build", "main"]

OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")
_FRESH_SECONDS = 10  # a lock younger than this may be between its creation and its owner's next step


def extensions_dir() -> Path:
    """Where torch's loader builds extensions: ``TORCH_EXTENSIONS_DIR``, else this virtualenv's cache."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")


def use_venv_cache() -> Path:
    """Make this process and its children build into the virtualenv's cache (unless one is set)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    return extensions_dir()


def lock_holders(lock: Path) -> list[int]:
    """PIDs of the processes that have ``lock`` open (Linux /proc; empty where it cannot be read)."""
    target, holders = os.path.realpath(lock), []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if any(os.readlink(fd) == target for fd in (proc / "fd").iterdir()):
                holders.append(int(proc.name))
        except OSError:  # the process ended, or its fds are not ours to read
            continue
    return holders


def clear_stale_locks(root: Path | None = None, log=print) -> list[Path]:
    """Remove the build locks under ``root`` (default :func:`extensions_dir`) that no live process holds."""
    root = extensions_dir() if root is None else Path(root)
    cleared = []
    for lock in sorted(root.glob("*/lock")):
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # released meanwhile
            continue
        if age < _FRESH_SECONDS or lock_holders(lock):
            continue
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
            cleared.append(lock)
            log(f"removed a stale DeepSpeed op build lock (no process holds it; a killed build left it, "
                f"{int(age)} s ago): {lock}")
    return cleared


@contextlib.contextmanager
def _one_builder(root: Path):
    """Serialise this package's builds in one cache (a flock: released by the OS if the holder dies)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".ds_ulysses_build", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def build(log=print) -> None:
    """Build (or load, when already built) every op this machine's accelerator can use."""
    from deepspeed.accelerator import get_accelerator

    root = extensions_dir()
    accelerator = get_accelerator()
    with _one_builder(root):
        clear_stale_locks(root, log)
        for class_name in OPS:
            builder = accelerator.create_op_builder(class_name)
            if builder is None or not builder.is_compatible():
                continue
            built = any(root.glob(f"{builder.name}/*.so"))
            if not built:
                log(f"building DeepSpeed's {builder.name} op into {root / builder.name} (once per virtualenv; "
                    "about 1-2 minutes on 2 cores)")
                sys.stdout.flush()
            start = time.monotonic()
            builder.load(verbose=False)
            if not built:
                log(f"built {builder.name} in {time.monotonic() - start:.0f} s")


def main() -> int:
    """``python -m ds_ulysses.train.ops``: build the ops into this virtualenv's cache."""
    root = use_venv_cache()
    print(f"DeepSpeed ops cache: {root}", flush=True)
    build()
    return 0


if __name__ == "__main__":
    sys.exit(main())

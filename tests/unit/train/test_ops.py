"""DeepSpeed's op builds: a lock a killed build left behind is cleared, a lock a live build holds is
kept, and a run that finds a leftover lock in the real op cache finishes instead of hanging."""

import os
import subprocess
import sys
import time

from ds_ulysses.train import ops


def _plant(path, age):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_only_locks_no_live_process_holds_are_cleared(tmp_path):
    stale = _plant(tmp_path / "cpu_adam" / "lock", age=3600)
    fresh = _plant(tmp_path / "fresh_op" / "lock", age=0)
    held = _plant(tmp_path / "held_op" / "lock", age=3600)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); print(1, flush=True); "
                               "time.sleep(60)", str(held)], stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()  # the holder has the file open
        assert ops.lock_holders(held) == [holder.pid]
        messages = []
        assert ops.clear_stale_locks(tmp_path, messages.append) == [stale]
    finally:
        holder.kill()
    assert not stale.exists() and fresh.exists() and held.exists()
    assert len(messages) == 1 and "removed a stale DeepSpeed op build lock" in messages[0] and str(stale) in messages[0]


def test_a_leftover_lock_in_the_op_cache_no_longer_hangs_a_run():
    """The way it failed: a killed build's lock in the cache every DeepSpeed process loads from."""
    lock = _plant(ops.extensions_dir() / "cpu_adam" / "lock", age=3600)
    code = "from ds_ulysses.train import ops; ops.build(); from deepspeed.ops.adam import DeepSpeedCPUAdam; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "removed a stale DeepSpeed op build lock" in result.stdout and result.stdout.strip().endswith("ok")
    assert not lock.exists()

"""The script's way out (job.leave): the exit code it is given, exit handlers run, buffered output
flushed, and no interpreter teardown (no finalizer runs), which is what keeps gloo's worker threads from
meeting an interpreter that is going away."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit
    import sys

    from ds_ulysses.train.job import leave


    class Finalized:
        def __del__(self):
            print("torn down", flush=True)


    kept = Finalized()
    atexit.register(print, "exit handler ran")
    sys.stdout.write("buffered line")
    sys.stderr.write("buffered error")
    leave(3)
    print("after leave")
""")


def test_leave_exits_with_the_code_after_handlers_and_flushes_without_teardown():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout == "buffered lineexit handler ran\n"
    assert proc.stderr.endswith("buffered error")

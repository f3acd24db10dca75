"""Every pytest run builds DeepSpeed's JIT ops into this virtualenv's cache before any test spawns ranks.

DeepSpeed compiles its CPU Adam and shared-memory comm op on first use. Doing it here, in the pytest
process and outside every test timeout, means no test's deadline covers a build (and no timeout can
kill a build half-way); a lock a killed build left behind is cleared with a message instead of making
every DeepSpeed run wait forever (:mod:`ds_ulysses.train.ops`). Ranks spawned by the tests inherit
``TORCH_EXTENSIONS_DIR``, so they load the ops this session built.
"""

from __future__ import annotations

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    from ds_ulysses.train import ops

    ops.use_venv_cache()
    ops.build()

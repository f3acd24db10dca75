"""SP training equals non-SP training: loss rel <= 1e-5, every gradient rel <= 1e-4 (fp32, CPU).

Reference: the same weights run unsharded in one process, each packed document alone. The
tolerances allow for a different floating-point summation order (all-to-all reassembly, per-rank
partial sums of the loss), nothing more: a wrong mask, head or position gives errors near 1.
"""

import pytest

from .distributed import run_distributed
from .sp_cases import sp_vs_reference

CASES = {
    "llama-mha-sp2": (2, dict(family="llama", heads=4)),
    "llama-8h-2kv-sp4": (4, dict(family="llama", heads=8, kv_heads=2)),
    "qwen2-gqa-sp2": (2, dict(family="qwen2", heads=4, kv_heads=2)),
    "qwen3-gqa-sp2": (2, dict(family="qwen3", heads=4, kv_heads=2)),
    "mistral-gqa-sp2": (2, dict(family="mistral", heads=4, kv_heads=2, extra={"sliding_window": None})),
    "llama-batch2-sp2": (2, dict(family="llama", heads=4, bs=2)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sp_matches_unsharded(name):
    world, case = CASES[name]
    for result in run_distributed(sp_vs_reference, world, case):
        assert result["steps"] == world
        assert result["loss"] <= 1e-5, result
        assert result["grad"][0] <= 1e-4, result

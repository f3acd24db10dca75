"""Accelerate on a CPU-only machine: let it count the gloo world DeepSpeed runs on.

A DeepSpeed launch sets LOCAL_RANK; with no GPU, Accelerate (1.15) finds no backend for a non-CPU
run and reports one process while DeepSpeed trains on all of them (with ``cpu=True`` it would skip
DeepSpeed altogether). The examples and tests call :func:`report_gloo_world` on CPU-only machines
so that Accelerate sees gloo and the real world size; on a GPU machine it does nothing.
"""

import os

__all__ = ["report_gloo_world"]


def report_gloo_world() -> None:
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if torch.cuda.is_available() or getattr(PartialState, "_gloo_world", False):
        return
    original = PartialState._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        found, kind = original(self, cpu, sagemaker_dp, backend)
        if found is None and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_CPU
        return found, kind

    PartialState._prepare_backend = prepare_backend
    PartialState._gloo_world = True

"""One progress line per training step on rank 0: step, loss, throughput and every rank's memory.

Memory is the point of ALST, and under SP it differs by rank (ZeRO partitions, uneven shards), so
each step gathers every rank's resident set size (RSS: on CPU that is the tensors; on GPU it is the
host side, with the device's peak next to it). One all_gather of three numbers per rank per step.
"""

from __future__ import annotations

import sys
import time

import psutil
import torch
import torch.distributed as dist

__all__ = ["StepReport", "ProgressLine"]

from ..constants import GIB
from ..distributed.collectives import collective_device


class StepReport:
    """What one step's line shows, also kept for callers (tests, summaries)."""

    def __init__(self, step: int, loss: float, tokens: int, seconds: float, rss_gb: list[float],
                 device_gb: list[float]):
        self.step, self.loss, self.tokens, self.seconds = step, loss, tokens, seconds
        self.rss_gb, self.device_gb = rss_gb, device_gb

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class ProgressLine:
    """Call :meth:`start` before a step and :meth:`end` after it on every rank (``end`` is collective)."""

    def __init__(self, total_steps: int, width: int = 20, stream=None):
        self.total, self.width, self.stream = total_steps, width, stream
        self.process = psutil.Process()
        self.t0 = time.perf_counter()

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def end(self, step: int, loss: float, local_tokens: int) -> StepReport:
        """``loss`` is this rank's (the same on SP peers); ``local_tokens`` the tokens of its shards."""
        seconds = time.perf_counter() - self.t0
        device = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0
        mine = torch.tensor([float(loss), float(local_tokens), self.process.memory_info().rss / GIB, device],
                            dtype=torch.float64, device=collective_device())  # [4]
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            table = torch.stack(every).cpu()  # [ws 4]
        else:
            table = mine[None].cpu()
        report = StepReport(step, table[:, 0].mean().item(), int(table[:, 1].sum().item()), seconds,
                            table[:, 2].tolist(), table[:, 3].tolist())
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(self.format(report), file=self.stream or sys.stdout, flush=True)
        return report

    def format(self, r: StepReport) -> str:
        done = round(self.width * r.step / max(self.total, 1))
        bar = "#" * done + "-" * (self.width - done)
        memory = " ".join(f"r{i} {gb:.2f}" for i, gb in enumerate(r.rss_gb))
        if any(r.device_gb):
            memory += " | device GB " + " ".join(f"r{i} {gb:.2f}" for i, gb in enumerate(r.device_gb))
        return (f"step {r.step:>{len(str(self.total))}}/{self.total} [{bar}] loss {r.loss:.4f} | "
                f"{r.tokens_per_second:,.0f} tok/s | {r.seconds:.1f} s | RSS GB {memory}")

"""Which device a collective's tensors live on, decided here and only here, and the small collectives
built on that choice.

NCCL moves CUDA tensors only and gloo CPU tensors only, so every tensor handed to a collective is
created on (or moved to) :func:`collective_device` of its group. Every helper short-circuits when the
group has one rank, so the same code runs single-process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["collective_device", "group_size", "group_rank", "all_gather_bytes", "all_reduce_max", "all_reduce_sum"]


def group_size(group=None) -> int:
    """Ranks in ``group`` (the world when None); 1 when torch.distributed is not initialised."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def collective_device(group=None) -> torch.device:
    """The device ``group``'s backend communicates from: this rank's CUDA device for NCCL, else CPU."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(payload: bytes, group=None) -> list[bytes]:
    """Every rank's ``payload`` (any lengths), in group-rank order."""
    ws = group_size(group)
    if ws == 1:
        return [payload]
    device = collective_device(group)
    size = torch.tensor([len(payload)], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(ws)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(max(longest, 1), dtype=torch.uint8)
    buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else buf[:0]
    buf = buf.to(device)
    bufs = [torch.empty_like(buf) for _ in range(ws)]
    dist.all_gather(bufs, buf, group=group)
    return [b[:int(s)].cpu().numpy().tobytes() for b, s in zip(bufs, sizes)]


def all_reduce_max(value: int, group=None) -> int:
    """The largest ``value`` over the ranks of ``group``."""
    return _all_reduce_int(value, dist.ReduceOp.MAX, group)


def all_reduce_sum(value: int, group=None) -> int:
    """The sum of ``value`` over the ranks of ``group``."""
    return _all_reduce_int(value, dist.ReduceOp.SUM, group)


def _all_reduce_int(value: int, op, group) -> int:
    if group_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=op, group=group)
    return int(t.item())

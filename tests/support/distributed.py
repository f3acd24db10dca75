"""Run a function on N ranks (gloo on CPU, or NCCL with one GPU per rank) in fresh processes;
collect each rank's result or traceback."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every gloo rank imports anyway, imported once by the process the ranks fork from (see _context)
PRELOAD = ["torch", "torch.distributed", "deepspeed", "deepspeed.runtime.engine", "transformers",
           "transformers.modeling_utils", "transformers.models.llama.modeling_llama", "ds_ulysses"]


def _context(backend: str):
    """gloo ranks under ``DS_ACCELERATOR=cpu`` (``make test`` sets it) fork from a server process that
    imported :data:`PRELOAD` once (2-6 s a process on this machine, most of a small test's launch); each rank
    still starts clean, as a spawned one would, and gets the parent's environment of the moment
    (:func:`_worker`). Other ranks are spawned: DeepSpeed picks its accelerator when it is imported, and a
    process forked after CUDA is touched cannot use it."""
    if backend == "nccl" or os.environ.get("DS_ACCELERATOR") != "cpu":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank, world_size, port, fn, args, queue, received, backend="gloo", environ=None):
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      DS_ACCELERATOR="cuda" if backend == "nccl" else "cpu")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        queue.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # report everything, including assertion failures, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # tensors in a result travel as shared-memory handles: exiting before the parent has
        # unpickled them would pull the memory out from under it
        received.wait(timeout=60)


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0, backend: str = "gloo") -> list:
    """``fn(rank, world_size, *args)`` on each rank; returns the results in rank order. ``backend="nccl"``
    gives rank r the GPU r."""
    ctx = _context(backend)
    queue, received = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, received, backend,
                                               dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        received.set()
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


class AllToAllBytes:
    """Counts the bytes this rank receives from other ranks in ``torch.distributed.all_to_all_single``
    while active (``with AllToAllBytes() as counted: ...; counted.received``), by wrapping the function
    the library looks up at call time: no counter lives in the library."""

    def __init__(self):
        self.received = 0
        self._original = None

    def __enter__(self):
        self._original = original = dist.all_to_all_single

        def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            me, ws = dist.get_rank(group), dist.get_world_size(group)
            row = output.element_size() * (output[0].numel() if output.dim() else 1)
            sizes = output_split_sizes or [output.shape[0] // ws] * ws
            self.received += sum(int(s) * row for r, s in enumerate(sizes) if r != me)
            return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        dist.all_to_all_single = counting
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._original

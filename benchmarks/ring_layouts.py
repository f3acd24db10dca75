"""One attention layer at a fixed sp, three ways: Ulysses alone, Ulysses x ring, ring alone.

At sp 4 (this machine's gloo ranks): Ulysses 4, Ulysses 2 x ring 2 and ring 4 run forward + backward on the same
q/k/v (``[bs hc sl_l hs]``, the benchmark model's 8 query / 2 KV heads of size 32), in an order rotated every
iteration so machine noise hits the three alike; each gets its median time and the bytes its rank sent per
layer, counted by wrapping the collectives it ends in (``torch.distributed.all_to_all_single`` for the
all-to-all, ``all_gather`` for the once-per-forward position and layout checks, the functional
``permute_tensor`` for the ring's blocks). Each ring layout's q/k/v come from the head-tail sample layout the
data adapter makes (:func:`ds_ulysses.distributed.ring.head_tail_order`).

Dimension legend::  bs batch   hc heads   kv KV heads   sl_l local sequence length   hs head size

Run as ``python -m benchmarks.ring_layouts S ITERS``: it starts 4 gloo ranks itself; rank 0 prints one JSON line,
layout -> median seconds and bytes sent per layer (forward + backward) by collective.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run", "main"]

WORLD = 4
LAYOUTS = {"ulysses 4": 1, "ulysses 2 x ring 2": 2, "ring 4": 4}  # name -> ring_size


class _Attn(torch.nn.Module):
    """What HF's sdpa reads from the attention module: causal, GQA groups, training flag."""

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.is_causal, self.num_key_value_groups, self.layer_idx = True, heads // kv_heads, 0


class _Bytes:
    """Bytes each wrapped collective sends from this rank while ``scope`` is set."""

    def __init__(self):
        self.scope, self.sent = None, defaultdict(lambda: defaultdict(int))

    def wrap(self, module, name: str, size):
        original = getattr(module, name)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if self.scope is not None:
                self.sent[self.scope][name] += size(*args, **kwargs)
            return original(*args, **kwargs)

        setattr(module, name, counted)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _a2a_off_rank(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **_):
    """The send buffer less this rank's own rows (dim 0 is split among the ranks)."""
    ws, me = dist.get_world_size(group), dist.get_rank(group)
    rows = input.shape[0] if input.dim() else 1
    mine = rows // ws if input_split_sizes is None else input_split_sizes[me]
    return _nbytes(input) * (rows - mine) // max(1, rows)


def _gather_off_rank(tensor_list, tensor, group=None, **_):
    return _nbytes(tensor) * (dist.get_world_size(group) - 1)


def run(seq_len: int, iters: int, heads: int = 8, kv_heads: int = 2, head_size: int = 32) -> dict:
    import torch.distributed._functional_collectives as ft_c
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ds_ulysses.distributed.mesh import Mesh
    from ds_ulysses.distributed.ring import head_tail_order
    from ds_ulysses.sp.attention import UlyssesAttention
    from ds_ulysses.sp.ring import RingCore

    torch.set_num_threads(1)
    tally = _Bytes()
    tally.wrap(dist, "all_to_all_single", _a2a_off_rank)
    tally.wrap(dist, "all_gather", _gather_off_rank)
    tally.wrap(ft_c, "permute_tensor", lambda tensor, *a, **k: _nbytes(tensor))
    rank, sl_l = dist.get_rank(), seq_len // WORLD
    module = _Attn(heads, kv_heads).train()
    arms = {}
    for name, ring in LAYOUTS.items():
        mesh = Mesh(1, WORLD, ring_size=ring)
        core = RingCore(mesh.ring_group, ring, mesh.ring_rank) if ring > 1 else None
        attn = UlyssesAttention(sdpa_attention_forward, 1, heads, head_size, kv_heads, 1, mesh.ulysses_group,
                                seq_length_is_variable=True, ring=core)
        natural = head_tail_order(seq_len, ring) if ring > 1 else torch.arange(seq_len)
        arms[name] = (attn, natural[rank * sl_l:(rank + 1) * sl_l].view(1, sl_l))  # [1 sl_l] positions
    gen = torch.Generator().manual_seed(rank)
    # [bs sl_l hc hs] token-major memory, viewed [bs hc sl_l hs] as a decoder's projections give it
    q, k, v = (torch.randn(1, sl_l, h, head_size, generator=gen).transpose(1, 2).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(1, sl_l, heads, head_size, generator=gen)
    times = defaultdict(list)
    names = list(arms)
    for it in range(iters + 1):
        order = names[it % len(names):] + names[:it % len(names)]
        for name in order:
            attn, positions = arms[name]
            attn.new_forward()
            tally.scope = name if it == 0 else None  # bytes of one forward + backward
            dist.barrier()
            start = time.perf_counter()
            out, _ = attn(module, q, k, v, None, position_ids=positions)
            out.backward(grad)
            dist.barrier()
            if it > 0:  # the first iteration warms up (and counts bytes)
                times[name].append(time.perf_counter() - start)
    tally.scope = None
    return {name: {"median_s": statistics.median(times[name]), "sent_bytes": dict(tally.sent[name])}
            for name in names}


def _rank(rank: int, port: int, seq_len: int, iters: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        result = run(seq_len, iters)
        if rank == 0:
            print(json.dumps({"seq_len": seq_len, "sp": WORLD, "iters": iters, "layouts": result}))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    import socket

    args = sys.argv[1:] if argv is None else argv
    seq_len, iters = int(args[0]) if args else 4096, int(args[1]) if len(args) > 1 else 5
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, seq_len, iters), nprocs=WORLD)


if __name__ == "__main__":
    main()

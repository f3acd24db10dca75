"""All-to-all between sequence-sharded and head-sharded layouts, as autograd Functions.

Dimension legend::

    bs   batch size            sl    global sequence length   sl_l  local sequence length (this rank)
    hc   heads of a tensor     hc_l  heads this rank owns      hs    head size
    ws   SP world size

Ulysses (arXiv 2309.14509, section 3) swaps which dimension is sharded: before attention every rank
holds ``[bs sl_l hc hs]`` (its tokens, all heads); after one all-to-all it holds ``[bs sl hc_l hs]``
(all tokens, its heads). The inverse all-to-all restores the sequence sharding.

Both directions are one linear map and its adjoint, so each Function's backward is the other's
forward. A :class:`HeadLayout` says which heads every rank owns for every tensor: head index lists
may be uneven (``hc % ws != 0``) and may repeat a head on several ranks (a GQA KV head shared by the
query heads of two ranks): the adjoint sums the replicas' gradients (``index_add``). Several tensors
(q, k, v) go through one collective: per destination their head slices are packed back to back.
Sequence shards may differ per rank (``seq_lens``), so the same code serves unpadded samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["HeadLayout", "SeqToHeads", "HeadsToSeq", "seq_to_heads", "heads_to_seq"]


@dataclass(frozen=True)
class HeadLayout:
    """Which heads each SP rank owns, per tensor, plus each rank's sequence-shard length.

    ``heads[t][r]`` lists the heads (of tensor ``t``, in its own head numbering) that rank ``r``
    receives; ``num_heads[t]`` is the tensor's total head count; ``seq_lens[r]`` is rank ``r``'s
    token count.
    """

    group: object
    rank: int
    heads: tuple[tuple[tuple[int, ...], ...], ...]
    num_heads: tuple[int, ...]
    seq_lens: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.seq_lens)

    def local_heads(self, t: int) -> int:
        return len(self.heads[t][self.rank])

    def is_partition(self, t: int) -> bool:
        """True when the ranks' head lists, concatenated in rank order, are exactly 0..hc-1."""
        flat = [h for hs in self.heads[t] for h in hs]
        return flat == list(range(self.num_heads[t]))


def _all_to_all(layout: HeadLayout, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]):
    recv = send.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=layout.group)
    return recv


def _index(heads, device) -> torch.Tensor:
    return torch.tensor(heads, dtype=torch.long, device=device)


def _select_heads(x: torch.Tensor, heads) -> torch.Tensor:
    """``x[:, :, heads]``: a view for a contiguous run of heads (the usual case), else a copy."""
    first = heads[0]
    if tuple(heads) == tuple(range(first, first + len(heads))):
        return x.narrow(2, first, len(heads))
    return x.index_select(2, _index(heads, x.device))


def _pack(per_destination: list[list[torch.Tensor]]) -> tuple[torch.Tensor, list[int]]:
    """Copy every piece straight into one flat send buffer (one copy per element), grouped per destination."""
    ref = per_destination[0][0]
    send = ref.new_empty(sum(p.numel() for pieces in per_destination for p in pieces))
    sizes, offset = [], 0
    for pieces in per_destination:
        start = offset
        for p in pieces:
            send[offset:offset + p.numel()].view(p.shape).copy_(p)
            offset += p.numel()
        sizes.append(offset - start)
    return send, sizes


def seq_to_heads(layout: HeadLayout, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``[bs sl_l hc hs]`` per tensor -> ``[bs sl hc_l hs]`` per tensor, one all-to-all."""
    if layout.world_size == 1:
        return tuple(tensors)
    ws = layout.world_size
    bs, _, _, hs = tensors[0].shape
    # pack: for destination r, every tensor's heads owned by r, back to back: [bs sl_l hc_r hs] each
    send, send_sizes = _pack([[_select_heads(x, layout.heads[t][r]) for t, x in enumerate(tensors)]
                              for r in range(ws)])
    n_me = [layout.local_heads(t) for t in range(len(tensors))]
    recv_sizes = [bs * layout.seq_lens[s] * sum(n_me) * hs for s in range(ws)]
    recv = _all_to_all(layout, send, send_sizes, recv_sizes)
    # unpack: from source s, its tokens for my heads of every tensor, written head-major
    # ([bs hc_l sl hs] in memory, returned as a [bs sl hc_l hs] view): the layout the core attention
    # reads, so sdpa gets contiguous inputs without another copy
    sl = sum(layout.seq_lens)
    outs = [recv.new_empty(bs, n, sl, hs) for n in n_me]
    start = 0
    for s, block in enumerate(recv.split(recv_sizes)):
        offset = 0
        for t, out in enumerate(outs):
            numel = bs * layout.seq_lens[s] * n_me[t] * hs
            part = block[offset:offset + numel].view(bs, layout.seq_lens[s], n_me[t], hs)
            out[:, :, start:start + layout.seq_lens[s]].copy_(part.transpose(1, 2))
            offset += numel
        start += layout.seq_lens[s]
    return tuple(out.transpose(1, 2) for out in outs)  # [bs sl hc_l hs]


def heads_to_seq(layout: HeadLayout, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``[bs sl hc_l hs]`` per tensor -> ``[bs sl_l hc hs]`` per tensor: the adjoint of seq_to_heads.

    Heads that several ranks own come back summed, which is the gradient of their replication.
    """
    if layout.world_size == 1:
        return tuple(tensors)
    ws, me = layout.world_size, layout.rank
    bs, _, _, hs = tensors[0].shape
    # pack: for destination s, its tokens of every tensor (my heads): [bs sl_s hc_l hs] each
    starts = [sum(layout.seq_lens[:s]) for s in range(ws)]
    send, send_sizes = _pack([[x.narrow(1, starts[s], layout.seq_lens[s]) for x in tensors] for s in range(ws)])
    sl_me = layout.seq_lens[me]
    recv_sizes = [bs * sl_me * sum(len(layout.heads[t][r]) for t in range(len(tensors))) * hs for r in range(ws)]
    recv = _all_to_all(layout, send, send_sizes, recv_sizes)
    # unpack: from rank r, my tokens for r's heads of every tensor
    parts = [[] for _ in tensors]
    for r, block in enumerate(recv.split(recv_sizes)):
        offset = 0
        for t in range(len(tensors)):
            n = len(layout.heads[t][r])
            parts[t].append(block[offset:offset + bs * sl_me * n * hs].view(bs, sl_me, n, hs))
            offset += bs * sl_me * n * hs
    outs = []
    for t in range(len(tensors)):
        if layout.is_partition(t):
            outs.append(torch.cat(parts[t], dim=2))  # [bs sl_l hc hs]
            continue
        out = tensors[t].new_zeros(bs, sl_me, layout.num_heads[t], hs)
        for r, p in enumerate(parts[t]):
            out.index_add_(2, _index(layout.heads[t][r], out.device), p)
        outs.append(out)
    return tuple(outs)


class SeqToHeads(torch.autograd.Function):
    """All-to-all seq->heads in forward (``[bs sl_l hc hs] -> [bs sl hc_l hs]``), the inverse in backward."""

    @staticmethod
    def forward(ctx, layout: HeadLayout, *tensors):
        ctx.layout = layout
        return seq_to_heads(layout, tensors)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *heads_to_seq(ctx.layout, _zeros_for_none(grads, ctx.layout, full=True)))


class HeadsToSeq(torch.autograd.Function):
    """All-to-all heads->seq in forward (``[bs sl hc_l hs] -> [bs sl_l hc hs]``), the inverse in backward."""

    @staticmethod
    def forward(ctx, layout: HeadLayout, *tensors):
        ctx.layout = layout
        return heads_to_seq(layout, tensors)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *seq_to_heads(ctx.layout, _zeros_for_none(grads, ctx.layout, full=False)))


def _zeros_for_none(grads, layout: HeadLayout, full: bool):
    """Autograd hands None for outputs that got no gradient; the collective still needs a buffer."""
    ref = next(g for g in grads if g is not None)
    bs, hs = ref.shape[0], ref.shape[-1]
    sl = sum(layout.seq_lens) if full else layout.seq_lens[layout.rank]
    out = []
    for t, g in enumerate(grads):
        if g is None:
            heads = layout.local_heads(t) if full else layout.num_heads[t]
            g = ref.new_zeros(bs, sl, heads, hs)
        out.append(g.contiguous())
    return tuple(out)

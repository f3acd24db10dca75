"""Per-document attention for packed samples, from global position_ids, without an S x S mask.

Dimension legend::

    bs  batch   sl  global sequence length   hc_l  local heads   hs  head size
    n   documents in a bucket                L     longest document in a bucket

A packed sample concatenates documents; its position_ids restart at every document. Attending
causally over the whole row lets tokens see the previous documents (the bug DeepSpeed's module and
Accelerate show under sdpa). Here each document is attended alone: documents are grouped into
buckets of similar length (within a factor of two), each bucket runs as one batched core-attention
call on ``[n hc_l L hs]``, so the work is ``sum(len_i * L_bucket) <= 2 * sum(len_i^2)`` scores
instead of ``sl^2``. Documents shorter than their bucket are right-padded, which causal attention
never lets a real token see, so the core runs unmasked (sdpa's flash kernel); the only mask ever
built is ``[n 1 L L]`` for a bucket that needs a sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DocSpans", "find_documents", "packed_attention", "mark_padding", "isolate_left_padding", "padding_hole"]


@dataclass(frozen=True)
class DocSpans:
    """Documents of a batch: ``(row, start, length)`` each, plus whether any row holds more than one."""

    spans: tuple[tuple[int, int, int], ...]
    packed: bool


def find_documents(position_ids: torch.Tensor) -> DocSpans:
    """A document starts where the position does not continue the previous one by +1."""
    # [bs sl]
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    sl = position_ids.shape[1]
    spans, packed = [], False
    for row, row_starts in enumerate(starts.cpu()):
        idx = row_starts.nonzero().flatten().tolist() + [sl]
        packed |= len(idx) > 2
        spans.extend((row, a, b - a) for a, b in zip(idx[:-1], idx[1:]))
    return DocSpans(tuple(spans), packed)


def mark_padding(positions: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
    """Positions ``[bs sl_l]`` with each pad token's ``p`` sent as ``-1 - p`` (positions are >= 0), so the
    gather that carries the positions carries the padding too; ``pad`` is True at padding, or None."""
    return positions if pad is None else torch.where(pad, -1 - positions, positions)


def isolate_left_padding(marked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gathered, marked positions ``[bs sl]`` -> (positions for the attention, left padding or None).

    Left padding (the pad tokens before a row's first real token; Llama's tokenizer pads so) must neither
    be seen by the real tokens nor see anything: without SP, the padding mask leaves each pad query no key,
    and sdpa and flash attention both give it a zero output. Here each pad token becomes a document of its
    own, at the position of the row's first real token (a position that restarts whichever way a core
    reads documents: a break in the +1 run, or the row's smallest position), and the caller zeroes its output.
    The real tokens keep their positions. Padding after the real tokens keeps its positions: causal attention
    never lets a real token see it. A hole (padding between real tokens) would need a mask no document
    layout gives, so it is refused on every rank alike.
    """
    pad = marked < 0
    if not bool(pad.any()):
        return marked, None
    positions = torch.where(pad, -1 - marked, marked)                       # [bs sl]
    real = ~pad
    hole = padding_hole(real)
    if hole is not None:
        row, col = hole
        raise ValueError(
            f"the attention mask has padding between real tokens (row {row}, token {col} of the gathered "
            "sequence); Ulysses SP serves padding before the real tokens (left padding) and after them, where a "
            "hole needs a mask that its per-document attention cannot give, so real tokens would attend to it; "
            "expected each row's real tokens contiguous; fix: pad on the left or the right only, or pack "
            "documents with position_ids restarting at 0")
    left = real.cumsum(dim=1) == 0                                          # [bs sl] before a row's first real
    if not bool(left.any()):
        return positions, None
    first = real.long().argmax(dim=1, keepdim=True)                         # [bs 1] (0 for an all-pad row)
    positions = torch.where(left, positions.gather(1, first), positions)
    return positions, left


def padding_hole(real: torch.Tensor) -> tuple[int, int] | None:
    """``(row, token)`` of the first padding between two real tokens of a row (``real``: ``[bs sl]`` bool, True
    at real tokens), or None: padding before and after the real tokens is no hole."""
    started = real.long().cumsum(dim=1) > 0                                  # at or after a row's first real token
    more = real.long().flip(1).cumsum(dim=1).flip(1) > 0                     # at or before its last real token
    holes = ~real & started & more
    if not bool(holes.any()):
        return None
    row, col = (int(i) for i in holes.nonzero()[0])
    return row, col


def _buckets(spans):
    by_class: dict[int, list] = {}
    for span in spans:
        by_class.setdefault((span[2] - 1).bit_length(), []).append(span)
    return [by_class[k] for k in sorted(by_class)]


def packed_attention(core, module, query, key, value, docs: DocSpans, sliding_window=None, **kwargs):
    """Run ``core`` once per length bucket; returns ``[bs sl hc_l hs]`` like the core does."""
    bs, hq, sl, hs = query.shape
    device = query.device
    # [bs hc sl hs] -> [bs*sl hc hs]: one token per row, so a bucket is an index gather
    q_flat, k_flat, v_flat = (x.transpose(1, 2).reshape(bs * sl, x.shape[1], hs) for x in (query, key, value))
    outs, rows = [], []
    for bucket in _buckets(docs.spans):
        length = max(s[2] for s in bucket)
        offsets = torch.arange(length, device=device)
        starts = torch.tensor([r * sl + a for r, a, _ in bucket], device=device)
        lens = torch.tensor([n for _, _, n in bucket], device=device)
        valid = offsets[None, :] < lens[:, None]                          # [n L]
        index = torch.where(valid, starts[:, None] + offsets[None, :], starts[:, None])
        q_b, k_b, v_b = (x[index].transpose(1, 2) for x in (q_flat, k_flat, v_flat))  # [n hc L hs]
        # documents shorter than L are right-padded: under causal attention no real query sees a
        # padded key, and padded queries are dropped below, so no mask is needed (and sdpa keeps its
        # flash kernel; with a mask it falls back to the math kernel, O(L^2) memory)
        mask = None
        if sliding_window is not None and length > sliding_window:
            causal = offsets[:, None] >= offsets[None, :]                  # [L L]
            mask = causal[None] & valid[:, None, :]                         # [n L L]
            mask = mask & (offsets[:, None] - offsets[None, :] < sliding_window)[None]
            mask = mask[:, None]                                            # [n 1 L L]
        positions = offsets.expand(len(bucket), length)
        out, _ = core(module, q_b, k_b, v_b, mask, position_ids=positions, **kwargs)  # [n L hc hs]
        outs.append(out[valid])                                             # [tokens hc hs]
        rows.append(index[valid])
    order = torch.cat(rows).argsort()
    return torch.cat(outs)[order].view(bs, sl, hq, hs), None

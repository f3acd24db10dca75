"""SeqToHeads / HeadsToSeq: the all-to-all is the reference slicing, and backward is its adjoint.

Every case runs on gloo ranks with uneven head counts (5 heads on 2 or 3 ranks), uneven sequence
shards, and KV heads replicated to several ranks (GQA), against plain torch: the whole tensor
all-gathered and sliced. fp32 moves only copies, so results are compared exactly; the adjoint
identity ``<A x, y> = <x, A^T y>`` sums products and is compared to 1e-10 in float64, with the
incoming gradients contiguous and head-major (as sdpa's backward makes them).
"""

import pytest
import torch
import torch.distributed as dist

from ds_ulysses.distributed import HeadLayout, HeadsToSeq, SeqToHeads
from ds_ulysses.sp.heads import plan_heads
from tests.support.distributed import run_distributed

BS, HS = 2, 3


def _layout(rank, ws, seq_lens, heads, kv_heads):
    plan = plan_heads(heads, kv_heads, ws)
    return HeadLayout(dist.group.WORLD, rank, (plan.q_heads, plan.kv_heads), (heads, kv_heads), seq_lens)


def _full(seed, sl, heads):
    return torch.randn(BS, sl, heads, HS, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _cases(rank, ws, seq_lens, heads, kv_heads, head_major):
    layout = _layout(rank, ws, seq_lens, heads, kv_heads)
    start = sum(seq_lens[:rank])
    mine = slice(start, start + seq_lens[rank])
    sl = sum(seq_lens)
    q_full, k_full = _full(1, sl, heads), _full(2, sl, kv_heads)          # [bs sl hc hs]
    q, k = q_full[:, mine].requires_grad_(), k_full[:, mine].requires_grad_()  # [bs sl_l hc hs]
    q_h, k_h = SeqToHeads.apply(layout, q, k)                             # [bs sl hc_l hs]
    want_q = q_full[:, :, list(layout.heads[0][rank])]
    want_k = k_full[:, :, list(layout.heads[1][rank])]
    forward_exact = torch.equal(q_h, want_q) and torch.equal(k_h, want_k)
    # adjoint: <SeqToHeads(x), y> summed over ranks == <x, backward(y)> summed over ranks
    y_q, y_k = _full(3 + rank, sl, q_h.shape[2]), _full(7 + rank, sl, k_h.shape[2])
    if head_major:  # used head-major, as sdpa uses them: their gradients come as [bs sl hc_l hs] views of
        # [bs hc_l sl hs] memory
        lhs = sum((x.transpose(1, 2) * y.transpose(1, 2).contiguous()).sum() for x, y in ((q_h, y_q), (k_h, y_k)))
    else:
        lhs = (q_h * y_q).sum() + (k_h * y_k).sum()
    lhs.backward()
    rhs = (q.detach() * q.grad).sum() + (k.detach() * k.grad).sum()
    sums = torch.stack([lhs.detach(), rhs])
    dist.all_reduce(sums)
    # and back: HeadsToSeq(SeqToHeads(q)) is q when every head lives on one rank
    (q_back,) = HeadsToSeq.apply(_layout(rank, ws, seq_lens, heads, kv_heads), q_h.detach())
    return {"forward": forward_exact, "adjoint": abs(sums[0] - sums[1]).item() / abs(sums[1]).item(),
            "round_trip": torch.equal(q_back, q.detach())}


@pytest.mark.parametrize("head_major", [False, True], ids=["contiguous-grads", "head-major-grads"])
@pytest.mark.parametrize("ws,seq_lens,heads,kv_heads", [
    (2, (4, 4), 4, 2),       # even
    (2, (5, 3), 5, 5),       # uneven heads and shards
    (3, (3, 1, 4), 5, 1),    # one KV head replicated to every rank
    (3, (2, 2, 2), 6, 2),    # KV heads shared by two ranks
])
def test_seq_to_heads_is_the_reference_slicing_and_its_backward_the_adjoint(ws, seq_lens, heads, kv_heads,
                                                                           head_major):
    for res in run_distributed(_cases, ws, seq_lens, heads, kv_heads, head_major):
        assert res["forward"] and res["round_trip"], res
        assert res["adjoint"] <= 1e-10, res


def test_one_rank_is_the_identity():
    layout = HeadLayout(None, 0, ((tuple(range(4)),),), (4,), (6,))
    x = torch.randn(1, 6, 4, 2)
    (y,) = SeqToHeads.apply(layout, x)
    assert torch.equal(y, x)

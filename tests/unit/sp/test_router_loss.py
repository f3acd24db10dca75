"""The router load-balancing loss from SP shards: on every rank the whole sequence's loss as Transformers'
Mixtral function computes it on the unsharded routing, and in backward each rank's shard of its gradient
(times grad_scale), on 2 and 3 gloo ranks with a padding mask. Transformers sums in fp32, so equality is
to fp32 rounding (1e-6 of the loss, 1e-5 of a gradient)."""

import pytest
import torch

from ds_ulysses.sp.router_loss import load_balancing_loss
from tests.support.distributed import run_distributed

EXPERTS, TOP_K, LAYERS = 6, 2, 3


def _routing(bs: int, sl: int):
    """Router logits of ``LAYERS`` layers, ``[bs * sl, EXPERTS]`` each, and a right-padding mask ``[bs, sl]``."""
    g = torch.Generator().manual_seed(0)
    gates = tuple(torch.randn(bs * sl, EXPERTS, generator=g, dtype=torch.float64) for _ in range(LAYERS))
    mask = torch.ones(bs, sl, dtype=torch.long)
    mask[1, sl - 4:] = 0
    return gates, mask


def _whole(gates, mask):
    """Transformers' function on the unsharded routing: loss and the gradient of every layer's logits."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    gates = tuple(g.clone().requires_grad_() for g in gates)
    loss = load_balancing_loss_func(gates, EXPERTS, TOP_K, mask)
    return loss.detach(), torch.autograd.grad(loss, gates)


def _shard(rank, world_size, with_mask, grad_scale):
    bs, sl = 2, 6 * world_size
    gates, mask = _routing(bs, sl)
    sl_l = sl // world_size
    # [bs*sl E] -> [bs sl E] -> this rank's [bs sl_l E] -> [bs*sl_l E], the rows its router sees
    mine = tuple(g.view(bs, sl, EXPERTS)[:, rank * sl_l:(rank + 1) * sl_l].reshape(-1, EXPERTS).clone().requires_grad_()
                 for g in gates)
    local_mask = mask[:, rank * sl_l:(rank + 1) * sl_l] if with_mask else None
    loss = load_balancing_loss(mine, EXPERTS, TOP_K, local_mask, torch.distributed.group.WORLD, grad_scale)
    grads = torch.autograd.grad(loss, mine)
    return loss.detach(), grads


@pytest.mark.parametrize("world_size,with_mask", [(2, False), (3, True)], ids=["2-ranks", "3-ranks-padding-mask"])
def test_every_rank_gets_the_whole_sequences_loss_and_its_own_shard_of_the_gradient(world_size, with_mask):
    grad_scale = 2.0
    bs, sl = 2, 6 * world_size
    gates, mask = _routing(bs, sl)
    want, want_grads = _whole(gates, mask if with_mask else None)
    sl_l = sl // world_size
    for rank, (loss, grads) in enumerate(run_distributed(_shard, world_size, with_mask, grad_scale)):
        assert torch.allclose(loss, want, rtol=1e-6), (rank, loss, want)
        for got, whole in zip(grads, want_grads):
            shard = whole.view(bs, sl, EXPERTS)[:, rank * sl_l:(rank + 1) * sl_l].reshape(-1, EXPERTS)
            assert torch.allclose(got, grad_scale * shard, rtol=1e-5, atol=1e-9)


def test_one_process_is_transformers_function_with_and_without_a_mask():
    gates, mask = _routing(2, 8)
    for m in (None, mask):
        want, want_grads = _whole(gates, m)
        mine = tuple(g.clone().requires_grad_() for g in gates)
        loss = load_balancing_loss(mine, EXPERTS, TOP_K, m)
        assert torch.allclose(loss, want, rtol=1e-6)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-9)
                   for a, b in zip(torch.autograd.grad(loss, mine), want_grads))


def test_a_mask_that_does_not_cover_the_routed_tokens_is_refused_naming_both_counts():
    gates, mask = _routing(2, 8)
    with pytest.raises(ValueError, match="got 16 routed tokens in a layer but an attention mask of 8 tokens; "
                                         "expected one mask entry per routed token"):
        load_balancing_loss(gates, EXPERTS, TOP_K, mask[:1])


def test_counts_past_float32s_exact_integers_stay_exact():
    """256 layers of 131,075 routed tokens, top-2 of 4 experts: 33.6M counted tokens and about 16.8M assignments
    per expert, past 2**24, where float32 sums round (the loss was 9e-6 off that way). Against the same sums
    in float64 by plain ops, to two float32 roundings of the loss."""
    n, layers, experts, top_k = 2**17 + 3, 256, 4, 2
    gate = torch.randn(n, experts, generator=torch.Generator().manual_seed(0))
    routing = torch.softmax(gate, dim=-1)
    assigned = torch.bincount(torch.topk(routing, top_k, dim=-1).indices.reshape(-1), minlength=experts) * layers
    probs = routing.double().sum(dim=0) * layers
    tokens = float(n * layers)
    want = experts * torch.sum(assigned.double() / tokens * probs / tokens)
    got = load_balancing_loss((gate,) * layers, experts, top_k)
    assert got.dtype == torch.float32
    assert abs(got.double() - want) <= 2e-7 * want

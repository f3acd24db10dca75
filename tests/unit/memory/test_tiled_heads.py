"""TiledHeads equals the plain sum of its groups' shares in plain PyTorch (value and every gradient), keeps
only its input and each group's fused attention kernel outputs for backward (the kernel runs once per group),
and hands each parameter's gradient to autograd once per backward, also for a
weight used again outside it. Tolerances: helpers.TOL (fp32 sums in another order)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_ulysses.memory import TiledHeads
from ds_ulysses.memory.tiles import storage_holders

from tests.support.autograd_probes import KernelCalls, held_after_forward

from .helpers import TOL, assert_close, count_accumulations, grads_of, rel


class Grouped(nn.Module):
    """A block that is a sum over groups, as attention over head groups is: per group, a projection in, a
    nonlinearity that mixes the sequence (a causal cumulative mean), a projection out."""

    def __init__(self, h=8, groups=4, width=3):
        super().__init__()
        self.inp = nn.Parameter(torch.randn(groups, h, width) * 0.3)
        self.out = nn.Parameter(torch.randn(groups, width, h) * 0.3)
        self.bias = nn.Parameter(torch.randn(h))

    def share(self, x, g):  # [bs sl h] -> [bs sl h]
        z = torch.tanh(x @ self.inp[g])                                            # [bs sl width]
        mixed = z.cumsum(1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]
        return mixed @ self.out[g] + (self.bias if g == 0 else 0)

    def forward(self, x):
        return sum(self.share(x, g) for g in range(self.inp.shape[0]))


def share_fn(module, x, g):
    return module.share(x, g)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_matches_the_sum_of_the_shares(groups):
    torch.manual_seed(0)
    block = Grouped(groups=groups)
    x = torch.randn(2, 5, 8, requires_grad=True)
    w = torch.randn(2, 5, 8)
    inputs = [x, *block.parameters()]
    want_y = block(x)
    want = grads_of((want_y * w).sum(), inputs)
    got_y = TiledHeads.apply(share_fn, block, x, groups)
    got = grads_of((got_y * w).sum(), inputs)
    assert rel(got_y, want_y) <= TOL
    assert_close(got, want, "grad")


def same_tensor(a, b):
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def test_keeps_only_its_input_for_backward():
    torch.manual_seed(0)
    block = Grouped()
    x = torch.randn(1, 6, 8, requires_grad=True)
    _, kept = held_after_forward(lambda: TiledHeads.apply(share_fn, block, x, 4))
    assert len(kept) == 1 and same_tensor(kept[0], x)


class HeadGroups(nn.Module):
    """Causal attention over groups of heads through torch's fused kernel (F.scaled_dot_product_attention),
    each group's output through its own columns of the output projection."""

    def __init__(self, h=16, heads=4):
        super().__init__()
        self.heads, self.hs = heads, h // heads
        self.qkv = nn.Parameter(torch.randn(3, h, h) * 0.3)
        self.o = nn.Parameter(torch.randn(h, h) * 0.3)

    def share(self, x, g, per_group):  # [bs sl h] -> [bs sl h]
        cols = slice(g * per_group * self.hs, (g + 1) * per_group * self.hs)
        q, k, v = (torch.tanh(x) @ w[:, cols] for w in self.qkv)  # [bs sl hc_g*hs]
        q, k, v = (t.unflatten(-1, (per_group, self.hs)).transpose(1, 2) for t in (q, k, v))  # [bs hc_g sl hs]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [bs hc_g sl hs]
        return y.transpose(1, 2).flatten(2) @ self.o[cols]

    def forward(self, x, groups):
        return sum(self.share(x, g, self.heads // groups) for g in range(groups))


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_runs_each_kernel_once_and_keeps_its_outputs(groups):
    """The core attention runs once per group in forward and not again in backward; what stays for backward is
    the input and each group's kernel outputs (saved as the Function's own, so that a checkpoint drops them); the
    value and every gradient are the untiled block's."""
    torch.manual_seed(0)
    block = HeadGroups()
    x = torch.randn(2, 9, 16, requires_grad=True)
    w = torch.randn(2, 9, 16)
    inputs = [x, *block.parameters()]
    want_y = block(x, 1)
    want = grads_of((want_y * w).sum(), inputs)

    def share(module, x, g):
        return module.share(x, g, module.heads // groups)

    counting = KernelCalls()
    with counting:
        got_y, kept = held_after_forward(lambda: TiledHeads.apply(share, block, x, groups))
        forward_calls = counting.calls
        got = grads_of((got_y * w).sum(), inputs)
    assert forward_calls == groups and counting.calls == groups
    # the input, then each group's kernel output [bs hc_g sl hs] and log-sum-exp [bs hc_g sl]: the outputs add
    # up to one input-sized tensor
    assert same_tensor(kept[0], x) and len(kept) == 1 + 2 * groups
    assert sum(t.numel() for t in kept[1:] if t.dim() == 4) == x.numel()
    assert rel(got_y, want_y) <= TOL
    assert_close(got, want, "grad")


def test_under_checkpointing_the_kept_outputs_are_dropped_and_recomputed_with_the_layer():
    """Inside a checkpointed layer (Transformers' non-reentrant checkpoint) the kernel outputs go the way of
    everything else the layer saves: not held from forward to backward, made again by the layer's recompute
    (one kernel call per group there), and then taken by TiledHeads' backward without a third call."""
    torch.manual_seed(0)
    block = HeadGroups()
    x = torch.randn(1, 8, 16, requires_grad=True)
    inputs = [x, *block.parameters()]
    want = grads_of(block(x, 1).sum(), inputs)

    def layer(x):
        return TiledHeads.apply(lambda m, x, g: m.share(x, g, 2), block, x, 2) * 2 - x

    counting = KernelCalls()
    with counting:
        y, kept = held_after_forward(lambda: torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False))
        assert counting.calls == 2
        alone = storage_holders(torch.empty(1))  # what a tensor nothing else holds counts
        assert [storage_holders(t) for t in counting.outputs] == [alone] * 4  # nothing but this test holds them
        got = grads_of(((y + x) / 2).sum(), inputs)
    assert len(kept) == 1 and same_tensor(kept[0], x)  # the checkpoint's input only
    assert counting.calls == 4
    assert_close(got, want, "grad")


def test_without_keeping_backward_runs_each_kernel_again():
    torch.manual_seed(0)
    block = HeadGroups()
    x = torch.randn(1, 6, 16, requires_grad=True)
    inputs = [x, *block.parameters()]
    want = grads_of(block(x, 1).sum(), inputs)
    counting = KernelCalls()
    with counting:
        y = TiledHeads.apply(lambda m, x, g: m.share(x, g, 2), block, x, 2, keep_kernels=False)
        assert counting.calls == 2
        got = grads_of(y.sum(), inputs)
    assert counting.calls == 4
    assert_close(got, want, "grad")


def test_a_call_autograd_does_not_record_keeps_nothing():
    torch.manual_seed(0)
    block = HeadGroups()
    x = torch.randn(1, 5, 16)
    counting = KernelCalls()
    with torch.no_grad(), counting:
        y = TiledHeads.apply(lambda m, x, g: m.share(x, g, 2), block, x, 2)
    assert counting.calls == 2 and y.grad_fn is None
    assert rel(y, block(x, 2).detach()) <= TOL


def test_each_gradient_reaches_autograd_once_with_a_use_outside():
    torch.manual_seed(0)
    block = Grouped()
    x = torch.randn(1, 6, 8, requires_grad=True)
    counts, handles = count_accumulations(list(block.parameters()))
    y = TiledHeads.apply(share_fn, block, x, 4)
    loss = (y.sum() + block.bias.square().sum())  # the bias used again outside the block: one accumulation
    loss.backward()
    for handle in handles:
        handle.remove()
    assert all(c == [1] for c in counts.values()), counts
    got = block.bias.grad.clone()
    want = grads_of(block(x).sum() + block.bias.square().sum(), [block.bias])
    assert rel(got, want[0]) <= TOL


def test_groups_must_be_a_positive_int():
    block = Grouped()
    with pytest.raises(ValueError, match="groups must be a positive int, got 0"):
        TiledHeads.apply(share_fn, block, torch.randn(1, 2, 8), 0)

"""TiledHeads equals the plain sum of its groups' shares in plain PyTorch (value and every gradient), keeps
only its input for backward, and hands each parameter's gradient to autograd once per backward, also for a
weight used again outside it. Tolerances: helpers.TOL (fp32 sums in another order)."""

import pytest
import torch
from torch import nn

from ds_ulysses.memory import TiledHeads

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


def test_keeps_only_its_input_for_backward():
    torch.manual_seed(0)
    block = Grouped()
    x = torch.randn(1, 6, 8, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        TiledHeads.apply(share_fn, block, x, 4)
    assert len(saved) == 1 and saved[0] is x


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

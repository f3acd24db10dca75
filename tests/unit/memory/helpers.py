"""What the tiled-Function tests share: small modules, relative error, gradients read from ``.grad``.

Dimensions: bs batch, sl sequence, h hidden, v vocab.
"""

import torch
import torch.nn.functional as F
from torch import nn

# fp32 on CPU: tiling only changes how matmuls are blocked and the order of sums over tiles, a few
# ulps (rel ~1e-7); 1e-5 has two orders of magnitude of headroom while any missing, doubled or
# misweighted tile (rel >= 1/sl) fails
TOL = 1e-5
# (sl, shards): dividing, not dividing, one tile, uneven tiles, more tiles than tokens
SPLITS = [(8, 2), (7, 3), (6, 1), (5, 4), (3, 4)]


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def assert_close(got, want, what, tol=TOL):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None, f"{what}[{i}] got no gradient"
        assert rel(g, w) <= tol, f"{what}[{i}] rel {rel(g, w):.2e}"


def grads_of(loss, tensors, scale=None, clear=True):
    """The .grad of `tensors` after `loss.backward()` (or `loss.backward(scale)`), left cleared."""
    for t in tensors:
        if clear:
            t.grad = None
    loss.backward(scale)
    grads = [None if t.grad is None else t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return grads


def grads_after(make_loss, tensors, scale=None):
    """Like `grads_of`, for a Function that accumulates gradients in its forward (DeepSpeed's fused
    loss does): .grad is cleared before `make_loss()` runs."""
    for t in tensors:
        t.grad = None
    return grads_of(make_loss(), tensors, scale, clear=False)


def tile_sizes(length, shards):
    return [len(t) for t in torch.tensor_split(torch.arange(length), shards)]


class GatedMLP(nn.Module):
    """Llama-style gate/up/down MLP."""

    def __init__(self, h=16, inter=40, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=bias)
        self.up_proj = nn.Linear(h, inter, bias=bias)
        self.down_proj = nn.Linear(inter, h, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LoraLinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update: compute_params=None must find A and B."""

    def __init__(self, h=16, v=11, r=2):
        super().__init__()
        self.base = nn.Linear(h, v, bias=False)
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(r, h) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(v, r) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


def mlp_fn(module, x):
    return module(x)


def mean_ce(head, x, y):
    """DeepSpeed's fn contract as its docstring and tests use it: the tile's CrossEntropyLoss() mean."""
    return nn.CrossEntropyLoss()(head(x), y)


def sum_ce(head, x, y):
    return F.cross_entropy(head(x), y, reduction="sum")


def count_accumulations(tensors):
    """{id: [how many times autograd accumulated into .grad]} via post-accumulate-grad hooks, the
    hooks DeepSpeed ZeRO reduces gradients from."""
    counts = {id(t): [0] for t in tensors}
    handles = [t.register_post_accumulate_grad_hook(lambda t: counts[id(t)].__setitem__(0, counts[id(t)][0] + 1))
               for t in tensors]
    return counts, handles

"""The three tiled Functions on random configurations against the same computation untiled, in fp64.

Each case draws the operation, batch size, sequence length (1-40), tile count (1 to sl + 3: empty tiles
included), biases, whether the input requires grad, ignored labels, the order of compute_params and
whether one parameter fn uses is left out of them, a gradient hook on a declared parameter, an
incoming gradient scale, and one or two backward passes (the second adds to the ``.grad`` the first
left). `extra` is a declared parameter that fn uses and the loss also uses outside the tiled call (a
tied weight), so its gradient is the sum of both uses. Every output and every gradient must match the
untiled run to 1e-9 relative: a gradient a tile drops, repeats or scales shows far above fp64 rounding.
"""

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ds_ulysses as ours

from .helpers import GatedMLP

OPS = ("tiled_mlp", "stc_tokens", "stc_loss", "fused_loss")
V = 13
TOL = {"rtol": 1e-9, "atol": 1e-12}


def _case(seed):
    rng = random.Random(seed)
    case = {"op": OPS[seed % len(OPS)], "bs": rng.choice([1, 2, 3]), "sl": rng.randint(1, 40),
            "h": rng.choice([4, 8]), "inter": rng.choice([6, 16]), "mlp_bias": rng.random() < 0.5,
            "head_bias": rng.random() < 0.3, "x_grad": rng.random() < 0.8, "reversed": rng.random() < 0.5,
            "omit": rng.random() < 0.25, "hook": rng.random() < 0.3, "scale": rng.choice([1.0, 0.5, 3.0]),
            "reduction": rng.choice([None, "mean", "sum"]), "steps": rng.choice([1, 2])}
    case["shards"] = rng.randint(1, case["sl"] + 3)
    return case


class _Setup:
    """The modules, inputs and declared parameters of one case (the same for the tiled and untiled runs)."""

    def __init__(self, case, seed):
        torch.manual_seed(seed)
        bs, sl, h = case["bs"], case["sl"], case["h"]
        self.mlp = GatedMLP(h, case["inter"], bias=case["mlp_bias"]).double()
        self.head = nn.Linear(h, V, bias=case["head_bias"]).double()
        self.extra = nn.Parameter(torch.randn(h, dtype=torch.float64))
        self.x = torch.randn(bs, sl, h, dtype=torch.float64).requires_grad_(case["x_grad"])
        self.y = torch.randint(0, V, (bs, sl))
        self.y[torch.rand(bs, sl) < 0.2] = -100
        self.probe = torch.randn(bs, sl, h, dtype=torch.float64)
        losses = case["op"] in ("stc_loss", "fused_loss")
        declared = [*(self.head if losses else self.mlp).parameters(), self.extra]
        declared += list(self.mlp.parameters()) if case["op"] == "stc_loss" else []
        if case["omit"]:  # an undeclared parameter without hooks gets its gradient written into .grad
            declared = declared[1:]
        self.declared = declared[::-1] if case["reversed"] else declared

    def mlp_fn(self, module, t):
        return module(t * self.extra)

    def loss_fn(self, module, t, labels):  # a tile's summed cross-entropy
        return F.cross_entropy(module(t * self.extra).reshape(-1, V), labels.reshape(-1), reduction="sum")

    def stc_tokens(self, hidden, factor):
        return self.mlp(hidden * self.extra) * factor

    def stc_loss(self, hidden, labels):
        return self.loss_fn(self.head, self.mlp(hidden), labels)

    def loss(self, case, tiled):
        """The scalar to backpropagate, and the tiled (or untiled) call's own output."""
        op, shards, reduction, x = case["op"], case["shards"], case["reduction"], self.x
        if op == "tiled_mlp":
            out = ours.TiledMLP.apply(self.mlp_fn, self.mlp, x, shards, self.declared) if tiled \
                else self.mlp_fn(self.mlp, x)
        elif op == "stc_tokens":
            if tiled:
                out = ours.sequence_tiled_compute(self.stc_tokens, case["sl"], shards, {"hidden": x}, {"factor": 2.0},
                                                  "hidden", self.declared, 1, reduction)
            else:
                out = self.stc_tokens(x, 2.0)
                out = out if reduction is None else getattr(out, reduction)()
        elif op == "stc_loss":
            out = ours.sequence_tiled_compute(self.stc_loss, case["sl"], shards, {"hidden": x, "labels": self.y}, {},
                                              "hidden", self.declared, 0, "sum") if tiled else self.stc_loss(x, self.y)
        else:
            out = ours.TiledFusedLogitsLoss.apply(self.loss_fn, self.head, x, self.y, None, shards, self.declared,
                                                  "sum") if tiled else self.loss_fn(self.head, x, self.y)
        value = (out * self.probe).sum() if out.dim() else out
        return value * case["scale"] + (self.extra ** 2).sum(), out  # extra's use outside the tiled call


def _run(case, seed, tiled):
    setup = _Setup(case, seed)
    hook = setup.extra.register_hook(lambda g: g * 0.5) if case["hook"] else None
    for _ in range(case["steps"]):
        loss, out = setup.loss(case, tiled)
        loss.backward()
    if hook is not None:
        hook.remove()
    return out.detach(), [t.grad for t in (setup.x, *setup.mlp.parameters(), *setup.head.parameters(), setup.extra)]


def _same(got, want):
    if got is None or want is None:
        return got is None and want is None
    return got.shape == want.shape and torch.allclose(got, want, **TOL)


@pytest.mark.parametrize("first", range(0, 400, 100))
def test_random_cases_match_untiled(first):
    wrong = []
    for seed in range(first, first + 100):
        case = _case(seed)
        want_out, want = _run(case, seed, tiled=False)
        got_out, got = _run(case, seed, tiled=True)
        if not (_same(got_out, want_out) and all(_same(g, w) for g, w in zip(got, want))):
            wrong.append((seed, case))
    assert not wrong, f"{len(wrong)} of 100 cases differ from the untiled run, first: {wrong[:3]}"

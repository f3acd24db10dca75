"""Tiled compute equals the untiled computation in plain torch: forward values and every gradient.

Tolerances: fp32 on CPU; tiling only changes how matmuls are blocked and the order of sums over
tiles, which moves results by a few ulps, so rel <= 1e-5 has orders of magnitude of headroom while
any missing or double-counted tile (rel >= 1/shards) fails. The ZeRO runs compare against 1e-4
because its gradients also pass through a reduce-scatter in a different summation order.

Dimensions: bs batch, sl sequence, h hidden, v vocab.
"""

import copy
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_ulysses.memory import (SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, agree_on_shards, auto_loss_shards,
                               auto_mlp_shards, sequence_tiled_compute)
from ds_ulysses.memory.mlp_tiling import tile_mlps, untile_mlps

TOL = 1e-5
# (sl, shards): dividing, not dividing, one tile, more tiles than tokens
SPLITS = [(8, 2), (7, 3), (6, 1), (5, 4), (3, 4)]


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


class GatedMLP(nn.Module):
    """Llama-style gate/up/down MLP."""

    def __init__(self, h=16, inter=40):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def mlp_fn(module, x):
    return module(x)


def sum_ce(head, x, y):
    return F.cross_entropy(head(x), y, reduction="sum")


def grads_of(loss, tensors):
    """.grad after loss.backward(): tiled backward accumulates parameter gradients into .grad from its
    recompute, so torch.autograd.grad with respect to parameters cannot see them."""
    for t in tensors:
        t.grad = None
    loss.backward()
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return grads


def assert_close(got, want, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert rel(g, w) <= TOL, f"{what}[{i}] rel {rel(g, w):.2e}"


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("sl,shards", SPLITS)
def test_tiled_mlp_matches_untiled(bs, sl, shards):
    torch.manual_seed(0)
    mlp = GatedMLP()
    x = torch.randn(bs, sl, 16, requires_grad=True)
    w = torch.randn(bs, sl, 16)  # a non-uniform upstream gradient
    inputs = [x, *mlp.parameters()]

    want_y = mlp(x)
    want = grads_of((want_y * w).sum(), inputs)
    got_y = TiledMLP.apply(mlp_fn, mlp, x, shards, None)
    got = grads_of((got_y * w).sum(), inputs)

    assert got_y.shape == want_y.shape
    assert rel(got_y, want_y) <= TOL
    assert_close(got, want, "grad")


@pytest.mark.parametrize("sl,shards", SPLITS + [(7, 4)])
def test_tile_sizes_follow_tensor_split(sl, shards):
    seen = []
    TiledMLP.apply(lambda m, t: seen.append(t.shape[-2]) or t, None, torch.randn(2, sl, 3), shards, [])
    assert seen == [len(t) for t in torch.tensor_split(torch.arange(sl), shards)]


def test_tiled_mlp_2d_input_and_stacked_mlps():
    torch.manual_seed(0)
    first, second = GatedMLP(), GatedMLP()
    x = torch.randn(7, 16, requires_grad=True)  # [sl, h], as MoE experts see it
    inputs = [x, *first.parameters(), *second.parameters()]

    want_y = second(first(x))
    want = grads_of(want_y.pow(2).sum(), inputs)
    got_y = TiledMLP.apply(mlp_fn, second, TiledMLP.apply(mlp_fn, first, x, 3, None), 2, None)
    got = grads_of(got_y.pow(2).sum(), inputs)

    assert rel(got_y, want_y) <= TOL
    assert_close(got, want, "grad")


def test_tiled_mlp_input_without_grad_still_trains_params():
    torch.manual_seed(0)
    mlp = GatedMLP()
    x = torch.randn(2, 5, 16)
    want = grads_of(mlp(x).pow(2).sum(), list(mlp.parameters()))
    got = grads_of(TiledMLP.apply(mlp_fn, mlp, x, 2, None).pow(2).sum(), list(mlp.parameters()))
    assert_close(got, want, "param grad")


def test_tiled_mlp_auto_shards_and_bad_shards():
    torch.manual_seed(0)
    mlp = GatedMLP(h=4, inter=8)
    x = torch.randn(1, 9, 4, requires_grad=True)  # auto: ceil(9 / 4) = 3 tiles
    calls = []
    y = TiledMLP.apply(lambda m, t: calls.append(t.shape[-2]) or m(t), mlp, x, "auto", None)
    assert calls == [3, 3, 3]
    assert rel(y, mlp(x)) <= TOL
    with pytest.raises(ValueError, match="shards must be a positive int, got 0"):
        TiledMLP.apply(mlp_fn, mlp, x, 0, None)
    with pytest.raises(ValueError, match=r"x must be \[bs, sl, h\] or \[sl, h\], got shape \(4,\)"):
        TiledMLP.apply(mlp_fn, mlp, torch.randn(4), 2, None)
    with pytest.raises(ValueError, match="fn must map"):
        TiledMLP.apply(lambda m, t: (m(t), None), mlp, x, 2, None)


def labels_with_holes(bs, sl, v, generator):
    """Labels with -100s: the first tokens are ignored so a tile has no valid token; one stays valid."""
    y = torch.randint(0, v, (bs, sl), generator=generator)
    y[0, : min(3, sl - 1)] = -100
    if bs > 1:
        y[-1, -1] = -100
    return y


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("sl,shards", SPLITS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_logits_loss_matches_untiled(bs, sl, shards, reduction):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    head = nn.Linear(16, 11)
    x = torch.randn(bs, sl, 16, requires_grad=True)
    y = labels_with_holes(bs, sl, 11, gen)
    inputs = [x, *head.parameters()]

    want_loss = F.cross_entropy(head(x).reshape(-1, 11), y.reshape(-1), reduction=reduction)
    want = grads_of(want_loss, inputs)
    got_loss = TiledFusedLogitsLoss.apply(sum_ce, head, x, y, None, shards, None, reduction)
    got = grads_of(got_loss, inputs)

    assert rel(got_loss, want_loss) <= TOL
    assert_close(got, want, "grad")


@pytest.mark.parametrize("bs", [1, 2])
def test_fused_logits_loss_with_mask_is_a_true_token_mean(bs):
    torch.manual_seed(0)
    head = nn.Linear(16, 11)
    x = torch.randn(bs, 7, 16, requires_grad=True)
    y = torch.randint(0, 11, (bs, 7))
    mask = torch.ones(bs, 7, dtype=torch.bool)
    mask[0, :4] = False  # first tile (of 3) has no valid token, the others have unequal counts

    def masked_sum_ce(head, x_t, y_t, mask_t):
        return (F.cross_entropy(head(x_t), y_t, reduction="none") * mask_t).sum()

    per_token = F.cross_entropy(head(x).reshape(-1, 11), y.reshape(-1), reduction="none")
    want_loss = per_token[mask.reshape(-1)].mean()
    want = grads_of(want_loss, [x, *head.parameters()])
    got_loss = TiledFusedLogitsLoss.apply(masked_sum_ce, head, x, y, mask, 3, None, "mean")
    got = grads_of(got_loss, [x, *head.parameters()])

    assert rel(got_loss, want_loss) <= TOL
    assert_close(got, want, "grad")


def test_fused_logits_loss_without_valid_tokens_is_zero_not_nan():
    head = nn.Linear(4, 5)
    x = torch.randn(1, 3, 4, requires_grad=True)
    y = torch.full((1, 3), -100)
    loss = TiledFusedLogitsLoss.apply(sum_ce, head, x, y, None, 2, None, "mean")
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(x.grad) == 0 and torch.count_nonzero(head.weight.grad) == 0


def test_fused_logits_loss_scales_every_grad_by_grad_output():
    torch.manual_seed(0)
    head = nn.Linear(16, 11)
    x = torch.randn(2, 7, 16, requires_grad=True)
    y = labels_with_holes(2, 7, 11, torch.Generator().manual_seed(1))
    inputs = [x, *head.parameters()]

    def tiled():
        return TiledFusedLogitsLoss.apply(sum_ce, head, x, y, None, 3, None, "mean")

    full = grads_of(tiled(), inputs)
    half = grads_of(0.5 * tiled(), inputs)
    want = grads_of(0.5 * F.cross_entropy(head(x).reshape(-1, 11), y.reshape(-1)), inputs)
    for h, f in zip(half, full):
        assert torch.equal(h * 2, f)  # scaling by a power of two is exact
    assert_close(half, want, "half grad")


def test_fused_logits_loss_holds_one_tile_of_logits_and_recomputes_in_backward():
    head = nn.Linear(16, 11)
    x = torch.randn(2, 7, 16, requires_grad=True)
    y = torch.randint(0, 11, (2, 7))
    rows = []

    def recording_ce(head, x_t, y_t):
        logits = head(x_t)  # [n_t, v]
        rows.append((logits.shape[0], torch.is_grad_enabled()))
        return F.cross_entropy(logits, y_t, reduction="sum")

    loss = TiledFusedLogitsLoss.apply(recording_ce, head, x, y, None, 4, None, "mean")
    assert rows == [(4, False), (4, False), (3, False), (3, False)]  # 14 tokens, no graph kept in forward
    loss.backward()
    assert rows[4:] == [(4, True), (4, True), (3, True), (3, True)]  # each tile recomputed with grad


def test_fused_logits_loss_errors():
    head = nn.Linear(4, 5)
    x, y = torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="output_reduction must be 'mean' or 'sum', got 'none'"):
        TiledFusedLogitsLoss.apply(sum_ce, head, x, y, None, 2, None, "none")
    with pytest.raises(ValueError, match=r"y of shape x.shape\[:-1\]"):
        TiledFusedLogitsLoss.apply(sum_ce, head, x, y[:, :2], None, 2, None, "mean")
    with pytest.raises(ValueError, match="mask must have y's shape"):
        TiledFusedLogitsLoss.apply(sum_ce, head, x, y, torch.ones(2, 2), 2, None, "mean")
    with pytest.raises(ValueError, match="summed loss as a 1-element tensor"):
        TiledFusedLogitsLoss.apply(lambda m, a, b: head(a), head, x, y, None, 2, None, "mean")
    with pytest.raises(ValueError, match=r"expected a module with a 2-D weight \[v, h\] \(an lm_head\)"):
        TiledFusedLogitsLoss.apply(lambda m, a, b: sum_ce(head, a, b), nn.Identity(), x, y, None, "auto", None,
                                   "mean")


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


@pytest.mark.parametrize("use", ["mlp", "loss"])
def test_lora_params_found_and_held_back_until_last_tile(use):
    torch.manual_seed(0)
    module = LoraLinear()
    x = torch.randn(2, 7, 16, requires_grad=True)
    y = labels_with_holes(2, 7, 11, torch.Generator().manual_seed(1))
    trainable = [module.lora_a, module.lora_b]
    seen = {id(p): [] for p in trainable}
    for p in trainable:
        p.register_post_accumulate_grad_hook(lambda p: seen[id(p)].append(getattr(p, "ds_grad_is_ready", None)))

    if use == "mlp":
        want_out = module(x).pow(2).sum()
        got_out = TiledMLP.apply(mlp_fn, module, x, 3, None).pow(2).sum()
    else:
        want_out = F.cross_entropy(module(x).reshape(-1, 11), y.reshape(-1))
        got_out = TiledFusedLogitsLoss.apply(sum_ce, module, x, y, None, 3, None, "mean")
    want = grads_of(want_out, [x, *trainable])
    for p in trainable:
        seen[id(p)].clear()
    got_out.backward()

    assert rel(got_out, want_out) <= TOL
    assert_close([x.grad, *(p.grad for p in trainable)], want, "grad")
    assert module.base.weight.grad is None
    for p in trainable:
        # held back during the 3 tiles, then one ready pass from the outer backward, flag restored (absent)
        assert seen[id(p)] == [False, False, False, None]
        assert not hasattr(p, "ds_grad_is_ready")


def test_existing_grad_ready_flag_is_restored():
    mlp = GatedMLP(h=4, inter=8)
    mlp.up_proj.weight.ds_grad_is_ready = "user value"
    TiledMLP.apply(mlp_fn, mlp, torch.randn(1, 4, 4, requires_grad=True), 2, None).sum().backward()
    assert mlp.up_proj.weight.ds_grad_is_ready == "user value"


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("sl,shards", SPLITS)
@pytest.mark.parametrize("reduction", [None, "mean", "sum"])
def test_sequence_tiled_compute_per_token_output(bs, sl, shards, reduction):
    torch.manual_seed(0)
    head = nn.Linear(16, 11)
    x = torch.randn(bs, sl, 16, requires_grad=True)
    y = torch.randint(0, 11, (bs, sl))
    w = torch.randn(bs, sl)

    def per_token_ce(hidden, labels, weight, scale):
        return F.cross_entropy(head(hidden).transpose(1, 2), labels, reduction="none") * weight * scale  # [bs, sl]

    inputs = [x, *head.parameters()]
    want_out = per_token_ce(x, y, w, 2.0)
    want_out = want_out if reduction is None else getattr(want_out, reduction)()
    got_out = sequence_tiled_compute(per_token_ce, sl, shards, {"hidden": x, "labels": y, "weight": w},
                                     {"scale": 2.0}, "hidden", output_reduction=reduction)
    weights = torch.arange(want_out.numel()).view_as(want_out) if reduction is None else 1.0
    want = grads_of((want_out * weights).sum(), inputs)
    got = grads_of((got_out * weights).sum(), inputs)

    assert got_out.shape == want_out.shape
    assert rel(got_out, want_out) <= TOL
    assert_close(got, want, "grad")


def test_sequence_tiled_compute_scalar_tiles_and_bound_module_params():
    torch.manual_seed(0)
    head = nn.Linear(16, 11)
    x = torch.randn(2, 7, 16, requires_grad=True)
    y = torch.randint(0, 11, (2, 7))

    def tile_loss(hidden, labels, module):
        return F.cross_entropy(module(hidden).reshape(-1, 11), labels.reshape(-1), reduction="sum")

    inputs = [x, *head.parameters()]
    want_out = F.cross_entropy(head(x).reshape(-1, 11), y.reshape(-1), reduction="sum")
    want = grads_of(want_out, inputs)
    got_out = sequence_tiled_compute(tile_loss, 7, 3, {"hidden": x, "labels": y}, {"module": head}, "hidden",
                                     output_unshard_dimension=0, output_reduction="sum")
    got = grads_of(got_out, inputs)
    assert rel(got_out, want_out) <= TOL
    assert_close(got, want, "grad")
    seen = []
    head.weight.register_post_accumulate_grad_hook(lambda p: seen.append(getattr(p, "ds_grad_is_ready", None)))
    got_out = SequenceTiledCompute.apply(tile_loss, 7, 3, ["hidden", "labels"], ["module"], "hidden", None, 0,
                                         "sum", x, y, head)
    got_out.backward()
    assert seen == [False, False, False, None]  # head found through kwargs_to_pass with compute_params=None


def test_sequence_tiled_compute_parameters_passed_as_kwargs_get_grads():
    torch.manual_seed(0)
    head = nn.Linear(16, 11)
    x = torch.randn(2, 7, 16, requires_grad=True)
    y = torch.randint(0, 11, (2, 7))
    def tile_loss(hidden, labels, weight, bias):
        return F.cross_entropy(F.linear(hidden, weight, bias).transpose(1, 2), labels, reduction="sum")

    inputs = [x, head.weight, head.bias]
    want = grads_of(tile_loss(x * 2, y, head.weight, head.bias), inputs)
    got_out = sequence_tiled_compute(tile_loss, 7, 3, {"hidden": x * 2, "labels": y},  # a non-leaf input
                                     {"weight": head.weight, "bias": head.bias}, "hidden",
                                     output_unshard_dimension=0, output_reduction="sum")
    assert_close(grads_of(got_out, inputs), want, "grad")


def test_sequence_tiled_compute_errors():
    x = torch.randn(1, 4, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"must be a \[bs, seqlen, \.\.\.\] tensor with seqlen=5"):
        sequence_tiled_compute(torch.sin, 5, 2, {"input": x}, {}, "input")
    with pytest.raises(ValueError, match="grad_requiring_tensor_key must name a tensor in kwargs_to_shard"):
        sequence_tiled_compute(torch.sin, 4, 2, {"input": x}, {}, "hidden")
    with pytest.raises(ValueError, match="output_reduction must be one of"):
        sequence_tiled_compute(torch.sin, 4, 2, {"input": x}, {}, "input", output_reduction="max")


def test_auto_shards_and_agreement_without_distributed():
    assert auto_mlp_shards(4096, 4096) == 1
    assert auto_mlp_shards(4097, 4096) == 2
    assert auto_mlp_shards(1, 64) == 1
    # 2**25 fp32 logits fit in the 128 MiB default budget
    assert auto_loss_shards(2**10, 2**15) == 1
    assert auto_loss_shards(2**10 + 1, 2**15) == 2
    assert auto_loss_shards(8192, 32000) == 8  # 8K tokens per rank, 32K vocab: 1 GB of logits
    assert auto_loss_shards(1000, 1000, budget_bytes=1000 * 1000, dtype=torch.bfloat16) == 2
    assert auto_loss_shards(1000, 1000, budget_bytes=1000 * 1000, dtype=torch.float32) == 4
    assert agree_on_shards(3) == 3
    with pytest.raises(ValueError, match="hidden_size must be a positive int, got 0"):
        auto_mlp_shards(10, 0)
    with pytest.raises(ValueError, match="n must be a positive int"):
        agree_on_shards(2.5)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


@pytest.mark.parametrize("bs,shards", [(1, "auto"), (2, 3)])
def test_tile_mlps_on_llama_equals_untiled(bs, shards):
    model = tiny_llama()
    ids = torch.randint(0, 128, (bs, 150), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[:, :20] = -100
    params = [p for p in model.parameters() if p.requires_grad]

    want_loss = model(input_ids=ids, labels=labels).loss
    want = grads_of(want_loss, params)

    tile_calls = []
    mlps = [m for n, m in model.named_modules() if n.endswith(".mlp")]
    hooks = [m.down_proj.register_forward_hook(lambda m, i, o: tile_calls.append(o.shape[-2])) for m in mlps]
    assert tile_mlps(model, shards=shards) == 2
    assert tile_mlps(model, shards=shards) == 2  # idempotent
    got_loss = model(input_ids=ids, labels=labels).loss
    n_forward_calls = len(tile_calls)
    got = grads_of(got_loss, params)

    assert rel(got_loss, want_loss) <= TOL
    assert_close(got, want, "grad")
    n_tiles = 3  # "auto": ceil(150 / 64)
    assert n_forward_calls == 2 * n_tiles  # each MLP ran tiled in forward...
    assert len(tile_calls) == 2 * 2 * n_tiles  # ...and recomputed per tile in backward

    assert untile_mlps(model) == 2
    assert untile_mlps(model) == 0
    assert all("forward" not in m.__dict__ for m in mlps)
    tile_calls.clear()
    assert rel(model(input_ids=ids, labels=labels).loss, want_loss) <= TOL
    assert len(tile_calls) == 2
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("shards,head_calls", [(1, 1), ("auto", 1), (3, 6)])
def test_tiled_causal_lm_loss_tiles_only_when_it_saves_memory(shards, head_calls):
    from ds_ulysses import enable_sp_loss, tiled_causal_lm_loss

    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :20] = -100
    params = [p for p in model.parameters() if p.requires_grad]
    want_loss = model(input_ids=ids, labels=labels).loss
    want = grads_of(want_loss, params)

    shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
    calls = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: calls.append(o.shape[0]))
    enable_sp_loss(model, loss_fn=tiled_causal_lm_loss(shards))
    got_loss = model(input_ids=ids, shift_labels=shift_labels).loss
    got = grads_of(got_loss, params)
    hook.remove()

    assert rel(got_loss, want_loss) <= TOL
    assert_close(got, want, "grad")
    # one untiled lm_head call when tiling would save nothing ("auto": 300 x 128 logits are far
    # below a tile's budget); otherwise each tile in forward and again in the backward recompute
    assert len(calls) == head_calls


def test_tile_mlps_handles_any_mlp_module_and_only_the_given_model():
    torch.manual_seed(0)

    def block():
        layer = nn.Module()
        layer.mlp = nn.Sequential(nn.Linear(8, 24), nn.GELU(), nn.Linear(24, 8))  # GPT-style, not gate/up/down
        return layer

    model, other = nn.ModuleList([block(), block()]), nn.ModuleList([block()])
    x = torch.randn(2, 5, 8, requires_grad=True)

    def run(m):
        h = x
        for layer in m:
            h = h + layer.mlp(h)
        return grads_of(h.pow(2).sum(), [x, *m.parameters()])

    want = run(model)
    assert tile_mlps(model, shards=4) == 2
    tiles = []
    model[0].mlp[0].register_forward_hook(lambda m, i, o: tiles.append(o.shape[-2]))
    assert_close(run(model), want, "grad")
    assert tiles == [2, 1, 1, 1] * 2  # forward, then the recompute in backward
    assert all("forward" not in layer.mlp.__dict__ for layer in other)
    with pytest.raises(ValueError, match="shards must be a positive int, got -1"):
        tile_mlps(model, shards=-1)


class TinyLM(nn.Module):
    """Embedding -> residual MLP (tiled by tile_mlps) -> residual MLP (explicit TiledMLP) -> lm_head + loss,
    with the lm_head tied to the embedding, so one weight gets gradient from inside and outside tiles."""

    def __init__(self, h=16, inter=24, v=20, tiled=True):
        super().__init__()
        self.embed = nn.Embedding(v, h)
        self.mlp = GatedMLP(h, inter)
        self.ffn = GatedMLP(h, inter)
        self.head = nn.Linear(h, v, bias=False)
        self.head.weight = self.embed.weight
        self.tiled = tiled

    def forward(self, ids, y):
        hidden = self.embed(ids)  # [bs, sl, h]
        hidden = hidden + self.mlp(hidden)
        if not self.tiled:
            hidden = hidden + self.ffn(hidden)
            return F.cross_entropy(self.head(hidden).reshape(-1, self.head.out_features), y.reshape(-1))
        hidden = hidden + TiledMLP.apply(mlp_fn, self.ffn, hidden, 3, None)
        return TiledFusedLogitsLoss.apply(sum_ce, self.head, hidden, y, None, 3, None, "mean")


def zero_batch(rank, step):
    """Ranks differ in length (7 and 20 tokens: "auto" MLP shards 1 and 2, which the ranks must agree
    on) and in valid-token counts, and a loss tile has no valid token."""
    gen = torch.Generator().manual_seed(10 + 2 * step + rank)
    sl = 7 + 13 * rank
    ids = torch.randint(0, 20, (2, sl), generator=gen)
    y = ids.roll(-1, dims=1)
    y[0, : 3 + rank] = -100
    return ids, y


def zero_worker(stage, steps=3):
    """One rank of the ZeRO test: tiled engine grads vs plain-torch untiled grads averaged over ranks,
    at every step (ZeRO-3 traces parameter use in the first step and prefetches from the second)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    reference.tiled = False
    tile_mlps(model, shards="auto")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step sees the same weights
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    partitioned = stage < 3 or all(p.ds_tensor.numel() < p.ds_numel for p in engine.module.parameters())
    calls = []
    engine.module.mlp.down_proj.register_forward_hook(lambda *_: calls.append(1))
    result = {"rank": rank, "partitioned": partitioned, "errors": {}, "loss_error": 0.0}
    for step in range(steps):
        calls.clear()
        loss = engine(*zero_batch(rank, step))
        result["mlp_tiles"] = len(calls)
        engine.backward(loss)
        got = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
        engine.step()

        reference.zero_grad(set_to_none=True)
        want_losses = [reference(*zero_batch(r, step)) for r in range(world)]
        (sum(want_losses) / world).backward()  # ZeRO averages gradients over the data-parallel ranks
        for n, p in reference.named_parameters():
            assert p.grad.norm() > 0, n
            result["errors"][n] = max(result["errors"].get(n, 0.0), rel(got[n], p.grad))
        result["loss_error"] = max(result["loss_error"], rel(loss.detach(), want_losses[rank].detach()))
    print("RESULT " + json.dumps(result), flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(*worker_args):
    """Run this file's worker on 2 gloo ranks; return the RESULT dict each rank printed."""
    world, port = 2, free_port()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *worker_args], env=env, cwd=repo,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    results = []
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-4000:]
        results += [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(results) == world
    return results


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_two_ranks_match_untiled(stage):
    for result in run_two_ranks("zero-worker", str(stage)):
        assert result["partitioned"], "parameters were not partitioned: the ZeRO-3 path was not exercised"
        assert result["loss_error"] <= TOL
        assert result["mlp_tiles"] == 2, "ranks did not agree on the 'auto' tile count"
        assert set(result["errors"]) == {n for n, _ in TinyLM().named_parameters()}
        bad = {n: e for n, e in result["errors"].items() if e > 1e-4}
        assert not bad, f"rank {result['rank']}: gradients differ from untiled torch: {bad}"


def zero3_llama_worker(steps=2):
    """One rank: a HF Llama under ZeRO-3 with tile_mlps and activation-checkpoint offload, vs plain torch."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from ds_ulysses import offload

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = tiny_llama().train()
    reference = copy.deepcopy(model)
    packed, to_host = [], offload._to_host
    offload._to_host = lambda t: packed.append(1) or to_host(t)  # count what the pack hook moves
    result = {"rank": rank, "mlps": tile_mlps(model, shards="auto"),
              "offloaded_layers": offload.enable_activation_checkpoint_offload(model), "errors": {},
              "loss_error": 0.0}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config=config)

    def ids(r, step):
        return torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(r + 2 * step))

    for step in range(steps):
        loss = engine(input_ids=ids(rank, step), labels=ids(rank, step)).loss
        engine.backward(loss)
        got = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
        engine.step()
        reference.zero_grad(set_to_none=True)
        want_losses = [reference(input_ids=ids(r, step), labels=ids(r, step)).loss for r in range(world)]
        (sum(want_losses) / world).backward()
        for n, p in reference.named_parameters():
            result["errors"][n] = max(result["errors"].get(n, 0.0), rel(got[n], p.grad))
        result["loss_error"] = max(result["loss_error"], rel(loss.detach(), want_losses[rank].detach()))
    result["packed"] = len(packed)
    print("RESULT " + json.dumps(result), flush=True)


@pytest.mark.slow
def test_zero3_llama_with_tiled_mlps_and_checkpoint_offload():
    for result in run_two_ranks("zero3-llama-worker"):
        assert result["mlps"] == 2 and result["offloaded_layers"] == 2
        assert result["packed"] >= 2 * 2, "checkpointed layer inputs did not go through the offload hook"
        assert result["loss_error"] <= TOL
        assert len(result["errors"]) == len(list(tiny_llama().parameters()))
        bad = {n: e for n, e in result["errors"].items() if e > 1e-4}
        assert not bad, f"rank {result['rank']}: gradients differ from plain torch: {bad}"


if __name__ == "__main__" and sys.argv[1:2] == ["zero-worker"]:
    zero_worker(int(sys.argv[2]))
if __name__ == "__main__" and sys.argv[1:] == ["zero3-llama-worker"]:
    zero3_llama_worker()

"""TiledFusedLogitsLoss against plain PyTorch on the untiled loss, and side by side with DeepSpeed's module.

DeepSpeed's `fn` contract (the tile's loss as the user computes it, CrossEntropyLoss()'s mean in its
examples); "mean" weights tiles by their token share, so it equals DeepSpeed with equal tiles and the
exact token mean without; gradients are computed in forward and scaled by the incoming gradient.
Tolerances: see helpers.TOL. "Equal to DeepSpeed" uses the same 1e-5: both sum the same per-tile
terms, in another order.
"""

import pytest
import torch
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel import ulysses_sp as deepspeed_alst
from torch import nn

import ds_ulysses.memory
from ds_ulysses.memory import TiledFusedLogitsLoss

from .helpers import SPLITS, TOL, LoraLinear, assert_close, count_accumulations, grads_after, grads_of, mean_ce, \
    rel, sum_ce, tile_sizes

V = 11


def inputs(bs, sl, seed=0, holes=0):
    """x [bs, sl, 16] requiring grad, labels [bs, sl] (the first `holes` of them -100), and an lm_head."""
    torch.manual_seed(seed)
    head = nn.Linear(16, V)
    x = torch.randn(bs, sl, 16, requires_grad=True)
    y = torch.randint(0, V, (bs, sl))
    y[0, :holes] = -100
    return head, x, y


def untiled(head, x, y, reduction="mean"):
    return F.cross_entropy(head(x).reshape(-1, V), y.reshape(-1), reduction=reduction)


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("sl,shards", SPLITS)
def test_mean_of_tile_means_is_the_exact_token_mean(bs, sl, shards):
    head, x, y = inputs(bs, sl)
    params = [x, *head.parameters()]
    want_loss = untiled(head, x, y)
    want = grads_of(want_loss, params)
    got_loss = TiledFusedLogitsLoss.apply(mean_ce, head, x, y, None, shards, None, "mean")
    assert rel(got_loss, want_loss) <= TOL
    assert_close(grads_of(got_loss, params), want, "grad")


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("sl,shards", SPLITS)
def test_sum_adds_the_tile_outputs(bs, sl, shards):
    head, x, y = inputs(bs, sl, holes=min(3, sl - 1))
    params = [x, *head.parameters()]
    want_loss = untiled(head, x, y, "sum")  # fn's per-tile sums add up to the whole sum
    want = grads_of(want_loss, params)
    got_loss = TiledFusedLogitsLoss.apply(sum_ce, head, x, y, None, shards, [head.weight, head.bias], "sum")
    assert rel(got_loss, want_loss) <= TOL
    assert_close(grads_of(got_loss, params), want, "grad")


def test_ignored_labels_weigh_tiles_by_size_not_by_valid_tokens():
    """With -100 labels a tile's CrossEntropyLoss() is the mean over its valid tokens; "mean" still
    weights it by its size n_t / n, as DeepSpeed's mean of tile means does with equal tiles."""
    head, x, y = inputs(1, 9, holes=2)  # 3 tiles of 3; the first has 1 valid token
    tiles = [mean_ce(head, xt, yt) for xt, yt in zip(x[0].split(3), y[0].split(3))]
    want = sum(tiles) / 3
    got = TiledFusedLogitsLoss.apply(mean_ce, head, x, y, None, 3, None, "mean")
    assert rel(got, want) <= TOL
    assert rel(got, untiled(head, x, y)) > 1e-3  # not the valid-token mean: use "sum" for that


@pytest.mark.parametrize("bs,sl,shards", [(2, 8, 2), (1, 8, 4), (3, 4, 3), (2, 425, 2)])
def test_equal_tiles_match_deepspeed(bs, sl, shards):
    head, x, y = inputs(bs, sl)
    params = [x, *head.parameters()]
    losses = []

    def deepspeed_loss():  # its parameter gradients accumulate in its forward
        losses.append(deepspeed_alst.TiledFusedLogitsLoss.apply(mean_ce, head, x, y, None, shards,
                                                                [head.weight, head.bias], "mean"))
        return losses[-1]

    want = grads_after(deepspeed_loss, params)
    want_loss = losses[0]
    got_loss = TiledFusedLogitsLoss.apply(mean_ce, head, x, y, None, shards, [head.weight, head.bias], "mean")
    assert rel(got_loss, want_loss) <= TOL
    assert_close(grads_of(got_loss, params), want, "grad")


@pytest.mark.parametrize("bs,sl,shards", [(1, 7, 2), (2, 5, 3)])
def test_unequal_tiles_are_exact_where_deepspeed_averages_tile_means(bs, sl, shards):
    head, x, y = inputs(bs, sl)
    params = [x, *head.parameters()]
    want_loss = untiled(head, x, y)
    want = grads_of(want_loss, params)
    got_loss = TiledFusedLogitsLoss.apply(mean_ce, head, x, y, None, shards, None, "mean")
    assert rel(got_loss, want_loss) <= TOL
    assert_close(grads_of(got_loss, params), want, "grad")
    biased = deepspeed_alst.TiledFusedLogitsLoss.apply(mean_ce, head, x, y, None, shards, [head.weight], "mean")
    assert rel(biased, want_loss) > 10 * TOL  # DeepSpeed weights the shorter tile like the longer one


def test_incoming_gradient_scales_every_gradient_where_deepspeed_ignores_it_for_parameters():
    head, x, y = inputs(2, 7)
    params = [x, *head.parameters()]

    def tiled(module=ds_ulysses.memory):
        return module.TiledFusedLogitsLoss.apply(mean_ce, head, x, y, None, 2, [head.weight, head.bias], "mean")

    full = grads_of(tiled(), params)
    half = grads_of(0.5 * tiled(), params)
    scaled = grads_of(tiled(), params, scale=torch.tensor(0.5))  # loss scaling hands backward the factor
    for h, s, f in zip(half, scaled, full):
        assert torch.equal(h * 2, f) and torch.equal(s, h)  # scaling by a power of two is exact
    assert_close(half, grads_of(0.5 * untiled(head, x, y), params), "half grad")

    ds_full = grads_after(lambda: tiled(deepspeed_alst), params)
    ds_half = grads_after(lambda: 0.5 * tiled(deepspeed_alst), params)
    assert torch.equal(ds_half[0] * 2, ds_full[0])  # its input gradient is scaled...
    assert torch.equal(ds_half[1], ds_full[1])  # ...its weight gradient is not


def test_gradient_accumulation_adds_exactly_scaled_micro_batch_gradients():
    head, x, y = inputs(2, 7)
    _, x2, y2 = inputs(2, 7, seed=1)
    params = [x, x2, *head.parameters()]
    want = grads_of(0.5 * untiled(head, x, y) + 0.5 * untiled(head, x2, y2), params)
    for p in params:
        p.grad = None
    for xi, yi in ((x, y), (x2, y2)):  # two micro-batches, each loss divided by GAS as DeepSpeed does
        (TiledFusedLogitsLoss.apply(mean_ce, head, xi, yi, None, 3, None, "mean") / 2).backward()
    assert_close([p.grad for p in params], want, "accumulated grad")


def test_tied_weight_gets_the_untiled_gradient_accumulated_once_after_every_use():
    torch.manual_seed(0)
    embed, head = nn.Embedding(V, 16), nn.Linear(16, V, bias=False)
    head.weight = embed.weight
    ids = torch.randint(0, V, (2, 7))

    def loss(tiled):
        hidden = torch.tanh(embed(ids))  # [bs, sl, h]
        y = ids.roll(-1, dims=1)
        if tiled:
            return TiledFusedLogitsLoss.apply(mean_ce, head, hidden, y, None, 3, [head.weight], "mean")
        return untiled(head, hidden, y)

    want = grads_of(loss(False), [embed.weight])
    counts, handles = count_accumulations([embed.weight])
    seen = []
    handles.append(embed.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone())))
    tiled_loss = loss(True)
    assert counts[id(embed.weight)] == [0]  # nothing reached .grad in forward
    got = grads_of(tiled_loss, [embed.weight])
    for handle in handles:
        handle.remove()
    assert counts[id(embed.weight)] == [1]  # once per backward: ZeRO reduces it once...
    assert_close(seen, want, "grad at the hook")  # ...with the embedding's part already added
    assert_close(got, want, "grad")


@pytest.mark.parametrize("hook", [lambda g: g * 0.5, lambda g: g.clamp(max=0.01)], ids=["halving", "clamping"])
def test_a_users_gradient_hook_on_the_head_runs_once_on_the_summed_gradient(hook):
    """The tiles run in forward; the user's hook on lm_head's weight still runs once, in backward, on the
    gradient summed over the tiles, as for the untiled loss."""
    head, x, y = inputs(2, 7)
    want = grads_of(untiled(head, x, y), [x, head.weight, head.bias])
    want[1] = hook(want[1])
    calls = []
    handle = head.weight.register_hook(lambda g: calls.append(1) or hook(g))
    loss = TiledFusedLogitsLoss.apply(mean_ce, head, x, y, None, 3, None, "mean")
    assert calls == [] and handle.id in head.weight._backward_hooks  # put back after the forward's tiles
    got = grads_of(loss, [x, head.weight, head.bias])
    handle.remove()
    assert_close(got, want, "grad")
    assert calls == [1]


def test_backward_runs_in_forward_and_lm_head_is_not_recomputed():
    head, x, y = inputs(2, 7)
    rows = []

    def recording_ce(head, x_t, y_t):
        logits = head(x_t)  # [n_t, v]
        rows.append((logits.shape[0], torch.is_grad_enabled()))
        return F.cross_entropy(logits, y_t)

    loss = TiledFusedLogitsLoss.apply(recording_ce, head, x, y, None, 4, None, "mean")
    assert rows == [(4, True), (4, True), (3, True), (3, True)]  # 14 tokens, graphs built one tile at a time
    loss.backward()
    assert len(rows) == 4  # no recompute in backward


def test_second_backward_is_refused():
    head, x, y = inputs(1, 4)
    loss = TiledFusedLogitsLoss.apply(mean_ce, head, x, y, None, 2, None, "mean")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice through the same loss; its gradients are computed "
                                           "once, in forward"):
        loss.backward()


def test_no_grad_evaluation_computes_the_value_only():
    head, x, y = inputs(2, 7)
    grad_modes = []

    def recording_ce(head, x_t, y_t):
        grad_modes.append(torch.is_grad_enabled())
        return mean_ce(head, x_t, y_t)

    with torch.no_grad():
        loss = TiledFusedLogitsLoss.apply(recording_ce, head, x, y, None, 3, None, "mean")
    assert grad_modes == [False] * 3 and not loss.requires_grad
    assert rel(loss, untiled(head, x, y)) <= TOL


def test_empty_tiles_run_fn_and_add_nothing():
    head, x, y = inputs(1, 3)
    calls = []

    def recording_ce(head, x_t, y_t):
        calls.append(len(y_t))
        return mean_ce(head, x_t, y_t)  # NaN on an empty tile

    params = [x, *head.parameters()]
    want_loss = untiled(head, x, y)
    want = grads_of(want_loss, params)
    got_loss = TiledFusedLogitsLoss.apply(recording_ce, head, x, y, None, 5, None, "mean")
    assert calls == tile_sizes(3, 5) == [1, 1, 1, 0, 0]  # every rank makes the same calls under ZeRO-3
    assert rel(got_loss, want_loss) <= TOL
    assert_close(grads_of(got_loss, params), want, "grad")


def test_mask_reaches_fn_as_fourth_argument_and_tiles_keep_their_size_weight():
    head, x, y = inputs(2, 7)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, :4] = False
    masks = []

    def masked_ce(head, x_t, y_t, mask_t):
        masks.append(mask_t.clone())
        per_token = F.cross_entropy(head(x_t), y_t, reduction="none")  # [n_t]
        return (per_token * mask_t).sum() / mask_t.sum().clamp(min=1)

    params = [x, *head.parameters()]
    want_loss = sum(size / 14 * masked_ce(head, xt, yt, mt) for size, xt, yt, mt in
                    zip(tile_sizes(14, 3), x.reshape(14, 16).split(tile_sizes(14, 3)), y.reshape(14).split(
                        tile_sizes(14, 3)), mask.reshape(14).split(tile_sizes(14, 3))))
    want = grads_of(want_loss, params)
    masks.clear()
    got_loss = TiledFusedLogitsLoss.apply(masked_ce, head, x, y, mask, 3, None, "mean")
    assert torch.equal(torch.cat(masks), mask.reshape(14))
    assert rel(got_loss, want_loss) <= TOL
    assert_close(grads_of(got_loss, params), want, "grad")


def test_parameters_accumulate_once_from_the_outer_backward():
    module = LoraLinear()
    _, x, y = inputs(2, 7)
    trainable = [module.lora_a, module.lora_b]
    want = grads_of(F.cross_entropy(module(x).reshape(-1, V), y.reshape(-1)), [x, *trainable])
    counts, handles = count_accumulations(trainable)
    loss = TiledFusedLogitsLoss.apply(mean_ce, module, x, y, None, 3, None, "mean")  # None finds A and B
    assert all(c == [0] for c in counts.values())
    got = grads_of(loss, [x, *trainable])
    assert all(c == [1] for c in counts.values())
    assert module.base.weight.grad is None
    assert_close(got, want, "grad")
    for handle in handles:
        handle.remove()


def test_undeclared_parameters_get_exact_gradients_without_hooks_and_are_refused_with_them():
    head, x, y = inputs(2, 7)
    params = [x, *head.parameters()]
    want = grads_of(0.5 * untiled(head, x, y), params)
    got = grads_of(0.5 * TiledFusedLogitsLoss.apply(mean_ce, head, x, y, None, 3, [], "mean"), params)
    assert_close(got, want, "grad")  # plain torch: written into .grad, scaled by the incoming gradient

    _, handles = count_accumulations([head.weight])  # stands in for the hook ZeRO puts on every parameter
    with pytest.raises(ValueError, match=r"TiledFusedLogitsLoss: fn uses weight \[11, 16\], which requires grad and "
                                         r"has gradient hooks .* add it to compute_params"):
        TiledFusedLogitsLoss.apply(mean_ce, head, x, y, None, 3, [head.bias], "mean")
    handles[0].remove()


def test_auto_shards_use_the_lm_head_vocabulary():
    head, x, y = inputs(1, 300)
    calls = []
    TiledFusedLogitsLoss.apply(lambda h, a, b: calls.append(len(b)) or mean_ce(h, a, b), head, x, y, None, "auto",
                               None, "mean")
    assert calls == [300]  # 300 x 11 fp32 logits fit one 128 MiB tile


def test_errors():
    head, x, y = inputs(2, 3)
    with pytest.raises(ValueError, match="output_reduction must be 'mean' or 'sum', got 'none'"):
        TiledFusedLogitsLoss.apply(mean_ce, head, x, y, None, 2, None, "none")
    with pytest.raises(ValueError, match=r"y of shape x.shape\[:-1\], got x \(2, 3, 16\) and y \(2, 2\)"):
        TiledFusedLogitsLoss.apply(mean_ce, head, x, y[:, :2], None, 2, None, "mean")
    with pytest.raises(ValueError, match=r"mask must have y's shape \(2, 3\), got \(2, 2\)"):
        TiledFusedLogitsLoss.apply(mean_ce, head, x, y, torch.ones(2, 2), 2, None, "mean")
    with pytest.raises(ValueError, match=r"fn must return the tile's loss as a 1-element tensor, got \(3, 11\)"):
        TiledFusedLogitsLoss.apply(lambda m, a, b: m(a), head, x, y, None, 2, None, "mean")
    with pytest.raises(ValueError, match=r"expected a module with a 2-D weight \[v, h\] \(an lm_head\)"):
        TiledFusedLogitsLoss.apply(lambda m, a, b: mean_ce(head, a, b), nn.Identity(), x, y, None, "auto", None,
                                   "mean")
    with pytest.raises(ValueError, match="shards must be a positive int, got 0"):
        TiledFusedLogitsLoss.apply(mean_ce, head, x, y, None, 0, None, "mean")
    with pytest.raises(ValueError, match=r"compute_params must be a list of the parameters fn uses, or None, got a "
                                         r"tensor of shape \(11, 16\)"):
        TiledFusedLogitsLoss.apply(mean_ce, head, x, y, None, 2, head.weight, "mean")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_head_gets_its_gradient_when_the_hidden_states_need_none(reduction):
    """Only lm_head trained (a frozen body): DeepSpeed's loss does not require grad there, so the head
    gets no gradient; ours gives the untiled one."""
    head, x, y = inputs(2, 9)
    x = x.detach()
    want = grads_of(untiled(head, x, y, reduction), list(head.parameters()))
    fn = mean_ce if reduction == "mean" else sum_ce
    got = grads_of(TiledFusedLogitsLoss.apply(fn, head, x, y, None, 3, None, reduction), list(head.parameters()))
    assert_close(got, want, "grad")

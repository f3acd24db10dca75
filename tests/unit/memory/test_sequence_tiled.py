"""sequence_tiled_compute equals the untiled computation in plain PyTorch (values and every gradient),
and DeepSpeed's on the same inputs where DeepSpeed is exact. Tolerances: helpers.TOL.
"""

import pytest
import torch
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel import ulysses_sp as deepspeed_alst
from torch import nn

from ds_ulysses.memory import SequenceTiledCompute, sequence_tiled_compute

from .helpers import SPLITS, TOL, GatedMLP, assert_close, count_accumulations, grads_of, rel, tile_sizes

V = 11


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("sl,shards", SPLITS)
@pytest.mark.parametrize("reduction", [None, "mean", "sum"])
def test_per_token_output(bs, sl, shards, reduction):
    torch.manual_seed(0)
    head = nn.Linear(16, V)
    x = torch.randn(bs, sl, 16, requires_grad=True)
    y = torch.randint(0, V, (bs, sl))
    w = torch.randn(bs, sl)

    def per_token_ce(hidden, labels, weight, scale):  # head is not declared: plain torch writes its .grad
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


@pytest.mark.parametrize("bs,sl", [(1, 125), (2, 125), (2, 8)])
def test_deepspeed_mlp_call_matches_deepspeed(bs, sl):
    torch.manual_seed(0)
    mlp = GatedMLP()
    x = torch.randn(bs, sl, 16, requires_grad=True)
    w = torch.randn(bs, sl, 16)
    params = [mlp.down_proj.weight, mlp.up_proj.weight, mlp.gate_proj.weight]
    outs, grads = [], []
    for call in (deepspeed_alst.sequence_tiled_compute, sequence_tiled_compute):
        out = call(GatedMLP.forward, sl, 4, {"x": x}, {"self": mlp}, "x", params, output_unshard_dimension=1,
                   output_reduction=None)
        outs.append(out)
        grads.append(grads_of(0.5 * (out * w).sum(), [x, *params]))
    assert rel(outs[1], outs[0]) <= TOL
    assert_close(grads[1], grads[0], "grad")
    assert rel(outs[1], mlp(x)) <= TOL


def per_tile_mean_ce(hidden, labels, module):
    """A tile's CrossEntropyLoss() mean: one 0-dim value per tile."""
    return F.cross_entropy(module(hidden).reshape(-1, V), labels.reshape(-1))


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("sl,shards", SPLITS)
def test_per_tile_values_mean_weights_tiles_by_length(bs, sl, shards):
    torch.manual_seed(0)
    head = nn.Linear(16, V)
    x = torch.randn(bs, sl, 16, requires_grad=True)
    y = torch.randint(0, V, (bs, sl))
    inputs = [x, *head.parameters()]
    want_out = F.cross_entropy(head(x).reshape(-1, V), y.reshape(-1))  # the exact token mean
    want = grads_of(want_out, inputs)
    got_out = sequence_tiled_compute(per_tile_mean_ce, sl, shards, {"hidden": x, "labels": y}, {"module": head},
                                     "hidden", output_unshard_dimension=0, output_reduction="mean")
    assert rel(got_out, want_out) <= TOL  # empty tiles (NaN means) add nothing
    assert_close(grads_of(got_out, inputs), want, "grad")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_per_tile_values_with_equal_tiles_match_deepspeed(reduction):
    torch.manual_seed(0)
    head = nn.Linear(16, V)
    x = torch.randn(2, 12, 16, requires_grad=True)
    y = torch.randint(0, V, (2, 12))
    inputs = [x, *head.parameters()]
    results = []
    for call in (deepspeed_alst.sequence_tiled_compute, sequence_tiled_compute):
        out = call(per_tile_mean_ce, 12, 3, {"hidden": x, "labels": y}, {"module": head}, "hidden",
                   [head.weight, head.bias], output_unshard_dimension=0, output_reduction=reduction)
        results.append((out, grads_of(0.5 * out, inputs)))
    (want_out, want), (got_out, got) = results
    assert got_out.shape == want_out.shape == ()
    assert rel(got_out, want_out) <= TOL
    assert_close(got, want, "grad")


def test_per_tile_values_without_reduction_are_stacked():
    """(DeepSpeed's backward fails here: it hands the [shards] gradient to each 0-dim tile value.)"""
    torch.manual_seed(0)
    head = nn.Linear(16, V)
    x = torch.randn(2, 7, 16, requires_grad=True)
    y = torch.randint(0, V, (2, 7))
    inputs = [x, *head.parameters()]
    weights = torch.tensor([1.0, -2.0, 3.0])
    tiles = zip(x.split([3, 2, 2], dim=1), y.split([3, 2, 2], dim=1))
    want_out = torch.stack([per_tile_mean_ce(x_t, y_t, head) for x_t, y_t in tiles])  # [shards]
    want = grads_of((want_out * weights).sum(), inputs)
    got_out = sequence_tiled_compute(per_tile_mean_ce, 7, 3, {"hidden": x, "labels": y}, {"module": head}, "hidden",
                                     output_unshard_dimension=0, output_reduction=None)
    assert got_out.shape == (3,)
    assert rel(got_out, want_out) <= TOL
    assert_close(grads_of((got_out * weights).sum(), inputs), want, "grad")


def test_uneven_per_tile_mean_is_exact_where_deepspeed_averages_tile_values():
    torch.manual_seed(0)
    head = nn.Linear(16, V)
    x, y = torch.randn(1, 7, 16), torch.randint(0, V, (1, 7))
    exact = F.cross_entropy(head(x).reshape(-1, V), y.reshape(-1))
    kwargs = ({"hidden": x, "labels": y}, {"module": head}, "hidden", [head.weight, head.bias])
    ours = sequence_tiled_compute(per_tile_mean_ce, 7, 2, *kwargs, output_unshard_dimension=0)
    theirs = deepspeed_alst.sequence_tiled_compute(per_tile_mean_ce, 7, 2, *kwargs, output_unshard_dimension=0)
    assert rel(ours, exact) <= TOL
    assert rel(theirs, exact) > 10 * TOL


def test_module_params_found_through_kwargs_to_pass_accumulate_once():
    torch.manual_seed(0)
    head = nn.Linear(16, V)
    x = torch.randn(2, 7, 16, requires_grad=True)
    y = torch.randint(0, V, (2, 7))

    def tile_loss(hidden, labels, module):
        return F.cross_entropy(module(hidden).reshape(-1, V), labels.reshape(-1), reduction="sum")

    inputs = [x, *head.parameters()]
    want = grads_of(F.cross_entropy(head(x).reshape(-1, V), y.reshape(-1), reduction="sum"), inputs)
    counts, handles = count_accumulations(list(head.parameters()))  # hooks like ZeRO's: undeclared is refused
    got_out = SequenceTiledCompute.apply(tile_loss, 7, 3, ["hidden", "labels"], ["module"], "hidden", None, 0,
                                         "sum", x, y, head)
    got = grads_of(got_out, inputs)
    for handle in handles:
        handle.remove()
    assert all(c == [1] for c in counts.values())
    assert_close(got, want, "grad")


def test_parameters_passed_as_kwargs_get_grads():
    torch.manual_seed(0)
    head = nn.Linear(16, V)
    x = torch.randn(2, 7, 16, requires_grad=True)
    y = torch.randint(0, V, (2, 7))

    def tile_loss(hidden, labels, weight, bias):
        return F.cross_entropy(F.linear(hidden, weight, bias).transpose(1, 2), labels, reduction="sum")

    inputs = [x, head.weight, head.bias]
    want = grads_of(tile_loss(x * 2, y, head.weight, head.bias), inputs)
    got_out = sequence_tiled_compute(tile_loss, 7, 3, {"hidden": x * 2, "labels": y},  # a non-leaf input
                                     {"weight": head.weight, "bias": head.bias}, "hidden",
                                     output_unshard_dimension=0, output_reduction="sum")
    assert_close(grads_of(got_out, inputs), want, "grad")


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
def test_a_sparse_embedding_gradient_is_summed_over_tiles(declared):
    """nn.Embedding(sparse=True) hands its weight a sparse gradient per tile; the sum equals the untiled one."""
    torch.manual_seed(0)
    emb = nn.Embedding(V, 16, sparse=True)
    x = torch.randn(2, 7, 16, requires_grad=True)
    ids = torch.randint(0, V, (2, 7))

    def tile_dot(hidden, tokens):
        return (hidden * emb(tokens)).sum(-1)  # [bs, sl_t]

    inputs = [x, emb.weight]
    want = grads_of(tile_dot(x, ids).sum(), inputs)
    got_out = sequence_tiled_compute(tile_dot, 7, 3, {"hidden": x, "tokens": ids}, {}, "hidden",
                                     [emb.weight] if declared else [], output_reduction="sum")
    got = grads_of(got_out, inputs)
    assert got[1].is_sparse
    assert_close([got[0], got[1].to_dense()], [want[0], want[1].to_dense()], "grad")


def test_undeclared_parameter_with_hooks_is_refused():
    torch.manual_seed(0)
    head = nn.Linear(16, V)
    x = torch.randn(1, 4, 16, requires_grad=True)
    _, handles = count_accumulations([head.weight])
    out = sequence_tiled_compute(lambda hidden: head(hidden), 4, 2, {"hidden": x}, {}, "hidden", [head.bias])
    with pytest.raises(ValueError, match=r"sequence_tiled_compute: fn uses a tensor \[11, 16\], which requires grad "
                                         r"and has gradient hooks"):
        out.backward()
    handles[0].remove()


def test_tiles_follow_tensor_split():
    seen = []
    sequence_tiled_compute(lambda x: seen.append(x.shape[1]) or x, 7, 4, {"x": torch.randn(2, 7, 3)}, {}, "x")
    assert seen == tile_sizes(7, 4) == [2, 2, 2, 1]


def test_errors():
    x = torch.randn(1, 4, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"kwargs_to_shard\['input'\] must be a \[bs, seqlen, \.\.\.\] tensor with "
                                         r"seqlen=5, got \(1, 4, 3\)"):
        sequence_tiled_compute(torch.sin, 5, 2, {"input": x}, {}, "input")
    with pytest.raises(ValueError, match="grad_requiring_tensor_key must name a tensor in kwargs_to_shard"):
        sequence_tiled_compute(torch.sin, 4, 2, {"input": x}, {}, "hidden")
    with pytest.raises(ValueError, match="output_reduction must be one of"):
        sequence_tiled_compute(torch.sin, 4, 2, {"input": x}, {}, "input", output_reduction="max")
    with pytest.raises(ValueError, match=r"fn must return one tensor per tile, got \['tuple'\]"):
        sequence_tiled_compute(lambda input: (input, None), 4, 2, {"input": x}, {}, "input")
    with pytest.raises(ValueError, match="shards must be a positive int, got 'auto'"):
        sequence_tiled_compute(torch.sin, 4, "auto", {"input": x}, {}, "input")


def test_parameters_get_their_gradients_when_the_sharded_input_needs_none():
    """A frozen input (nothing before fn trains): fn's declared parameters still get the untiled
    gradients. DeepSpeed's output does not require grad there, so they get none."""
    torch.manual_seed(0)
    mlp = GatedMLP()
    x, w = torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    params = list(mlp.parameters())
    want = grads_of((mlp(x) * w).sum(), params)
    got_out = sequence_tiled_compute(lambda hidden: mlp(hidden), 9, 3, {"hidden": x}, {}, "hidden", params, 1, None)
    assert_close(grads_of((got_out * w).sum(), params), want, "grad")

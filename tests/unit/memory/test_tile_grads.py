"""TileGrads: the per-tile backward's gradient sums, checked against sums written out by hand.
(Through the tiled Functions and under ZeRO-3: test_tiled_mlp.py, test_sequence_tiled.py,
test_tiled_loss.py, tests/integration/test_tiled_zero.py.)"""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ds_ulysses.memory import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute
from ds_ulysses.memory.tile_grads import TileGrads

from .helpers import GatedMLP, assert_close, grads_of, mean_ce, mlp_fn


def test_gradient_sums_never_write_into_tensors_autograd_handed_out():
    """`p + 0` hands back the incoming gradient itself: summing tiles in place would change it."""
    p = nn.Parameter(torch.zeros(3))
    grads = TileGrads("test", [p])
    incoming = torch.ones(3)
    with grads.hooked():
        for weight in (1.0, 1.0, 0.5):
            grads.backprop(p + 0, incoming, weight=weight)
    assert torch.equal(incoming, torch.ones(3))
    (total,) = grads.declared_grads(scale=torch.tensor(2.0))
    assert torch.equal(total, torch.full((3,), 5.0))
    assert grads.declared_grads() == [None]  # handed over once


def test_tile_gradient_is_weighted_and_unused_parameters_get_none():
    p, unused = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(1))
    tile = torch.ones(3, requires_grad=True)
    x_grad = torch.full((2, 3), float("nan"))  # as uninitialised memory may hold: every element is written
    grads = TileGrads("test", [p, unused])
    with grads.hooked():
        grads.backprop((p * tile * 2).sum(), torch.tensor(1.0), tile, x_grad[0], weight=0.25)
        assert torch.equal(x_grad[0], torch.full((3,), 0.5))
        grads.backprop(torch.ones(()), torch.tensor(1.0), tile, x_grad[1])  # nothing trainable in that tile
    assert torch.equal(x_grad[1], torch.zeros(3))
    got = grads.declared_grads()
    assert torch.equal(got[0], torch.full((3,), 0.5)) and got[1] is None


@pytest.mark.parametrize("uses_input", ["in the first tile only", "never", "never, nothing trainable"])
@pytest.mark.parametrize("op", ["TiledMLP", "sequence_tiled_compute", "TiledFusedLogitsLoss"])
def test_the_input_gradient_is_written_everywhere_zeros_where_a_tile_gives_none(monkeypatch, op, uses_input):
    """The tiled Functions allocate the input's gradient uninitialised (no zero-filling pass) and each
    tile writes its whole slice: zeros where its output does not depend on its input, or requires no
    grad at all. Checked against the tiles computed by hand with plain autograd, with every
    ``torch.empty_like`` filled with NaN as reused memory may be."""
    torch.manual_seed(0)
    sl, shards, h = 7, 3, 4  # tiles of 3, 2 and 2 tokens
    w = nn.Parameter(torch.randn(h))
    frozen = uses_input == "never, nothing trainable"

    def token_wise(x):  # [.., sl_t, h] -> [.., sl_t, h]
        if uses_input == "in the first tile only" and x.shape[-2] == 3:
            return x * w
        return (w.detach() if frozen else w).expand_as(x) * 1.0

    x0, probe = torch.randn(1, sl, h), torch.randn(1, sl)  # [bs sl h], [bs sl]
    x = x0.clone().requires_grad_(True)
    tiles = [token_wise(t) for t in torch.tensor_split(x, shards, dim=1)]
    want = (torch.cat(tiles, dim=1) * probe[..., None]).sum()
    want_x_grad = torch.zeros_like(x0)
    if want.requires_grad:
        (want_x_grad,) = torch.autograd.grad(want, x, materialize_grads=True)
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: empty_like(t, **kw).fill_(float("nan")))
    x = x0.clone().requires_grad_(True)
    if op == "TiledMLP":
        got = (TiledMLP.apply(lambda module, tile: token_wise(tile), None, x, shards, [w]) * probe[..., None]).sum()
    elif op == "sequence_tiled_compute":
        out = sequence_tiled_compute(token_wise, sl, shards, {"x": x}, {}, "x", [w], 1, None)
        got = (out * probe[..., None]).sum()
    else:
        got = TiledFusedLogitsLoss.apply(lambda module, tile, p: (token_wise(tile) * p[..., None]).sum(), None, x,
                                         probe, None, shards, [w], "sum")
    got.backward()
    assert torch.allclose(got, want) and torch.equal(x.grad[0, 3:], torch.zeros(sl - 3, h))
    assert torch.allclose(x.grad, want_x_grad)


def test_the_hooks_live_only_in_the_block_and_pass_other_backwards_through():
    """The gradient hooks are gone after the tiles' block, also when a tile fails; inside it, a backward
    that is not a tile's gets the parameter's gradient untouched; a tile outside the block is refused."""
    p = nn.Parameter(torch.ones(3))
    grads = TileGrads("test", [p])
    with pytest.raises(ValueError, match="a tile failed"):
        with grads.hooked():
            assert p._backward_hooks
            (p * 2).sum().backward()
            assert torch.equal(p.grad, torch.full((3,), 2.0))
            raise ValueError("a tile failed")
    assert not p._backward_hooks
    with pytest.raises(RuntimeError, match="hooked"):
        grads.backprop((p * 2).sum(), torch.tensor(1.0))


def test_users_hooks_are_set_aside_for_the_tiles_and_put_back_in_order_with_any_added_meanwhile():
    """A user's hook does not see the tiles' gradients; afterwards it runs first again, a hook registered
    during the block (fn could) is kept after it, and the user's handles still remove theirs."""
    p = nn.Parameter(torch.ones(3))
    seen = []
    users = p.register_hook(lambda g: seen.append("user") or g * 2)
    grads = TileGrads("test", [p])
    with grads.hooked():
        grads.backprop((p * 3).sum(), torch.tensor(1.0))
        added = p.register_hook(lambda g: seen.append("added"))
    (total,) = grads.declared_grads()
    assert seen == [] and torch.equal(total, torch.full((3,), 3.0))
    p.sum().backward()
    assert seen == ["user", "added"] and torch.equal(p.grad, torch.full((3,), 2.0))
    users.remove()
    added.remove()
    assert not p._backward_hooks


def test_a_tile_output_that_is_itself_an_undeclared_leaf_gets_its_gradient():
    """fn may return a trainable leaf as it is (no graph behind it): its gradient is still summed."""
    declared, returned = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    grads = TileGrads("test", [declared])
    with grads.hooked():
        for weight in (1.0, 0.5):
            grads.backprop(returned, torch.full((3,), 2.0), weight=weight)
    grads.write_undeclared()
    assert torch.equal(returned.grad, torch.full((3,), 3.0))
    assert grads.declared_grads() == [None]


def _three_tiles(layer, keep):
    """The gradient of the weight p (ones) of `layer` (x @ w or F.linear(x, w), w = p + 0) summed over
    three tiles of `(layer(x_t)).sum()` with x_t = 1, 2, 3 (ones [4, 3]); `keep(grad)` is a hook on w,
    which sees the very tensor autograd then hands p (`+ 0` passes its gradient through)."""
    p = nn.Parameter(torch.ones(2, 3) if layer == "linear" else torch.ones(3, 2))
    grads = TileGrads("test", [p])
    with grads.hooked():
        for value in (1.0, 2.0, 3.0):
            x, w = torch.full((4, 3), value), p + 0
            w.register_hook(keep)
            grads.backprop((nn.functional.linear(x, w) if layer == "linear" else x @ w).sum(), torch.tensor(1.0))
    return p, grads.declared_grads()[0]


@pytest.mark.parametrize("layer", ["matmul", "linear"])
def test_a_first_gradient_nothing_else_holds_becomes_the_sum_without_a_copy(layer):
    """A weight gradient (nn.Linear's is a view of a base only it holds) is held by nothing but the sum
    once its tile is done: later tiles add into it in place (no parameter-sized copy), as autograd's
    accumulation into .grad does."""
    addresses = []
    p, total = _three_tiles(layer, lambda grad: addresses.append(grad.data_ptr()))
    assert torch.equal(total, torch.full(p.shape, 24.0))
    assert total.data_ptr() == addresses[0]


@pytest.mark.parametrize("layer, keep", [
    ("matmul", lambda grad: grad), ("matmul", lambda grad: grad.detach()), ("matmul", lambda grad: grad[0]),
    ("linear", lambda grad: grad), ("linear", lambda grad: grad._base), ("linear", lambda grad: grad._base[0])],
    ids=["the tensor", "an alias of its memory", "a view", "a view: the tensor", "a view: its base",
         "a view: a view of its base"])
def test_a_first_gradient_someone_else_holds_is_copied_before_later_tiles_add_to_it(layer, keep):
    """A hook that keeps the gradient (or a tensor on its memory) must see it unchanged."""
    kept = []
    p, total = _three_tiles(layer, lambda grad: kept.append(keep(grad)))
    assert torch.equal(total, torch.full(p.shape, 24.0))
    assert torch.equal(kept[0], torch.full(kept[0].shape, 4.0))
    assert total.data_ptr() != kept[0].data_ptr()


def test_a_first_gradient_of_a_tensor_subclass_is_copied():
    """A subclass keeps its memory in inner tensors the holder counts do not see (here one a hook kept)."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    p = nn.Parameter(torch.ones(3, 2))
    kept = []
    grads = TileGrads("test", [p])
    with grads.hooked():
        for value in (1.0, 2.0, 3.0):
            w = p + 0
            w.register_hook(lambda grad: kept.append(grad.a))
            grads.backprop(torch.full((4, 3), value) @ w, two_tensor.TwoTensor(torch.ones(4, 2), torch.ones(4, 2)))
    total = grads.declared_grads()[0]
    assert torch.equal(total.a, torch.full((3, 2), 24.0)) and torch.equal(total.b, torch.full((3, 2), 24.0))
    assert torch.equal(kept[0], torch.full((3, 2), 4.0))


def test_one_gradient_autograd_hands_to_two_parameters_is_summed_for_each():
    """`p + q` hands both the same gradient tensor: one sum may keep it, the other must copy it first."""
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    grads = TileGrads("test", [p, q])
    with grads.hooked():
        for value in (1.0, 2.0, 3.0):
            grads.backprop((torch.full((3,), value) * (p + q)).sum(), torch.tensor(1.0))
    got = grads.declared_grads()
    assert torch.equal(got[0], torch.full((3,), 6.0)) and torch.equal(got[1], torch.full((3,), 6.0))
    assert got[0].data_ptr() != got[1].data_ptr()


class _SumsSeenInBackward(torch.autograd.Function):
    """Identity whose backward records whether the first parameter's sum already holds a gradient."""

    @staticmethod
    def forward(ctx, x, grads, seen):
        ctx.grads, ctx.seen = grads, seen
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append(ctx.grads.sums[0].total is not None)
        return grad, None, None


def test_a_parameter_gradient_is_summed_as_soon_as_autograd_has_it():
    """The tile's backward reaches `first` before the rest of the graph: its gradient must be in the sum
    by then, not held by autograd.grad until the tile's whole backward ends (one more parameter-sized
    buffer per parameter at the tile's peak)."""
    first, second = nn.Parameter(torch.full((4,), 2.0)), nn.Parameter(torch.full((4,), 3.0))
    tile = torch.ones(4, requires_grad=True)
    grads, seen = TileGrads("test", [first, second]), []
    with grads.hooked():
        for _ in range(2):
            out = (first * _SumsSeenInBackward.apply(second * tile, grads, seen)).sum()
            grads.backprop(out, torch.tensor(1.0), tile, torch.empty(4))
    assert seen == [True, True]
    got = grads.declared_grads()
    assert torch.equal(got[0], torch.full((4,), 6.0)) and torch.equal(got[1], torch.full((4,), 4.0))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # the forward's no-grad tiles
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("name", ["TiledMLP", "sequence_tiled_compute", "TiledFusedLogitsLoss"])
def test_checkpointing_inside_fn_is_exact_non_reentrant_and_refused_by_name_reentrant(name, reentrant):
    """A reentrant checkpoint's parameters are not in the tile's graph (its backward is a plain backward of
    its own): refused before any gradient is written. Non-reentrant checkpointing is in the graph: exact."""
    torch.manual_seed(0)
    mlp, head = GatedMLP(), nn.Linear(16, 11)
    x = torch.randn(2, 7, 16, requires_grad=True)
    labels = torch.randint(0, 11, (2, 7))
    w = torch.randn(2, 7, 16)

    def checkpointed(fn):
        return lambda *args: checkpoint(fn, *args, use_reentrant=reentrant)

    if name == "TiledFusedLogitsLoss":
        inputs = [x, *head.parameters()]
        want = grads_of(mean_ce(head, x.reshape(-1, 16), labels.reshape(-1)), inputs)  # the tiles are [n_t, h]

        def loss():
            return TiledFusedLogitsLoss.apply(checkpointed(mean_ce), head, x, labels, None, 3, None, "mean")
    else:
        inputs = [x, *mlp.parameters()]
        want = grads_of((mlp(x) * w).sum(), inputs)
        per_tile = checkpointed(mlp_fn)

        def loss():
            if name == "TiledMLP":
                return (TiledMLP.apply(per_tile, mlp, x, 3, None) * w).sum()
            return (sequence_tiled_compute(lambda hidden: per_tile(mlp, hidden), 7, 3, {"hidden": x}, {}, "hidden",
                                           list(mlp.parameters()), 1, None) * w).sum()

    if reentrant:
        with pytest.raises(ValueError, match=f"{name}: fn runs torch.utils.checkpoint with use_reentrant=True.*"
                                             "pass use_reentrant=False"):
            loss().backward()
        assert all(t.grad is None for t in inputs)
    else:
        assert_close(grads_of(loss(), inputs), want, "grad")

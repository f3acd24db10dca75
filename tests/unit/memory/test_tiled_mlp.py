"""TiledMLP equals the untiled MLP in plain PyTorch (values and every gradient), and DeepSpeed's TiledMLP
on the same inputs; its parameter gradients reach autograd once per backward. Tolerances: helpers.TOL.
"""

import contextlib

import pytest
import torch
from deepspeed.runtime.sequence_parallel import ulysses_sp as deepspeed_alst
from torch import nn

from ds_ulysses.memory import AutogradComputeMLP, TiledMLP

from .helpers import SPLITS, TOL, GatedMLP, LoraLinear, assert_close, count_accumulations, grads_of, mlp_fn, rel, \
    tile_sizes


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("sl,shards", SPLITS)
def test_matches_untiled(bs, sl, shards):
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


class DeepSpeedStyleMLP(GatedMLP):
    """TiledMLP called from the MLP's own forward with explicit compute_params, DeepSpeed's pattern."""

    def __init__(self, tiled_mlp, shards):
        super().__init__()
        self.tiled_mlp, self.shards = tiled_mlp, shards

    def forward(self, x):
        params = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
        return self.tiled_mlp.apply(GatedMLP.forward, self, x, self.shards, params)


@pytest.mark.parametrize("bs,sl,shards", [(1, 125, 4), (2, 125, 4), (2, 8, 2)])
def test_matches_deepspeed_called_from_the_mlp_forward(bs, sl, shards):
    torch.manual_seed(0)
    ours, theirs = DeepSpeedStyleMLP(TiledMLP, shards), DeepSpeedStyleMLP(deepspeed_alst.TiledMLP, shards)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(bs, sl, 16, requires_grad=True)
    w = torch.randn(bs, sl, 16)
    want_y = theirs(x)
    want = grads_of(0.5 * (want_y * w).sum(), [x, *theirs.parameters()])
    got_y = ours(x)
    got = grads_of(0.5 * (got_y * w).sum(), [x, *ours.parameters()])
    assert rel(got_y, want_y) <= TOL
    assert_close(got, want, "grad")


@pytest.mark.parametrize("shape", [(1, 9, 16), (2, 5, 16), (7, 16)])
def test_autograd_compute_mlp_matches_deepspeed_s_and_the_plain_mlp(shape):
    """DeepSpeed's AutogradComputeMLP recomputes ``fn`` in backward on ``x`` as it came: so does ours, with
    the values and gradients of the plain MLP and of DeepSpeed's on the same inputs."""
    torch.manual_seed(0)
    mlp = GatedMLP()
    seen = {"ours": [], "deepspeed": []}
    x = torch.randn(*shape, requires_grad=True)
    w = torch.randn(*shape)
    inputs = [x, *mlp.parameters()]
    want_y = mlp(x)
    want = grads_of((want_y * w).sum(), inputs)
    for name, lib in (("ours", AutogradComputeMLP), ("deepspeed", deepspeed_alst.AutogradComputeMLP)):
        y = lib.apply(lambda m, t, shapes=seen[name]: shapes.append(tuple(t.shape)) or GatedMLP.forward(m, t), mlp, x)
        got = grads_of((y * w).sum(), inputs)
        assert rel(y, want_y) <= TOL
        assert_close(got, want, "grad")
    assert seen["ours"] == seen["deepspeed"] == [shape, shape]


@pytest.mark.parametrize("sl,shards", SPLITS + [(7, 4)])
def test_tile_sizes_follow_tensor_split(sl, shards):
    seen = []
    TiledMLP.apply(lambda m, t: seen.append(t.shape[-2]) or t, None, torch.randn(2, sl, 3), shards, [])
    assert seen == tile_sizes(sl, shards)


@pytest.mark.parametrize("bs,sl,shards", [(1, 8, 4), (2, 6, 3), (2, 5, 4)])
def test_backward_recomputes_on_flattened_token_tiles_as_deepspeed_does(bs, sl, shards):
    seen = {"ours": [], "deepspeed": []}
    for name, lib in (("ours", TiledMLP), ("deepspeed", deepspeed_alst.TiledMLP)):
        x = torch.randn(bs, sl, 3, requires_grad=True)
        lib.apply(lambda _m, t, shapes=seen[name]: shapes.append(tuple(t.shape)) or t * 2, None, x, shards,
                  []).sum().backward()
        assert torch.equal(x.grad, torch.full_like(x, 2.0))
    assert seen["ours"][shards:] == [(n, 3) for n in tile_sizes(bs * sl, shards)]
    if sl % shards == 0:  # DeepSpeed's torch.chunk and our tensor_split agree on even splits
        assert seen["ours"] == seen["deepspeed"]


def test_2d_input_and_stacked_mlps():
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


def test_input_without_grad_still_trains_params():
    torch.manual_seed(0)
    mlp = GatedMLP()
    x = torch.randn(2, 5, 16)
    want = grads_of(mlp(x).pow(2).sum(), list(mlp.parameters()))
    got = grads_of(TiledMLP.apply(mlp_fn, mlp, x, 2, None).pow(2).sum(), list(mlp.parameters()))
    assert_close(got, want, "param grad")


def test_lora_params_found_and_accumulated_once_from_the_outer_backward():
    torch.manual_seed(0)
    module = LoraLinear()
    x = torch.randn(2, 7, 16, requires_grad=True)
    trainable = [module.lora_a, module.lora_b]
    want = grads_of(module(x).pow(2).sum(), [x, *trainable])
    counts, handles = count_accumulations(trainable)
    got = grads_of(TiledMLP.apply(mlp_fn, module, x, 3, None).pow(2).sum(), [x, *trainable])
    for handle in handles:
        handle.remove()
    assert all(c == [1] for c in counts.values())  # not once per tile: ZeRO reduces from this hook
    assert module.base.weight.grad is None
    assert not hasattr(module.lora_a, "ds_grad_is_ready")
    assert_close(got, want, "grad")


def test_undeclared_parameters_get_exact_gradients_without_hooks_and_are_refused_with_them():
    torch.manual_seed(0)
    mlp = GatedMLP()
    x = torch.randn(2, 7, 16, requires_grad=True)
    inputs = [x, *mlp.parameters()]
    want = grads_of(mlp(x).pow(2).sum(), inputs)
    got = grads_of(TiledMLP.apply(mlp_fn, mlp, x, 3, [mlp.up_proj.weight]).pow(2).sum(), inputs)
    assert_close(got, want, "grad")

    _, handles = count_accumulations([mlp.gate_proj.weight])  # stands in for ZeRO's hook
    y = TiledMLP.apply(mlp_fn, mlp, x, 3, [mlp.up_proj.weight, mlp.down_proj.weight])
    with pytest.raises(ValueError, match=r"TiledMLP: fn uses gate_proj.weight \[40, 16\], which requires grad"):
        y.sum().backward()
    handles[0].remove()

    handle = mlp.gate_proj.weight.register_hook(lambda g: g * 0.5)  # per tile it could not be served exactly
    y = TiledMLP.apply(mlp_fn, mlp, x, 3, [mlp.up_proj.weight, mlp.down_proj.weight])
    with pytest.raises(ValueError, match=r"TiledMLP: fn uses gate_proj.weight \[40, 16\], which requires grad"):
        y.sum().backward()
    handle.remove()


@pytest.mark.parametrize("hook", [lambda g: g * 0.5, lambda g: g.clamp(max=0.05)], ids=["halving", "clamping"])
@pytest.mark.parametrize("impl", ["untiled", "ours", "deepspeed"])
def test_a_users_gradient_hook_on_a_declared_parameter_runs_once_on_the_summed_gradient(impl, hook):
    """As without tiles: once per backward, on the gradient summed over the tiles. Run per tile and then
    on the sum again it would quarter a gradient the hook halves. DeepSpeed runs it once per tile: the
    same for a linear hook, not for a clamp."""
    torch.manual_seed(0)
    mlp = DeepSpeedStyleMLP(deepspeed_alst.TiledMLP if impl == "deepspeed" else TiledMLP, 4)
    x = torch.randn(2, 9, 16, requires_grad=True)
    w = torch.randn(2, 9, 16)
    want = grads_of((GatedMLP.forward(mlp, x) * w).sum(), [x, *mlp.parameters()])
    calls = []
    handle = mlp.up_proj.weight.register_hook(lambda g: calls.append(1) or hook(g))
    got = grads_of(((GatedMLP.forward(mlp, x) if impl == "untiled" else mlp(x)) * w).sum(), [x, *mlp.parameters()])
    handle.remove()
    want[2] = hook(want[2])  # [x, gate, up, down]
    if impl == "deepspeed" and hook(torch.ones(())) != 0.5:
        assert rel(got[2], want[2]) > TOL  # the clamp applied to each tile's part
        return
    assert_close(got, want, "grad")
    assert len(calls) == (4 if impl == "deepspeed" else 1)
    assert not mlp.up_proj.weight._backward_hooks and not mlp.gate_proj.weight._backward_hooks


def test_auto_shards_and_bad_inputs():
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
    with pytest.raises(ValueError, match=r"fn must map a \[\.\.\., 3, h\] tile to one tensor \[\.\.\., 3, h_out\], "
                                         r"got tuple"):
        TiledMLP.apply(lambda m, t: (m(t), None), mlp, x, 3, None)
    with pytest.raises(ValueError, match="compute_params must be a list of the parameters fn uses, or None"):
        TiledMLP.apply(mlp_fn, mlp, x, 3, [nn.Linear(2, 2)])


def test_parameters_get_their_gradients_when_the_input_needs_none():
    """Everything before the MLP frozen (LoRA on the MLP only, say): the MLP's weights still train.
    DeepSpeed's TiledMLP returns an output that does not require grad there, so they get none."""
    torch.manual_seed(0)
    mlp = GatedMLP()
    x, w = torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    want = grads_of((mlp(x) * w).sum(), list(mlp.parameters()))
    got = grads_of((TiledMLP.apply(mlp_fn, mlp, x, 3, None) * w).sum(), list(mlp.parameters()))
    assert_close(got, want, "grad")


class _Store:
    """Where a model keeps what its blocks record during a call (Transformers' output collector, in small):
    ``recorded`` is a list while a call records, None otherwise."""

    recorded = None


class _RoutedMLP(GatedMLP):
    """A MoE-like block: its router scales the MLP's output and records its logits in the store, one row per
    token, as Transformers' hooks record a router's output."""

    def __init__(self, store):
        super().__init__()
        self.router = nn.Linear(16, 4, bias=False)
        self.store = store

    def forward(self, x):
        logits = self.router(x.reshape(-1, 16))  # [n, 4]
        if self.store.recorded is not None:
            self.store.recorded.append(logits)
        scale = torch.softmax(logits, -1).max(-1).values.reshape(*x.shape[:-1], 1)
        return super().forward(x) * scale


class _StoreSide:
    """TiledMLP's side for _Store: the recordings of the calls inside, taken from the store (from a store of
    its own in backward, where no call records)."""

    def __init__(self, store):
        self.store = store

    @contextlib.contextmanager
    def recording(self, backward):
        saved = self.store.recorded
        if backward:
            self.store.recorded = []
        elif saved is None:
            yield []
            return
        start, got = len(self.store.recorded), []
        try:
            yield got
        finally:
            got.extend(self.store.recorded[start:])
            del self.store.recorded[start:]
            self.store.recorded = saved if backward else self.store.recorded

    def keep(self, tensors):
        self.store.recorded.extend(tensors)


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("sl,shards", [(8, 1), (8, 4), (7, 3), (5, 4)])
def test_side_outputs_reach_the_model_joined_in_token_order_and_carry_their_gradient(bs, sl, shards):
    """A block's recorded router logits: one tensor per site, batch-major token order, as the untiled block
    records them; a loss on them gives the router, the MLP and the input the untiled block's gradients."""
    torch.manual_seed(0)
    store = _Store()
    mlp = _RoutedMLP(store)
    x = torch.randn(bs, sl, 16, requires_grad=True)
    w, c = torch.randn(bs, sl, 16), torch.randn(bs * sl, 4)
    inputs = [x, *mlp.parameters()]

    def loss_of(y, recorded):
        assert len(recorded) == 1
        return (y * w).sum() + (torch.softmax(recorded[0], -1) * c).sum()

    store.recorded = []
    want_y = mlp(x)
    want_recorded, store.recorded = store.recorded, None
    want = grads_of(loss_of(want_y, want_recorded), inputs)

    store.recorded = []
    got_y = TiledMLP.apply(lambda m, t: m(t), mlp, x, shards, None, _StoreSide(store))
    got_recorded, store.recorded = store.recorded, None
    assert rel(got_recorded[0], want_recorded[0]) <= TOL and got_recorded[0].grad_fn is not None
    assert rel(got_y, want_y) <= TOL
    assert_close(grads_of(loss_of(got_y, got_recorded), inputs), want, "grad")


def test_side_outputs_that_differ_between_tiles_are_refused():
    store = _Store()
    mlp = _RoutedMLP(store)
    calls = []

    def fn(m, t):  # records only in its first tile
        calls.append(1)
        return m(t) if len(calls) == 1 else GatedMLP.forward(m, t)

    store.recorded = []
    with pytest.raises(ValueError, match=r"the tiles of one call recorded \[0, 1\] side outputs; expected the same "
                                         "recording sites in every tile"):
        TiledMLP.apply(fn, mlp, torch.randn(1, 8, 16, requires_grad=True), 2, None, _StoreSide(store))


def test_without_a_side_a_recorded_output_carries_no_gradient_as_in_deepspeed_s():
    """What the side is for: without it the block's recording is made without autograd (DeepSpeed's TiledMLP
    the same), so a loss on it would train nothing."""
    store = _Store()
    mlp = _RoutedMLP(store)
    for lib in (TiledMLP, deepspeed_alst.TiledMLP):
        store.recorded = []
        lib.apply(lambda m, t: m(t), mlp, torch.randn(1, 8, 16, requires_grad=True), 2, list(mlp.parameters()))
        assert len(store.recorded) == 2 and all(not r.requires_grad for r in store.recorded)
    store.recorded = None

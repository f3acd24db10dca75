"""Tiled norms (:mod:`ds_ulysses.hf.norm_tiling`, :mod:`ds_ulysses.memory.rebuild`) in one process: the
decoder's norms recomputed from their input, and the tiled blocks they feed keeping the norm's input, give the
untiled model's loss and gradients (fp32: loss rel 1e-5, every gradient rel 1e-4; the same ops on the same
inputs, so in practice equal), and autograd keeps only the residual stream: two hidden-sized tensors per
layer, counted from what autograd saves. The SP and ZeRO-3 paths are in tests/integration."""

import copy

import pytest
import torch

import ds_ulysses
from ds_ulysses.hf.attention_tiling import tile_attention
from ds_ulysses.hf import norm_tiling
from ds_ulysses.hf.norm_tiling import norm_modules, tile_norms, untile_norms
from ds_ulysses.memory import tile_mlps
from ds_ulysses.memory.rebuild import kept_input, mark_rebuildable
from ds_ulysses.memory.tiled_mlp import TiledMLP

from tests.support.autograd_probes import held_after_forward
from tests.support.models import rel_err, tiny_config, tiny_model


@pytest.fixture(autouse=True)
def _uninstall():
    yield
    ds_ulysses.uninstall()


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _ids(rows=2, length=24):
    return torch.randint(0, 128, (rows, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family,norms", [
    ("llama", 5),        # RMSNorm before attention and MLP, and the final one
    ("qwen2", 5),
    ("gemma3_text", 9),  # sandwich norms (after attention and MLP too), (1 + weight) scaling, a tied head
    ("cohere", 3),       # one LayerNorm feeding attention and MLP in parallel
    ("phi", 3),          # torch's nn.LayerNorm with a bias, parallel blocks
    ("olmo2", 5),        # norms after the blocks, on their outputs
    ("stablelm", 5),     # nn.LayerNorm before each block
])
@pytest.mark.parametrize("blocks", ["untiled", "tiled"])
def test_tiled_norms_train_like_untiled(family, norms, blocks):
    extra = {"tie_word_embeddings": True} if family == "gemma3_text" else {}
    base = tiny_model(tiny_config(family, heads=4, kv_heads=2, **extra))
    model = copy.deepcopy(base)
    assert tile_norms(model) == norms == len(norm_modules(model))
    if blocks == "tiled":
        tile_mlps(model, 3)
        if family != "olmo2":  # its q/k norms span every head: tiled attention refuses it
            tile_attention(model, 1, 2)
    ids = _ids()
    want_loss, want = _loss_and_grads(base, ids)
    got_loss, got = _loss_and_grads(model, ids)
    assert rel_err(got_loss, want_loss) <= 1e-5
    assert got.keys() == want.keys()
    for name in want:
        assert rel_err(got[name], want[name]) <= 1e-4, name


def _saved_hidden(model, ids) -> list[torch.dtype]:
    """The dtypes of the distinct hidden-sized ``[rows, length, h]`` storages autograd holds for backward once
    the forward has returned (what a tiled block saves and drops inside its forward is not held)."""
    numel = ids.numel() * model.config.hidden_size
    loss, held = held_after_forward(lambda: model(input_ids=ids, labels=ids).loss)
    seen = {t.untyped_storage().data_ptr(): t.dtype for t in held
            if t.numel() == numel and t.untyped_storage().nbytes() == numel * t.element_size()}
    loss.backward()
    return list(seen.values())


class _Alias(torch.autograd.Function):
    """What ZeRO-3's module hooks do to every module output: another tensor object on the same memory."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


@pytest.mark.parametrize("dtype,aliased", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_a_layer_keeps_only_its_residual_stream(dtype, aliased):
    config = tiny_config("llama", heads=4, kv_heads=2, layers=3)
    layers, ids = config.num_hidden_layers, _ids()
    model = tiny_model(config).to(dtype)
    tile_mlps(model, 3)
    tile_attention(model, 1, 2)
    if aliased:
        for _, norm in norm_modules(model):
            norm.register_forward_hook(lambda _m, _args, out: _Alias.apply(out))
    # per layer: its input, the norm's normalised copy, the norm's output the block keeps, twice (before the
    # attention, before the MLP); the final norm's input, copy and output (lm_head keeps it); under bf16 the
    # norms' fp32 upcasts on top
    untiled = _saved_hidden(model, ids)
    assert len(untiled) >= 6 * layers + 3
    tile_norms(model)
    tiled = _saved_hidden(model, ids)
    # per layer: its input and the residual after its attention; then the final norm's input and output
    assert len(tiled) == 2 * layers + 2
    assert set(tiled) == {dtype}  # no fp32 upcast kept under bf16


def test_without_autograd_and_after_untiling_the_norms_run_their_own_forward(monkeypatch):
    base = tiny_model(tiny_config("llama", heads=4, kv_heads=2))
    model = copy.deepcopy(base)
    tile_norms(model)
    calls = []

    class Counted:
        @staticmethod
        def apply(*args):
            calls.append(1)
            return TiledMLP.apply(*args)

    monkeypatch.setattr(norm_tiling, "TiledMLP", Counted)
    ids = _ids(1, 12)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, base(input_ids=ids).logits)
    assert calls == []
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == 5
    assert untile_norms(model) == 5
    assert all("forward" not in vars(m) for _, m in norm_modules(model))


def test_a_rebuildable_input_changed_in_place_is_kept_as_it_is():
    """A marked output changed in place after it was made is not the norm of its source any more: a block
    keeps it whole, so its gradients are the ones of what it computed with."""
    x = torch.randn(3, 5, requires_grad=True)
    weight = torch.randn(5, requires_grad=True)
    fn = lambda _m, t: t * 2.0  # noqa: E731  a token-wise stand-in for a norm
    y = mark_rebuildable(fn(None, x), fn, None, x, [])
    assert kept_input(y)[0] is x
    y.mul_(3.0)
    kept, how = kept_input(y)
    assert kept is y and how is None
    out = TiledMLP.apply(lambda _m, t: t * weight, None, y, 2, [weight])
    out.sum().backward()
    torch.testing.assert_close(weight.grad, (6.0 * x).sum(0).detach())
    torch.testing.assert_close(x.grad, torch.full_like(x, 6.0) * weight.detach())


def test_the_rebuilt_input_gives_the_kept_one_gradients():
    """A block given a marked output keeps the source and rebuilds the output in backward, tile by tile."""
    x = torch.randn(2, 7, 4, requires_grad=True)
    scale = torch.randn(4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    norm = lambda _m, t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * scale  # noqa: E731
    y = TiledMLP.apply(norm, None, x, 2, [scale])
    out = TiledMLP.apply(lambda _m, t: t @ w, None, mark_rebuildable(y, norm, None, x, [scale]), 3, [w])
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    got = [t.grad.clone() for t in (x, scale, w)]
    for t in (x, scale, w):
        t.grad = None
    want_out = norm(None, x) @ w
    (want_out * torch.arange(want_out.numel()).view_as(want_out)).sum().backward()
    for g, t in zip(got, (x, scale, w)):
        torch.testing.assert_close(g, t.grad)

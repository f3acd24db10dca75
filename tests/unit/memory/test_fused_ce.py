"""linear_cross_entropy_sum against the head and loss it replaces, in plain PyTorch:
``F.cross_entropy(softcap(scale * F.linear(x, w, b)).float(), y, reduction="sum")`` and its autograd
gradients. fp32: helpers.TOL (a log-sum-exp per token instead of a log_softmax per logit, a few ulps).
bf16: 1e-2, about two bf16 ulps (2**-8 each): the soft cap's derivative is taken from the fp32 copy of
the capped logits, where autograd takes it in bf16; without a soft cap the two agree to the bit here.
"""

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ds_ulysses.memory import TiledFusedLogitsLoss, fused_ce
from ds_ulysses.memory.fused_ce import fusable_head, linear_cross_entropy_sum

from .helpers import TOL, rel

N, H, V = 37, 16, 50


def reference(x, w, b, y, scale, softcap):
    logits = F.linear(x, w, b)
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), y, ignore_index=-100, reduction="sum")


def leaves(dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    w = (2 * torch.randn(V, H, generator=g)).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    y[::5] = -100
    return x, w, b, y


@pytest.mark.parametrize("dtype,tol", [(torch.float32, TOL), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("scale,softcap", [(1.0, None), (0.0625, None), (8.0, None), (1.0, 0.5), (2.5, 30.0)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_loss_and_gradients_equal_the_head_then_cross_entropy(dtype, tol, scale, softcap, bias, chunk_rows,
                                                              monkeypatch):
    if chunk_rows is not None:  # the soft-capped path works in chunks of rows: 13 of 3, the last one short
        monkeypatch.setattr(fused_ce, "_CHUNK_ELEMENTS", chunk_rows * V)
    x, w, b, y = leaves(dtype, bias)
    params = [t for t in (x, w, b) if t is not None]
    want = reference(x, w, b, y, scale, softcap)
    want_grads = torch.autograd.grad(0.7 * want, params)  # a scaled incoming gradient, as 0.5 * loss or GAS give
    got = linear_cross_entropy_sum(x, w, b, y, scale, softcap)
    got_grads = torch.autograd.grad(0.7 * got, params)

    assert got.dtype == torch.float32
    assert rel(got, want) <= TOL
    for name, g, r in zip("xwb", got_grads, want_grads):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert rel(g.float(), r.float()) <= tol, (name, rel(g.float(), r.float()))


def test_ignored_labels_add_nothing_and_get_no_gradient():
    x, w, b, y = leaves(torch.float32, bias=True)
    y[:] = -100
    got = linear_cross_entropy_sum(x, w, b, y)
    grads = torch.autograd.grad(got, [x, w, b])
    assert got.item() == 0.0
    assert all(g.abs().max().item() == 0.0 for g in grads)


def test_an_empty_tile_is_zero_and_differentiable():
    x, w, b, _ = leaves(torch.float32, bias=False)
    empty = x[:0]
    got = linear_cross_entropy_sum(empty, w, b, torch.zeros(0, dtype=torch.long))
    gx, gw = torch.autograd.grad(got, [empty, w])
    assert got.item() == 0.0 and gx.shape == (0, H) and gw.abs().max().item() == 0.0


def test_without_grad_it_returns_the_loss_only():
    x, w, b, y = leaves(torch.float32, bias=True)
    with torch.no_grad():
        got = linear_cross_entropy_sum(x, w, b, y, 0.5, 30.0)
        want = reference(x, w, b, y, 0.5, 30.0)
    assert got.grad_fn is None and rel(got, want) <= TOL


def test_only_inputs_that_need_a_gradient_get_one():
    x, w, b, y = leaves(torch.float32, bias=True)
    frozen = w.detach()  # a frozen head (LoRA elsewhere), trained input
    got = linear_cross_entropy_sum(x, frozen, None, y)
    (gx,) = torch.autograd.grad(got, [x])
    (want,) = torch.autograd.grad(reference(x, frozen, None, y, 1.0, None), [x])
    assert rel(gx, want) <= TOL


def test_fusable_head_is_a_plain_linear_without_foreign_hooks():
    class Sub(nn.Linear):
        pass

    def deepspeed_hook(module, args):
        return None

    deepspeed_hook.__module__ = "deepspeed.runtime.zero.parameter_offload"  # what ZeRO-3's hooks carry

    assert fusable_head(nn.Linear(4, 6))
    assert not fusable_head(Sub(4, 6))  # LoRA, quantised and other heads subclass or wrap Linear
    assert not fusable_head(nn.Embedding(6, 4))
    wrapped = nn.Linear(4, 6)
    wrapped.forward = lambda x: nn.Linear.forward(wrapped, x).relu()  # Accelerate-style instance forward
    assert not fusable_head(wrapped)
    with_ds = nn.Linear(4, 6)
    with_ds.register_forward_pre_hook(deepspeed_hook)
    assert fusable_head(with_ds)
    for register in ("register_forward_hook", "register_forward_pre_hook"):
        head = nn.Linear(4, 6)
        getattr(head, register)(lambda *args: None)  # a user's hook could change the logits: keep the module call
        assert not fusable_head(head), register
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert not fusable_head(nn.Linear(4, 6))
    finally:
        handle.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale,softcap", [(1.0, None), (2.5, 30.0)])
@pytest.mark.parametrize("bias", [False, True])
def test_tiles_sharing_buffers_get_the_bits_of_fresh_ones_and_reuse_them_once_each_backward_ran(dtype, scale,
                                                                                                 softcap, bias):
    """Three tiles (the last shorter), each backpropagated before the next, as the tiled loss runs them."""
    x, w, b, y = leaves(dtype, bias)
    params = [t for t in (x, w, b) if t is not None]
    bounds = [(0, 13), (13, 26), (26, N)]

    def tiles(buffers):
        out, pointers = [], []
        for start, stop in bounds:
            loss = linear_cross_entropy_sum(x[start:stop], w, b, y[start:stop], scale, softcap, buffers=buffers)
            out.append((loss.detach(), torch.autograd.grad(loss, params)))
            pointers.append({buf.data_ptr() for buf in (buffers._buffers.values() if buffers else ())})
        return out, pointers

    fresh, _ = tiles(None)
    buffers = fused_ce.TileBuffers()
    shared, pointers = tiles(buffers)
    for (want, want_grads), (got, got_grads) in zip(fresh, shared):
        assert torch.equal(got, want) and all(torch.equal(g, r) for g, r in zip(got_grads, want_grads))
    assert pointers[0] == pointers[1] == pointers[2]  # the first tile's buffers, lent to every tile
    assert len(pointers[0]) == (1 if dtype == torch.float32 else 2)  # a bf16 head's logits and their fp32 copy


def test_a_buffer_a_live_graph_still_holds_is_not_lent_again():
    """Two tiles' forwards before either backward: the second gets a buffer of its own, both exact."""
    x, w, b, y = leaves(torch.float32, True)
    params = [x, w, b]
    buffers = fused_ce.TileBuffers()
    first = linear_cross_entropy_sum(x[:20], w, b, y[:20], buffers=buffers)
    held = buffers._buffers[torch.float32].data_ptr()
    second = linear_cross_entropy_sum(x[20:], w, b, y[20:], buffers=buffers)
    assert buffers._buffers[torch.float32].data_ptr() != held
    got = torch.autograd.grad(first + 2 * second, params)
    want = torch.autograd.grad(reference(x[:20], w, b, y[:20], 1.0, None) + 2 * reference(x[20:], w, b, y[20:], 1.0,
                                                                                           None), params)
    for g, r in zip(got, want):
        assert rel(g, r) <= TOL


class _LiveShapes(TorchDispatchMode):
    """The most tensors of ``shape`` that ops allocated and that were alive at once (weak references)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.live, self.most = torch.Size(shape), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        for t in pytree.tree_leaves(out):
            if torch.is_tensor(t) and t.shape == self.shape and t.untyped_storage().data_ptr() not in ins:
                self.live += 1
                self.most = max(self.most, self.live)
                weakref.finalize(t.untyped_storage(), self._freed)
        return out

    def _freed(self):
        self.live -= 1


@pytest.mark.parametrize("tied", [False, True])
def test_the_tiled_loss_sums_the_head_gradient_in_place_one_vocab_by_hidden_tensor_at_a_time(tied):
    """Each tile's ``[V, h]`` head gradient goes into the tiles' running sum (addmm_), not beside it; the sum is
    the gradient the untiled head and cross-entropy give (a head tied to an embedding too)."""
    torch.manual_seed(0)
    vocab, hidden, n = 50, 8, 40
    head, embed = nn.Linear(hidden, vocab, bias=False), nn.Embedding(vocab, hidden)
    if tied:
        head.weight = embed.weight
    ids, y = torch.randint(0, vocab, (n,)), torch.randint(0, vocab, (n,))

    def loss_fn(module, x, labels):
        return linear_cross_entropy_sum(x, module.weight, None, labels)

    want = F.cross_entropy(head(embed(ids) * 1.5), y, reduction="sum")
    want_grad = torch.autograd.grad(want, head.weight)[0]
    hidden_states = embed(ids) * 1.5
    with _LiveShapes((vocab, hidden)) as live:  # the tiled loss computes its gradients in forward, tile by tile
        got = TiledFusedLogitsLoss.apply(loss_fn, head, hidden_states, y, None, 4, None, "sum")
    assert live.most == 1  # the sum alone, where a tile's own [V, h] beside it made two
    got_grad = torch.autograd.grad(got, head.weight)[0]
    assert rel(got, want) <= TOL and rel(got_grad, want_grad) <= TOL

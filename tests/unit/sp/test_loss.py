"""The SP loss: a global token mean on every rank, exact in backward, and its label checks."""

import pytest
import torch
import torch.nn.functional as F

from ds_ulysses import sp_loss_from_logits
from tests.support.models import VOCAB


def test_labels_out_of_vocab_in_the_loss_name_the_count_and_the_vocabulary():
    logits = torch.randn(1, 4, VOCAB)
    with pytest.raises(ValueError, match=rf"shift_labels out of range: 2 label\(s\) in this batch are neither "
                                         rf"-100 nor in \[0, {VOCAB}\)"):
        sp_loss_from_logits(logits, torch.tensor([[1, VOCAB, -7, -100]]))
    with pytest.raises(ValueError, match="shift_labels out of range: 4 label"):  # float labels: none usable
        sp_loss_from_logits(logits, torch.zeros(1, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_from_logits_is_cross_entropy_and_keeps_no_tensor_of_the_logits_size(monkeypatch, dtype):
    """``logits_cross_entropy_sum`` against ``F.cross_entropy(logits.float(), reduction="sum")`` (ignored
    labels, several chunks of rows, an incoming gradient other than 1): the same loss and logits gradient.
    What autograd keeps for its backward: the logits themselves and per-token vectors, where
    ``log_softmax`` keeps an ``[n V]`` output of its own (so the loss can sit beside a caller's own loss on
    the same logits at no extra ``[n V]``)."""
    from ds_ulysses.sp import loss as loss_mod

    monkeypatch.setattr(loss_mod, "_CHUNK_ELEMENTS", 3 * VOCAB)  # 3 rows per chunk
    torch.manual_seed(0)
    n = 20
    logits = (torch.randn(n, VOCAB) * 4).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (n,))
    labels[::3] = -100

    def run(fn):
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fn(logits, labels)
        (loss * 0.37).backward()
        grad, logits.grad = logits.grad, None
        big = [t for t in saved if t.numel() >= n * VOCAB]
        return loss.detach(), grad, [t.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr() for t in big]

    ours, our_grad, our_big = run(loss_mod.logits_cross_entropy_sum)
    ref, ref_grad, ref_big = run(lambda z, y: F.cross_entropy(z.float(), y, ignore_index=-100, reduction="sum"))
    assert ours.dtype == torch.float32 and torch.allclose(ours, ref, rtol=1e-6)
    assert our_grad.dtype == dtype
    torch.testing.assert_close(our_grad.float(), ref_grad.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-6 if dtype == torch.float32 else 1e-3)
    assert not our_grad[::3].any()  # ignored rows get no gradient
    assert our_big == [True]  # the logits, not a copy
    assert False in ref_big  # autograd keeps an [n V] tensor of its own (the check can tell)

"""check_batch: every bad batch refused with what was expected, what came in and the fix."""

import pytest
import torch

from ds_ulysses.sp.batch_check import check_batch
from ds_ulysses.sp.data import prepare_sample
from tests.support.models import VOCAB


def _ids(*shape, high=VOCAB):
    return torch.randint(0, high, shape)


def _batch(**over):
    batch = {"input_ids": _ids(2, 6), "labels": _ids(2, 6), "position_ids": torch.arange(6).expand(2, 6).clone()}
    batch.update(over)
    return {k: v for k, v in batch.items() if v is not None}


BAD_BATCHES = [
    ("not a dict", [torch.ones(2, 6)], "each batch must be a dict of tensors"),
    ("non-str key", {**_batch(), 3: torch.ones(2, 6)}, "batch keys must be strings, got 3"),
    ("3-d input_ids", _batch(input_ids=torch.ones(2, 6, 1, dtype=torch.long)),
     r"needs a tensor 'input_ids' of shape \[bs, sl\]; got shape \[2, 6, 1\]"),
    ("float input_ids", _batch(input_ids=torch.ones(2, 6)), "'input_ids' must be an integer tensor, got torch.float32"),
    ("empty sequence", _batch(input_ids=torch.ones(2, 0, dtype=torch.long), labels=None, position_ids=None),
     "input_ids is empty"),
    ("batch dim mismatch", _batch(labels=_ids(1, 6)),
     r"must share the batch size on dim 0.*'labels' has shape \[1, 6\]"),
    ("labels and shift_labels", _batch(shift_labels=_ids(2, 6)), "both 'labels' and 'shift_labels'"),
    ("token id >= vocab", _batch(input_ids=torch.full((2, 6), VOCAB)),
     rf"'input_ids' has a value out of range: expected \[0, {VOCAB}\), got {VOCAB}"),
    ("negative token id", _batch(input_ids=torch.full((2, 6), -1)), "'input_ids' has a value out of range"),
    ("label >= vocab", _batch(labels=torch.full((2, 6), 500)),
     rf"'labels' has a value out of range: expected -100 or \[0, {VOCAB}\), got 500"),
    ("label -5", _batch(labels=torch.full((2, 6), -5)), "'labels' has a value out of range.*got -5"),
    ("float labels", _batch(labels=torch.zeros(2, 6)), "'labels' must be an integer tensor"),
    ("3-d position_ids", _batch(position_ids=torch.zeros(2, 6, 1, dtype=torch.long)),
     r"position_ids must have shape \[bs, sl\] or \[1, sl\] = \[2, 6\] or \[1, 6\]; got \[2, 6, 1\]"),
    ("float position_ids", _batch(position_ids=torch.zeros(2, 6)), "'position_ids' must be an integer tensor"),
    ("negative position_ids", _batch(position_ids=torch.full((2, 6), -3)),
     "'position_ids' has a value out of range: expected >= 0, got -3"),
    ("hole", _batch(attention_mask=torch.tensor([[1] * 6, [0, 1, 1, 0, 1, 1]])),
     r"attention_mask has padding between real tokens \(row 1, token 3\)"),
    ("labelled padding", _batch(attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6]),
                                labels=torch.tensor([[1, 2, 3, 4, -100, 7], [1] * 6])),
     "attention_mask marks token 4 of row 0 as padding, but the label it predicts .* is 7, not -100"),
    ("labelled padding, shifted", _batch(attention_mask=torch.tensor([[1, 1, 1, 0, 0, 0]] * 2), labels=None,
                                         shift_labels=torch.tensor([[1, 2, -100, -100, 5, -100]] * 2)),
     "marks token 4 of row 0 as padding, but the label it predicts .* is 5"),
]


@pytest.mark.parametrize("batch,phrase", [c[1:] for c in BAD_BATCHES], ids=[c[0] for c in BAD_BATCHES])
def test_bad_batch_is_refused_with_its_reason(batch, phrase):
    with pytest.raises(ValueError, match=phrase):
        check_batch(batch, VOCAB)
    if isinstance(batch, dict) and 3 not in batch:
        with pytest.raises(ValueError, match=phrase):  # the adapter's entry point says the same
            prepare_sample(batch, 2, vocab_size=VOCAB)


def test_left_padding_is_accepted_with_its_last_pad_predicting_the_first_real_token():
    """Left padding attends to nothing under SP, as the padding mask makes it without SP: its predictions are
    the unsharded model's, so the last pad may predict the first real token (the collator labels it so)."""
    labels = torch.tensor([[-100, -100, 3, 4, 5, 6], [1] * 6])
    check_batch(_batch(attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]), labels=labels), VOCAB)
    check_batch(_batch(attention_mask=torch.tensor([[0, 1, 1, 1, 0, 0], [1] * 6]),
                       labels=torch.tensor([[-100, 2, 3, 4, -100, -100], [1] * 6])), VOCAB)


def test_right_padding_and_broadcast_positions_are_accepted():
    labels = torch.tensor([[1, 2, 3, 4, 5, -100], [1] * 6])  # the label the pad at 5 predicts is appended: -100
    check_batch(_batch(attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6]), labels=labels,
                       position_ids=torch.arange(6)[None]), VOCAB)

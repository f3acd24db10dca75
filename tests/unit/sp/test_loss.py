"""The SP loss: a global token mean on every rank, exact in backward, and its label checks."""

import pytest
import torch

from ds_ulysses import sp_loss_from_logits
from tests.support.models import VOCAB


def test_labels_out_of_vocab_in_the_loss_name_the_count_and_the_vocabulary():
    logits = torch.randn(1, 4, VOCAB)
    with pytest.raises(ValueError, match=rf"shift_labels out of range: 2 label\(s\) in this batch are neither "
                                         rf"-100 nor in \[0, {VOCAB}\)"):
        sp_loss_from_logits(logits, torch.tensor([[1, VOCAB, -7, -100]]))
    with pytest.raises(ValueError, match="shift_labels out of range: 4 label"):  # float labels: none usable
        sp_loss_from_logits(logits, torch.zeros(1, 4))

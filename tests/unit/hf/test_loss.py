"""The SP loss on a Transformers model: shift_labels win over labels, and a model whose own loss adds
a term the SP loss would drop is refused by name. Single process (no SP group): the SP loss is then
the plain token mean, checked against cross-entropy on the model's own logits."""

import pytest
import torch
import torch.nn.functional as F

from ds_ulysses import enable_sp_loss, tiled_causal_lm_loss
from tests.support.models import rel_err, tiny_config, tiny_model


@pytest.mark.parametrize("loss_fn", [None, tiled_causal_lm_loss(3)], ids=["logits", "tiled"])
def test_a_batch_with_labels_and_shift_labels_trains_on_shift_labels(loss_fn):
    model = tiny_model(tiny_config("cohere", logit_scale=0.5))
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    shift = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    want = F.cross_entropy(logits.flatten(0, 1), shift.flatten(), ignore_index=-100)
    enable_sp_loss(model, loss_fn=loss_fn)
    with torch.no_grad():
        got = model(input_ids=ids, labels=ids, shift_labels=shift).loss
    assert rel_err(got, want) <= 1e-6


def test_a_router_load_balancing_loss_is_refused():
    model = tiny_model(tiny_config("mixtral", num_local_experts=2, num_experts_per_tok=1, output_router_logits=True))
    with pytest.raises(ValueError, match="output_router_logits=True: the model adds a router load-balancing loss.*"
                                         "fix: set config.output_router_logits = False"):
        enable_sp_loss(model)

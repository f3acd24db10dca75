"""logits_transform: what a model does to its logits after lm_head, measured by running the model's own
forward on a probe, and reproduced exactly by the tiled loss; anything else refused by name.

Reference: the model's own ``forward(...).logits`` on real inputs. fp32, so a recognised transform
reproduces the model's logits to rounding (1e-6 relative)."""

import pytest
import torch
from transformers import LlamaForCausalLM

from ds_ulysses.hf.head import LogitsTransform, logits_transform
from tests.support.models import rel_err, tiny_config, tiny_model

CASES = [("llama", {}, None),
         ("cohere", {"logit_scale": 0.0625}, LogitsTransform(scale=0.0625)),
         ("cohere2", {"logit_scale": 0.25}, LogitsTransform(scale=0.25)),
         ("granite", {"logits_scaling": 8.0}, LogitsTransform(scale=0.125)),
         ("gemma3_text", {"final_logit_softcapping": 0.5}, LogitsTransform(softcap=0.5))]


@pytest.mark.parametrize("family,extra,expected", CASES, ids=[c[0] for c in CASES])
def test_the_model_s_own_transform_is_found_and_reproduces_its_logits(family, extra, expected):
    model = tiny_model(tiny_config(family, **extra))
    transform = logits_transform(model)
    assert transform == expected
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
        got = model.get_output_embeddings()(hidden)
        got = transform(got) if transform is not None else got
    assert rel_err(got, want) <= 1e-6


class _Shifted(LlamaForCausalLM):
    """A head transform of a form ds_ulysses does not know (a constant added to every logit)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits + 1.0
        return out


def test_an_unknown_transform_is_refused_with_the_model_type_and_the_fix():
    torch.manual_seed(0)
    model = _Shifted(tiny_config("llama")).float()
    with pytest.raises(ValueError, match=r"the tiled loss cannot serve 'llama' exactly: its forward transforms the "
                                         r"logits after lm_head.*fix: set \"tiled_loss\": \{\"enabled\": false\}"):
        logits_transform(model)

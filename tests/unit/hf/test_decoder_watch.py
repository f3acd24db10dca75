"""The decoder's forward hooks under SP: a forward that never reaches the SP attention is refused. The
position_ids the pre-forward hook judges are tested through whole models in tests/integration/test_failures.py,
its eval-mode shard refusal in tests/integration/test_accelerate.py."""

import torch

from ds_ulysses import UlyssesSPAttentionHF
from tests.support.distributed import run_distributed
from tests.support.models import tiny_config, tiny_model


def _bypassed(rank, world_size):
    model = tiny_model(tiny_config("llama"))
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world_size, 1, scope="model")
    model.config._attn_implementation = "eager"  # after registration: attention no longer looks up 'sdpa'
    sl_l = 8
    try:
        positions = torch.arange(rank * sl_l, (rank + 1) * sl_l)[None]
        model(input_ids=torch.randint(0, 100, (1, sl_l)), position_ids=positions)
    except ValueError as err:
        return str(err)
    return "NO ERROR"


def test_a_forward_that_never_reaches_the_sp_attention_is_an_error_not_plain_data_parallelism():
    for message in run_distributed(_bypassed, 2):
        assert "model not servable by Ulysses SP: LlamaModel.forward ran without the SP attention" in message, message

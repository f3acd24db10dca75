"""The attention wrapper and its registration: isolation, collective count, eval switch, errors."""

import copy

import pytest
import torch
import torch.distributed as dist

from ds_ulysses import UlyssesSPAttentionHF
from tests.support.distributed import run_distributed
from tests.support.models import rel_err, tiny_config, tiny_model
from tests.support.sp_cases import make_sample


def _count_collectives(rank, world_size, layers, kv_heads):
    """Wrap torch.distributed's collectives and count calls during one SP forward."""
    cfg = tiny_config("llama", heads=4, kv_heads=kv_heads, layers=layers)
    model = tiny_model(cfg)
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world_size, 1)
    counts = {"n": 0}
    for name in ("all_to_all_single", "all_gather", "all_reduce", "all_to_all", "broadcast", "reduce_scatter_tensor"):
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            counts["n"] += 1
            return _original(*args, **kwargs)
        setattr(dist, name, counted)
    sl_l = 8
    ids = torch.randint(0, 100, (1, sl_l))
    pos = torch.arange(rank * sl_l, (rank + 1) * sl_l)[None]
    model(input_ids=ids, position_ids=pos)
    forward = counts["n"]
    model(input_ids=ids, position_ids=pos.clone())
    return forward, counts["n"] - forward


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_two_collectives_per_attention_layer(kv_heads):
    """Forward with L and 2L layers: the difference is exactly 2 collectives per added layer, and
    the per-forward position gather is not repeated per layer."""
    few = run_distributed(_count_collectives, 2, 2, kv_heads)[0]
    many = run_distributed(_count_collectives, 2, 4, kv_heads)[0]
    per_layer = (many[0] - few[0]) / 2
    assert per_layer == 2
    assert few[0] - 2 * 2 <= 2  # position_ids: shard lengths + positions, once per forward
    assert few[1] == few[0]     # a second forward pays the same, no stale cache


def _disable_in_eval(rank, world_size):
    """Eval-mode logits and a cached greedy generation, with SP off in eval against the model unregistered;
    then what a cached generation raises with SP on in eval."""
    cfg = tiny_config("qwen2", heads=4, kv_heads=2)
    ref = tiny_model(cfg).eval()
    models = {off: copy.deepcopy(ref) for off in (True, False)}
    for off, model in models.items():
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world_size, 1, disable_in_eval=off,
                                                       scope="model")
        model.eval()
    x = make_sample(1, 16)
    prompt = x["input_ids"][:, :9 + rank]  # each rank its own prompt
    with torch.no_grad():
        full = models[True](input_ids=x["input_ids"]).logits  # eval: plain attention on the full sequence
        expect = ref(input_ids=x["input_ids"]).logits
        generated = models[True].generate(prompt, max_new_tokens=4, do_sample=False)
        want = ref.generate(prompt, max_new_tokens=4, do_sample=False)
        try:
            models[False].generate(prompt, max_new_tokens=4, do_sample=False)
            sp_on = None
        except ValueError as err:
            sp_on = str(err)
    return rel_err(full, expect), torch.equal(generated, want), sp_on


def test_disable_in_eval_runs_plain_attention_on_full_sequences_and_generation_with_sp_on_is_refused():
    for err, generated_alike, sp_on in run_distributed(_disable_in_eval, 2):
        assert err <= 1e-6 and generated_alike
        assert "the SP attention got 10 keys for 1 queries: keys from a KV cache (model.generate" in sp_on

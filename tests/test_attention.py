"""The attention wrapper and its registration: isolation, collective count, eval switch, errors."""

import copy

import pytest
import torch
import torch.distributed as dist

from ds_ulysses import UlyssesSPAttentionHF, build_mesh, unregister_from_transformers
from ds_ulysses.heads import plan_heads
from ds_ulysses.loss import enable_sp_loss

from .distributed import run_distributed
from .models import rel_err, tiny_config, tiny_model
from .sp_cases import make_sample


def _isolation(rank, world_size):
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    a, b = tiny_model(cfg), tiny_model(cfg)  # built from the same config object
    a.config = b.config = cfg
    for m in list(a.modules()) + list(b.modules()):
        if "config" in m.__dict__:
            m.config = cfg
    x = make_sample(0, 16)
    before = b(input_ids=x["input_ids"]).logits
    UlyssesSPAttentionHF.register_with_transformers(a, "sdpa", world_size, 1)
    after = b(input_ids=x["input_ids"]).logits
    return {"same": torch.equal(before, after), "b_impl": b.config._attn_implementation,
            "a_impl": a.config._attn_implementation}


def test_registration_touches_only_that_model():
    for res in run_distributed(_isolation, 2):
        assert res["same"] and res["b_impl"] == "sdpa" and res["a_impl"].startswith("ulysses")


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
    cfg = tiny_config("qwen2", heads=4, kv_heads=2)
    ref = tiny_model(cfg)
    model = copy.deepcopy(ref)
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world_size, 1, disable_in_eval=True)
    x = make_sample(1, 16)
    model.eval()
    with torch.no_grad():
        full = model(input_ids=x["input_ids"]).logits  # eval: plain attention on the full sequence
        expect = ref(input_ids=x["input_ids"]).logits
    return rel_err(full, expect)


def test_disable_in_eval_runs_plain_attention_on_full_sequences():
    assert all(err <= 1e-6 for err in run_distributed(_disable_in_eval, 2))


def _global_registration(rank, world_size, config_dir):
    from transformers import AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from .sp_cases import reference_loss

    mpu = UlyssesSPAttentionHF.register_with_transformers(config_dir, "sdpa", world_size, 1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(config_dir, attn_implementation="sdpa")
    replaced = ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward
    enable_sp_loss(model, mpu.get_sequence_parallel_group())
    sample = make_sample(3, 16)
    sl_l = 16 // world_size
    shard = slice(rank * sl_l, (rank + 1) * sl_l)
    shift = torch.nn.functional.pad(sample["labels"][:, 1:], (0, 1), value=-100)
    loss = model(input_ids=sample["input_ids"][:, shard], position_ids=sample["position_ids"][:, shard],
                 shift_labels=shift[:, shard]).loss
    unregister_from_transformers()
    restored = ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    plain = AutoModelForCausalLM.from_pretrained(config_dir, attn_implementation="sdpa")
    ref = reference_loss(plain, sample)
    return {"replaced": replaced, "restored": restored, "err": rel_err(loss.detach(), ref.detach())}


def test_name_path_registration_is_global_and_reversible(tmp_path):
    tiny_model(tiny_config("llama", heads=4)).save_pretrained(tmp_path)
    for res in run_distributed(_global_registration, 2, str(tmp_path)):
        assert res["replaced"] and res["restored"] and res["err"] <= 1e-5, res


def test_eager_is_refused_with_reason():
    model = tiny_model(tiny_config("llama"))
    with pytest.raises(ValueError, match="eager attention needs a full S x S attention mask.*use 'sdpa'"):
        UlyssesSPAttentionHF.register_with_transformers(model, "eager", 2, 1)


def test_unknown_core_is_refused():
    with pytest.raises(ValueError, match="unknown core attention 'xformers'"):
        UlyssesSPAttentionHF.register_with_transformers(tiny_model(tiny_config("llama")), "xformers", 2, 1)


def test_sp_one_returns_none():
    assert UlyssesSPAttentionHF.register_with_transformers(tiny_model(tiny_config("llama")), "sdpa", 1, 1) is None


def test_sp_not_dividing_world_size():
    with pytest.raises(ValueError, match="sequence_parallel_size=3 must divide the world size 1"):
        build_mesh(3)


def test_more_ranks_than_heads_is_refused():
    with pytest.raises(ValueError, match="exceeds the model's 4 attention heads"):
        plan_heads(4, 2, 8)


def test_unservable_gqa_layout_is_refused():
    with pytest.raises(ValueError, match="attention layout not servable: 6 query heads"):
        plan_heads(6, 4, 2)


@pytest.mark.parametrize("heads,kv,ws", [(14, 2, 4), (8, 2, 4), (6, 1, 4), (5, 5, 2), (32, 8, 4), (12, 3, 8)])
def test_head_plan_covers_every_query_head_once_with_its_kv_head(heads, kv, ws):
    plan = plan_heads(heads, kv, ws)
    assert [h for hs in plan.q_heads for h in hs] == list(range(heads))
    assert [len(hs) for hs in plan.q_heads] == [heads // ws + (r < heads % ws) for r in range(ws)]
    group = heads // kv
    for r in range(ws):
        rep = plan.kv_groups(r)
        for i, h in enumerate(plan.q_heads[r]):
            assert plan.kv_heads[r][i // rep] == h // group  # the core's GQA mapping reads the right KV head

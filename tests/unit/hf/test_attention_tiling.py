"""Tiled attention (:mod:`ds_ulysses.hf.attention_tiling`) in one process: each attention block computed a
group of heads at a time gives the untiled model's loss and gradients (fp32: loss rel 1e-5, every gradient
rel 1e-4, the correctness bar; the sums of the groups' o_proj shares differ from one matmul by rounding only),
on the architectures whose blocks are sums over heads; the blocks that are not are refused by name. The SP
path (2 ranks) is in tests/integration/test_equivalence.py and the architecture sweep."""

import copy

import pytest
import torch

import ds_ulysses
from ds_ulysses.hf.attention_tiling import attention_blocks, tile_attention, untile_attention
from ds_ulysses.memory import tiled_heads

from tests.support.autograd_probes import KernelCalls
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


def _count_tiled_calls(monkeypatch) -> list:
    calls = []
    forward = tiled_heads.TiledHeads.forward

    def counted(ctx, fn, module, x, groups, keep, *params):
        calls.append(groups)
        return forward(ctx, fn, module, x, groups, keep, *params)

    monkeypatch.setattr(tiled_heads.TiledHeads, "forward", staticmethod(counted))
    return calls


@pytest.mark.parametrize("family,extra", [
    ("llama", {}),
    ("qwen2", {}),                       # q/k/v biases: narrowed with their rows
    ("qwen3", {}),                       # per-head q/k RMSNorm over head_dim
    ("gemma3_text", {}),                 # per-head q/k norms, query_pre_attn_scalar, sliding layers
    ("cohere", {}),                      # parallel attention and MLP in one layer
    ("llama", {"attention_bias": True}),  # o_proj's bias: added by group 0 only
    ("phi", {}),                          # the output projection named dense, partial RoPE
    ("stablelm", {}),                     # its views read the block's num_heads / num_key_value_heads
])
@pytest.mark.parametrize("shards", ["auto", 1])
def test_tiled_blocks_train_like_untiled(family, extra, shards, monkeypatch):
    base = tiny_model(tiny_config(family, heads=4, kv_heads=2, **extra))
    model = copy.deepcopy(base)
    assert tile_attention(model, 1, shards) == base.config.num_hidden_layers
    calls = _count_tiled_calls(monkeypatch)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    want_loss, want = _loss_and_grads(base, ids)
    got_loss, got = _loss_and_grads(model, ids)
    assert calls == [2 if shards == "auto" else 1] * base.config.num_hidden_layers
    assert rel_err(got_loss, want_loss) <= 1e-5
    assert got.keys() == want.keys()
    for name in want:
        assert rel_err(got[name], want[name]) <= 1e-4, name


def test_backward_runs_no_core_attention_again_under_sdpa():
    """Each group's kernel runs once, in forward; backward takes its kept outputs."""
    model = tiny_model(tiny_config("llama", heads=4, kv_heads=2))
    tile_attention(model, 1, 2)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    counting = KernelCalls()
    with counting:
        loss = model(input_ids=ids, labels=ids).loss
        forward_calls = counting.calls
        loss.backward()
    assert forward_calls == 2 * model.config.num_hidden_layers
    assert counting.calls == forward_calls


def test_without_autograd_the_blocks_run_whole_and_untiling_restores_them(monkeypatch):
    base = tiny_model(tiny_config("llama", heads=4, kv_heads=2))
    model = copy.deepcopy(base)
    tile_attention(model)
    calls = _count_tiled_calls(monkeypatch)
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, base(input_ids=ids).logits)
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(generated, base.generate(ids, max_new_tokens=4, do_sample=False))
    assert calls == []
    assert untile_attention(model) == 2 and all("forward" not in vars(m) for _, m in attention_blocks(model))


def test_a_cache_made_while_training_gets_no_tiled_entries():
    model = tiny_model(tiny_config("llama", heads=4, kv_heads=2))
    tile_attention(model)
    out = model(input_ids=torch.randint(0, 128, (1, 10)), use_cache=True)
    assert out.past_key_values is None or out.past_key_values.get_seq_length() == 0


@pytest.mark.parametrize("family,extra,message", [
    ("olmo2", {}, "its q_norm normalises every head's features together"),
    ("gpt_neox", {}, "it has no q_proj, k_proj, v_proj (its parts: query_key_value, dense)"),
    ("gpt_oss", {"attn": "eager"}, "it holds sinks (attention sinks, one logit per head)"),
    ("llama", {"attention_dropout": 0.1}, "attention_dropout=0.1 draws its masks again"),
    ("stablelm", {"qk_layernorm": True}, "its q_layernorm keeps a norm per head (q_layernorm.norms.0.weight)"),
])
def test_blocks_that_are_not_sums_over_heads_are_refused_by_name(family, extra, message):
    model = tiny_model(tiny_config(family, heads=4, kv_heads=2, **extra))
    with pytest.raises(ValueError, match="tiled_attention cannot split") as err:
        tile_attention(model)
    assert message in str(err.value) and "fix" in str(err.value)
    assert all("forward" not in vars(m) for _, m in attention_blocks(model))  # nothing changed


def test_lora_projections_are_refused_by_name():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(tiny_config("llama", heads=4, kv_heads=2)),
                           LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match=r"its q_proj is a Linear, not a plain nn.Linear|its q_proj is a \w+, not"):
        tile_attention(model)

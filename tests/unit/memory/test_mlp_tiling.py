"""tile_mlps runs a model's MLPs through TiledMLP without editing model code, and our own loss path
(ds_ulysses.hf.tiled_causal_lm_loss) runs TiledFusedLogitsLoss with a summing fn and "sum"; both equal
the untiled model in plain PyTorch. Tolerances: helpers.TOL.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_ulysses.memory.mlp_tiling import tile_mlps, untile_mlps

from .helpers import TOL, assert_close, grads_of, rel


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def llama_batch(bs, seed):
    ids = torch.randint(0, 128, (bs, 150), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, :20] = -100
    return ids, labels


@pytest.mark.parametrize("bs,shards", [(1, "auto"), (2, 3)])
def test_tile_mlps_on_llama_equals_untiled(bs, shards):
    model = tiny_llama()
    ids, labels = llama_batch(bs, 2)
    params = [p for p in model.parameters() if p.requires_grad]

    want_loss = model(input_ids=ids, labels=labels).loss
    want = grads_of(want_loss, params)

    tile_calls = []
    mlps = [m for n, m in model.named_modules() if n.endswith(".mlp")]
    hooks = [m.down_proj.register_forward_hook(lambda m, i, o: tile_calls.append(o.shape[-2])) for m in mlps]
    assert tile_mlps(model, shards=shards) == 2
    assert tile_mlps(model, shards=shards) == 2  # idempotent
    got_loss = model(input_ids=ids, labels=labels).loss
    n_forward_calls = len(tile_calls)
    got = grads_of(got_loss, params)

    assert rel(got_loss, want_loss) <= TOL
    assert_close(got, want, "grad")
    n_tiles = 3  # "auto": ceil(150 / 64)
    assert n_forward_calls == 2 * n_tiles  # each MLP ran tiled in forward...
    assert len(tile_calls) == 2 * 2 * n_tiles  # ...and recomputed per tile in backward

    assert untile_mlps(model) == 2
    assert untile_mlps(model) == 0
    assert all("forward" not in m.__dict__ for m in mlps)
    tile_calls.clear()
    assert rel(model(input_ids=ids, labels=labels).loss, want_loss) <= TOL
    assert len(tile_calls) == 2
    for h in hooks:
        h.remove()


def test_tile_mlps_handles_any_mlp_module_and_only_the_given_model():
    torch.manual_seed(0)

    def block():
        layer = nn.Module()
        layer.mlp = nn.Sequential(nn.Linear(8, 24), nn.GELU(), nn.Linear(24, 8))  # GPT-style, not gate/up/down
        return layer

    model, other = nn.ModuleList([block(), block()]), nn.ModuleList([block()])
    x = torch.randn(2, 5, 8, requires_grad=True)

    def run(m):
        h = x
        for layer in m:
            h = h + layer.mlp(h)
        return grads_of(h.pow(2).sum(), [x, *m.parameters()])

    want = run(model)
    assert tile_mlps(model, shards=4) == 2
    tiles = []
    model[0].mlp[0].register_forward_hook(lambda m, i, o: tiles.append(tuple(o.shape[:-1])))
    assert_close(run(model), want, "grad")
    # forward tiles the sequence of each row; backward the 10 flattened tokens, lifted to the MLP's rank
    assert tiles == [(2, 2), (2, 1), (2, 1), (2, 1), (1, 3), (1, 3), (1, 2), (1, 2)]
    assert all("forward" not in layer.mlp.__dict__ for layer in other)
    with pytest.raises(ValueError, match="shards must be a positive int, got -1"):
        tile_mlps(model, shards=-1)


class RoutedMLP(nn.Module):
    """A token-wise MoE-style block whose forward unpacks `bs, sl, h`, as Transformers' sparse MoE blocks do."""

    def __init__(self, h=8, experts=3):
        super().__init__()
        self.router = nn.Linear(h, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(h, 12), nn.SiLU(), nn.Linear(12, h))
                                     for _ in range(experts))

    def forward(self, x):
        bs, sl, h = x.shape
        flat = x.reshape(bs * sl, h)
        weights = torch.softmax(self.router(flat), dim=-1)  # [n, experts]
        mixed = sum(weights[:, e, None] * expert(flat) for e, expert in enumerate(self.experts))
        return mixed.view(bs, sl, h)


def test_tile_mlps_gives_a_forward_that_unpacks_bs_sl_h_its_rank_in_backward():
    torch.manual_seed(0)
    layer = nn.Module()
    layer.mlp = RoutedMLP()
    x = torch.randn(2, 7, 8, requires_grad=True)

    def run():
        return grads_of((layer.mlp(x) * torch.linspace(-1, 1, 8)).sum(), [x, *layer.parameters()])

    want = run()
    assert tile_mlps(layer, shards=3) == 1
    assert_close(run(), want, "grad")


@pytest.mark.parametrize("shards,head_calls", [(1, 1), ("auto", 1), (3, 3)])
def test_tiled_causal_lm_loss_equals_untiled_without_recomputing_lm_head(shards, head_calls):
    from ds_ulysses import enable_sp_loss, tiled_causal_lm_loss

    model = tiny_llama()
    ids, labels = llama_batch(2, 3)
    params = [p for p in model.parameters() if p.requires_grad]
    want_loss = model(input_ids=ids, labels=labels).loss
    want = grads_of(0.5 * want_loss, params)

    enable_sp_loss(model, loss_fn=tiled_causal_lm_loss(shards))
    calls = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: calls.append(o.shape[0]))
    got_loss = model(input_ids=ids, shift_labels=F.pad(labels, (0, 1), value=-100)[:, 1:]).loss
    got = grads_of(0.5 * got_loss, params)
    hook.remove()

    assert rel(got_loss, want_loss) <= TOL
    assert_close(got, want, "grad")
    # one untiled lm_head call when tiling would save nothing ("auto": 300 x 128 logits are far
    # below a tile's budget); otherwise one per tile, all in forward: backward recomputes nothing
    assert len(calls) == head_calls


def test_tiled_causal_lm_loss_fuses_a_plain_linear_head(monkeypatch):
    """Without hooks on lm_head (the test above counts calls with one, which keeps the module call),
    each tile runs linear_cross_entropy_sum on lm_head's weight: same loss and gradients."""
    from ds_ulysses import enable_sp_loss, tiled_causal_lm_loss
    from ds_ulysses.hf import loss as loss_mod

    fused = []
    real = loss_mod.linear_cross_entropy_sum
    monkeypatch.setattr(loss_mod, "linear_cross_entropy_sum", lambda x, *a: fused.append(len(x)) or real(x, *a))
    model = tiny_llama()
    ids, labels = llama_batch(2, 3)
    params = [p for p in model.parameters() if p.requires_grad]
    want_loss = model(input_ids=ids, labels=labels).loss
    want = grads_of(0.5 * want_loss, params)

    enable_sp_loss(model, loss_fn=tiled_causal_lm_loss(3))
    got_loss = model(input_ids=ids, shift_labels=F.pad(labels, (0, 1), value=-100)[:, 1:]).loss
    got = grads_of(0.5 * got_loss, params)

    assert fused == [100, 100, 100]  # 2 x 150 tokens in 3 tiles
    assert rel(got_loss, want_loss) <= TOL
    assert_close(got, want, "grad")

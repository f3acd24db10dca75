"""Activation-checkpoint offload changes where checkpointed inputs live, never the numbers.

Reference: the same tiny Llama without checkpointing or offload, in plain torch. Checkpointing
recomputes the same fp32 ops in the same order, so loss and grads agree to rounding (rel <= 1e-5).

Dimensions: bs batch, sl sequence, h hidden.
"""

import pytest
import torch
from torch import nn

import ds_ulysses.memory.offload as offload
from ds_ulysses.hf.checkpointing import disable_activation_checkpoint_offload, enable_activation_checkpoint_offload

TOL = 1e-5
HIDDEN, LAYERS = 64, 2


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    model.train()  # checkpointing only runs in training mode
    return model


def batch(bs, sl=24):
    ids = torch.randint(0, 128, (bs, sl), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :5] = -100
    return ids, labels


def loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.fixture
def moves(monkeypatch):
    """Record every tensor that goes through the host copy in forward and the copy back in backward."""
    packed, unpacked = [], []
    to_host, to_device = offload._to_host, offload._unpack_to_device

    def spy_to_host(tensor):
        packed.append(tuple(tensor.shape))
        return to_host(tensor)

    def spy_to_device(item):
        unpacked.append(tuple(item[1].shape))
        return to_device(item)

    monkeypatch.setattr(offload, "_to_host", spy_to_host)
    monkeypatch.setattr(offload, "_unpack_to_device", spy_to_device)
    return packed, unpacked


@pytest.mark.parametrize("bs", [1, 2])
def test_offload_equals_plain_model_and_moves_each_layer_input(bs, moves):
    packed, unpacked = moves
    model = tiny_llama()
    ids, labels = batch(bs)
    want_loss, want = loss_and_grads(model, ids, labels)
    assert not packed

    assert enable_activation_checkpoint_offload(model) == LAYERS
    got_loss, got = loss_and_grads(model, ids, labels)

    assert rel(got_loss, want_loss) <= TOL
    assert set(got) == set(want)
    bad = {n: rel(got[n], want[n]) for n in want if rel(got[n], want[n]) > TOL}
    assert not bad, bad
    hidden = (bs, ids.shape[1], HIDDEN)
    assert packed.count(hidden) == LAYERS  # each layer's checkpointed hidden states went to the host...
    assert unpacked.count(hidden) == LAYERS  # ...and came back for its recompute


def test_offload_composes_with_tiled_mlps(moves):
    from ds_ulysses.memory.mlp_tiling import tile_mlps

    packed, _ = moves
    model = tiny_llama()
    ids, labels = batch(2, sl=150)  # "auto": 3 MLP tiles, recomputed inside each layer's recompute
    want_loss, want = loss_and_grads(model, ids, labels)

    enable_activation_checkpoint_offload(model)
    assert tile_mlps(model, shards="auto") == LAYERS
    got_loss, got = loss_and_grads(model, ids, labels)

    assert rel(got_loss, want_loss) <= TOL
    bad = {n: rel(got[n], want[n]) for n in want if rel(got[n], want[n]) > TOL}
    assert not bad, bad
    assert packed.count((2, 150, HIDDEN)) == LAYERS


def test_enable_and_disable_are_idempotent_and_restore_state():
    model = tiny_llama()
    layers = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())

    assert enable_activation_checkpoint_offload(model) == LAYERS
    wrapped = {id(m): m._gradient_checkpointing_func for m in model.model.layers}
    assert enable_activation_checkpoint_offload(model) == LAYERS
    assert {id(m): m._gradient_checkpointing_func for m in model.model.layers} == wrapped  # not wrapped twice
    assert all(m.gradient_checkpointing for m in model.model.layers)

    assert disable_activation_checkpoint_offload(model) == LAYERS
    assert disable_activation_checkpoint_offload(model) == 0
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())  # we turned it on
    assert all(not isinstance(m.__dict__.get("_gradient_checkpointing_func"), offload._OffloadedCheckpoint)
               for m in layers)


def test_user_checkpointing_stays_on_after_disable(moves):
    packed, _ = moves
    model = tiny_llama()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    original = model.model.layers[0]._gradient_checkpointing_func
    ids, labels = batch(1)
    want_loss, want = loss_and_grads(model, ids, labels)
    assert not packed

    enable_activation_checkpoint_offload(model)
    got_loss, got = loss_and_grads(model, ids, labels)
    assert rel(got_loss, want_loss) <= TOL
    assert all(rel(got[n], want[n]) <= TOL for n in want)
    assert packed

    disable_activation_checkpoint_offload(model)
    assert model.model.layers[0].gradient_checkpointing
    assert model.model.layers[0]._gradient_checkpointing_func is original


def test_host_copy_is_identity_on_cpu_and_parameters_stay():
    t = torch.randn(2, 3)
    assert offload._to_host(t) is t
    p = nn.Parameter(torch.randn(2))
    device, kept = offload._pack_to_host(p)
    assert kept is p and device == p.device
    assert offload._unpack_to_device(offload._pack_to_host(t)) is t


def test_model_without_checkpointing_support_is_rejected():
    with pytest.raises(ValueError, match="needs a HuggingFace model with gradient checkpointing support, got "
                                         "Linear"):
        enable_activation_checkpoint_offload(nn.Linear(2, 2))


def test_model_transformers_cannot_checkpoint_is_refused_naming_the_switch():
    """JetMoE declares supports_gradient_checkpointing = False: refused with the config fix, nothing changed."""
    import transformers

    model = transformers.JetMoeForCausalLM(transformers.JetMoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        kv_channels=8, intermediate_size=32, num_local_experts=2, num_experts_per_tok=1))
    with pytest.raises(ValueError, match=r"activation checkpoint offload needs gradient checkpointing, and "
                                         r"JetMoeForCausalLM does not support it .*fix: set "
                                         r'"activation_checkpoint_offload": \{"enabled": false\}'):
        enable_activation_checkpoint_offload(model)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_a_subset_of_layers_offloads_the_rest_keep_their_checkpoints(moves):
    """``layers=1``: the first layer's checkpointed input goes to the host, the second's stays; the numbers are
    the plain model's. A later call with more layers offloads them too, with fewer stops the rest."""
    packed, unpacked = moves
    model = tiny_llama()
    ids, labels = batch(2)
    want_loss, want = loss_and_grads(model, ids, labels)
    assert enable_activation_checkpoint_offload(model, layers=1) == 1
    got_loss, got = loss_and_grads(model, ids, labels)
    assert rel(got_loss, want_loss) <= TOL
    bad = {n: rel(got[n], want[n]) for n in want if rel(got[n], want[n]) > TOL}
    assert not bad, bad
    hidden = (2, ids.shape[1], HIDDEN)
    assert packed.count(hidden) == unpacked.count(hidden) == 1
    layers = model.model.layers
    assert [isinstance(vars(m).get("_gradient_checkpointing_func"), offload.OffloadedCheckpoint) for m in layers] \
        == [True, False]
    assert enable_activation_checkpoint_offload(model) == LAYERS
    assert enable_activation_checkpoint_offload(model, layers=0) == 0
    assert not any(isinstance(vars(m).get("_gradient_checkpointing_func"), offload.OffloadedCheckpoint)
                   for m in layers)
    with pytest.raises(ValueError, match="layers must be \"all\" or a count >= 0, got -1"):
        enable_activation_checkpoint_offload(model, layers=-1)

"""The checks that mean something on a CUDA device (``make test-gpu``; skipped without one).

- the core kernels through the paths SP uses: sdpa per document (packed_attention) and Transformers'
  flash_attention_2 varlen path fed global position_ids, against plain sdpa on each document;
- the whole training step through ``ds_ulysses.initialize`` on NCCL (one rank: collectives on CUDA
  tensors, the engine, the SP loss, ZeRO-3), against the plain model;
- TiledMLP / TiledFusedLogitsLoss under ZeRO-3 on CUDA tensors against the untiled model;
- activation-checkpoint offload moving the saved layer inputs to the host and back;
- peak memory of the tiled loss against the untiled one (torch.cuda.max_memory_allocated);
- SP itself (two ranks, NCCL) when at least two GPUs exist: NCCL refuses two ranks on one device.

Tolerances: fp32 paths as on CPU (1e-5 loss, 1e-4 gradients; TF32 is switched off); bf16 kernels
against an fp32 reference of the same inputs, 2e-2 (bf16 has 8 bits of mantissa).
"""

import copy
import importlib.util

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.models import rel_err, tiny_config, tiny_model
from tests.support.sp_cases import make_sample, reference_loss

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2,
                               reason="needs 2 GPUs: NCCL refuses two ranks on one device")
needs_flash = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                                 reason="flash_attention_2 needs the flash-attn package (pip install -e '.[gpu]')")


@pytest.fixture(autouse=True)
def _exact_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _documents(docs, heads=4, kv=2, hs=64, dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(0)
    sl = sum(docs)
    q, k, v = (torch.randn(1, h, sl, hs, generator=g, device="cuda", dtype=dtype) for h in (heads, kv, kv))
    positions = torch.cat([torch.arange(n, device="cuda") for n in docs])[None]
    return q, k, v, positions


def _per_document(q, k, v, docs):
    """Plain sdpa on each document alone, fp32: the reference. Returns [1 sl hc hs]."""
    rep = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in docs:
        piece = slice(start, start + n)
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[:, :, piece].float(), k[:, :, piece].float().repeat_interleave(rep, 1),
            v[:, :, piece].float().repeat_interleave(rep, 1), is_causal=True).transpose(1, 2))
        start += n
    return torch.cat(out, dim=1)


class _Module(torch.nn.Module):
    is_causal, num_key_value_groups, layer_idx = True, 2, 0


def test_sdpa_per_document_on_cuda():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ds_ulysses.sp.packed import find_documents, packed_attention

    docs = [100, 37, 400, 12]
    q, k, v, positions = _documents(docs)
    out, _ = packed_attention(sdpa_attention_forward, _Module(), q, k, v, find_documents(positions))
    assert rel_err(out, _per_document(q, k, v, docs)) <= 1e-5


@needs_flash
@pytest.mark.parametrize("core", ["flash_attention_2", "flash_attention_3"])
def test_flash_kernels_attend_per_document_from_global_position_ids(core):
    """The contract SP's flash path relies on: no mask, packed documents found from position_ids."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if core == "flash_attention_3" and importlib.util.find_spec("flash_attn_interface") is None:
        pytest.skip("flash_attention_3 needs flash_attn_interface (FlashAttention 3, Hopper)")
    docs = [100, 37, 400, 12]
    q, k, v, positions = _documents(docs, dtype=torch.bfloat16)
    module = _Module()
    module.config = tiny_config("llama", attn=core)
    out, _ = ALL_ATTENTION_FUNCTIONS[core](module, q, k, v, None, position_ids=positions)
    assert rel_err(out.float(), _per_document(q, k, v, docs)) <= 2e-2


def _engine_step(rank, world_size, sp, stage):
    """One step of ds_ulysses.initialize (tiled loss, tiled MLP) on CUDA vs the plain model."""
    import ds_ulysses

    model = tiny_model(tiny_config("llama", heads=4, kv_heads=2, head_dim=16)).cuda()
    ref = copy.deepcopy(model)
    sample = make_sample(7, 64)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_allow_untested_optimizer": True,
              "ulysses": {"sequence_parallel_size": sp, "tiled_loss": {"enabled": True, "shards": 3},
                          "tiled_mlp": {"enabled": True, "shards": 2}}}
    data = [{"input_ids": sample["input_ids"][0], "labels": sample["labels"][0]}] * world_size
    engine, _, loader, _ = ds_ulysses.initialize(model=model, config=config, training_data=data)
    batch = next(iter(loader))
    loss = engine(**{k: v.cuda() for k, v in batch.items()}).loss
    engine.backward(loss)
    from deepspeed.utils import safe_get_full_grad

    want = reference_loss(ref, {k: v.cuda() for k, v in sample.items()})
    want.backward()
    grad = max(rel_err(safe_get_full_grad(p).float(), q.grad) for p, q in zip(engine.module.parameters(),
                                                                               ref.parameters()))
    ds_ulysses.uninstall()
    return {"loss": rel_err(loss.detach(), want.detach()), "grad": grad}


@pytest.mark.parametrize("stage", [2, 3])
def test_initialize_trains_on_cuda_like_the_plain_model(stage):
    """NCCL, one rank: every collective the step makes gets CUDA tensors (NCCL refuses others)."""
    for res in run_distributed(_engine_step, 1, 1, stage, backend="nccl", timeout=600):
        assert res["loss"] <= 1e-5 and res["grad"] <= 1e-4, res


@needs_two
@pytest.mark.parametrize("stage", [2, 3])
def test_sp2_on_two_gpus_like_the_plain_model(stage):
    for res in run_distributed(_engine_step, 2, 2, stage, backend="nccl", timeout=600):
        assert res["loss"] <= 1e-5 and res["grad"] <= 1e-4, res


def test_checkpoint_offload_moves_saved_layer_inputs_to_the_host_and_back():
    from ds_ulysses import enable_activation_checkpoint_offload
    from ds_ulysses.memory import offload

    model = tiny_model(tiny_config("llama", head_dim=16)).cuda()
    ref = copy.deepcopy(model)
    moved = []
    original = offload._to_host

    def recording(tensor):
        host = original(tensor)
        moved.append((tensor.device.type, host.device.type, host.is_pinned()))
        return host

    offload._to_host = recording
    try:
        enable_activation_checkpoint_offload(model)
        ids = torch.randint(0, 100, (2, 64), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        offload._to_host = original
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref(input_ids=ids, labels=ids).loss.backward()
    # what lives on CUDA goes to pinned host memory; a CPU tensor the layer saves stays as it is
    assert ("cuda", "cpu", True) in moved and set(moved) <= {("cuda", "cpu", True), ("cpu", "cpu", False)}, moved
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-5


def test_tiled_loss_holds_less_cuda_memory_than_the_full_logits():
    from ds_ulysses import tiled_causal_lm_loss
    from ds_ulysses.hf.loss import enable_sp_loss

    def peak(loss_fn):
        model = tiny_model(tiny_config("llama", head_dim=16, vocab_size=32000)).cuda()
        enable_sp_loss(model, loss_fn=loss_fn)
        ids = torch.randint(0, 32000, (1, 8192), device="cuda")
        shift = torch.cat([ids[:, 1:], torch.full((1, 1), -100, device="cuda")], dim=1)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(input_ids=ids, position_ids=torch.arange(8192, device="cuda")[None], shift_labels=shift).loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    full, tiled = peak(None), peak(tiled_causal_lm_loss(8))
    # fp32 logits of 8192 x 32000 are 1 GiB, with their gradient and log-softmax several times that
    assert tiled < 0.5 * full, (tiled, full)

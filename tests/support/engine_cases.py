"""Rank functions for the engine-hook tests: DeepSpeed engines vs the unsharded model."""

from __future__ import annotations

import copy

import torch

from tests.support.models import rel_err, tiny_config, tiny_model
from tests.support.sp_cases import make_sample, reference_loss


def require_fp16() -> None:
    """Skip where DeepSpeed's accelerator has no fp16: its CPU accelerator refuses an fp16 config without
    AVX512-FP16/AMX, so the machines CI lands on differ."""
    import pytest
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        pytest.skip("DeepSpeed has no fp16 on this CPU (no AVX512-FP16/AMX): it refuses the config")


def full_fp32_param(p: torch.nn.Parameter) -> torch.Tensor:
    """A copy of the whole fp32 parameter under ZeRO-1/2/3; ZeRO-0 keeps no separate fp32 copy."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(p)
    return (p.detach() if full is None else full).float().clone()


def ds_config(stage: int, offload: bool = False, sp: int = 2, extra_section: dict | None = None, **zero) -> dict:
    zero_cfg = {"stage": stage, **zero}
    if offload:
        zero_cfg["offload_param"] = {"device": "cpu"}
        zero_cfg["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": not offload}},
        "zero_optimization": zero_cfg,
        "ulysses": {"sequence_parallel_size": sp, "tiled_loss": {"enabled": False}, **(extra_section or {})},
    }


def dataset(n: int, length: int) -> list[dict]:
    out = []
    for i in range(n):
        s = make_sample(500 + i, length)
        out.append({"input_ids": s["input_ids"][0], "labels": s["labels"][0]})
    return out


def engine_vs_reference(rank: int, world_size: int, config: dict, via_install: bool = False,
                        family: str = "llama", length: int = 24, mesh_param=None, extra: dict | None = None,
                        heads: int = 4, kv_heads: int = 2) -> dict:
    """First step: per-rank loss vs its SP group's unsharded sample; full grads vs the DP mean.
    ``extra`` goes into the model config (a logits transform, say). With plain SGD in the config, the
    step's update is compared too, with the unsharded gradient clipped by torch at the config's
    ``gradient_clipping``, and so is the gradient norm the engine reports."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    import ds_ulysses

    cfg = tiny_config(family, heads=heads, kv_heads=kv_heads, **(extra or {}))
    model = tiny_model(cfg)
    ref = copy.deepcopy(model)
    data = dataset(2 * world_size, length)
    if via_install:
        ds_ulysses.install()
        ds_ulysses.install()  # idempotent
        engine, _, loader, _ = deepspeed.initialize(model=model, config=config, training_data=data)
    else:
        engine, _, loader, _ = ds_ulysses.initialize(model=model, config=config, training_data=data,
                                                     mesh_param=mesh_param)
    mpu = engine.mpu
    sp, dp = mpu.get_sequence_parallel_world_size(), mpu.get_data_parallel_world_size()
    batch = next(iter(loader))
    loss = engine(**batch).loss
    engine.backward(loss)
    # micro-batch 0 of SP group g is the sample drawn by that group's first rank: index g * sp
    groups = [g * sp for g in range(dp)]
    mine = groups[mpu.get_data_parallel_rank()]
    ref_losses = []
    for idx in groups:
        sample = {k: v[None] for k, v in data[idx].items()}
        sample["position_ids"] = torch.arange(length)[None]
        l = reference_loss(ref, sample) / len(groups)
        l.backward()
        ref_losses.append((idx, l.item() * len(groups)))
    loss_err = rel_err(loss.detach(), torch.tensor(dict(ref_losses)[mine]))
    floor = 1e-5 * torch.stack([p.grad.norm() for p in ref.parameters()]).norm().item()
    grad_err = max(rel_err(safe_get_full_grad(p).float(), q.grad, floor)
                   for p, q in zip(engine.module.parameters(), ref.parameters()))
    out = {"loss": loss_err, "grad": grad_err, "sp": sp, "dp": dp}
    before = [full_fp32_param(p) for p in engine.module.parameters()]
    engine.step()
    if config["optimizer"]["type"] == "SGD":
        clip, lr = config.get("gradient_clipping", 0.0), config["optimizer"]["params"]["lr"]
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip > 0 else float("inf"))
        update = torch.cat([(full_fp32_param(p) - b).flatten() for p, b in zip(engine.module.parameters(), before)])
        expected = torch.cat([-lr * q.grad.flatten() for q in ref.parameters()])
        out["update"], out["ref_norm"] = rel_err(update, expected), ref_norm.item()
        reported = engine.get_global_grad_norm()
        out["norm"] = None if reported is None else rel_err(torch.tensor(float(reported)), ref_norm)
    if via_install:
        ds_ulysses.uninstall()
    return out


def not_sp_inputs(rank: int, world_size: int) -> dict:
    """An engine set up by the section, fed what is not its SP group's shards of one sample: each rank's own
    whole sample before any adapter ran (plain data parallelism), the same after, and the shards of two
    different micro-batches. Returns each forward's error (every rank must raise it)."""
    import ds_ulysses
    from ds_ulysses import UlyssesSPDataLoaderAdapter

    model = tiny_model(tiny_config("llama", heads=4, kv_heads=2))
    data = dataset(2 * world_size, 24)
    engine, *_ = ds_ulysses.initialize(model=model, config=ds_config(2))
    mesh = engine.mpu
    own = {"input_ids": data[rank]["input_ids"][None], "labels": data[rank]["labels"][None],
           "position_ids": torch.arange(24)[None]}
    errors = {}

    def forward(name, batch):
        try:
            engine(**batch)
        except ValueError as err:
            errors[name] = str(err)

    forward("no_adapter", own)
    batches = [{k: v[None] for k, v in sample.items()} for sample in data[rank::world_size]]
    adapter = UlyssesSPDataLoaderAdapter(batches, mesh.sp_rank, mesh.sp_group, mesh.sp, "cpu")
    first = next(adapter)
    forward("not_a_shard", own)
    forward("misaligned", first if rank == 0 else next(adapter))  # rank 1 runs the refill's next micro-batch
    return errors


def trims_per_step(rank: int, world_size: int, config: dict, steps: int = 2) -> int:
    """How many times the engine gave the host heap back during ``steps`` training steps (the real
    trim runs; the count wraps it)."""
    from ds_ulysses import engine as engine_mod

    import ds_ulysses

    calls = []
    real = engine_mod.trim_host_heap

    def counted():
        calls.append(1)
        return real()

    engine_mod.trim_host_heap = counted
    try:
        model = tiny_model(tiny_config("llama", heads=4, kv_heads=2))
        engine, _, loader, _ = ds_ulysses.initialize(model=model, config=config, training_data=dataset(4, 24))
        batches = iter(loader)
        for _ in range(steps):
            engine.backward(engine(**next(batches)).loss)
            before = len(calls)
            engine.step()
            assert len(calls) in (before, before + 1)
    finally:
        engine_mod.trim_host_heap = real
    return len(calls)

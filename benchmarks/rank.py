"""One rank of one benchmark launch: train a few steps with one implementation and measure them.

Run by :mod:`benchmarks.bench` as ``python -m benchmarks.rank SPEC.json`` in fresh processes
(one process group per launch), so each implementation's peak RSS is its own. Implementations:

- ``deepspeed``: DeepSpeed's ALST module as its tutorial uses it: ``register_with_transformers``
  -> its ``mpu``, its ``UlyssesSPDataLoaderAdapter``, and the tutorial's loss aggregation (per-rank
  mean loss and token count, differentiable all-gather over the SP group).
- ``ours-dropin``: our drop-in API with exactly the same user code (the mechanism comparison).
- ``ours``: ``ds_ulysses.initialize`` with the config's ``"ulysses"`` section and its defaults
  (the product comparison); the loss is ``engine(**batch).loss``.

The model, the samples, the DeepSpeed config (ZeRO-3, parameters and optimizer offloaded to CPU)
and the thread count are identical for all three. Measured per rank: each step's wall time
(forward + backward + optimizer step, after a barrier), the RSS high-water mark of the process over
its whole life and over the steps only (``/proc/self/clear_refs`` resets it after setup), and the
collectives of the attention layers and of the adapter's refills (:mod:`benchmarks.tap`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

from .tap import CollectiveTap

__all__ = ["IMPLEMENTATIONS", "MODEL_DEFAULTS", "ds_config", "make_dataset", "build_model", "tutorial_loss", "main"]

IMPLEMENTATIONS = ("deepspeed", "ours-dropin", "ours")
MODEL_DEFAULTS = {"vocab": 32000, "hidden": 256, "intermediate": 688, "layers": 4, "heads": 8, "kv_heads": 2}


def ds_config(sp: int) -> dict:
    """The DeepSpeed config both implementations train with: ZeRO-3 with CPU offload, fp32."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu"}},
        "sequence_parallel_size": sp,
        "steps_per_print": 1 << 30,
    }


def make_dataset(n: int, seq_len: int, vocab: int, packed_docs: int = 0, seed: int = 1234) -> list[dict]:
    """``n`` random-token samples of ``seq_len``; with ``packed_docs`` each holds that many documents.

    Packed documents have position_ids restarting at 0 and a -100 label on each document's first
    token (nothing predicts across a boundary). Lengths are random but seeded: every implementation
    trains on the very same samples.
    """
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(seed + i)
        ids = torch.randint(0, vocab, (seq_len,), generator=g)
        labels = ids.clone()
        positions = torch.arange(seq_len)
        if packed_docs > 1:
            cuts = torch.randperm(seq_len - 1, generator=g)[:packed_docs - 1].add(1).sort().values.tolist()
            for start in cuts:
                positions[start:] = torch.arange(seq_len - start)
                labels[start] = -100
        out.append({"input_ids": ids, "labels": labels, "position_ids": positions})
    return out


def build_model(model: dict, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=model["vocab"], hidden_size=model["hidden"],
                      intermediate_size=model["intermediate"], num_hidden_layers=model["layers"],
                      num_attention_heads=model["heads"], num_key_value_heads=model["kv_heads"],
                      head_dim=model["hidden"] // model["heads"], max_position_embeddings=1 << 22,
                      tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()


class _AllGather(torch.autograd.Function):
    """``[]`` on each rank -> ``[ws]`` on every rank; backward: each rank's slot gets the sum of every
    rank's gradient for it (an all-reduce, then the own slot), the adjoint of the gather.

    The tutorial uses ``torch.distributed.nn.functional.all_gather``, whose backward fails on gloo
    subgroups (it addresses a global rank inside the group); this is the same maths.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank = group, dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def tutorial_loss(engine, batch: dict, group) -> torch.Tensor:
    """DeepSpeed's tutorial loss recipe: per-rank mean loss, weighted by per-rank token counts."""
    shift_labels = batch.pop("shift_labels")
    outputs = engine(**batch)
    model = engine.module
    loss = model.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                               vocab_size=model.config.vocab_size)
    good = (shift_labels != -100).sum().to(loss.dtype)
    if group is None or dist.get_world_size(group) == 1:
        return loss
    losses = _AllGather.apply(loss, group)  # [ws]
    goods = [torch.empty_like(good) for _ in range(dist.get_world_size(group))]
    dist.all_gather(goods, good, group=group)
    total = sum(losses[r] * goods[r] for r in range(len(goods)) if goods[r] > 0)
    return total / max(sum(goods), torch.ones_like(good))


def _loader(data, world: int, rank: int):
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    return DataLoader(data, batch_size=1, sampler=sampler)


def _deepspeed(model, spec, data, tap):
    import deepspeed
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    sp = spec["sp"]
    tap.wrap_method(ulysses_sp.UlyssesSPAttentionHF, "forward", lambda _: f"attn_{tap_phase(tap)}")
    tap.wrap_method(ulysses_sp.UlyssesSPDataLoaderAdapter, "refill", lambda _: "refill")
    mpu = ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(sp),
                                      mpu=mpu)
    group = mpu.get_sequence_parallel_group() if mpu is not None else None
    sp_rank = mpu.get_sequence_parallel_rank() if mpu is not None else 0
    loader = ulysses_sp.UlyssesSPDataLoaderAdapter(_loader(data, dist.get_world_size(), dist.get_rank()),
                                                   sp_rank, group, sp, "cpu")
    return engine, loader, functools.partial(tutorial_loss, group=group)


def _ours_dropin(model, spec, data, tap):
    import deepspeed

    from ds_ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from ds_ulysses.sp import attention, data as data_mod

    sp = spec["sp"]
    tap.wrap_method(attention.UlyssesAttention, "forward", lambda _: f"attn_{tap_phase(tap)}")
    tap.wrap_method(data_mod.UlyssesSPDataLoaderAdapter, "refill", lambda _: "refill")
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(sp),
                                      mpu=mpu)
    group = mpu.get_sequence_parallel_group() if mpu is not None else None
    sp_rank = mpu.get_sequence_parallel_rank() if mpu is not None else 0
    loader = UlyssesSPDataLoaderAdapter(_loader(data, dist.get_world_size(), dist.get_rank()), sp_rank, group, sp,
                                        "cpu")
    return engine, loader, functools.partial(tutorial_loss, group=group)


def _ours(model, spec, data, tap):
    import ds_ulysses
    from ds_ulysses.sp import attention, data as data_mod

    tap.wrap_method(attention.UlyssesAttention, "forward", lambda _: f"attn_{tap_phase(tap)}")
    tap.wrap_method(data_mod.UlyssesSPDataLoaderAdapter, "refill", lambda _: "refill")
    config = {**ds_config(spec["sp"]), "ulysses": {"sequence_parallel_size": spec["sp"], **spec.get("section", {})}}
    engine, _, loader, _ = ds_ulysses.initialize(model=model, config=config, training_data=data)
    return engine, iter(loader), lambda engine, batch: engine(**batch).loss


RECIPES = {"deepspeed": _deepspeed, "ours-dropin": _ours_dropin, "ours": _ours}


def tap_phase(tap) -> str:
    return getattr(tap, "phase", "other")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run(spec: dict) -> dict:
    """Set up one implementation, train ``warmup + steps`` steps, return this rank's measurements."""
    import deepspeed

    torch.set_num_threads(spec.get("threads", 1))
    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's comm layer and its mpu need it
    rank, world = dist.get_rank(), dist.get_world_size()
    tap = CollectiveTap().install()
    tap.phase = "setup"
    model_spec = {**MODEL_DEFAULTS, **spec.get("model", {})}
    model = build_model(model_spec)
    refills = math.ceil((spec["warmup"] + spec["steps"]) / spec["sp"]) + 1
    data = make_dataset(world * refills, spec["seq_len"], model_spec["vocab"], spec.get("packed_docs", 0))
    engine, loader, loss_fn = RECIPES[spec["impl"]](model, spec, data, tap)
    init_peak = _hwm_bytes()
    reset_ok = _reset_hwm()
    times, phases, losses = [], [], []
    for i in range(spec["warmup"] + spec["steps"]):
        tap.phase = "load"
        batch = next(loader)
        measured = i >= spec["warmup"]
        if measured and i == spec["warmup"]:
            refill = (tap.tallies["refill"].as_dict(), tap.counts["refill"])
            tap.reset()
        dist.barrier()
        start = time.perf_counter()
        tap.phase = "forward"
        loss = loss_fn(engine, batch)
        forward_end = time.perf_counter()
        tap.phase = "backward"
        with tap.scope("backward"):
            engine.backward(loss)
        backward_end = time.perf_counter()
        tap.phase = "step"
        engine.step()
        end = time.perf_counter()
        losses.append(float(loss.detach()))
        if measured:
            times.append(end - start)
            phases.append((forward_end - start, backward_end - forward_end, end - backward_end))
    if spec["warmup"] == 0:
        refill = (tap.tallies["refill"].as_dict(), tap.counts["refill"])
    steps_peak = _hwm_bytes()
    result = {
        "rank": rank, "world": world, "times": times, "phases": phases, "losses": losses,
        "init_peak": init_peak, "steps_peak": steps_peak if reset_ok else None,
        "peak": max(init_peak, steps_peak),
        "attn_forward": tap.tallies["attn_forward"].as_dict(), "attn_forward_calls": tap.counts["attn_forward"],
        "attn_backward": tap.tallies["attn_backward"].as_dict(), "backward": tap.tallies["backward"].as_dict(),
        "refill": refill[0], "refills": refill[1],
    }
    dist.barrier()
    dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.rank SPEC.json``: writes ``SPEC.json.rank<r>.json``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit(f"usage: python -m benchmarks.rank SPEC.json (got {argv}); run it through "
                         "`ds-ulysses bench`, which writes the spec and sets RANK/WORLD_SIZE")
    with open(argv[0]) as f:
        spec = json.load(f)
    if spec["impl"] == "layer":
        from .layer import run as run_layer

        result = run_layer(spec["seq_len"], spec["iters"])
    else:
        result = run(spec)
    with open(f"{argv[0]}.rank{os.environ['RANK']}.json", "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

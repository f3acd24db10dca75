"""The arms as their users set them up: the model, the samples, the DeepSpeed config and each library's recipe.

What every per-rank loop trains, identical for all arms: a Llama with GQA built from its config
(:data:`benchmarks.arms.MODEL_DEFAULTS`), seeded random-token samples (optionally packed documents), and
ZeRO-3 with parameters and optimizer offloaded to CPU, in fp32. The engine loop's recipes
(:data:`RECIPES`, each ``(model, spec, data, tap, regions) -> (engine, loader, loss_fn)``):

- ``deepspeed``: DeepSpeed's ALST module as its tutorial uses it: ``register_with_transformers``
  -> its ``mpu``, its ``UlyssesSPDataLoaderAdapter``, and the tutorial's loss aggregation (per-rank
  mean loss and token count, differentiable all-gather over the SP group).
- ``ours-dropin``: our drop-in API with exactly the same user code (the mechanism comparison).
- ``ours``: ``ds_ulysses.initialize`` with the config's ``"ulysses"`` section and its defaults
  (the product comparison); the loss is ``engine(**batch).loss``.
- ``deepspeed-alst``: DeepSpeed with every ALST tool it has, switched on as ArcticTraining's SFT
  trainer does: DeepSpeed's ``TiledMLP`` on every MLP (``ceil(sl_l / h)`` tiles agreed by an
  all_reduce, the three weights as ``compute_params``), DeepSpeed's ``TiledFusedLogitsLoss`` on the
  decoder's hidden states (ArcticTraining's tile rule: about 1 GiB of fp32 logits per tile; summed
  per-tile loss sums, divided by the valid count), gradient checkpointing (Transformers' default,
  non-reentrant), and checkpoint offload, which on CPU is the identity (the checkpointed inputs are
  already in host memory), then the tutorial's cross-rank aggregation.

ds_ulysses is imported only inside our recipes, so DeepSpeed's arm runs without it in the process.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

__all__ = ["ds_config", "make_dataset", "loop_dataset", "build_model", "tutorial_loss", "arctic_loss_shards",
           "arctic_tiled_loss", "library_classes", "tap_library", "tap_phase", "RECIPES"]

ARCTIC_LOGITS_TILE_GIB = 1  # ArcticTraining's tiled loss: "about 1GB fp32 logits in a shard"


def ds_config(sp: int) -> dict:
    """The DeepSpeed config every implementation trains with: ZeRO-3 with CPU offload, fp32."""
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


def loop_dataset(spec: dict, vocab: int, world: int, steps: int) -> list[dict]:
    """The samples for ``steps`` steps of a loop: each sample feeds ``sp`` steps (one shard a step), so
    ``ceil(steps / sp)`` refills of one sample per rank, and one refill spare."""
    refills = math.ceil(steps / spec["sp"]) + 1
    return make_dataset(world * refills, spec["seq_len"], vocab, spec.get("packed_docs", 0))


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


def _aggregate(loss: torch.Tensor, shift_labels: torch.Tensor, group) -> torch.Tensor:
    """The tutorial's cross-rank step: per-rank mean losses weighted by per-rank valid-token counts."""
    good = (shift_labels != -100).sum().to(loss.dtype)
    if group is None or dist.get_world_size(group) == 1:
        return loss
    losses = _AllGather.apply(loss, group)  # [ws]
    goods = [torch.empty_like(good) for _ in range(dist.get_world_size(group))]
    dist.all_gather(goods, good, group=group)
    total = sum(losses[r] * goods[r] for r in range(len(goods)) if goods[r] > 0)
    return total / max(sum(goods), torch.ones_like(good))


def tutorial_loss(engine, batch: dict, group, labels_in_batch: bool = False) -> torch.Tensor:
    """DeepSpeed's tutorial loss recipe: per-rank mean loss, weighted by per-rank token counts. DeepSpeed's
    tutorial takes ``shift_labels`` out of the batch the model gets; Accelerate's ALST example leaves them
    in (``labels_in_batch``)."""
    shift_labels = batch["shift_labels"] if labels_in_batch else batch.pop("shift_labels")
    outputs = engine(**batch)
    model = engine.module
    loss = model.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                               vocab_size=model.config.vocab_size)
    return _aggregate(loss, shift_labels, group)


def arctic_loss_shards(tokens: int, vocab: int) -> int:
    """ArcticTraining's tiled-loss tile count: about :data:`ARCTIC_LOGITS_TILE_GIB` of fp32 logits a tile."""
    return max(1, math.ceil(tokens * vocab * 4 / 2**30 / ARCTIC_LOGITS_TILE_GIB))


def arctic_tiled_loss(engine, batch: dict, group) -> torch.Tensor:
    """ArcticTraining's SP loss with DeepSpeed's ``TiledFusedLogitsLoss`` (its SFT trainer, our words):
    the decoder's hidden states, per-tile loss sums over ~1 GiB fp32 logit tiles, "sum" reduction,
    divided by the rank's valid-token count, then the tutorial's cross-rank aggregation."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    shift_labels = batch.pop("shift_labels")
    model = engine.module
    hidden = model.model(**batch, use_cache=False).last_hidden_state  # [bs sl_l h]
    bs, sl_l = shift_labels.shape
    vocab = model.config.vocab_size
    shards = arctic_loss_shards(bs * sl_l, vocab)

    def tile_loss_sum(owner, x, y):
        logits = owner.lm_head(x)
        valid = (y != -100).sum()
        if valid == 0:  # cross-entropy of no tokens is NaN; keep the graph, add zero
            return (logits.sum() * 0.0).float()
        return owner.loss_function(logits=logits, labels=None, vocab_size=vocab, shift_labels=y) * valid

    total = TiledFusedLogitsLoss.apply(tile_loss_sum, model, hidden, shift_labels, None, shards,
                                       [model.lm_head.weight], "sum")
    loss = total / max((shift_labels != -100).sum(), 1)
    return _aggregate(loss, shift_labels, group)


def _loader(data, world: int, rank: int):
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    return DataLoader(data, batch_size=1, sampler=sampler)


def _tile_mlps_deepspeed(model, group) -> None:
    """DeepSpeed's documented TiledMLP recipe on every Llama MLP: ``ceil(sl / h)`` tiles, agreed by an
    all_reduce(MAX) at every call, the MLP's three weights as ``compute_params``."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp_forward(mlp, x):
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    def tiled_forward(mlp, x):
        shards = torch.tensor(math.ceil(x.shape[-2] / x.shape[-1]), device=x.device)
        dist.all_reduce(shards, op=dist.ReduceOp.MAX, group=group)
        params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
        return TiledMLP.apply(mlp_forward, mlp, x, int(shards), params)

    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "mlp":
            module.forward = functools.partial(tiled_forward, module)


def library_classes(deepspeed: bool) -> tuple:
    """One library's SP attention class, data adapter class and the attention's position-gather method (ours
    only): DeepSpeed's module, or ours."""
    if deepspeed:
        from deepspeed.runtime.sequence_parallel import ulysses_sp

        return ulysses_sp.UlyssesSPAttentionHF, ulysses_sp.UlyssesSPDataLoaderAdapter, None
    from ds_ulysses.sp import attention as ours, data as data_mod

    return ours.UlyssesAttention, data_mod.UlyssesSPDataLoaderAdapter, "_gather_positions"


def tap_library(tap, deepspeed: bool) -> tuple:
    """Has ``tap`` count the collectives of one library's attention layer (per phase) and adapter refills:
    DeepSpeed's module, or ours. Returns that attention class and its position-gather method (ours only),
    as :meth:`benchmarks.profile.Regions.attention` takes them."""
    attention, adapter, positions = library_classes(deepspeed)
    tap.wrap_method(attention, "forward", lambda _: f"attn_{tap_phase(tap)}")
    tap.wrap_method(adapter, "refill", lambda _: "refill")
    return attention, positions


def _deepspeed(model, spec, data, tap, regions, alst=False):
    import deepspeed
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    sp = spec["sp"]
    regions.attention(*tap_library(tap, deepspeed=True))
    mpu = ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1)
    if alst:
        _tile_mlps_deepspeed(model, None)
        model.gradient_checkpointing_enable()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(sp),
                                      mpu=mpu)
    group = mpu.get_sequence_parallel_group() if mpu is not None else None
    sp_rank = mpu.get_sequence_parallel_rank() if mpu is not None else 0
    loader = ulysses_sp.UlyssesSPDataLoaderAdapter(_loader(data, dist.get_world_size(), dist.get_rank()),
                                                   sp_rank, group, sp, "cpu")
    return engine, loader, functools.partial(arctic_tiled_loss if alst else tutorial_loss, group=group)


def _ours_dropin(model, spec, data, tap, regions):
    import deepspeed

    from ds_ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    sp = spec["sp"]
    regions.attention(*tap_library(tap, deepspeed=False))
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(sp),
                                      mpu=mpu)
    group = mpu.get_sequence_parallel_group() if mpu is not None else None
    sp_rank = mpu.get_sequence_parallel_rank() if mpu is not None else 0
    loader = UlyssesSPDataLoaderAdapter(_loader(data, dist.get_world_size(), dist.get_rank()), sp_rank, group, sp,
                                        "cpu")
    return engine, loader, functools.partial(tutorial_loss, group=group)


def _ours(model, spec, data, tap, regions):
    import ds_ulysses

    regions.attention(*tap_library(tap, deepspeed=False))
    config = {**ds_config(spec["sp"]), "ulysses": {"sequence_parallel_size": spec["sp"], **spec.get("section", {})}}
    engine, _, loader, _ = ds_ulysses.initialize(model=model, config=config, training_data=data)
    return engine, iter(loader), lambda engine, batch: engine(**batch).loss


RECIPES = {"deepspeed": _deepspeed, "ours-dropin": _ours_dropin, "ours": _ours,
           "deepspeed-alst": functools.partial(_deepspeed, alst=True)}


def tap_phase(tap) -> str:
    return getattr(tap, "phase", "other")

"""Rank functions for the copy tests: copies of an SP model (``copy.deepcopy``, a pickle) against the
unsharded model, on every way SP is switched on."""

from __future__ import annotations

import copy
import pickle

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_ulysses import UlyssesSPDataLoaderAdapter

from tests.support.models import rel_err, tiny_config, tiny_model
from tests.support.sp_cases import make_sample, reference_loss

LENGTH = 16


def _samples(world_size: int) -> list[dict]:
    return [make_sample(100 + k, LENGTH) for k in range(world_size)]


def sp_errors(model, ref, samples: list[dict], group, rank: int, world_size: int) -> dict:
    """One SP forward and backward of ``model`` per micro-batch of the adapter over ``samples``: the largest
    loss and SP-summed gradient errors against ``ref`` run on each whole sample (ignores what ``ref`` held)."""
    loader = UlyssesSPDataLoaderAdapter([samples[rank]], dist.get_rank(group), group, world_size, "cpu")
    loss_errs, grad_errs = [], []
    for k, micro in enumerate(loader):
        model.zero_grad()
        ref.zero_grad()
        loss = model(**micro).loss
        loss.backward()
        ref_loss = reference_loss(ref, samples[k])
        ref_loss.backward()
        loss_errs.append(rel_err(loss.detach(), ref_loss.detach()))
        floor = 1e-5 * torch.stack([q.grad.norm() for q in ref.parameters()]).norm().item()
        for p, q in zip(model.parameters(), ref.parameters()):
            g = p.grad.clone()
            dist.all_reduce(g, group=group)
            grad_errs.append(rel_err(g, q.grad, floor))
    model.zero_grad()
    return {"loss": max(loss_errs), "grad": max(grad_errs)}


def _perturbed(model, seed: int):
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _sp_model(path: str, base, world_size: int):
    """``base``'s copy with SP switched on by ``path``; returns (model, its SP group, a model built after)."""
    import deepspeed

    import ds_ulysses
    from ds_ulysses import UlyssesSPAttentionHF, enable_sp_loss

    if path in ("dropin", "model-scope"):
        model = copy.deepcopy(base)
        scope = {"scope": "model"} if path == "model-scope" else {}
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world_size, 1, **scope)
        group = mpu.get_sequence_parallel_group()
        enable_sp_loss(model, group)
        later = None
        if path == "dropin":  # the implementation's global entry serves models built after the call
            later = tiny_model(base.config)
            enable_sp_loss(later, group)
        return model, group, later
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_optimization": {"stage": 0},
              "ulysses": {"sequence_parallel_size": world_size, "tiled_loss": {"enabled": False}}}
    if path == "initialize":
        engine, *_ = ds_ulysses.initialize(model=copy.deepcopy(base), config=config)
    else:
        ds_ulysses.install()
        engine, *_ = deepspeed.initialize(model=copy.deepcopy(base), config=config)
    return engine.module, engine.mpu.get_sequence_parallel_group(), None


def copies_vs_reference(rank: int, world_size: int, path: str) -> dict:
    """Switch SP on by ``path`` ("dropin": DeepSpeed's registration, which also serves a model built after it;
    "model-scope"; "initialize"; "install": a plain ``deepspeed.initialize`` after ``install()``), copy the
    model by ``copy.deepcopy`` and by a pickle round trip, and compare each against the unsharded model: as it
    is, and after the copy's weights change (the original must not follow). After ``uninstall()`` a copy
    computes as the plain model. ``pickled``: a pickle of a copy, for the parent process to load. The module
    of a DeepSpeed engine ("initialize", "install") is only deep-copied: DeepSpeed's engine hangs a local
    function on it as a forward hook, which no pickle can name, with SP or without."""
    import ds_ulysses

    base = tiny_model(tiny_config("llama", heads=4, kv_heads=2))
    samples = _samples(world_size)
    model, group, later = _sp_model(path, base, world_size)
    picklable = path in ("dropin", "model-scope")
    copies = {"original": model, "deepcopy": copy.deepcopy(model)}
    if picklable:
        copies["pickle"] = pickle.loads(pickle.dumps(model))
    if later is not None:
        copies["built-after-deepcopy"] = copy.deepcopy(later)
    out = {name: sp_errors(m, copy.deepcopy(base), samples, group, rank, world_size) for name, m in copies.items()}
    for name in [n for n in ("deepcopy", "pickle") if n in copies]:
        changed = _perturbed(copies[name], 1)
        out[f"{name}-changed"] = sp_errors(changed, _perturbed(copy.deepcopy(base), 1), samples, group, rank,
                                           world_size)
    out["original-after-changes"] = sp_errors(model, copy.deepcopy(base), samples, group, rank, world_size)
    if picklable:
        out["pickled"] = pickle.dumps(copy.deepcopy(model))
    ds_ulysses.uninstall()
    whole = samples[0]  # every rank: the same whole sample, as a plain model gets it
    plain = base(input_ids=whole["input_ids"], labels=whole["labels"]).loss
    copied = copies["deepcopy"]
    out["after-uninstall"] = rel_err(_perturbed(copy.deepcopy(base), 1)(input_ids=whole["input_ids"],
                                                                        labels=whole["labels"]).loss.detach(),
                                     copied(input_ids=whole["input_ids"], labels=whole["labels"]).loss.detach())
    out["plain-loss"] = plain.item()
    return out


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the SP group; backward: the incoming gradient, unchanged (each rank's loss is the
    same function of every rank's part, and gradients are then summed over the group)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _row_logps(model, ids, pos, shift_labels) -> torch.Tensor:
    """Per-row sum of log p(label) over this rank's tokens with a label: ``[bs]``."""
    logits = model(input_ids=ids, position_ids=pos).logits  # [bs sl_l V]
    valid = shift_labels != -100
    taken = torch.log_softmax(logits.float(), -1).gather(-1, shift_labels.clamp(min=0)[..., None])[..., 0]
    return (taken * valid).sum(-1)


def _dpo_loss(pc, pr, rc, rr, beta: float = 0.1) -> torch.Tensor:
    return -F.logsigmoid(beta * ((pc - rc) - (pr - rr))).mean()


def dpo_step_vs_reference(rank: int, world_size: int) -> dict:
    """A DPO-style step: the policy in train mode, its reference from TRL's ``create_reference_model`` (a deep
    copy, frozen, in eval mode) under a registration with ``disable_in_eval``; both score the adapter's shards of
    one chosen/rejected pair, per-row log-probability sums reduced over the SP group. The loss and the policy's
    SP-summed gradients against the same step on the unsharded models."""
    from trl import create_reference_model

    from ds_ulysses import UlyssesSPAttentionHF

    base = tiny_model(tiny_config("llama", heads=4, kv_heads=2))
    policy = copy.deepcopy(base)
    mpu = UlyssesSPAttentionHF.register_with_transformers(policy, "sdpa", world_size, 2, disable_in_eval=True)
    group = mpu.get_sequence_parallel_group()
    reference = create_reference_model(policy)
    # the pair: one prompt, two completions; labels only on the completions
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 128, (6,), generator=g)
    rows = torch.stack([torch.cat([prompt, torch.randint(0, 128, (10,), generator=g)]) for _ in range(2)])
    labels = rows.clone()
    labels[:, :6] = -100
    pair = {"input_ids": rows, "labels": labels, "position_ids": torch.arange(16).expand(2, 16)}
    loader = UlyssesSPDataLoaderAdapter([pair], mpu.get_sequence_parallel_rank(), group, world_size, "cpu")
    micro = next(iter(loader))  # micro-batch 0: rank 0's pair, sharded
    args = (micro["input_ids"], micro["position_ids"], micro["shift_labels"])
    with torch.no_grad():
        rc, rr = _SumOverGroup.apply(_row_logps(reference, *args), group)
    pc, pr = _SumOverGroup.apply(_row_logps(policy, *args), group)
    loss = _dpo_loss(pc, pr, rc, rr)
    loss.backward()
    # the same step without SP: whole rows, plain models
    ref_policy, ref_reference = copy.deepcopy(base), copy.deepcopy(base).eval()
    shift = F.pad(labels[:, 1:], (0, 1), value=-100)
    whole = (rows, pair["position_ids"], shift)
    with torch.no_grad():
        erc, err_ = _row_logps(ref_reference, *whole)
    epc, epr = _row_logps(ref_policy, *whole)
    expected = _dpo_loss(epc, epr, erc, err_)
    expected.backward()
    floor = 1e-5 * torch.stack([q.grad.norm() for q in ref_policy.parameters()]).norm().item()
    grad_errs = []
    for p, q in zip(policy.parameters(), ref_policy.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        grad_errs.append(rel_err(grad, q.grad, floor))
    return {"loss": rel_err(loss.detach(), expected.detach()), "grad": max(grad_errs),
            "logps": rel_err(torch.stack([pc, pr, rc, rr]).detach(), torch.stack([epc, epr, erc, err_]).detach()),
            "reference_eval": not reference.training, "reference_frozen": not any(
                p.requires_grad for p in reference.parameters())}

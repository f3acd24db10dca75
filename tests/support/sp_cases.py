"""Rank functions shared by the SP equivalence tests: SP training vs the unsharded model."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
from ds_ulysses import enable_sp_loss, tile_attention, tile_norms
from ds_ulysses.memory import TiledHeads

from tests.support.models import VOCAB, rel_err, tiny_config, tiny_model


def make_sample(seed: int, length: int, bs: int = 1, docs: list[int] | None = None,
                mask_crossing: bool = True, right_pad: int = 0, left_pad: tuple[int, ...] = ()) -> dict:
    """input_ids/labels/position_ids; with ``docs`` the sample packs documents of those lengths.

    ``mask_crossing`` sets the label of each document's first token to -100, so no token is trained
    to predict the next document (what a packing collator does). ``right_pad`` pads the last row's
    end: an attention_mask with that many zeros, their labels -100 (what a padding collator does).
    ``left_pad[r]`` pads row r's beginning the same way (Llama's tokenizer pads on the left), so the last
    pad predicts the row's first real token, as DataCollatorForLanguageModeling labels it.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (bs, length), generator=g)
    labels = ids.clone()
    if docs is None:
        pos = torch.arange(length).expand(bs, length).clone()
    else:
        if sum(docs) != length:
            raise ValueError(f"docs {docs} do not add up to {length}")
        pos = torch.cat([torch.arange(n) for n in docs]).expand(bs, length).clone()
        starts = torch.tensor(docs).cumsum(0)[:-1]
        if mask_crossing:
            labels[:, starts] = -100
    sample = {"input_ids": ids, "labels": labels, "position_ids": pos}
    if right_pad or any(left_pad):
        sample["attention_mask"] = torch.ones_like(ids)
    if right_pad:
        sample["attention_mask"][-1, length - right_pad:] = 0
        labels[-1, length - right_pad:] = -100
    for row, pad in enumerate(left_pad):
        sample["attention_mask"][row, :pad] = 0
        labels[row, :pad] = -100
    return sample


def reference_loss(model, sample: dict) -> torch.Tensor:
    """Token-mean loss of the row's labels, with every document of every row run alone (under the
    sample's attention_mask, when it has one)."""
    ids, labels, pos = sample["input_ids"], sample["labels"], sample["position_ids"]
    mask = sample.get("attention_mask", torch.ones_like(ids))
    rows = []
    for row in range(ids.shape[0]):
        starts = [0] + [i for i in range(1, ids.shape[1]) if pos[row, i] != pos[row, i - 1] + 1] + [ids.shape[1]]
        rows.append(torch.cat([model(input_ids=ids[row:row + 1, a:b], position_ids=pos[row:row + 1, a:b],
                                     attention_mask=mask[row:row + 1, a:b]).logits[0]
                               for a, b in zip(starts[:-1], starts[1:])]))
    logits = torch.stack(rows)                                               # [bs sl V]
    target = F.pad(labels[:, 1:], (0, 1), value=-100)                        # [bs sl]
    total = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
    return total / (target != -100).sum().clamp(min=1)


def flash_standin(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                  softcap=None, s_aux=None, **kwargs):
    """Checks flash_attention_2's calling contract and computes what its varlen path would.

    Flash kernels take q ``[bs hc sl hs]`` with fewer KV heads (GQA by head ratio), no mask, and
    find packed documents from the global ``position_ids [bs sl]``; they return ``[bs sl hc hs]``. Like
    Transformers' flash path they take ``sliding_window`` (a query sees the keys less than that many positions
    back) and ``softcap`` (``softcap * tanh(scores / softcap)``), and a kernel with attention sinks (FA3's
    ``s_aux``) one sink per query head at the call, a logit that joins each query's softmax with no value
    behind it.
    """
    bs, hc, sl, hs = query.shape
    if attention_mask is not None:
        raise AssertionError("flash path must get no attention mask")
    pos = kwargs["position_ids"]
    if tuple(pos.shape) != (bs, sl):
        raise AssertionError(f"flash path needs global position_ids [bs, sl], got {tuple(pos.shape)}")
    if hc % key.shape[1]:
        raise AssertionError(f"flash needs q heads divisible by kv heads, got {hc}/{key.shape[1]}")
    rep = hc // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    doc = starts.cumsum(1)
    idx = torch.arange(sl)
    mask = (idx[:, None] >= idx[None, :])[None] & (doc[:, :, None] == doc[:, None, :])  # [bs sl sl]
    if sliding_window is not None:
        mask = mask & (idx[:, None] - idx[None, :] < sliding_window)[None]
    scores = (query @ key.transpose(-1, -2)) * (scaling if scaling is not None else hs ** -0.5)  # [bs hc sl sl]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    if s_aux is not None:
        if tuple(s_aux.shape) != (hc,):
            raise AssertionError(
                f"s_aux must hold one sink per query head at the call [{hc}], got {tuple(s_aux.shape)}")
        scores = torch.cat([scores, s_aux.view(1, hc, 1, 1).expand(bs, hc, sl, 1).to(scores.dtype)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :sl]
    return (probs @ value).transpose(1, 2), None


def _build(case: dict, world_size: int):
    cfg = tiny_config(case.get("family", "llama"), case.get("heads", 4), case.get("kv_heads"),
                      head_dim=case.get("head_dim", 8), layers=case.get("layers", 2),
                      attn=case.get("ref_attn", "sdpa"), **case.get("extra", {}))
    base = tiny_model(cfg)
    bs = case.get("bs", 1)
    lens = case.get("lens", [case.get("length", 16)] * world_size)
    samples = [make_sample(100 + k, lens[k], bs, case.get("docs"), case.get("mask_crossing", True),
                           case.get("right_pad", 0), case.get("left_pad", ())) for k in range(world_size)]
    return base, samples, bs


def sp_vs_reference(rank: int, world_size: int, case: dict) -> dict:
    """Train one step per SP micro-batch; compare loss and SP-summed grads to the unsharded model
    (``case["compile"]``: the SP model run through ``torch.compile`` with that backend;
    ``case["tiled_attention"]``: its attention blocks tiled over that many head groups, or "auto";
    ``case["tiled_norms"]``: its norms tiled)."""
    base, samples, bs = _build(case, world_size)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    core = case.get("attn", "sdpa")
    if core.startswith("flash"):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        ALL_ATTENTION_FUNCTIONS[core] = flash_standin
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, core, world_size, bs, scope="model")
    enable_sp_loss(model, mpu.get_sequence_parallel_group())
    tiled_calls = []
    if "tiled_attention" in case:  # each attention block a group of heads at a time; its calls counted
        tile_attention(model, world_size, case["tiled_attention"])
        forward = TiledHeads.forward

        def counted(ctx, fn, module, x, groups, keep, *params):
            tiled_calls.append(groups)
            return forward(ctx, fn, module, x, groups, keep, *params)

        TiledHeads.forward = staticmethod(counted)
    if case.get("tiled_norms"):  # the decoder's norms recomputed; the tiled blocks keep their inputs
        tile_norms(model)
    loader = UlyssesSPDataLoaderAdapter([samples[rank]], mpu.get_sequence_parallel_rank(),
                                        mpu.get_sequence_parallel_group(), world_size, "cpu")
    run = torch.compile(model, backend=case["compile"]) if "compile" in case else model
    loss_errs, grad_errs = [], []
    for k, micro in enumerate(loader):
        loss = run(**micro).loss
        loss.backward()
        ref.zero_grad()
        ref_loss = reference_loss(ref, samples[k])
        ref_loss.backward()
        loss_errs.append(rel_err(loss.detach(), ref_loss.detach()))
        floor = 1e-5 * torch.stack([q.grad.norm() for q in ref.parameters()]).norm().item()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            g = p.grad.clone()
            dist.all_reduce(g, group=mpu.get_sequence_parallel_group())
            grad_errs.append((rel_err(g, q.grad, floor), name))
        model.zero_grad()
    if "tiled_attention" in case:
        TiledHeads.forward = staticmethod(forward)
    return {"loss": max(loss_errs), "grad": max(grad_errs), "steps": len(loss_errs), "tiled_calls": tiled_calls}


def sp_eval_vs_reference(rank: int, world_size: int, case: dict) -> dict:
    """Forward only (eval, no grad): SP loss vs the unsharded per-document loss."""
    base, samples, bs = _build(case, world_size)
    ref, model = copy.deepcopy(base).eval(), copy.deepcopy(base).eval()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, case["attn"], world_size, bs, scope="model")
    enable_sp_loss(model, mpu.get_sequence_parallel_group())
    loader = UlyssesSPDataLoaderAdapter([samples[rank]], mpu.get_sequence_parallel_rank(),
                                        mpu.get_sequence_parallel_group(), world_size, "cpu")
    errs = []
    with torch.no_grad():
        for k, micro in enumerate(loader):
            errs.append(rel_err(model(**micro).loss, reference_loss(ref, samples[k])))
    return {"loss": max(errs), "steps": len(errs)}


def run_cases(rank: int, world_size: int, fn_name: str, cases: dict) -> dict:
    """Several cases in one process group (spawning ranks costs more than a tiny case)."""
    import traceback

    import ds_ulysses

    fn = globals()[fn_name]
    out = {}
    for name, case in cases.items():
        try:
            out[name] = fn(rank, world_size, case)
        except Exception:  # reported per case by the test that owns it
            out[name] = traceback.format_exc()
        finally:  # each case registers afresh (a flash case puts its stand-in kernel in Transformers' table)
            ds_ulysses.uninstall()
    return out

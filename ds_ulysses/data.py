"""The data loader adapter: every SP rank's sample, sharded on the sequence, to every SP rank.

Dimension legend::

    bs  batch   sl  sequence length (padded to a multiple of ws)   sl_l = sl / ws   ws  SP world size

Each rank draws one batch from its own loader; the SP group then processes those ws batches one
after the other, each sharded over the group. A refill is one all-to-all: rank ``r`` sends peer
``p`` the ``p``-th sequence shard of its batch, so a rank receives ``sl`` tokens per tensor (its
shard of each of the ws batches), where an all_gather of whole batches would deliver ``sl * ws``.
All tensors of a batch travel in the same collective, as bytes. A small metadata exchange first
checks that every rank's batch agrees in keys and dtypes, so a mismatch raises on every rank alike
instead of aborting gloo or hanging NCCL.
"""

from __future__ import annotations

import json
from collections import deque

import torch
import torch.distributed as dist

__all__ = ["UlyssesSPDataLoaderAdapter", "prepare_sample", "AdapterCounter"]


class AdapterCounter:
    """Bytes this process received in refills' tensor all-to-alls (tests and benchmarks read it)."""

    bytes_received = 0


def prepare_sample(batch: dict, sp_world_size: int, pad_to_multiple: bool = True, pad_token_id: int = 0) -> dict:
    """Shift labels, add missing position_ids, pad the sequence to a multiple of ``sp_world_size``.

    ``labels`` become ``shift_labels`` (left by one, ``-100`` appended) before padding, so the
    model never has to shift across a shard boundary. Padded tokens get ``-100`` labels and
    position_ids that continue the last document: causal attention never lets real tokens see them.
    """
    batch = dict(batch)
    if "input_ids" not in batch or not torch.is_tensor(batch["input_ids"]) or batch["input_ids"].dim() < 2:
        got = type(batch.get("input_ids")).__name__ if "input_ids" in batch else f"keys {sorted(batch)}"
        raise ValueError(
            f"each batch needs a tensor 'input_ids' of shape [bs, sl]; got {got}; "
            "collate samples into a dict with input_ids (and labels, position_ids)")
    bs, sl = batch["input_ids"].shape[:2]
    for key, value in batch.items():
        if torch.is_tensor(value) and (value.dim() < 2 or value.shape[1] != sl):
            raise ValueError(
                f"batch tensors must share the sequence length on dim 1: input_ids has {sl} tokens "
                f"but '{key}' has shape {list(value.shape)}; pad or truncate every tensor of a sample "
                "to the same length")
    if "position_ids" not in batch:
        batch["position_ids"] = torch.arange(sl).expand(bs, sl).clone()
    if "labels" in batch:
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    pad = -sl % sp_world_size
    if pad and not pad_to_multiple:
        raise ValueError(
            f"sequence length {sl} is not divisible by sequence_parallel_size={sp_world_size}; "
            f"pad every sample to a multiple of {sp_world_size} (e.g. {sl + pad} tokens), or set "
            "\"pad_to_multiple\": true in the ulysses section")
    if pad:
        for key, value in batch.items():
            if not torch.is_tensor(value):
                continue
            if key == "position_ids":
                step = torch.arange(1, pad + 1, dtype=value.dtype)
                batch[key] = torch.cat([value, value[:, -1:] + step], dim=1)
                continue
            fill = {"input_ids": pad_token_id, "shift_labels": -100}.get(key, 0)
            tail = value.new_full((value.shape[0], pad, *value.shape[2:]), fill)
            batch[key] = torch.cat([value, tail], dim=1)
    return batch


class UlyssesSPDataLoaderAdapter:
    """Iterator over sequence shards; drop-in for DeepSpeed's adapter of the same name.

    ``len()`` is ``len(dl) * sp_world_size``; micro-batch ``k`` of a refill is SP rank ``k``'s batch,
    sharded on dim 1; tensor shards are on CPU, non-tensor entries are copied unchanged. Beyond
    DeepSpeed's: ranks may draw samples of different lengths, any length is padded to a multiple of
    sp (``pad_to_multiple``), and missing position_ids are generated.
    """

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device,
                 *, pad_to_multiple: bool = True, pad_token_id: int = 0):
        self.dl = dl
        self.sp_rank, self.sp_group, self.sp_world_size = sp_rank, sp_group, sp_world_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.pad_to_multiple, self.pad_token_id = pad_to_multiple, pad_token_id
        self.iter = iter(dl)
        self.micro_batches: deque = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            batch = None
        if batch is not None:
            batch = prepare_sample(batch, self.sp_world_size, self.pad_to_multiple, self.pad_token_id)
        metas = self._exchange_meta(batch)
        if any(m is None for m in metas):
            # an epoch ends for the whole group together; the next iteration starts a new one
            self.iter = iter(self.dl)
            raise StopIteration
        _check_agreement(metas)
        tensors = self._exchange_tensors(batch, metas)
        for k, meta in enumerate(metas):
            micro = dict(meta["objects"])
            micro.update(tensors[k])
            self.micro_batches.append({key: micro[key] for key in meta["order"]})

    # -- collectives ----------------------------------------------------------------------------
    def _exchange_meta(self, batch) -> list:
        meta = None
        if batch is not None:
            tensors = {k: v for k, v in batch.items() if torch.is_tensor(v)}
            objects = {k: v for k, v in batch.items() if not torch.is_tensor(v)}
            meta = {
                "order": list(batch),
                "tensors": {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in tensors.items()},
                "objects": objects,
            }
        if self.sp_world_size == 1:
            return [meta]
        try:
            payload = json.dumps(meta).encode()
            json_ok = torch.tensor([1], device=self.device)
        except (TypeError, ValueError):
            payload, json_ok = b"", torch.tensor([0], device=self.device)
        # one tiny all_reduce decides whether every rank's metadata is JSON; if not, fall back to
        # all_gather_object (pickle) for this refill only
        dist.all_reduce(json_ok, op=dist.ReduceOp.MIN, group=self.sp_group)
        if not json_ok.item():
            metas = [None] * self.sp_world_size
            dist.all_gather_object(metas, meta, group=self.sp_group)
            return metas
        return [json.loads(raw) for raw in _all_gather_bytes(payload, self.sp_group, self.sp_world_size, self.device)]

    def _exchange_tensors(self, batch, metas) -> list[dict]:
        ws, me = self.sp_world_size, self.sp_rank
        keys = sorted(metas[0]["tensors"])
        if ws == 1:
            return [{k: batch[k].cpu() for k in keys}]
        # send: peer p gets shard p of each of my tensors, as raw bytes, keys in sorted order
        chunks, send_sizes = [], []
        for p in range(ws):
            size = 0
            for k in keys:
                value = batch[k]
                sl_l = value.shape[1] // ws
                part = value[:, p * sl_l:(p + 1) * sl_l].contiguous().view(torch.uint8).reshape(-1)
                chunks.append(part)
                size += part.numel()
            send_sizes.append(size)
        send = torch.cat(chunks).to(self.device)
        shapes = [{k: _shard_shape(metas[src]["tensors"][k][1], ws) for k in keys} for src in range(ws)]
        dtypes = {k: getattr(torch, metas[0]["tensors"][k][0]) for k in keys}
        recv_sizes = [sum(_numel(shapes[src][k]) * _itemsize(dtypes[k]) for k in keys) for src in range(ws)]
        recv = send.new_empty(sum(recv_sizes))
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.sp_group)
        AdapterCounter.bytes_received += sum(recv_sizes) - recv_sizes[me]
        out = []
        for src, block in enumerate(recv.cpu().split(recv_sizes)):
            offset, micro = 0, {}
            for k in keys:
                nbytes = _numel(shapes[src][k]) * _itemsize(dtypes[k])
                micro[k] = block[offset:offset + nbytes].clone().view(dtypes[k]).view(shapes[src][k])
                offset += nbytes
            out.append(micro)
        return out


def _shard_shape(shape, ws):
    return [shape[0], shape[1] // ws, *shape[2:]]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _all_gather_bytes(payload: bytes, group, ws: int, device) -> list[bytes]:
    size = torch.tensor([len(payload)], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(ws)]
    dist.all_gather(sizes, size, group=group)
    buf = torch.zeros(max(int(s) for s in sizes), dtype=torch.uint8)
    buf[:len(payload)] = torch.tensor(list(payload), dtype=torch.uint8)
    buf = buf.to(device)
    bufs = [torch.empty_like(buf) for _ in range(ws)]
    dist.all_gather(bufs, buf, group=group)
    return [b[:int(s)].cpu().numpy().tobytes() for b, s in zip(bufs, sizes)]


def _check_agreement(metas) -> None:
    first = metas[0]["tensors"]
    for rank, meta in enumerate(metas[1:], start=1):
        mine = meta["tensors"]
        if sorted(mine) != sorted(first):
            raise ValueError(
                f"SP ranks drew batches with different tensor keys: rank 0 has {sorted(first)}, rank "
                f"{rank} has {sorted(mine)}; every rank's loader must yield the same keys")
        for key, (dtype, shape) in mine.items():
            if dtype != first[key][0] or shape[2:] != first[key][1][2:]:
                raise ValueError(
                    f"SP ranks disagree on '{key}': rank 0 has {first[key][0]} {first[key][1]}, rank "
                    f"{rank} has {dtype} {shape}; only the batch and sequence dims may differ")

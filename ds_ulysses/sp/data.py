"""The data loader adapter: every SP rank's sample, sharded on the sequence, to every SP rank.

Dimension legend::

    bs  batch   sl  sequence length (padded to a multiple of ws)   sl_l = sl / ws   ws  SP world size

With a ring (``ring_size > 1``) each sample is laid out head-tail at ring granularity after its labels are
shifted and it is padded (:func:`ds_ulysses.distributed.ring.head_tail_order`), so that the group's contiguous
shards give every ring rank an equal share of the causal work; a sum over tokens (the loss) does not see the
order, and :func:`~ds_ulysses.distributed.ring.natural_order` brings gathered per-token outputs back.

Each rank draws one batch from its own loader; the SP group then processes those ws batches one
after the other, each sharded over the group. A refill is one all-to-all: rank ``r`` sends peer
``p`` the ``p``-th sequence shard of its batch, so a rank receives ``sl`` tokens per tensor (its
shard of each of the ws batches), where an all_gather of whole batches would deliver ``sl * ws``.
All tensors of a batch travel in the same collective, as bytes. A small JSON metadata exchange
first carries each rank's verdict on its own batch (:func:`ds_ulysses.sp.batch_check.check_batch`) and
checks that every rank's batch agrees in keys and dtypes, so a bad batch raises the same error on
every rank instead of raising on one while the others hang, or aborting gloo. Non-tensor entries
travel as JSON too: nothing a peer sends is unpickled. Every shard's ``input_ids`` is fingerprinted
in :data:`ds_ulysses.sp.shards.SHARDS`, so a model whose SP was configured by a section or by
Accelerate can tell its shard from a batch that never went through an adapter.
"""

from __future__ import annotations

import copy
import json
import math
from collections import deque
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..constants import IGNORE_INDEX
from ..distributed.collectives import all_gather_bytes, collective_device
from ..distributed.ring import head_tail_order
from ..distributed.watch import GroupWatch
from .batch_check import VARLEN_KEYS, check_batch, first_error, is_int_tensor
from .packed import find_documents
from .shards import SHARDS

__all__ = ["UlyssesSPDataLoaderAdapter", "prepare_sample", "continue_over_right_padding"]


def prepare_sample(batch: dict, sp_world_size: int, pad_to_multiple: bool = True, pad_token_id: int = 0,
                   vocab_size: int | None = None, *, ring_size: int = 1) -> dict:
    """Check the batch, shift labels, add missing position_ids, pad to a multiple of ``sp_world_size``.

    ``labels`` become ``shift_labels`` (left by one, ``-100`` appended) before padding, so the
    model never has to shift across a shard boundary. Padded tokens get ``-100`` labels, position_ids
    that continue the last document (causal attention never lets real tokens see them) and 0 in the
    attention mask (one is added when the batch has none), so what counts tokens (a MoE router's loss)
    does not count them.
    With ``vocab_size``, token ids and labels are range-checked here, where the sample is known,
    rather than failing inside an embedding or the loss on one rank. With ``ring_size > 1`` the multiple is
    also one of ``2 * ring_size`` (head and tail chunks per ring rank), right padding continues its row's
    positions (:func:`continue_over_right_padding`), and every tensor's sequence dim is then put in
    head-tail order, position_ids and masks with the tokens, shifted labels with their tokens.
    """
    batch = varlen_as_positions(batch)
    check_batch(batch, vocab_size)
    batch = dict(batch)
    bs, sl = batch["input_ids"].shape
    if "position_ids" not in batch:
        batch["position_ids"] = torch.arange(sl).expand(bs, sl).clone()
    if "labels" in batch:
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    if ring_size > 1 and "attention_mask" in batch:
        batch["position_ids"] = continue_over_right_padding(batch)
    multiple = sp_world_size if ring_size == 1 else math.lcm(sp_world_size, 2 * ring_size)
    pad = -sl % multiple
    if pad and not pad_to_multiple:
        ring = "" if ring_size == 1 else f" x 2 x ring_size={ring_size} (head-tail chunks), i.e. {multiple}"
        raise ValueError(
            f"sequence length {sl} is not divisible by sequence_parallel_size={sp_world_size}{ring}; "
            f"pad every sample to a multiple of {multiple} (e.g. {sl + pad} tokens), or set "
            "\"pad_to_multiple\": true in the ulysses section")
    if pad:
        if "attention_mask" not in batch:
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        for key, value in batch.items():
            if not torch.is_tensor(value):
                continue
            if key == "position_ids":
                step = torch.arange(1, pad + 1, dtype=value.dtype)
                batch[key] = torch.cat([value, value[:, -1:] + step], dim=1)
                continue
            fill = {"input_ids": pad_token_id, "shift_labels": IGNORE_INDEX}.get(key, 0)
            tail = value.new_full((value.shape[0], pad, *value.shape[2:]), fill)
            batch[key] = torch.cat([value, tail], dim=1)
    if ring_size > 1:
        order = head_tail_order(sl + pad, ring_size)  # [sl]
        batch = {k: v[:, order] if torch.is_tensor(v) else v for k, v in batch.items()}
    return batch


def continue_over_right_padding(batch: dict) -> torch.Tensor:
    """The batch's position_ids with each row's right padding (attention mask 0 after its last real token)
    continuing the row's +1 run.

    The ring's causal kernel takes no document mask, so padding whose positions restart at 0 (TRL's collator
    under SP writes them so) would read as a packed document and be refused. Such padding is seen by no real
    token (causal attention) and predicts no label (:func:`~ds_ulysses.sp.batch_check.check_batch` refuses padding
    whose next label is not -100), so its positions change nothing the loss sees; continuing the run is what the
    model computes without SP when given no position_ids."""
    positions, real = batch["position_ids"], batch["attention_mask"] != 0  # [bs sl]
    index = torch.arange(positions.shape[1]).expand_as(positions)          # [bs sl]
    tail = real.long().flip(1).cumsum(dim=1).flip(1) == 0                  # after a row's last real token
    last = torch.where(real, index, 0).amax(dim=1, keepdim=True)          # [bs 1] (0 for a row of padding)
    base = positions.gather(1, last) - last                                # [bs 1] the run's position at index 0
    return torch.where(tail, base + index, positions).to(positions.dtype)


def varlen_as_positions(batch):
    """``batch`` without :data:`VARLEN_KEYS`, its documents carried by position_ids alone.

    The offsets describe the whole row: no shard can use them, and they stop matching it once the
    adapter pads it. Position_ids carry the same documents (the SP attention finds them there, as
    Transformers' sdpa masks do without SP), so the offsets are dropped once position_ids are checked
    to restart exactly at them, or become position_ids when the batch has none. A batch where the two
    disagree is refused: which one the attention follows without SP depends on its kernel.
    """
    if not isinstance(batch, Mapping) or not any(k in batch for k in VARLEN_KEYS):
        return batch
    out = {k: v for k, v in batch.items() if k not in VARLEN_KEYS}
    offsets, ids = _varlen_offsets(batch), out.get("input_ids")
    if offsets is None or not torch.is_tensor(ids) or ids.dim() != 2 or ids.numel() == 0:
        return out  # check_batch names what is wrong with input_ids
    bs, sl = ids.shape
    if bs != 1 or offsets[0] != 0 or offsets[-1] != sl or bool((offsets.diff() < 0).any()):
        raise ValueError(
            f"the varlen offsets {offsets.tolist()} must be those of one packed row, rising from 0 to its {sl} "
            f"tokens; got input_ids of shape {[bs, sl]}; expected [1, sl] with offsets [0, ..., {sl}]; fix: pack "
            "with a padding-free collator (one row per batch), or leave the offsets out")
    lengths = offsets.diff()
    starts = offsets[:-1][lengths > 0].tolist()
    given = out.get("position_ids")
    if given is None:
        out["position_ids"] = torch.cat([torch.arange(int(n)) for n in lengths[lengths > 0]]).view(1, sl)  # [1 sl]
    elif torch.is_tensor(given) and given.shape == (1, sl) and is_int_tensor(given):
        restarts = [start for _, start, _ in find_documents(given).spans]
        if restarts != starts:
            raise ValueError(
                f"the varlen offsets put documents at {starts} but position_ids restart at {restarts}; expected the "
                "two to agree (flash attention follows the offsets, sdpa the positions); fix: build both from the "
                "same document lengths, or leave the offsets out")
    return out


def _varlen_offsets(batch) -> torch.Tensor | None:
    """The batch's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (one, or both equal), as int64 on CPU."""
    given = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k") if k in batch}
    for key, value in given.items():
        if not torch.is_tensor(value) or value.dim() != 1 or not is_int_tensor(value):
            got = f"{value.dtype} {list(value.shape)}" if torch.is_tensor(value) else type(value).__name__
            raise ValueError(f"'{key}' must be a 1-D integer tensor of document offsets [0, ..., sl]; got {got}; "
                             "fix: build it as Transformers' DataCollatorWithFlattening does, or leave it out")
    if len(given) == 2 and not torch.equal(given["cu_seq_lens_q"].cpu(), given["cu_seq_lens_k"].cpu()):
        raise ValueError(f"'cu_seq_lens_q' {given['cu_seq_lens_q'].tolist()} and 'cu_seq_lens_k' "
                         f"{given['cu_seq_lens_k'].tolist()} differ; expected one set of documents (a causal LM "
                         "attends within its own sequence); fix: give both the same offsets")
    return next(iter(given.values())).cpu().long() if given else None


class UlyssesSPDataLoaderAdapter:
    """Iterator over sequence shards; drop-in for DeepSpeed's adapter of the same name.

    ``len()`` is ``len(dl) * sp_world_size``; micro-batch ``k`` of a refill is SP rank ``k``'s batch,
    sharded on dim 1; tensor shards are on CPU, non-tensor entries are copied unchanged. Beyond
    DeepSpeed's: ranks may draw samples of different lengths, any length is padded to a multiple of
    sp (``pad_to_multiple``), and missing position_ids are generated. ``ring_size`` (the mesh's) lays each
    sample out head-tail for the ring attention (:func:`prepare_sample`). ``vocab_size`` range-checks
    token ids and labels at refill; ``watch`` (the mesh's ``sp_watch``) names the group and step if
    an exchange fails. A bad batch on any rank raises the same error on every rank.
    """

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device,
                 *, pad_to_multiple: bool = True, pad_token_id: int = 0, vocab_size: int | None = None,
                 watch: GroupWatch | None = None, ring_size: int = 1):
        self.dl = dl
        self.ring_size = ring_size
        self.sp_rank, self.sp_group, self.sp_world_size = sp_rank, sp_group, sp_world_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.pad_to_multiple, self.pad_token_id, self.vocab_size = pad_to_multiple, pad_token_id, vocab_size
        self.watch = watch if watch is not None else GroupWatch.of_group(sp_group)
        self.iter = iter(dl)
        self.micro_batches: deque = deque()

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped loader (Transformers' Trainer sets each epoch's shuffling seed)."""
        if hasattr(self.dl, "set_epoch"):
            self.dl.set_epoch(epoch)

    def resumed(self, micro_batches: int, skip_first_batches) -> "UlyssesSPDataLoaderAdapter":
        """This adapter as it stands ``micro_batches`` into an epoch, for a resumed run.

        ``skip_first_batches(dl, n)`` skips the wrapped loader's first ``n`` batches (Accelerate's of the
        same name): every refill draws one batch and yields ``sp_world_size`` micro-batches, so that is
        ``micro_batches // sp_world_size`` batches, and the rest are drawn and dropped (a refill, on every
        rank of the group together).
        """
        refills, within = divmod(micro_batches, self.sp_world_size)
        adapter = copy.copy(self)
        adapter.dl = skip_first_batches(self.dl, refills)
        adapter.iter, adapter.micro_batches = iter(adapter.dl), deque()
        for _ in range(within):
            next(adapter)
        return adapter

    def with_ring(self, ring_size: int) -> "UlyssesSPDataLoaderAdapter":
        """This adapter, before its first refill, laying samples out for a ring of ``ring_size``
        (:func:`prepare_sample`): for an adapter built by a caller that knows no ring (Accelerate builds it
        with DeepSpeed's five arguments), once the mesh's ring is known."""
        if self.micro_batches:
            raise ValueError(
                f"with_ring({ring_size}) on an adapter holding {len(self.micro_batches)} micro-batches laid out for "
                f"ring_size={self.ring_size}; expected an adapter before its first refill; fix: call with_ring "
                "before iterating the adapter")
        adapter = copy.copy(self)
        adapter.ring_size, adapter.iter, adapter.micro_batches = ring_size, iter(self.dl), deque()
        return adapter

    def __len__(self) -> int:
        # each batch the wrapped loader yields becomes sp micro-batches: one per sample owner in the group
        return self.sp_world_size * len(self.dl)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Draw this rank's batch, check it, and exchange shards with the SP group.

        A rank whose batch fails its checks does not raise on its own (its peers would wait in the
        exchange): its error travels in place of its metadata, and every rank raises it.
        """
        try:
            batch = next(self.iter)
        except StopIteration:
            batch = None
        error = None
        if batch is not None:
            try:
                batch = prepare_sample(batch, self.sp_world_size, self.pad_to_multiple, self.pad_token_id,
                                       self.vocab_size, ring_size=self.ring_size)
            except ValueError as err:
                if self.sp_world_size == 1:
                    raise
                batch, error = None, str(err)
        metas = self._exchange_meta(batch, error)
        message = first_error([(r, m["error"]) for r, m in enumerate(metas) if m is not None and "error" in m])
        if message is not None:
            raise ValueError(message)
        if any(m is None for m in metas):
            # an epoch ends for the whole group together; the next iteration starts a new one
            self.iter = iter(self.dl)
            raise StopIteration
        _fill_masks(batch, metas)
        _check_agreement(metas)
        tensors = self._exchange_tensors(batch, metas)
        for k, meta in enumerate(metas):
            micro = dict(meta["objects"])
            micro.update(tensors[k])
            self.micro_batches.append({key: micro[key] for key in meta["order"]})
        if self.sp_world_size > 1:
            SHARDS.record(self.sp_group, [shards["input_ids"] for shards in tensors])

    # -- collectives ----------------------------------------------------------------------------
    def _exchange_meta(self, batch, error: str | None = None) -> list:
        """Every rank's batch description (or its error), as JSON: peers' data is never unpickled."""
        meta = None if error is None else {"error": error}
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
        except (TypeError, ValueError):
            payload = json.dumps({"error": _not_json(meta["objects"])}).encode()
        with self.watch.collective("the data adapter's metadata exchange"):
            raws = all_gather_bytes(payload, self.sp_group)
        return [json.loads(raw) for raw in raws]

    def _exchange_tensors(self, batch, metas) -> list[dict]:
        ws = self.sp_world_size
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
        send = torch.cat(chunks).to(collective_device(self.sp_group))
        shapes = [{k: _shard_shape(metas[src]["tensors"][k][1], ws) for k in keys} for src in range(ws)]
        dtypes = {k: _dtype(metas[0]["tensors"][k][0]) for k in keys}
        recv_sizes = [sum(_numel(shapes[src][k]) * _itemsize(dtypes[k]) for k in keys) for src in range(ws)]
        recv = send.new_empty(sum(recv_sizes))
        with self.watch.collective("the data adapter's shard exchange"):
            dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.sp_group)
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


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a peer described a tensor dtype as {name!r}; expected a torch dtype name")
    return dtype


def _not_json(objects: dict) -> str:
    bad = []
    for key, value in objects.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            bad.append(f"'{key}' ({type(value).__name__})")
    return (f"non-tensor batch entries {', '.join(bad)} are not JSON-serializable; they are sent to SP "
            "peers as JSON (never pickled); expected str, int, float, bool, None, or lists/dicts of those; "
            "fix: convert them (e.g. to lists or tensors) or drop them from the batch in the collator")


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _fill_masks(batch: dict, metas: list) -> None:
    """Give every batch without an attention mask one of ones (every token real, which is what no mask
    means) when a peer's batch has one: :func:`prepare_sample` adds one where it pads, and ranks pad
    samples of different lengths differently, while the group exchanges one set of keys. ``batch`` and
    ``metas`` (every rank's description, alike on every rank) are updated in place."""
    dtype = next((m["tensors"]["attention_mask"][0] for m in metas if "attention_mask" in m["tensors"]), None)
    if dtype is None:
        return
    for meta in metas:
        if "attention_mask" not in meta["tensors"]:
            meta["tensors"]["attention_mask"] = [dtype, meta["tensors"]["input_ids"][1][:2]]
            meta["order"].append("attention_mask")
    if "attention_mask" not in batch:
        batch["attention_mask"] = torch.ones(batch["input_ids"].shape[:2], dtype=_dtype(dtype))


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

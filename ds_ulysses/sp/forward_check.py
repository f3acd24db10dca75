"""The once-per-forward check of the SP attention's inputs, exchanged as one typed record.

Every SP rank must enter the attention's collectives with its shard of the same micro-batch. A rank
whose input is wrong (no position_ids, a mis-shaped tensor, another batch size, dtype or head layout
than its peers) must not raise alone while the others wait in the all-to-all. So each rank describes its
forward as a :class:`ForwardFacts` record; the records of all SP ranks are all-gathered once per
model forward (the gather that also carries each rank's shard length), and :func:`check_forward`
raises the same error on every rank, or none.

:class:`PositionCheck` is the verdict on the position_ids of one call. The SP attention makes it from
the kwargs it receives; the decoder pre-hook that Transformers registration installs makes it from
the model call itself (Transformers would otherwise invent local ``arange`` positions, silently
wrong under SP) and hands it to the attention for the next gather.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch

from .batch_check import VARLEN_KEYS, first_error, is_int_tensor

__all__ = ["Problem", "PositionCheck", "ShardStatus", "ShardCheck", "ForwardFacts", "check_positions",
           "check_forward"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)


def dtype_code(dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def dtype_name(code: int) -> str:
    return str(_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_DTYPES) else "an unsupported dtype"


class Problem(enum.IntEnum):
    OK = 0
    NO_POSITIONS = 1
    POSITIONS_DTYPE = 2
    POSITIONS_SHAPE = 3
    NEGATIVE_POSITIONS = 4
    NOT_FORWARDED = 5      # the model call had position_ids; its attention call and its embeddings none
    VARLEN_OFFSETS = 6     # the attention call carries a batch's varlen offsets (cu_seq_lens_*, max_length_*)
    MASK_LOOKS_AHEAD = 7   # the model's mask lets a token attend to the next one (a bidirectional overlay)


@dataclass(frozen=True)
class PositionCheck:
    """This rank's position_ids against its shard ``[bs, sl_l]``."""

    problem: int = Problem.OK
    dtype: int = -1      # dtype code when the dtype is the problem
    ndim: int = 0
    dim0: int = 0
    dim1: int = 0
    minimum: int = 0     # the negative value when that is the problem

    @property
    def ok(self) -> bool:
        return self.problem == Problem.OK


def check_positions(position_ids, bs: int, sl_l: int) -> PositionCheck:
    if position_ids is None:
        return PositionCheck(Problem.NO_POSITIONS)
    if not torch.is_tensor(position_ids) or not is_int_tensor(position_ids):
        return PositionCheck(Problem.POSITIONS_DTYPE,
                             dtype_code(position_ids.dtype) if torch.is_tensor(position_ids) else -1)
    dims = list(position_ids.shape) + [0, 0]
    shape = dict(ndim=position_ids.dim(), dim0=dims[0], dim1=dims[1])
    if position_ids.dim() != 2 or position_ids.shape[1] != sl_l or position_ids.shape[0] not in (1, bs):
        return PositionCheck(Problem.POSITIONS_SHAPE, **shape)
    if position_ids.numel() and int(position_ids.min()) < 0:
        return PositionCheck(Problem.NEGATIVE_POSITIONS, minimum=int(position_ids.min()), **shape)
    return PositionCheck(Problem.OK, **shape)


class ShardStatus(enum.IntEnum):
    UNCHECKED = 0    # SP not configured by a section / parallelism_config (drop-in), or no input_ids
    SHARD = 1        # a shard the data adapter yielded for this SP group
    NOT_A_SHARD = 2  # the adapter ran for this group, but this input is none of its shards
    NO_ADAPTER = 3   # no adapter ever yielded for this group


@dataclass(frozen=True)
class ShardCheck:
    """This rank's model input against the shards the data adapter yielded (:mod:`ds_ulysses.sp.shards`)."""

    status: int = ShardStatus.UNCHECKED
    serial: int = -1     # which yielded micro-batch (SHARD; -1 when two micro-batches look alike)
    rows: int = 0        # the input's [bs, sl_l] when it is not a shard
    cols: int = 0


@dataclass(frozen=True)
class ForwardFacts:
    """What one SP rank's attention sees at the first layer of a forward."""

    seq_len: int          # sl_l: this rank's shard length
    batch: int            # bs
    dtype: int            # dtype code of the query
    heads: int            # query heads at the call
    kv_heads: int         # key/value heads at the call
    head_size: int
    kv_len: int           # the keys' length: sl_l, or more with a KV cache or a prefix
    positions: PositionCheck
    shard: ShardCheck = ShardCheck()

    _SCALARS = 7  # the int fields before positions

    @classmethod
    def of(cls, query: torch.Tensor, key: torch.Tensor, positions: PositionCheck,
           shard: ShardCheck = ShardCheck()) -> "ForwardFacts":
        """Facts of q ``[bs hc sl_l hs]`` and k ``[bs hc_kv sl_l hs]``."""
        bs, hc, sl_l, hs = query.shape
        return cls(sl_l, bs, dtype_code(query.dtype), hc, key.shape[1], hs, key.shape[2], positions, shard)

    def to_tensor(self, device) -> torch.Tensor:
        """The record as one int64 row (``[width]``), for an all_gather."""
        flat = [*dataclasses.astuple(self)[:self._SCALARS], *dataclasses.astuple(self.positions),
                *dataclasses.astuple(self.shard)]
        return torch.tensor(flat, dtype=torch.long, device=device)

    @classmethod
    def from_tensor(cls, row: torch.Tensor) -> "ForwardFacts":
        """Inverse of :meth:`to_tensor`."""
        values = [int(v) for v in row.tolist()]
        split = cls._SCALARS + len(dataclasses.fields(PositionCheck))
        return cls(*values[:cls._SCALARS], PositionCheck(*values[cls._SCALARS:split]), ShardCheck(*values[split:]))


def _cache_message(facts: ForwardFacts) -> str:
    return (f"the SP attention got {facts.kv_len} keys for {facts.seq_len} queries: keys from a KV cache "
            "(model.generate, a forward with past_key_values) or a prefix (PEFT prefix tuning) that this rank "
            "holds alone, where SP exchanges one shard of the sequence for every query, key and value; expected as "
            "many keys as queries; fix: generate in eval mode with SP off there (register with "
            "disable_in_eval=True, or the section's \"disable_in_eval\": true), and train with a weight adapter "
            "(LoRA) rather than a prefix")


def _problem_message(facts: ForwardFacts) -> str:
    pos, bs, sl_l = facts.positions, facts.batch, facts.seq_len
    if pos.problem == Problem.NOT_FORWARDED:
        return ("position_ids reached the model call but not its attention function, and none of the decoder's own "
                "modules (a position or rotary embedding) took that tensor either: the model places its tokens some "
                "other way, so SP cannot tell where each token sits in the whole sequence (or where packed documents "
                "start); expected position_ids in the attention call's kwargs, or taken as given by the model's "
                "position embedding; fix: train this model without sequence parallelism")
    if pos.problem == Problem.VARLEN_OFFSETS:
        return (f"the attention call carries flash attention's varlen offsets ({', '.join(VARLEN_KEYS)}) from the "
                "batch: they place the documents of the whole unsharded row, which neither a shard nor the "
                "gathered, padded sequence matches, so a varlen kernel would attend over the wrong spans; expected "
                "the documents in position_ids only; fix: feed the batches of UlyssesSPDataLoaderAdapter (it turns "
                "the offsets into position_ids), or drop the offsets from the batch")
    if pos.problem == Problem.MASK_LOOKS_AHEAD:
        return ("the model's attention mask lets a token attend to the token after it (a bidirectional overlay: a "
                "PrefixLM's prefix from token_type_ids, image tokens), which SP's attention, causal within each "
                "document of the global position_ids, would drop silently; expected a causal mask; fix: leave "
                "token_type_ids out of the batch (or set config.prefix_lm=False), or train without sequence "
                "parallelism")
    if pos.problem == Problem.NO_POSITIONS:
        return ("Ulysses SP needs position_ids in the model call (each rank's positions within the whole "
                "sequence); got none; fix: pass the batch from UlyssesSPDataLoaderAdapter, or position_ids = "
                "arange(sl) sharded like input_ids")
    if pos.problem == Problem.POSITIONS_DTYPE:
        return (f"position_ids must be an integer tensor, got {dtype_name(pos.dtype)}; fix: build them with "
                "dtype=torch.long")
    if pos.problem == Problem.POSITIONS_SHAPE:
        shape = [pos.dim0, pos.dim1][:pos.ndim] + (["..."] if pos.ndim > 2 else [])
        return (f"position_ids must have shape [bs, sl_l] = [{bs}, {sl_l}] or [1, {sl_l}], got {shape}; fix: "
                "shard position_ids on dim 1 exactly like input_ids")
    return (f"position_ids must be >= 0, got {pos.minimum}; fix: positions count from 0 within each packed "
            "document")


_FEED_FIX = ("fix: feed the model the batches of UlyssesSPDataLoaderAdapter (the loader ds_ulysses.initialize "
             "returns; under Accelerate, prepare the DataLoader in the same accelerator.prepare call as the model; "
             "Transformers' Trainer wraps its train loader itself once ds_ulysses.install() runs before the Trainer "
             "is created)")


def _shard_message(every: list[ForwardFacts]) -> str | None:
    """Every rank's input must be its shard of the micro-batch its peers run (SP configured by a section or
    Accelerate's parallelism_config); anything else would train plain data parallelism, silently."""
    per_rank = []
    for rank, facts in enumerate(every):
        shard = facts.shard
        if shard.status == ShardStatus.NO_ADAPTER:
            per_rank.append((rank, (
                "Ulysses SP is configured for this model, but its input did not come from "
                "UlyssesSPDataLoaderAdapter: no adapter has yielded shards for this SP group, so each rank would "
                "attend over its own whole sequences (plain data parallelism, not SP); expected each rank's input "
                f"to be its shard of a sample the SP group shares; {_FEED_FIX}")))
        elif shard.status == ShardStatus.NOT_A_SHARD:
            per_rank.append((rank, (
                f"Ulysses SP is configured for this model, but its input_ids [{shard.rows}, {shard.cols}] are not a "
                "shard UlyssesSPDataLoaderAdapter yielded for this SP group (whole sequences, another loader, or "
                "input_ids changed after the adapter); SP would treat the ranks' inputs as pieces of one sequence; "
                f"expected each rank's input to be its shard of a sample the SP group shares; {_FEED_FIX}")))
    message = first_error(per_rank)
    serials = [f.shard.serial for f in every if f.shard.status == ShardStatus.SHARD]
    if message is None and len(serials) == len(every) and min(serials) >= 0 and len(set(serials)) > 1:
        message = (f"SP ranks run shards of different micro-batches: per SP rank the adapter's micro-batch "
                   f"{serials}; expected every rank of the group to run its shard of the same micro-batch; fix: "
                   "iterate the adapter the same way on every rank (no rank may skip or repeat a batch)")
    return message


def check_forward(every: list[ForwardFacts], fixed_length: int | None) -> None:
    """Raise the same ValueError on every SP rank when any rank's forward input is wrong."""
    message = _shard_message(every)
    if message is None:
        message = first_error([(r, _cache_message(f)) for r, f in enumerate(every) if f.kv_len != f.seq_len])
    if message is None:
        message = first_error([(r, _problem_message(f)) for r, f in enumerate(every) if not f.positions.ok])
    if message is None:
        for what, values in (("batch size", [f.batch for f in every]),
                             ("attention dtype", [dtype_name(f.dtype) for f in every]),
                             ("head layout (query heads, key/value heads, head size)",
                              [(f.heads, f.kv_heads, f.head_size) for f in every])):
            if len(set(values)) > 1:
                message = (f"SP ranks disagree on the {what}: per SP rank {values}; expected every rank of "
                           "the group to run its shard of the same micro-batch; fix: feed the model through "
                           "UlyssesSPDataLoaderAdapter (or shard one batch on dim 1 across the group)")
                break
    total = sum(f.seq_len for f in every)
    if message is None and fixed_length is not None and total != fixed_length:
        message = (f"seq_length_is_variable is false with seq_length={fixed_length}, but this forward's "
                   f"shards add up to {total} tokens {[f.seq_len for f in every]}; fix: pad or pack every "
                   "sample to seq_length, or set seq_length_is_variable to true")
    if message is not None:
        raise ValueError(message)

"""Which inputs are SP shards: fingerprints of what the data adapter yielded, per SP group.

Under SP each rank's model input must be its shard of a sample the whole SP group shares. Nothing
in a ``[bs, sl_l]`` tensor says so: a rank holding its own whole sample (a loader that was never
wrapped, plain data parallelism) looks like a shard, and Ulysses attention would treat the group's
different samples as one packed sequence. The one component that knows is the adapter, so it
records a fingerprint of every shard it yields, and the decoder's pre-forward hook looks the model
input up here. The verdict (:class:`ShardCheck`) travels in the attention's first gather of the
forward, so every rank of the group raises together (:mod:`ds_ulysses.sp.forward_check`).

The ledger is keyed by the SP process group: DeepSpeed's adapter signature, which Accelerate and
Transformers' Trainer construct, carries the group and no other object to hang the record on.
Entries die with the group (weak keys). Only groups whose SP was configured by a ``"ulysses"``
section or Accelerate's ``parallelism_config`` are checked (:meth:`ShardLedger.require`); the
drop-in API keeps DeepSpeed's contract, where users may shard by hand.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from .forward_check import ShardCheck, ShardStatus

__all__ = ["fingerprint", "ShardLedger", "SHARDS"]

_MODULUS = 2_147_483_647  # 2^31 - 1: weights and ids below it keep every product and sum inside int64
_KEEP = 4096  # fingerprints kept per group: the Trainer prefetches a whole accumulation window of micro-batches


def fingerprint(ids: torch.Tensor) -> tuple[int, ...]:
    """An order-sensitive checksum of an integer tensor, with its shape; the same on every device.

    Computed where the tensor lives (one small reduction and one scalar read); exact integer
    arithmetic, so a shard recorded on the CPU matches the same shard after ``.to(device)``.
    """
    flat = ids.reshape(-1).to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) * 48_271 % _MODULUS
    return (*ids.shape, int(((flat % _MODULUS + 1) * weights % _MODULUS).sum()))


class _GroupShards:
    def __init__(self):
        self.required = False
        self.recorded = 0  # micro-batches the adapters on this group have yielded: the next one's serial
        self.serials: OrderedDict = OrderedDict()  # fingerprint -> serial, or -1 when two micro-batches share it


class ShardLedger:
    """Per SP group: the fingerprints of the shards adapters yielded, and whether inputs are checked."""

    def __init__(self):
        self._groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _of(self, group) -> _GroupShards:
        if group not in self._groups:
            self._groups[group] = _GroupShards()
        return self._groups[group]

    def record(self, group, shards: list[torch.Tensor]) -> None:
        """The ``input_ids`` shards of one refill, in the order the adapter yields them. Every rank of the
        group refills together, so the serials agree across ranks."""
        if group is None:
            return
        entry = self._of(group)
        for ids in shards:
            key = fingerprint(ids)
            entry.serials[key] = -1 if key in entry.serials else entry.recorded  # -1: ambiguous, not compared
            entry.serials.move_to_end(key)
            entry.recorded += 1
            while len(entry.serials) > _KEEP:
                entry.serials.popitem(last=False)

    def require(self, group) -> None:
        """From now on every SP forward on ``group`` must get a shard an adapter yielded."""
        if group is not None:
            self._of(group).required = True

    def release(self, group) -> None:
        if group is not None and group in self._groups:
            self._groups[group].required = False

    def required(self, group) -> bool:
        return group is not None and group in self._groups and self._groups[group].required

    def verdict(self, group, input_ids) -> ShardCheck:
        """This rank's model input against the shards yielded for ``group``."""
        if not self.required(group) or not torch.is_tensor(input_ids):
            return ShardCheck()
        entry = self._groups[group]
        if entry.recorded == 0:
            return ShardCheck(ShardStatus.NO_ADAPTER)
        serial = entry.serials.get(fingerprint(input_ids))
        if serial is None:
            return ShardCheck(ShardStatus.NOT_A_SHARD, rows=input_ids.shape[0], cols=input_ids.shape[-1])
        return ShardCheck(ShardStatus.SHARD, serial=serial)

    def yielded(self, group, input_ids) -> bool:
        """Whether an adapter yielded ``input_ids`` as a shard for ``group`` (checked or not)."""
        entry = self._groups.get(group) if group is not None else None
        return (entry is not None and torch.is_tensor(input_ids)
                and entry.serials.get(fingerprint(input_ids)) is not None)


SHARDS = ShardLedger()
"""The process's ledger. A global only because DeepSpeed's adapter signature carries nothing else."""

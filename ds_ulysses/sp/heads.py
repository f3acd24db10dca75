"""Which attention heads each SP rank computes, for any head count and any sp <= heads.

Rank ``r`` of ``ws`` gets a contiguous run of ``hc // ws + (r < hc % ws)`` query heads, so uneven
counts (14 heads on 4 ranks: 4, 4, 3, 3) need no padding heads. Each rank receives the KV heads
its query heads read (GQA: query head ``h`` reads KV head ``h // (hc // hc_kv)``):

- if each received KV head serves the same number of the rank's query heads, the rank gets each
  KV head once and runs GQA locally with that group size (the usual case: 32/8 heads on 4 ranks);
- otherwise (a rank's query heads straddle KV groups unevenly: 14/2 heads on 4 ranks) the rank
  gets one KV head per query head, so the core attention sees plain MHA.

A KV head needed by several ranks is sent to each (replication, e.g. 2 KV heads on 4 ranks); the
all-to-all's backward sums the replicas' gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HeadPlan", "plan_heads", "plan_attention_groups"]


@dataclass(frozen=True)
class HeadPlan:
    q_heads: tuple[tuple[int, ...], ...]   # per rank: query heads
    kv_heads: tuple[tuple[int, ...], ...]  # per rank: KV heads, in the order the rank's core reads them

    def kv_groups(self, rank: int) -> int:
        """Query heads per local KV head on ``rank`` (``num_key_value_groups`` for the core)."""
        return len(self.q_heads[rank]) // len(self.kv_heads[rank])


def plan_heads(num_heads: int, num_kv_heads: int, world_size: int) -> HeadPlan:
    if world_size > num_heads:
        raise ValueError(
            f"sequence_parallel_size={world_size} exceeds the model's {num_heads} attention heads; "
            f"Ulysses gives every SP rank at least one head, so use sequence_parallel_size <= {num_heads}, or a "
            f"ring_size that makes sequence_parallel_size / ring_size <= {num_heads}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"attention layout not servable: {num_heads} query heads are not a multiple of "
            f"{num_kv_heads} key/value heads; GQA needs num_attention_heads % num_key_value_heads == 0")
    group = num_heads // num_kv_heads
    q_heads, kv_heads, start = [], [], 0
    for r in range(world_size):
        count = num_heads // world_size + (r < num_heads % world_size)
        mine = tuple(range(start, start + count))
        start += count
        needed = sorted({h // group for h in mine})
        served = [sum(1 for h in mine if h // group == kv) for kv in needed]
        if len(set(served)) == 1:
            kv_heads.append(tuple(needed))
        else:
            kv_heads.append(tuple(h // group for h in mine))
        q_heads.append(mine)
    return HeadPlan(tuple(q_heads), tuple(kv_heads))


def plan_attention_groups(num_heads: int, num_kv_heads: int, sp: int, shards="auto") -> int:
    """How many head groups: ``shards`` checked, or with "auto" the most groups whose query heads still
    split evenly over the ``sp`` ranks (every group holds whole KV groups: G divides hc_kv). More groups hold
    fewer heads' full-sequence tensors at once; each costs two all-to-alls of its own."""
    valid = [g for g in range(1, num_kv_heads + 1) if num_kv_heads % g == 0 and num_heads // g >= sp]
    if shards == "auto":
        even = [g for g in valid if (num_heads // g) % sp == 0]
        return max(even or valid)
    if shards not in valid:
        raise ValueError(
            f"tiled_attention shards={shards!r} cannot split {num_heads} query / {num_kv_heads} KV heads at sp {sp}: "
            f"each group must hold whole KV groups (the count divides {num_kv_heads}) and at least one query head "
            f"per SP rank ({num_heads} / count >= {sp}); expected one of {valid}; fix: set \"shards\" to one of "
            f"them, or \"auto\"")
    return shards

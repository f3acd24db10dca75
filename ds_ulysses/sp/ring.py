"""The core attention of a Ulysses x ring mesh: the ring, fed by the Ulysses all-to-all.

Dimension legend::

    bs  batch   hc_l  query heads after the all-to-all   hs  head size
    sl  global sequence length   sl_r = sl / ring  the tokens of this rank's ring block   ring  ring size

After the Ulysses all-to-all on its (contiguous) sub-group, a rank holds its heads over the ring block its
Ulysses group shares: one head and one tail chunk of the sample, which the data adapter laid out so
(:func:`ds_ulysses.sp.data.prepare_sample`). :class:`RingCore` takes the place of the core attention there and runs
:func:`ds_ulysses.distributed.ring.ring_attention` across the ring sub-group.

The ring is causal attention over one document per row, nothing else (torch's SDPA ring takes no mask). Once
per model forward every ring rank checks its block's positions (they must be the head-tail block of one
``+1`` run: no packed documents, no left padding, no holes) and the ring exchanges the verdicts, so a sample the
ring cannot serve raises the same error on every rank instead of a wrong loss or a hang. What a model asks of
every call (dropout, soft-capping, attention sinks, a window shorter than the sequence) is refused by name at
its first call, on every rank alike.
"""

from __future__ import annotations

import enum
from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist

from ..distributed.collectives import collective_device
from ..distributed.ring import check_ring_template, head_tail_order, ring_attention
from ..distributed.watch import GroupWatch

__all__ = ["RingCore", "RingFacts", "RingProblem", "check_ring_core"]

_NOT_SERVED = "the ring attention (ring_size > 1) serves causal sdpa attention over one document per row"


def check_ring_core(core_attn_implementation: str, ring_size) -> None:
    """The ring runs torch's fused SDPA kernels only: a ring with any other core is refused, at setup, on every
    rank alike (each holds the same section). ``"auto"`` is judged once resolved (it may come to 1)."""
    if isinstance(ring_size, int) and ring_size > 1 and core_attn_implementation != "sdpa":
        raise ValueError(
            f"ring_size={ring_size!r} needs attn_implementation 'sdpa', got {core_attn_implementation!r}: "
            f"{_NOT_SERVED}, through torch's SDPA ring; fix: set attn_implementation to \"sdpa\", or ring_size "
            "to 1")


class RingProblem(enum.IntEnum):
    OK = 0
    LEFT_PADDING = 1   # pad tokens before a row's first real token: the ring would let real tokens see them
    DOCUMENTS = 2      # positions that do not run +1 through the sample: packed documents, holes, a reorder
    LENGTH = 3         # a ring block of odd length: no head and tail chunk of equal size


@dataclass(frozen=True)
class RingFacts:
    """One ring rank's verdict on its block, as the ring exchanges it."""

    problem: int
    batch: int
    length: int  # sl_r

    def to_tensor(self, device) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.long, device=device)  # [3]

    @classmethod
    def from_tensor(cls, row: torch.Tensor) -> "RingFacts":
        return cls(*(int(x) for x in row.tolist()))


class RingCore:
    """Ring attention in the place of the core attention: called as ``UlyssesAttention._core`` is, with the
    Ulysses-gathered forward state, returning ``([bs sl_r hc_l hs], None)``."""

    def __init__(self, group, ring_size: int, ring_rank: int, core_attn_implementation: str = "sdpa", *,
                 watch: GroupWatch | None = None):
        check_ring_core(core_attn_implementation, ring_size)
        check_ring_template()
        self.group, self.ring_size, self.ring_rank = group, ring_size, ring_rank
        self.watch = watch if watch is not None else GroupWatch.of_group(group)
        self._checked = None  # the forward state whose layout the ring agreed on

    def __call__(self, module, q, k, v, state, plan, *rest, **kwargs):
        # q [bs hc_l sl_r hs], k/v [bs hkv_l sl_r hs] -> ([bs sl_r hc_l hs], None)
        if state is not self._checked:
            self._check_layout(state)
            self._checked = state
        _check_call(module, q.shape[2] * self.ring_size, rest, kwargs)
        out = ring_attention(q, k, v, self.group, scale=kwargs.get("scaling"))
        return out.transpose(1, 2), None

    def _check_layout(self, state) -> None:
        """Every ring rank's block is the head-tail block of one ``+1`` run of positions starting at the same
        position in every rank; the same error on every rank, or none."""
        positions = state.positions  # [bs sl_r]
        bs, sl_r = positions.shape
        problem, start = RingProblem.OK, positions[:, :1]
        if state.left_padding is not None:
            problem = RingProblem.LEFT_PADDING
        elif sl_r % 2:
            problem = RingProblem.LENGTH
        else:
            block = head_tail_order(sl_r * self.ring_size, self.ring_size).view(self.ring_size, sl_r)[self.ring_rank]
            start = positions - block.to(positions.device)  # [bs sl_r] the position of natural token 0
            if not bool((start == start[:, :1]).all()):
                problem = RingProblem.DOCUMENTS
        device = collective_device(self.group)
        mine = RingFacts(int(problem), bs, sl_r).to_tensor(device)
        rows = [torch.empty_like(mine) for _ in range(self.ring_size)]
        with self.watch.collective("the ring's layout check"):
            dist.all_gather(rows, mine, group=self.group)
        every = [RingFacts.from_tensor(r) for r in rows]
        _raise_for(every)
        starts = [torch.empty(bs, dtype=torch.long, device=device) for _ in range(self.ring_size)]
        with self.watch.collective("the ring's layout check"):
            dist.all_gather(starts, start[:, 0].to(device=device, dtype=torch.long).contiguous(), group=self.group)
        if any(not torch.equal(s, starts[0]) for s in starts):
            _raise_for([RingFacts(int(RingProblem.DOCUMENTS), bs, sl_r)])


def _raise_for(every: list[RingFacts]) -> None:
    first = every[0]
    for rank, facts in enumerate(every):
        if facts.problem == RingProblem.LEFT_PADDING:
            raise ValueError(
                f"ring block {rank} has left padding (pad tokens before a row's first real token); {_NOT_SERVED}, "
                "and its causal ring would let real tokens attend to the padding; expected right padding or none; "
                "fix: pad on the right (tokenizer.padding_side = 'right'), or set ring_size to 1")
        if facts.problem == RingProblem.DOCUMENTS:
            raise ValueError(
                f"ring block {rank}'s position_ids are not the head-tail block of one +1 run of positions (packed "
                f"documents, a hole, or a batch not laid out by the data adapter); {_NOT_SERVED} (torch's SDPA ring "
                "takes no document mask); expected one document per row, laid out by the UlyssesSPDataLoaderAdapter "
                "with ring_size; fix: train on unpacked samples, feed batches through the adapter, or set ring_size "
                "to 1 (Ulysses alone serves packed documents)")
        if facts.problem == RingProblem.LENGTH or (facts.batch, facts.length) != (first.batch, first.length):
            raise ValueError(
                f"ring blocks differ or are odd: block {rank} holds {facts.batch} rows of {facts.length} tokens, "
                f"block 0 {first.batch} of {first.length}; expected equal blocks of an even length (a head and a "
                "tail chunk each); fix: feed batches through the UlyssesSPDataLoaderAdapter with ring_size, which "
                "pads every sample to a multiple of lcm(sp, 2 x ring_size)")


def _check_call(module, sl: int, rest, kwargs) -> None:
    """What a layer's attention call asks that the ring does not do: refused by name (every rank makes the same
    call at the same layer, so every rank raises)."""
    asked = []
    if rest:
        asked.append(f"{len(rest)} positional arguments after the mask")
    if kwargs.get("dropout"):
        asked.append(f"attention dropout {kwargs['dropout']}")
    if kwargs.get("softcap") is not None:
        asked.append(f"logit soft-capping {kwargs['softcap']}")
    if kwargs.get("s_aux") is not None:
        asked.append("attention sinks (s_aux)")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        asked.append("bidirectional attention")
    window = kwargs.get("sliding_window")
    if window is not None and window < sl:
        asked.append(f"a sliding window of {window} tokens over a {sl}-token sequence")
    if asked:
        layer = getattr(module, "layer_idx", None)
        raise ValueError(
            f"layer {layer} ({type(module).__name__}) asks for {', '.join(asked)}; {_NOT_SERVED}; expected none of "
            "these under ring_size > 1; fix: set ring_size to 1 (Ulysses serves them), or turn them off in the "
            "model config (attention_dropout 0.0)")

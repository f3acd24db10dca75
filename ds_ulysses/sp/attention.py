"""Ulysses attention: the wrapper around a core attention function of Transformers' signature.

Dimension legend::

    bs  batch   sl  global sequence length   sl_l  local sequence length
    hc  heads   hc_l  heads this rank owns   hs    head size

Per attention layer: one all-to-all carries q, k and v together from sequence-sharded to
head-sharded, the unmodified core attention (sdpa, flash_attention_2/3, flex_attention, a Hub kernel)
runs on the whole sequence for this rank's heads, and one all-to-all carries the output back. Which
heads a rank owns follows from the head counts each call brings (a layer may differ from the config:
per-layer head sizes or KV head counts), so any model's layout is served. Global position_ids are
gathered once per forward (the same local tensor reaches every layer and is recognised), so packed
documents are attended per document and RoPE-free cores still see them. The same gather carries each
rank's :class:`~ds_ulysses.sp.forward_check.ForwardFacts` (position_ids present, integer, shaped like
the shard; batch size, dtype and head layout equal across ranks), so a bad input raises the same error
on every rank before any tensor is exchanged. Nothing here imports Transformers:
:class:`ds_ulysses.UlyssesSPAttentionHF` adds the registration with it.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from ..config import attn_implementations
from ..distributed import HeadLayout, HeadsToSeq, SeqToHeads
from ..distributed.collectives import collective_device
from ..distributed.watch import GroupWatch
from ..patching import ProcessLocal
from .batch_check import VARLEN_KEYS
from .forward_check import ForwardFacts, PositionCheck, Problem, ShardCheck, check_forward, check_positions
from .heads import HeadPlan, plan_heads
from .packed import find_documents, isolate_left_padding, mark_padding, packed_attention

__all__ = ["UlyssesAttention", "check_core_attention", "core_kind"]

# org/repo, optionally @revision and :function, as Transformers names Hub attention kernels
HUB_KERNEL = re.compile(r"^[^/:@]+/[^/:@]+(?:@[^/:]+)?(?::[^/:]+)?$")


def core_kind(name) -> str:
    """How the core attention ``name`` learns about causality, documents and windows under SP:
    ``"sdpa"`` (documents and windows as separate calls or masks), ``"flex"`` (a BlockMask) or
    ``"flash"`` (flash_attention_*, Hub kernels: varlen from the global position_ids, the window as an
    argument). Raises ValueError for cores SP cannot run exactly."""
    if name in ("eager", "paged|eager"):
        raise ValueError(
            f"attn_implementation '{name}' cannot run under Ulysses SP: eager attention needs a full S x S attention "
            "mask built for the local shard, which is both wrong after the all-to-all and O(S^2) memory; use "
            "'sdpa' (CPU or GPU), 'flash_attention_2'/'flash_attention_3' (GPU) or 'flex_attention'")
    if name == "sdpa":
        return "sdpa"
    if name == "flex_attention":
        return "flex"
    if isinstance(name, str) and (name.startswith("flash_attention_") or HUB_KERNEL.match(name)):
        return "flash"
    raise ValueError(
        f"unknown core attention {name!r}; expected one of {', '.join(attn_implementations())}, another "
        "flash_attention_N, or a Hub kernel ('org/repo[@revision][:function]'); fix: pick one of those")


def check_core_attention(name) -> None:
    core_kind(name)


class UlyssesAttention(ProcessLocal, torch.nn.Module):
    """Sequence-parallel attention around a core attention function of Transformers' signature.

    The machinery behind :class:`ds_ulysses.UlyssesSPAttentionHF`: DeepSpeed's constructor, and
    ``forward`` takes q/k/v ``[bs hc sl_l hs]`` and returns ``([bs sl_l hc hs], attn_weights)``, the
    shape Transformers' own attention functions return (DeepSpeed flattens it to ``hc*hs``, which
    breaks models that split, normalise or gate the output per head). Unlike DeepSpeed's, any head
    count works for any sp <= heads, sequence shards may differ in length, and packed documents are
    attended per document under every core. The head counts given to the constructor are the
    config's; each call's own q/k/v decide the head split. Keyword-only extras: ``watch`` (the mesh's
    ``sp_watch``: names the group and counts steps in failure messages) and ``sliding_layers``
    (indices of layers that must receive their window as ``sliding_window``). Copies of a model share
    their SP attention (:class:`~ds_ulysses.patching.ProcessLocal`): it holds the process group.
    """

    def __init__(self, attn, batch_size: int, attn_head_count: int, attn_head_size: int,
                 kv_head_count: int, num_hidden_layers: int, process_group,
                 seq_length_is_variable: bool = False, local_seq_length: int | None = None,
                 global_seq_length: int | None = None, disable_in_eval: bool = False,
                 core_attn_implementation: str = "sdpa", *, watch: GroupWatch | None = None,
                 sliding_layers: frozenset = frozenset(), ring=None) -> None:
        super().__init__()
        core_kind(core_attn_implementation)
        self.attn = attn
        self.core_attn_implementation = core_attn_implementation
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.sp_rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self.batch_size = batch_size
        self.attn_head_count, self.attn_head_size = attn_head_count, attn_head_size
        self.kv_head_count = kv_head_count
        self.num_hidden_layers, self.seq_length_is_variable = num_hidden_layers, seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        # set per forward by the decoder's hook: the model input is a sequence shard the data adapter yielded,
        # so SP runs even in eval mode under disable_in_eval (a model trained without model.train(), a
        # reference model in eval mode scoring the same shards); whole samples in eval mode still run without SP
        self.shard_input = False
        self.retired = False  # its registration was undone: copies of a model it served compute as plain models
        plan_heads(attn_head_count, kv_head_count, self.world_size)  # the config's layout must be servable
        self.watch = watch if watch is not None else GroupWatch.of_group(process_group)
        self.sliding_layers = sliding_layers  # layer_idx of layers whose window must arrive as a kwarg
        self.ring = ring  # a RingCore (ds_ulysses.sp.ring) in the core's place when the mesh has a ring
        # the PositionCheck of the model call itself, set per forward by the hook registration adds:
        # HF decoders invent local arange positions when none are given (silently wrong under SP),
        # and fail in RoPE before attention on a mis-shaped tensor (the hook swaps in a stand-in)
        self.input_verdict = None
        # the hook's ShardCheck of the model input (ds_ulysses.sp.shards): is it the data adapter's shard?
        self.shard_verdict = ShardCheck()
        # the model call's position_ids, set by the same hook, and whether one of the decoder's own modules (its
        # position embedding, its rotary embedding) took that very tensor during this forward: the positions of a
        # model whose attention calls get none (GPTBigCode's, Persimmon's)
        self.call_positions = None
        self.call_positions_taken = False
        self.call_positions_served = False  # this forward's attention calls got them from here
        self.call_padding = None  # the model call's padding ([bs sl_l] bool, True at pad tokens), set by the hook
        self.forwards = 0  # model forwards begun (new_forward): a recompute in backward belongs to the latest
        self._forward_state = None  # (position_ids as given, its version, gathered state)
        self._plans: dict[tuple[int, int], HeadPlan] = {}
        self._layouts: dict = {}

    @property
    def kind(self) -> str:
        """sdpa, flex or flash (see :func:`core_kind`); DeepSpeed's users set core_attn_implementation
        after construction, so it is read at every call."""
        return core_kind(self.core_attn_implementation)

    def serves(self, module) -> bool:
        """Whether a call from ``module`` runs SP: on more than one rank, unless ``disable_in_eval`` holds in eval
        mode for an input that is not a sequence shard (whole evaluation samples)."""
        return ((self.world_size > 1 or self.ring is not None) and not self.retired
                and (module.training or not self.disable_in_eval or self.shard_input))

    def retire(self) -> None:
        """The registration is undone: from now on the models (and copies) it served compute without SP."""
        self.retired = True

    def new_forward(self) -> None:
        """Forget the gathered positions: the next layer call starts a new model forward (called by the
        decoder's pre-forward hook; without it a forward is recognised by its position_ids tensor)."""
        self._forward_state = None
        self.call_positions, self.call_positions_taken, self.call_positions_served = None, False, False
        self.call_padding = None
        self.forwards += 1

    # -- once per model forward -----------------------------------------------------------------
    def _gather_positions(self, given, query: torch.Tensor, key: torch.Tensor, varlen: bool = False):
        """Global position_ids and every rank's shard length, gathered once per model forward.

        Every layer receives the very same position_ids tensor, so the first layer gathers and the
        others (and gradient-checkpointing recomputes) reuse it. An attention call without position_ids
        takes the model call's, if the model's own position or rotary embedding took them, as its mask
        builder does; otherwise it is refused. The first gather also carries each rank's check of its
        inputs (``varlen``: the call carries a batch's varlen offsets), so every rank raises the same
        error or none does. The model call's padding rides in the positions' gather
        (:func:`~ds_ulysses.sp.packed.mark_padding`): left padding is attended as no key and gets no output
        (:func:`~ds_ulysses.sp.packed.isolate_left_padding`), as the padding mask makes it without SP.
        """
        if given is None and self.call_positions_taken:
            given, self.call_positions_served = self.call_positions, True
        state = self._forward_state
        if state is not None and given is not None and state[0] is given and state[1] == given._version:
            return state[2]
        self.watch.step += 1
        bs, _, sl_l, _ = query.shape
        positions = check_positions(given, bs, sl_l)
        if self.input_verdict is not None and not self.input_verdict.ok:
            positions = self.input_verdict
        elif self.input_verdict is not None and given is None:
            positions = PositionCheck(Problem.NOT_FORWARDED)
        if varlen and positions.ok:
            positions = PositionCheck(Problem.VARLEN_OFFSETS)
        self.input_verdict = None
        shard, self.shard_verdict = self.shard_verdict, ShardCheck()
        device = collective_device(self.process_group)
        mine = ForwardFacts.of(query, key, positions, shard).to_tensor(device)  # [width]
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        with self.watch.collective("the attention's shard-length gather"):
            dist.all_gather(rows, mine, group=self.process_group)
        every = [ForwardFacts.from_tensor(r) for r in rows]
        check_forward(every, None if self.seq_length_is_variable else self.global_seq_length)
        seq_lens = tuple(f.seq_len for f in every)
        local = given.expand(bs, sl_l) if given.shape[0] != bs else given
        padded = torch.zeros(bs, max(seq_lens), dtype=torch.long, device=device)
        padding = self.call_padding if self.call_padding is not None and self.call_padding.shape == (bs, sl_l) \
            else None
        padded[:, :sl_l] = mark_padding(local, None if padding is None else padding.to(local.device))
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        with self.watch.collective("the attention's position_ids gather"):
            dist.all_gather(parts, padded, group=self.process_group)
        marked = torch.cat([p[:, :n] for p, n in zip(parts, seq_lens)], dim=1).to(query.device)  # [bs sl]
        positions, left_padding = isolate_left_padding(marked)
        gathered = _Gathered(positions, seq_lens, find_documents(positions), left_padding)
        self._forward_state = (given, given._version, gathered)
        return gathered

    def _plan(self, hc: int, hc_kv: int) -> HeadPlan:
        if (hc, hc_kv) not in self._plans:
            self._plans[hc, hc_kv] = plan_heads(hc, hc_kv, self.world_size)
        return self._plans[hc, hc_kv]

    def _layout(self, seq_lens, hc: int, hc_kv: int, qkv: bool) -> HeadLayout:
        key = (seq_lens, hc, hc_kv, qkv)
        if key not in self._layouts:
            plan = self._plan(hc, hc_kv)
            heads = (plan.q_heads, plan.kv_heads, plan.kv_heads) if qkv else (plan.q_heads,)
            counts = (hc, hc_kv, hc_kv) if qkv else (hc,)
            self._layouts[key] = HeadLayout(self.process_group, self.sp_rank, heads, counts, seq_lens)
        return self._layouts[key]

    # -- per layer ------------------------------------------------------------------------------
    def forward(self, module, query, key, value, attention_mask, *rest, **kwargs):
        """q/k/v ``[bs hc sl_l hs]`` -> ``([bs sl_l hc hs], attn_weights)``.

        ``attention_mask`` is ignored under SP: a mask built for the local shard means nothing
        after the all-to-all; causality and document boundaries come from the global position_ids.
        """
        if not self.serves(module):
            return self.attn(module, query, key, value, attention_mask, *rest, **kwargs)
        hc, hc_kv = query.shape[1], key.shape[1]
        varlen = any(kwargs.get(name) is not None for name in VARLEN_KEYS)
        state = self._gather_positions(kwargs.get("position_ids"), query, key, varlen)
        seq_lens = state.seq_lens
        if self.sliding_layers and kwargs.get("sliding_window") is None:
            self._check_window_passed(module)

        # [bs hc sl_l hs] -> [bs sl_l hc hs] -> all-to-all -> [bs sl hc_l hs] -> [bs hc_l sl hs]
        try:
            q, k, v = SeqToHeads.apply(self._layout(seq_lens, hc, hc_kv, True),
                                       *(x.transpose(1, 2) for x in (query, key, value)))
        except RuntimeError as err:
            self.watch.reraise("the attention's q/k/v all-to-all", err)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        kwargs["position_ids"] = state.positions
        core = self._core if self.ring is None else self.ring
        out, weights = core(module, q, k, v, state, self._plan(hc, hc_kv), *rest, **kwargs)  # [bs sl hc_l hs]
        if state.left_padding is not None:  # a pad query attends to no key: zero, as without SP
            out = out.masked_fill(state.left_padding[:, :, None, None], 0)
        # [bs sl hc_l hs] -> all-to-all -> [bs sl_l hc hs]
        try:
            (out,) = HeadsToSeq.apply(self._layout(seq_lens, hc, hc_kv, False), out)
        except RuntimeError as err:
            self.watch.reraise("the attention's output all-to-all", err)
        return out, weights

    def _check_window_passed(self, module) -> None:
        """A sliding layer whose model encodes the window only in the mask (which SP drops) would
        attend past the window; such models are refused on their first SP forward, on every rank.
        Runs only for models with sliding layers, and only when the call carries no window."""
        layer = getattr(module, "layer_idx", None)
        if layer in self.sliding_layers:
            raise ValueError(
                f"model not servable by Ulysses SP: layer {layer} attends within a sliding window, but its "
                "attention call passes no sliding_window (the model encodes the window only in the attention "
                "mask, which SP replaces with global positions), so it would attend past the window and train "
                "silently wrong; expected the window as the core attention's sliding_window argument; fix: "
                "train without SP, or disable the window in the model config")

    def _core(self, module, q, k, v, state: "_Gathered", plan: HeadPlan, *args, **kwargs):
        groups_attr = hasattr(module, "num_key_value_groups")
        saved = getattr(module, "num_key_value_groups", None)
        if groups_attr:
            module.num_key_value_groups = plan.kv_groups(self.sp_rank)
        try:
            if kwargs.get("s_aux") is not None:
                kwargs["s_aux"] = _own_sinks(kwargs["s_aux"], plan, self.sp_rank)
            window = kwargs.get("sliding_window")
            if self.kind == "sdpa":
                if state.docs.packed or (window is not None and q.shape[2] > window):
                    kwargs.pop("position_ids")
                    kwargs.pop("sliding_window", None)
                    return packed_attention(self.attn, module, q, k, v, state.docs, window, **kwargs)
                return self.attn(module, q, k, v, None, *args, **kwargs)
            if self.kind == "flex":
                mask = state.flex_mask(window)
                return self.attn(module, q, k, v, mask, *args, **kwargs)
            # flash kernels read packing from the global position_ids (their varlen path) and the
            # window from sliding_window (passed through in kwargs)
            return self.attn(module, q, k, v, None, *args, **kwargs)
        finally:
            if groups_attr:
                module.num_key_value_groups = saved


def _own_sinks(sinks, plan: HeadPlan, rank: int) -> torch.Tensor:
    """Learnable attention sinks (``s_aux``: GPT-OSS, one per query head): the core runs this rank's query
    heads, so it gets their sinks, a slice whose gradient reaches the parameter (each rank's heads' part of it)."""
    heads = plan.q_heads[rank]
    total = sum(len(h) for h in plan.q_heads)
    if not torch.is_tensor(sinks) or sinks.dim() != 1 or sinks.shape[0] != total:
        shape = list(sinks.shape) if torch.is_tensor(sinks) else type(sinks).__name__
        raise ValueError(
            f"model not servable by Ulysses SP: its attention passes s_aux (attention sinks) of shape {shape}, where "
            f"SP can split only one sink per query head ([{total}]) among the ranks' heads; expected s_aux of shape "
            f"[{total}]; fix: train this model without sequence parallelism")
    return sinks[heads[0]:heads[-1] + 1]


class _Gathered:
    """What one model forward shares across its layers: global positions, shard lengths, documents."""

    def __init__(self, positions: torch.Tensor, seq_lens: tuple[int, ...], docs, left_padding=None):
        self.positions, self.seq_lens, self.docs = positions, seq_lens, docs
        self.left_padding = left_padding  # [bs sl] True at left padding, or None
        self._flex_masks: dict = {}

    def flex_mask(self, window):
        if window not in self._flex_masks:
            self._flex_masks[window] = _flex_block_mask(self.positions, window)
        return self._flex_masks[window]


def _flex_block_mask(positions: torch.Tensor, window):
    """Causal, per-document (and windowed) BlockMask over the gathered sequence."""
    from torch.nn.attention.flex_attention import create_block_mask

    bs, sl = positions.shape
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    doc = starts.cumsum(dim=1)  # [bs sl]

    def mask_mod(b, h, q_idx, kv_idx):
        keep = (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        return keep

    return create_block_mask(mask_mod, B=bs, H=None, Q_LEN=sl, KV_LEN=sl, device=positions.device)

"""Ulysses attention for HuggingFace models: the wrapper around the core attention function.

Dimension legend::

    bs  batch   sl  global sequence length   sl_l  local sequence length
    hc  heads   hc_l  heads this rank owns   hs    head size   em  hc * hs

Per attention layer: one all-to-all carries q, k and v together from sequence-sharded to
head-sharded, the unmodified core attention (sdpa, flash_attention_2/3, flex_attention) runs on the
whole sequence for this rank's heads, and one all-to-all carries the output back. Global
position_ids are gathered once per forward (the same local tensor reaches every layer and is
recognised), so packed documents are attended per document and RoPE-free cores still see them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import HeadLayout, HeadsToSeq, SeqToHeads
from .heads import plan_heads
from .packed import find_documents, packed_attention

__all__ = ["UlyssesSPAttentionHF", "CORE_ATTENTIONS", "check_core_attention"]

CORE_ATTENTIONS = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def check_core_attention(name: str) -> None:
    if name in ("eager", "paged|eager"):
        raise ValueError(
            f"attn_implementation '{name}' cannot run under Ulysses SP: eager attention needs a full "
            "S x S attention mask built for the local shard, which is both wrong after the all-to-all "
            "and O(S^2) memory; use 'sdpa' (CPU or GPU), 'flash_attention_2'/'flash_attention_3' (GPU) "
            "or 'flex_attention'")
    if name not in CORE_ATTENTIONS:
        raise ValueError(
            f"unknown core attention '{name}'; expected one of {', '.join(CORE_ATTENTIONS)}")


class UlyssesSPAttentionHF(torch.nn.Module):
    """Sequence-parallel attention around a HF core attention function.

    Drop-in for DeepSpeed's class of the same name: same constructor and ``forward`` contract
    (q/k/v ``[bs hc sl_l hs]`` in, ``([bs sl_l em], attn_weights)`` out). Unlike it, any head count
    works for any sp <= heads, sequence shards may differ in length, and packed documents are
    attended per document under every core.
    """

    def __init__(self, attn, batch_size: int, attn_head_count: int, attn_head_size: int,
                 kv_head_count: int, num_hidden_layers: int, process_group,
                 seq_length_is_variable: bool = False, local_seq_length: int | None = None,
                 global_seq_length: int | None = None, disable_in_eval: bool = False,
                 core_attn_implementation: str = "sdpa") -> None:
        super().__init__()
        check_core_attention(core_attn_implementation)
        self.attn = attn
        self.core_attn_implementation = core_attn_implementation
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.sp_rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self.batch_size = batch_size
        self.attn_head_count, self.attn_head_size = attn_head_count, attn_head_size
        self.kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.heads = plan_heads(attn_head_count, kv_head_count, self.world_size)
        self._forward_state = None  # (local position_ids, its version, gathered state)
        self._layouts: dict = {}

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                   micro_batch_size, seq_length=None, seq_length_is_variable=True,
                                   disable_in_eval=False, mesh=None):
        """See :func:`ds_ulysses.register.register_with_transformers` (returns the ``mpu``)."""
        from .register import register_with_transformers

        return register_with_transformers(model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                          micro_batch_size, seq_length, seq_length_is_variable,
                                          disable_in_eval, mesh)

    # -- once per model forward -----------------------------------------------------------------
    def _gather_positions(self, local: torch.Tensor):
        """Global position_ids and every rank's shard length, gathered once per model forward.

        Every layer receives the very same local position_ids tensor, so the first layer gathers
        and the others (and gradient-checkpointing recomputes) reuse it.
        """
        state = self._forward_state
        if state is not None and state[0] is local and state[1] == local._version:
            return state[2]
        bs, sl_l = local.shape
        lens = torch.tensor([sl_l], dtype=torch.long, device=local.device)
        all_lens = [torch.zeros_like(lens) for _ in range(self.world_size)]
        dist.all_gather(all_lens, lens, group=self.process_group)
        seq_lens = tuple(int(x) for x in all_lens)
        padded = local.new_zeros(bs, max(seq_lens), dtype=torch.long)
        padded[:, :sl_l] = local
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.process_group)
        positions = torch.cat([p[:, :n] for p, n in zip(parts, seq_lens)], dim=1)  # [bs sl]
        gathered = _Gathered(positions, seq_lens, find_documents(positions))
        self._forward_state = (local, local._version, gathered)
        return gathered

    def _layout(self, seq_lens, qkv: bool) -> HeadLayout:
        key = (seq_lens, qkv)
        if key not in self._layouts:
            heads = (self.heads.q_heads, self.heads.kv_heads, self.heads.kv_heads) if qkv else (self.heads.q_heads,)
            counts = (self.attn_head_count, self.kv_head_count, self.kv_head_count) if qkv else (self.attn_head_count,)
            self._layouts[key] = HeadLayout(self.process_group, self.sp_rank, heads, counts, seq_lens)
        return self._layouts[key]

    # -- per layer ------------------------------------------------------------------------------
    def forward(self, module, query, key, value, attention_mask, *args, **kwargs):
        """q/k/v ``[bs hc sl_l hs]`` -> ``([bs sl_l em], attn_weights)``.

        ``attention_mask`` is ignored under SP: a mask built for the local shard means nothing
        after the all-to-all; causality and document boundaries come from the global position_ids.
        """
        if self.world_size == 1 or (self.disable_in_eval and not module.training):
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        bs, _, sl_l, _ = query.shape
        local_pos = kwargs.get("position_ids")
        if local_pos is None:
            raise ValueError(
                "Ulysses SP needs position_ids in the model call (each rank's positions within the "
                "whole sequence); pass the batch from UlyssesSPDataLoaderAdapter, or "
                "position_ids = arange(sl) sharded like input_ids")
        local_pos = local_pos.expand(bs, sl_l) if local_pos.shape[0] != bs else local_pos
        state = self._gather_positions(local_pos)
        seq_lens = state.seq_lens

        # [bs hc sl_l hs] -> [bs sl_l hc hs] -> all-to-all -> [bs sl hc_l hs] -> [bs hc_l sl hs]
        q, k, v = SeqToHeads.apply(self._layout(seq_lens, True), *(x.transpose(1, 2) for x in (query, key, value)))
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        kwargs["position_ids"] = state.positions
        out, weights = self._core(module, q, k, v, state, *args, **kwargs)  # [bs sl hc_l hs]
        # [bs sl hc_l hs] -> all-to-all -> [bs sl_l hc hs] -> [bs sl_l em]
        (out,) = HeadsToSeq.apply(self._layout(seq_lens, False), out)
        return out.reshape(bs, sl_l, -1), weights

    def _core(self, module, q, k, v, state: "_Gathered", *args, **kwargs):
        groups_attr = hasattr(module, "num_key_value_groups")
        saved = getattr(module, "num_key_value_groups", None)
        if groups_attr:
            module.num_key_value_groups = self.heads.kv_groups(self.sp_rank)
        try:
            core = self.core_attn_implementation
            window = kwargs.get("sliding_window")
            if core == "sdpa":
                if state.docs.packed or (window is not None and q.shape[2] > window):
                    kwargs.pop("position_ids")
                    kwargs.pop("sliding_window", None)
                    return packed_attention(self.attn, module, q, k, v, state.docs, window, **kwargs)
                return self.attn(module, q, k, v, None, *args, **kwargs)
            if core == "flex_attention":
                mask = state.flex_mask(window)
                return self.attn(module, q, k, v, mask, *args, **kwargs)
            # flash kernels read packing from the global position_ids (their varlen path)
            return self.attn(module, q, k, v, None, *args, **kwargs)
        finally:
            if groups_attr:
                module.num_key_value_groups = saved


class _Gathered:
    """What one model forward shares across its layers: global positions, shard lengths, documents."""

    def __init__(self, positions: torch.Tensor, seq_lens: tuple[int, ...], docs):
        self.positions, self.seq_lens, self.docs = positions, seq_lens, docs
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

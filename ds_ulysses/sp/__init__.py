"""Ulysses sequence parallelism proper: which heads each rank computes, the attention wrapper around
a core attention function, per-document attention for packed samples, the data adapter that shards
samples over the SP group, the SP loss, and the checks on what enters them. Imports torch only."""

from .attention import UlyssesAttention, check_core_attention
from .data import UlyssesSPDataLoaderAdapter, prepare_sample
from .heads import HeadPlan, plan_heads
from .loss import GlobalTokenMean, TokenCounts, sp_loss_from_logits

__all__ = ["UlyssesAttention", "check_core_attention", "UlyssesSPDataLoaderAdapter", "prepare_sample", "HeadPlan",
           "plan_heads", "GlobalTokenMean", "TokenCounts", "sp_loss_from_logits"]

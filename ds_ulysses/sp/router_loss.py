"""A MoE router's load-balancing loss over the whole sequence, from each SP rank's shard of it.

Dimension legend::  n tokens of a shard (bs x sl_l, flattened as the router sees them)   E experts   k top-k

Switch Transformer's auxiliary loss (Fedus et al. 2021, eqs. 4-6; Transformers' ``load_balancing_loss_func``,
which Mixtral, Qwen-MoE, OLMoE, GPT-OSS and most MoE families share) is ``E * sum_e f_e * P_e``: ``f_e`` the
top-k assignments that go to expert e and ``P_e`` its summed routing probability, each divided by the number
of (unmasked) tokens, over every layer. Under SP each rank routes only its shard, and the loss of a shard is
not the loss of the sequence: the products of per-shard means are not the product of the whole means.

Both factors are sums over tokens, though, so one all_reduce of ``[P-sums (E), f-sums (E), tokens (1)]`` gives
every rank the whole sequence's factors, not its router logits (which would be ``sp`` times the memory). Every
rank then computes the same loss. In backward, the loss is the same function of the summed ``P`` on every
rank, so a rank's own ``P``-sum receives the gradient of the sum itself, times ``grad_scale`` for how the
engine reduces the ranks' gradients (the same scale as the token loss, :mod:`ds_ulysses.sp.loss`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.collectives import collective_device, group_size
from ..distributed.watch import GroupWatch

__all__ = ["load_balancing_loss", "RouterSums"]


class RouterSums(torch.autograd.Function):
    """Sum ``[2E + 1]`` router statistics over the SP group in forward; ``grad * grad_scale`` in backward."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, grad_scale: float, watch: GroupWatch | None):
        ctx.scale = grad_scale
        if group is None or group_size(group) == 1:
            return local.clone()
        out = local.detach().to(collective_device(group))  # [2E+1]
        watch = watch if watch is not None else GroupWatch.of_group(group)
        with watch.collective("the router load-balancing all_reduce"):
            dist.all_reduce(out, group=group)
        return out.to(local.device)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None, None, None  # local, group, grad_scale, watch


def load_balancing_loss(gate_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None, group=None, grad_scale: float = 1.0,
                        watch: GroupWatch | None = None) -> torch.Tensor:
    """The Switch load-balancing loss of the sequence whose shards the SP ``group`` holds.

    ``gate_logits``: one ``[n E]`` tensor per layer, this rank's tokens; ``attention_mask``: this rank's
    ``[bs sl_l]`` mask (0 for padding, which does not count), or None to count every token. With ``group``
    None or of one rank it is Transformers' ``load_balancing_loss_func`` on these tokens.
    """
    device = gate_logits[0].device
    mask = None
    if attention_mask is not None:
        mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)  # [n]
    # sums over every layer's tokens: float64, where float32 would stop counting exactly at 2**24 (16.8M)
    probs = torch.zeros(num_experts, dtype=torch.float64, device=device)  # [E]
    assigned = torch.zeros(num_experts, dtype=torch.float64, device=device)  # [E]
    tokens = torch.zeros(1, dtype=torch.float64, device=device)  # [1]
    for gate in gate_logits:
        gate = gate.to(device)
        if mask is not None and mask.numel() != gate.shape[0]:
            raise ValueError(
                f"the router load-balancing loss got {gate.shape[0]} routed tokens in a layer but an attention mask "
                f"of {mask.numel()} tokens; expected one mask entry per routed token (the mask of this rank's "
                "shard, [bs, sl_l]); fix: pass the batch's attention_mask as the adapter sharded it, or none (a MoE "
                "block tiled by hand records its routing tile by tile: tile it with the ulysses section's tiled_mlp)")
        routing = torch.softmax(gate, dim=-1)  # [n E]
        chosen = torch.topk(routing, top_k, dim=-1).indices.reshape(-1)  # [n*k]
        weight = (torch.ones_like(chosen, dtype=torch.float64) if mask is None
                  else mask.double().repeat_interleave(top_k))
        assigned = assigned + torch.zeros_like(assigned).scatter_add_(0, chosen, weight)
        if mask is None:
            probs = probs + routing.float().sum(dim=0).double()
            tokens = tokens + gate.shape[0]
        else:
            probs = probs + (routing.float() * mask.unsqueeze(-1)).sum(dim=0).double()
            tokens = tokens + mask.double().sum()
    total = RouterSums.apply(torch.cat([probs, assigned.detach(), tokens.detach()]), group, grad_scale, watch)
    probs, assigned, tokens = total.split([num_experts, num_experts, 1])  # [E], [E], [1]
    return (torch.sum(assigned / tokens * probs / tokens) * num_experts).float()

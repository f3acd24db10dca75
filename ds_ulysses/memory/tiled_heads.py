"""TiledHeads: a block that is a sum over groups of heads, computed one group at a time, so the block's
per-head activations exist for one group at a time (the attention counterpart of TiledMLP).

An attention block is such a sum: each head's output goes through its own columns of o_proj, so
``o_proj(attention(x)) = sum_g o_proj[:, cols_g](attention_g(x))`` over any split of the heads into groups
(whole KV groups, so GQA's sharing stays inside one group). Under SP every per-head tensor of the block
(q/k/v, their RoPE'd and all-to-all'd copies, the core's output and log-sum-exp, o_proj's input) is a
full-sequence tensor for this rank's heads: one group at a time divides their peak by the group count.
Forward runs each group without keeping its graph and keeps the block's input and each group's core attention
outputs (:mod:`.kept_kernels`: one more hidden-sized tensor per token over all groups); backward recomputes
each group, all but its core attention, and backpropagates it before the next, summing the parameter
gradients (:mod:`.tile_grads`), so ZeRO reduces each gradient once. A call that autograd does not record (a
checkpointed layer's first forward, evaluation) keeps no kernel outputs.

Dimensions: bs batch, sl_l local sequence, h hidden, g one group of heads, G the groups.
"""

import contextlib

import torch
from torch.autograd import Function

from .kept_kernels import KeptKernels
from .rebuild import kept_input, rebuilt
from .tile_grads import TileGrads
from .tiles import one_grad_per_input, positive_int, trainable_params, zero3_fetch_with, zero3_whole

__all__ = ["TiledHeads"]


class TiledHeads(Function):
    """``sum(fn(module, x, g) for g in range(groups))``, one group alive at a time.

    ``fn(module, x, g) -> y_g`` computes group g's share of the block's output from the whole input
    ``x`` (``[bs, sl_l, h]``); every share has the output's shape. ``compute_params`` lists the trainable
    parameters ``fn`` uses (None: every trainable parameter of ``module``); their gradients leave the
    Function summed over the groups, once per backward. Under ZeRO-3 they are gathered once for the
    groups of a pass, as TiledMLP's are. ``fn`` must compute the same thing when called again (backward
    recomputes it): no dropout, no state it updates. ``keep_kernels=False`` keeps no kernel outputs (each
    group's core attention runs again in backward): for a kernel that cannot run under a dispatch mode
    (flex_attention compiles itself). The groups of one call run collectives in the same
    order on every rank (each one's all-to-alls), so every rank must call with the same ``groups``.
    """

    @classmethod
    def apply(cls, fn, module, x, groups, compute_params=None, keep_kernels=True):
        params = trainable_params(compute_params, [module])
        zero3_fetch_with(module, params)
        keep = keep_kernels and torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
        with zero3_whole(params):
            return super().apply(fn, module, x, positive_int(groups, "groups"), keep, *params)

    @staticmethod
    def forward(ctx, fn, module, x, groups, keep, *params):
        ctx.fn, ctx.module, ctx.groups, ctx.params = fn, module, groups, params
        kept, ctx.rebuild = kept_input(x)  # a norm's output is kept as the norm's input (see .rebuild)
        # keeping, each group runs with grad so that its kernels are called as backward's recompute will call
        # them (some compute their log-sum-exp only then); its graph is dropped with its output
        ctx.kernels = [KeptKernels() for _ in range(groups)] if keep else None
        x_in = x.detach().requires_grad_(x.requires_grad) if keep else x
        out = None
        for g in range(groups):
            if keep:
                with torch.enable_grad(), ctx.kernels[g].recording():
                    y = fn(module, x_in, g).detach()  # [bs sl_l h]: group g's share; its graph goes here
            else:
                with torch.no_grad():
                    y = fn(module, x, g)
            if out is None:
                out = y
            else:
                out.add_(y)
            del y  # not alive through the next group's fn
        # saved, not held: a checkpointed layer drops them with all it saves and its recompute makes them again
        ctx.save_for_backward(kept, *(t for kernels in ctx.kernels or () for t in kernels.hand_over()))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        kept, *outputs = ctx.saved_tensors  # [bs sl_l h]: x, or the source x is rebuilt from; the kernels' outputs
        outputs = iter(outputs)
        x = rebuilt(kept, ctx.rebuild).requires_grad_(ctx.needs_input_grad[2])  # [bs sl_l h]
        x_grad = torch.zeros_like(x) if ctx.needs_input_grad[2] else None
        grads = TileGrads("TiledHeads", ctx.params, [ctx.module])
        with zero3_whole(ctx.params), grads.hooked():
            for g in range(ctx.groups):
                replay = contextlib.nullcontext() if ctx.kernels is None else \
                    ctx.kernels[g].replaying([next(outputs) for _ in range(ctx.kernels[g].count)])
                with torch.enable_grad(), replay:
                    y = ctx.fn(ctx.module, x, g)  # [bs sl_l h]
                grads.backprop(y, grad_out, x, x_grad, accumulate=True)
                del y  # group g's activations go before group g + 1's are made
        grads.write_undeclared()
        return one_grad_per_input(TiledHeads.forward, x=x_grad, varargs=grads.declared_grads())

"""TiledHeads: a block that is a sum over groups of heads, computed one group at a time, so the block's
per-head activations exist for one group at a time (the attention counterpart of TiledMLP).

An attention block is such a sum: each head's output goes through its own columns of o_proj, so
``o_proj(attention(x)) = sum_g o_proj[:, cols_g](attention_g(x))`` over any split of the heads into groups
(whole KV groups, so GQA's sharing stays inside one group). Under SP every per-head tensor of the block
(q/k/v, their RoPE'd and all-to-all'd copies, the core's output and log-sum-exp, o_proj's input) is a
full-sequence tensor for this rank's heads: one group at a time divides their peak by the group count.
Forward runs each group without autograd and keeps only the block's input; backward recomputes each
group and backpropagates it before the next, summing the parameter gradients (:mod:`.tile_grads`), so
ZeRO reduces each gradient once.

Dimensions: bs batch, sl_l local sequence, h hidden, g one group of heads, G the groups.
"""

import torch
from torch.autograd import Function

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
    recomputes it): no dropout, no state it updates. The groups of one call run collectives in the same
    order on every rank (each one's all-to-alls), so every rank must call with the same ``groups``.
    """

    @classmethod
    def apply(cls, fn, module, x, groups, compute_params=None):
        params = trainable_params(compute_params, [module])
        zero3_fetch_with(module, params)
        with zero3_whole(params):
            return super().apply(fn, module, x, positive_int(groups, "groups"), *params)

    @staticmethod
    def forward(ctx, fn, module, x, groups, *params):
        ctx.fn, ctx.module, ctx.groups, ctx.params = fn, module, groups, params
        kept, ctx.rebuild = kept_input(x)  # a norm's output is kept as the norm's input (see .rebuild)
        ctx.save_for_backward(kept)
        out = None
        with torch.no_grad():
            for g in range(groups):
                y = fn(module, x, g)  # [bs sl_l h]: group g's share
                if out is None:
                    out = y
                else:
                    out.add_(y)
                del y  # not alive through the next group's fn
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (kept,) = ctx.saved_tensors  # [bs sl_l h]: x, or the source x is rebuilt from
        x = rebuilt(kept, ctx.rebuild).requires_grad_(ctx.needs_input_grad[2])  # [bs sl_l h]
        x_grad = torch.zeros_like(x) if ctx.needs_input_grad[2] else None
        grads = TileGrads("TiledHeads", ctx.params, [ctx.module])
        with zero3_whole(ctx.params), grads.hooked():
            for g in range(ctx.groups):
                with torch.enable_grad():
                    y = ctx.fn(ctx.module, x, g)  # [bs sl_l h]
                grads.backprop(y, grad_out, x, x_grad, accumulate=True)
                del y  # group g's activations go before group g + 1's are made
        grads.write_undeclared()
        return one_grad_per_input(TiledHeads.forward, x=x_grad, varargs=grads.declared_grads())

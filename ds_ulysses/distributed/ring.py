"""Ring attention over a ring group: one autograd Function around torch's ring templates.

Dimension legend::

    bs  batch   hc_l  query heads this rank computes   hkv_l  their key/value heads   hs  head size
    sl  global sequence length   sl_r = sl / ring: the tokens of one ring rank   ring  ring size

Ulysses needs a head per rank, so it cannot spread one sequence over more ranks than the model has query
heads. The ring lifts that bound: each ring rank keeps its queries and passes its key/value block around the
ring, merging each block's partial attention by its log-sum-exp (Liu et al., "Ring Attention with Blockwise
Transformers", 2023). Under causal attention a contiguous split would give the last rank ``ring`` times the
work of the first, so the sequence is laid out head-tail: cut into ``2 * ring`` chunks, ring rank ``r`` holds
chunks ``r`` and ``2 * ring - 1 - r`` (:func:`head_tail_order`), and every rank does the same work.

The rotation, the causal bookkeeping of that layout and the merge are torch's
(``torch.distributed.tensor.experimental._context_parallel._attention``: ``_templated_ring_attention`` and its
backward), called functionally on a process group with the fused SDPA op of the device. They are private: their
signature has changed twice, and their options are a module global. :func:`check_ring_template` compares the
signature at setup and refuses ``ring_size > 1`` by name where it differs; :class:`RingAttention` sets the
options it needs around each call and restores them.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["RingAttention", "check_ring_template", "head_tail_order", "natural_order", "ring_attention"]

_TEMPLATE = "torch.distributed.tensor.experimental._context_parallel._attention"
_FORWARD_PARAMS = ("group", "seq_dim", "op", "query", "key", "value", "is_causal")
_BACKWARD_PARAMS = ("group", "seq_dim", "op", "grad_out", "grad_out_name", "query", "key", "value", "out",
                    "logsumexp", "is_causal")
_OPTIONS = ("convert_to_f32", "enable_load_balance", "rotate_method")
_SEQ_DIM = 2  # q/k/v are [bs hc sl_r hs]


def _template():
    import torch.distributed.tensor.experimental._context_parallel._attention as template

    return template


def check_ring_template() -> None:
    """Refuse ``ring_size > 1`` on a torch whose private ring templates are not the ones this module calls.

    Called at setup, before any SP group exists, so a torch upgrade fails by name instead of in the first
    backward (or silently, should a reordered parameter still bind)."""
    try:
        template = _template()
        found = (tuple(inspect.signature(template._templated_ring_attention).parameters)[:len(_FORWARD_PARAMS)],
                 tuple(inspect.signature(template._templated_ring_attention_backward).parameters)[
                     :len(_BACKWARD_PARAMS)])
        options = all(hasattr(template._cp_options, name) for name in _OPTIONS)
        rotate = hasattr(template._RotateMethod, "ALL_TO_ALL")
    except (ImportError, AttributeError) as err:
        found, options, rotate = (repr(err), ""), False, False
    if found != (_FORWARD_PARAMS, _BACKWARD_PARAMS) or not options or not rotate:
        raise ValueError(
            f"ring_size > 1 needs torch's ring attention templates in {_TEMPLATE} with parameters "
            f"{_FORWARD_PARAMS} (forward), {_BACKWARD_PARAMS} (backward) and _cp_options {_OPTIONS}; torch "
            f"{torch.__version__} has {found[0]} / {found[1]} (options present: {options}, all-to-all rotation: "
            f"{rotate}); fix: set ring_size to 1 (Ulysses alone) or use a torch whose templates match (2.13)")


def head_tail_order(sl: int, ring: int) -> torch.Tensor:
    """Natural token indices in ring order: ``sl`` tokens cut into ``2 * ring`` chunks, ring rank ``r``'s part
    being chunks ``r`` then ``2 * ring - 1 - r``; ``x[:, head_tail_order(sl, ring)]`` lays a batch out for the
    ring, and its contiguous ``1 / ring`` parts are the ring ranks' (``sl`` must be a multiple of ``2 * ring``)."""
    if sl % (2 * ring):
        raise ValueError(f"head-tail layout: expected a sequence length that is a multiple of 2 x ring_size = "
                         f"{2 * ring}, got {sl}; fix: pad the sample (the data adapter pads to this multiple)")
    chunks = torch.arange(sl).view(2 * ring, sl // (2 * ring))  # [2ring sl/2ring]
    return torch.cat([torch.cat([chunks[r], chunks[2 * ring - 1 - r]]) for r in range(ring)])  # [sl]


def natural_order(sl: int, ring: int) -> torch.Tensor:
    """The inverse of :func:`head_tail_order`: ``y[:, natural_order(sl, ring)]`` puts per-token outputs gathered
    in ring order (shards concatenated by SP rank) back into the sample's order."""
    return torch.argsort(head_tail_order(sl, ring))


@contextlib.contextmanager
def _options(dtype: torch.dtype):
    """torch's ring options for one call, restored after: head-tail load balancing (our layout), point-to-point
    rotation (one K/V block in flight, not the ring's whole K/V as the all-gather rotation holds), and merging in
    fp32, or fp64 for fp64 inputs (the default fp32 merge would cap fp64 at fp32 precision)."""
    options = _template()._cp_options
    saved = tuple(getattr(options, name) for name in _OPTIONS)
    options.convert_to_f32 = dtype != torch.float64
    options.enable_load_balance = True
    options.rotate_method = _template()._RotateMethod.ALL_TO_ALL
    try:
        yield
    finally:
        for name, value in zip(_OPTIONS, saved):
            setattr(options, name, value)


class RingAttention(torch.autograd.Function):
    """Causal ring attention of head-tail blocks: forward rotates K/V and merges by log-sum-exp, backward rotates
    K/V and their gradients back; every rank calls it with the same group, at every layer."""

    @staticmethod
    def forward(ctx, group, scale, query, key, value):
        # q [bs hc_l sl_r hs], k/v [bs hkv_l sl_r hs] -> out [bs hc_l sl_r hs]
        template, (op, kwargs, _, _) = _template(), _ops(query.device, scale)
        with _options(query.dtype):
            out, lse, *rest = template._templated_ring_attention(
                group, _SEQ_DIM, op, query, key, value, is_causal=True, **kwargs)
        ctx.group, ctx.scale, ctx.rest = group, scale, rest
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        template, (_, _, op, kwargs) = _template(), _ops(query.device, ctx.scale, ctx.rest)
        with _options(query.dtype):
            dq, dk, dv, *_ = template._templated_ring_attention_backward(
                ctx.group, _SEQ_DIM, op, grad_out=grad_out.contiguous(), grad_out_name="grad_out", query=query,
                key=key, value=value, out=out, logsumexp=lse, is_causal=True, **kwargs)
        return None, None, dq, dk, dv


def _ops(device: torch.device, scale, rest=()):
    """(forward op, its kwargs, backward op, its kwargs) of the fused SDPA kernel on ``device``: the CPU flash
    kernel, or CUDA's flash kernel (whose backward takes the forward's sequence bookkeeping, ``rest``)."""
    aten = torch.ops.aten
    if device.type == "cpu":
        kwargs = {"dropout_p": 0.0, "scale": scale}
        return (aten._scaled_dot_product_flash_attention_for_cpu.default, kwargs,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default, kwargs)
    backward = {}
    if rest:
        cum_q, cum_k, max_q, max_k, seed, offset, *_ = rest
        backward = {"cum_seq_q": cum_q, "cum_seq_k": cum_k, "max_q": max_q, "max_k": max_k, "dropout_p": 0.0,
                    "philox_seed": seed, "philox_offset": offset, "scale": scale}
    return (aten._scaled_dot_product_flash_attention.default,
            {"dropout_p": 0.0, "return_debug_mask": False, "scale": scale},
            aten._scaled_dot_product_flash_attention_backward.default, backward)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group, scale: float | None = None):
    """Causal attention of this ring rank's head-tail block ``[bs hc_l sl_r hs]`` against the whole sequence
    around ``group``; GQA key/value heads ``[bs hkv_l sl_r hs]`` (``hc_l`` a multiple of ``hkv_l``). Without a
    ring (``group`` None or of one rank) it is plain causal SDPA."""
    if group is None or dist.get_world_size(group) == 1:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                              enable_gqa=key.shape[1] != query.shape[1])
    if query.device.type == "cuda" and key.shape[1] != query.shape[1]:
        # CUDA's flash kernel takes equal head counts; autograd sums the copies' gradients
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return RingAttention.apply(group, scale, query, key, value)

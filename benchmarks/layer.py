"""The attention layer alone: DeepSpeed's ``UlyssesSPAttentionHF`` and ours, interleaved per iteration.

Whole training steps on this 2-core machine vary by 3-12% between identical launches, which hides a
difference of a few percent in the SP mechanism under ZeRO-3 offload, the loss and the optimizer,
which both libraries' mechanism paths share. Here DeepSpeed's wrapper, a second instance of it (the
noise arm, ``deepspeed[again]``) and ours run in the same process group on the same q/k/v (``[bs hc
sl_l hs]`` views of token-major memory, as a decoder's projections make them; GQA, the benchmark
model's heads) around the same core (HF's sdpa), forward + backward, in an order rotated every
iteration, so machine noise hits all three alike. A launch gives each arm its median time; the
report takes ours / DeepSpeed per launch and the noise arm's largest distance from DeepSpeed over
the launches (:func:`benchmarks.mode_tables.format_layer`).

Dimension legend::  bs batch   hc heads   kv KV heads   sl_l local sequence length   hs head size

Run as ``python -m benchmarks.layer S ITERS`` under ``RANK``/``WORLD_SIZE`` (``ds-ulysses
bench --layer-only`` launches it); rank 0 prints one JSON line with per-implementation medians.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from .arms import NOISE_ARM

__all__ = ["run", "main"]


class _Attn(torch.nn.Module):
    """What HF's sdpa reads from the attention module: causal, GQA groups, training flag."""

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.is_causal, self.num_key_value_groups, self.layer_idx = True, heads // kv_heads, 0


def run(seq_len: int, iters: int, heads: int = 8, kv_heads: int = 2, head_size: int = 32) -> dict:
    import deepspeed
    from deepspeed.runtime.sequence_parallel import ulysses_sp
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ds_ulysses import UlyssesSPAttentionHF

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    group, ws, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    sl_l = seq_len // ws
    theirs = ulysses_sp.UlyssesSPAttentionHF(sdpa_attention_forward, 1, heads, head_size, kv_heads, 1, group,
                                             seq_length_is_variable=True)
    theirs.core_attn_implementation = "sdpa"
    again = ulysses_sp.UlyssesSPAttentionHF(sdpa_attention_forward, 1, heads, head_size, kv_heads, 1, group,
                                            seq_length_is_variable=True)
    again.core_attn_implementation = "sdpa"
    ours = UlyssesSPAttentionHF(sdpa_attention_forward, 1, heads, head_size, kv_heads, 1, group,
                                seq_length_is_variable=True, core_attn_implementation="sdpa")

    g = torch.Generator().manual_seed(rank)
    # [bs hc sl_l hs] views of token-major memory, as a decoder's projections (and RoPE after them) hand
    # q, k and v to attention: `proj(x).view(bs, sl_l, hc, hs).transpose(1, 2)`
    q = torch.randn(1, sl_l, heads, head_size, generator=g).transpose(1, 2)      # [bs hc sl_l hs]
    kv = [torch.randn(1, sl_l, kv_heads, head_size, generator=g).transpose(1, 2)  # [bs kv sl_l hs]
          for _ in range(2)]
    positions = torch.arange(rank * sl_l, (rank + 1) * sl_l)[None]  # [bs sl_l]
    impls = {"deepspeed": theirs, NOISE_ARM: again, "ours": ours}
    times = {name: [] for name in impls}
    outs = {}
    for it in range(iters + 1):
        shift = it % len(impls)
        order = list(impls)[shift:] + list(impls)[:shift]
        for name in order:
            module = _Attn(heads, kv_heads)
            x = [t.clone().requires_grad_(True) for t in (q, *kv)]
            dist.barrier()
            start = time.perf_counter()
            out, _ = impls[name](module, *x, None, position_ids=positions.clone())  # [bs sl_l hc*hs] or [.. hc hs]
            out.square().sum().backward()
            dist.barrier()
            if it > 0:  # the first iteration warms up every arm
                times[name].append(time.perf_counter() - start)
            outs[name] = (out.detach().flatten(2), x[0].grad)  # ours is [bs sl_l hc hs], as HF's cores return
    same = all(torch.allclose(outs[name][i], outs["deepspeed"][i], rtol=1e-4, atol=1e-5)
               for name in impls for i in range(2))
    return {"seq_len": seq_len, "sp": ws, "iters": iters, "same_output_and_grad": same,
            **{f"{name}_s": statistics.median(t) for name, t in times.items()}, "times": times}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    result = run(int(argv[0]), int(argv[1]))
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""TiledMLP, sequence_tiled_compute and TiledFusedLogitsLoss against DeepSpeed's, at equal shards.

One process per (operation, length, repetition), no process group: DeepSpeed's implementation,
DeepSpeed's again (the noise arm) and ours run the same function on the same module and input with
the same tile count, forward + backward, in an order rotated every iteration (the first iteration
warms them up and is not counted). A process's time is the median wall time per iteration; its
memory is the median of the RSS high-water mark above the RSS before the call (the
mark is reset with ``/proc/self/clear_refs`` before each call, and the suite runs the process with a fixed
``MALLOC_MMAP_THRESHOLD_``, :data:`benchmarks.suites.MALLOC_ENV`, so that freed tensors leave the RSS at
once: glibc would otherwise keep one implementation's freed blocks resident and hand them to the other for
free). Parameter
gradients are dropped before each call, so each allocates them. Outputs and gradients are compared.
After the timed iterations each implementation runs once more under ``torch.profiler`` with
``profile_memory``: the running sum of its allocator events (every tensor allocated and freed, in
order) gives the peak bytes of tensors alive above those before the call, exact to the byte and
blind to where glibc places a block, which the RSS mark is not (it also counts the heap pages that
small allocations, a tensor's or a Python object's, happen to fault in).
The report takes ours / DeepSpeed per process and its median over the repetitions; the noise is
``max |again / DeepSpeed - 1|`` over them, as for the training steps (:func:`benchmarks.mode_tables.format_tiled`).

The operations, with the benchmark model's sizes (hidden 256, intermediate 688, vocab 32000):

- ``tiled_mlp``: a Llama MLP through ``TiledMLP.apply`` with ``ceil(sl / hidden)`` tiles (DeepSpeed's
  documented rule) and the three weights as ``compute_params``;
- ``stc_mlp``: the same MLP through ``sequence_tiled_compute`` (tensor output concatenated on the
  sequence, no reduction);
- ``stc_loss``: lm_head + summed cross-entropy per tile through ``sequence_tiled_compute`` with
  DeepSpeed's loss contract (a 0-dim value per tile, ``output_unshard_dimension=0``, "sum");
- ``fused_loss``: the same ``fn`` through ``TiledFusedLogitsLoss`` ("sum").

Dimension legend: bs batch, sl sequence (one rank's shard), h hidden, v vocabulary.
"""

from __future__ import annotations

import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

from .arms import MODEL_DEFAULTS, NOISE_ARM, TILED_OPS as OPS
from .measure import rss_pair, settle, tensor_peak

__all__ = ["OPS", "run"]

LOSS_TILE_TOKENS = 1024  # the loss ops: 128 MiB of fp32 logits per tile at a 32K vocabulary (ours' "auto")


def _mlp(model: dict):
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP

    cfg = LlamaConfig(hidden_size=model["hidden"], intermediate_size=model["intermediate"])
    return LlamaMLP(cfg).float()


def _mlp_fn(mlp, x):
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def _loss_fn(head, x, y):
    """Summed cross-entropy of one tile: ``[.., h]`` hidden states, ``[..]`` labels."""
    logits = head(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), ignore_index=-100,
                           reduction="sum")


def _calls(op: str, model: dict, seq_len: int):
    """(module, params, x, shards, {impl: call}) of one operation; each call returns a scalar to backprop."""
    from deepspeed.runtime.sequence_parallel import ulysses_sp as ds

    import ds_ulysses as ours

    libs = {"deepspeed": ds, NOISE_ARM: ds, "ours": ours}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq_len, model["hidden"], generator=g)  # [bs sl h]
    if op in ("tiled_mlp", "stc_mlp"):
        module = _mlp(model)
        params = [module.down_proj.weight, module.gate_proj.weight, module.up_proj.weight]
        shards = math.ceil(seq_len / model["hidden"])
        probe = torch.randn(1, seq_len, model["hidden"], generator=g)  # a fixed direction to reduce the output on

        def mlp_call(lib):
            if op == "tiled_mlp":
                return lambda x: (lib.TiledMLP.apply(_mlp_fn, module, x, shards, params) * probe).sum()

            def fn(hidden_states):
                return _mlp_fn(module, hidden_states)

            return lambda x: (lib.sequence_tiled_compute(fn, seq_len, shards, {"hidden_states": x}, {},
                                                         "hidden_states", params, 1, None) * probe).sum()

        return module, params, x, shards, {name: mlp_call(lib) for name, lib in libs.items()}
    module = torch.nn.Linear(model["hidden"], model["vocab"], bias=False)
    params = [module.weight]
    y = torch.randint(0, model["vocab"], (1, seq_len), generator=g)  # [bs sl]
    shards = max(1, math.ceil(seq_len / LOSS_TILE_TOKENS))

    def fn(x, y):
        return _loss_fn(module, x, y)

    def loss_call(lib):
        if op == "stc_loss":
            return lambda x: lib.sequence_tiled_compute(fn, seq_len, shards, {"x": x, "y": y}, {}, "x", params, 0,
                                                        "sum")
        return lambda x: lib.TiledFusedLogitsLoss.apply(_loss_fn, module, x, y, None, shards, params, "sum")

    return module, params, x, shards, {name: loss_call(lib) for name, lib in libs.items()}


def run(op: str, seq_len: int, iters: int, model: dict | None = None) -> dict:
    """The three arms of ``op`` on one rank's ``seq_len`` tokens, interleaved ``iters`` times."""
    torch.set_num_threads(1)
    model = {**MODEL_DEFAULTS, **(model or {})}
    module, params, x0, shards, calls = _calls(op, model, seq_len)
    times = {name: [] for name in calls}
    peaks = {name: [] for name in calls}
    results = {}
    for it in range(iters + 1):
        names = list(calls)
        order = names[it % len(names):] + names[:it % len(names)]
        for name in order:
            for p in params:
                p.grad = None
            x = x0.clone().requires_grad_(True)
            base = settle()
            start = time.perf_counter()
            out = calls[name](x)
            out.backward()
            elapsed = time.perf_counter() - start
            peak = rss_pair()[1] - base
            if it > 0:
                times[name].append(elapsed)
                peaks[name].append(peak)
            results[name] = (out.detach(), x.grad, [p.grad.clone() for p in params])
            del out, x
    tensor_peaks = {}
    for name in calls:
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_(True)
        tensor_peaks[name] = tensor_peak(lambda: calls[name](x).backward())
        del x
    ref, got = results["deepspeed"], results["ours"]
    same = bool(torch.allclose(ref[0], got[0], rtol=1e-4, atol=1e-4) and torch.allclose(ref[1], got[1], rtol=1e-4,
                                                                                           atol=1e-6)
                and all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(ref[2], got[2])))
    return {"op": op, "seq_len": seq_len, "shards": shards, "iters": iters, "same_output_and_grads": same,
            **{f"{name}_s": statistics.median(t) for name, t in times.items()},
            **{f"{name}_peak": statistics.median(p) for name, p in peaks.items()},
            **{f"{name}_tensor_peak": peak for name, peak in tensor_peaks.items()},
            "times": times, "peaks": peaks}


if __name__ == "__main__":  # a quick look without the launcher: python -m benchmarks.tiled OP SEQ ITERS
    import sys

    print(json.dumps({k: v for k, v in run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])).items()
                      if k not in ("times", "peaks")}))

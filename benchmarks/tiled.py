"""TiledMLP, sequence_tiled_compute and TiledFusedLogitsLoss against DeepSpeed's, at equal shards.

One process per (operation, length, repetition), no process group: DeepSpeed's implementation,
DeepSpeed's again (the noise arm) and ours run the same function on the same module and input with
the same tile count, forward + backward, in an order rotated every iteration (the first iteration
warms them up and is not counted). A process's time is the median wall time per iteration; its
memory is the median of the RSS high-water mark above the RSS before the call (the
mark is reset with ``/proc/self/clear_refs`` before each call, and the process runs with a fixed
``MALLOC_MMAP_THRESHOLD_`` so that freed tensors leave the RSS at once: glibc would otherwise keep
one implementation's freed blocks resident and hand them to the other for free). Parameter
gradients are dropped before each call, so each allocates them. Outputs and gradients are compared.
After the timed iterations each implementation runs once more under ``torch.profiler`` with
``profile_memory``: the running sum of its allocator events (every tensor allocated and freed, in
order) gives the peak bytes of tensors alive above those before the call, exact to the byte and
blind to where glibc places a block, which the RSS mark is not (it also counts the heap pages that
small allocations, a tensor's or a Python object's, happen to fault in).
The report takes ours / DeepSpeed per process and its median over the repetitions; the noise is
``max |again / DeepSpeed - 1|`` over them, as for the training steps (:mod:`benchmarks.report`).

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

import ctypes
import gc
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .bench import NOISE_ARM, TILED_OPS as OPS

__all__ = ["OPS", "run", "run_tiled_suite", "format_tiled", "MALLOC_ENV"]

LOSS_TILE_TOKENS = 1024  # the loss ops: 128 MiB of fp32 logits per tile at a 32K vocabulary (ours' "auto")
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 17), "MALLOC_TRIM_THRESHOLD_": str(1 << 17)}


def _rss_pair() -> tuple[int, int]:
    current = peak = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                current = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return current, peak


def _settle() -> int:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss_pair()[0]


def _tensor_peak(call) -> int:
    """Peak bytes of tensors alive during `call()` above those alive before it: the running sum of the
    profiler's allocator events (+ allocated, - freed) in the order they happened."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events = [(e.start_ns(), i, e.nbytes()) for i, e in enumerate(prof.profiler.kineto_results.events())
              if e.name() == "[memory]"]
    live = peak = 0
    for _, _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    return peak


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
    from .rank import MODEL_DEFAULTS

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
            base = _settle()
            start = time.perf_counter()
            out = calls[name](x)
            out.backward()
            elapsed = time.perf_counter() - start
            peak = _rss_pair()[1] - base
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
        tensor_peaks[name] = _tensor_peak(lambda: calls[name](x).backward())
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


def run_tiled_suite(seq_lens, iters: int, out: Path, timeout: float = 1800.0, ops=OPS, log=print,
                    reps: int = 3) -> list[dict]:
    """Each operation at each per-rank length, in its own process, ``reps`` times (every operation and
    length once per repetition, so a repetition's processes are minutes apart)."""
    import os

    from .bench import _workdir, launch, stamp

    records = []
    out.parent.mkdir(parents=True, exist_ok=True)
    saved = {k: os.environ.get(k) for k in MALLOC_ENV}
    os.environ.update(MALLOC_ENV)
    try:
        for rep in range(reps):
            for seq_len in seq_lens:
                for op in ops:
                    spec = {"impl": "tiled", "op": op, "seq_len": seq_len, "sp": 1, "iters": iters}
                    record = {"kind": "tiled", **spec, "name": op, "rep": rep, **stamp()}
                    try:
                        record["result"] = launch(spec, 1, _workdir(), timeout)[0]
                    except RuntimeError as exc:
                        record["error"] = str(exc)[-2000:]
                    with open(out, "a") as f:
                        f.write(json.dumps(record) + "\n")
                    if "error" in record:
                        log(f"rep {rep} {op} sl={seq_len}: FAILED ({record['error'].splitlines()[-1]})")
                        continue
                    records.append(record)
                    res = record["result"]
                    log(f"rep {rep} {op} sl={seq_len} shards={res['shards']}: " + ", ".join(
                        f"{name} {res[f'{name}_s']:.3f}s {res[f'{name}_peak'] / 2**20:.0f} MiB"
                        for name in ("deepspeed", NOISE_ARM, "ours")))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return records


def _spread(values, scale=1.0, digits=3) -> str:
    values = [v / scale for v in values]
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def _ratio(res: dict, arm: str, key: str) -> float:
    base = res[f"deepspeed_{key}"]
    return res[f"{arm}_{key}"] / base if base > 0 else float("nan")


def format_tiled(records: list[dict]) -> str:
    """One row per (operation, length): medians over the repetitions of each process's medians, ours /
    DeepSpeed per process with its spread, the noise arm's largest distance from 1, and the verdict
    against the issue's target (<= 1.0)."""
    from .report import _k, _noise_text, _table, target_verdict

    groups: dict[tuple, list[dict]] = {}
    for rec in records:
        if rec.get("result"):
            groups.setdefault((rec["seq_len"], OPS.index(rec["op"])), []).append(rec["result"])
    rows = []
    for (seq_len, op_index), results in sorted(groups.items()):
        cells = [OPS[op_index], _k(seq_len), results[0]["shards"], f"{len(results)} x {results[0]['iters']}"]
        for key, scale, digits, ratio_digits in (("s", 1.0, 3, 2), ("peak", 2**20, 2, 3)):
            ratios = [_ratio(res, "ours", key) for res in results]
            noise = max(abs(_ratio(res, NOISE_ARM, key) - 1) for res in results)
            cells += [_spread([res[f"deepspeed_{key}"] for res in results], scale, digits),
                      _spread([res[f"ours_{key}"] for res in results], scale, digits),
                      f"**{_spread(ratios, digits=ratio_digits)}**", _noise_text(noise),
                      target_verdict(statistics.median(ratios), noise, 1.0)]
        rows.append(cells + _tensor_cells([res for res in results if "ours_tensor_peak" in res])
                    + ["yes" if all(res["same_output_and_grads"] for res in results) else "NO"])
    return _table(["operation", "sl (one rank)", "shards", "processes x iterations", "DeepSpeed s", "ours s",
                   "time ours/DS", "noise", "time <= 1", "DeepSpeed peak MiB above base", "ours peak MiB",
                   "memory ours/DS", "noise", "memory <= 1", "processes with tensor peaks",
                   "DeepSpeed tensor peak MiB", "tensor peak ours - DS, bytes", "noise, bytes", "tensor peak <= DS",
                   "same output and grads"], rows)


def _tensor_cells(results: list[dict]) -> list[str]:
    """The tensor-peak cells of a row: ours - DeepSpeed in bytes per process (median [min, max]), the noise
    arm's largest distance from DeepSpeed, and the verdict on the median against it."""
    if not results:
        return ["0", "-", "-", "-", "-"]
    diffs = [res["ours_tensor_peak"] - res["deepspeed_tensor_peak"] for res in results]
    noise = max(abs(res[f"{NOISE_ARM}_tensor_peak"] - res["deepspeed_tensor_peak"]) for res in results)
    diff = statistics.median(diffs)
    verdict = ("met" if diff + noise <= 0 else f"missed by +{diff:g} B" if diff - noise > 0
               else "undecided (within noise)")
    return [str(len(results)), _spread([res["deepspeed_tensor_peak"] for res in results], 2**20, 2),
            f"**{diff:+g} [{min(diffs):+g}, {max(diffs):+g}]**", f"{noise:g}", verdict]


if __name__ == "__main__":  # a quick look without the launcher: python -m benchmarks.tiled OP SEQ ITERS
    import sys

    print(json.dumps({k: v for k, v in run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])).items()
                      if k not in ("times", "peaks")}))

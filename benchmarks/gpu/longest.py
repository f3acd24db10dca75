"""One GPU, one long sequence: the longest sequence that trains, and the step time and peak memory at
given lengths, for our defaults and for DeepSpeed's own ALST recipe, in the spirit of the ALST paper's
single-H100 row.

Both train the same Llama-3-style model built from its config (random weights: nothing is downloaded),
bf16, ZeRO-3 with the optimizer offloaded to the CPU, one sequence per step, sp 1:

- ``ours``: ``ds_ulysses.initialize`` with tiled MLP, tiled loss and activation-checkpoint offload on;
- ``deepspeed``: DeepSpeed's module as ArcticTraining uses it: every MLP through its ``TiledMLP``
  with the MLP's weights as ``compute_params``, the loss through its ``TiledFusedLogitsLoss``, and
  Transformers' gradient checkpointing (DeepSpeed's module has no checkpoint offload of its own). On the
  Llama-3.2 shapes, whose lm_head is tied to the embedding, its loss hands ZeRO the tied weight's gradient
  twice, and ZeRO-3, its bucket flushed in between by the layers' gradients, keeps only the embedding's
  part (README, drop-in table; not checked on a GPU): a wrong gradient at the same
  cost, so its time and memory still compare;
- ``ours-no-offload`` (not run unless named in ``--impl``): ours with Transformers' gradient
  checkpointing instead of the checkpoint offload, DeepSpeed's recipe's set of tools, to tell what the
  offload costs from what the rest of ours does.

Each trial is a fresh process (an out-of-memory step leaves nothing behind) that trains ``--steps``
steps (default 3) and reports each one's forward, backward and optimizer seconds, and what torch's
allocators had to do in it: pinned host blocks created, with the seconds that took (the offload's host
copies and the CPU optimizer's transfers go there; a block is created once, then reused), cudaMalloc
calls, and retries (a failed cudaMalloc that frees every cached block and synchronizes); the time is the last
step's, since the first pays one-off costs (pinned host buffers, kernel selection). The search doubles S
until a trial fails, then bisects to ``--resolution`` tokens; ``--at S ...`` instead runs both at those
lengths and prints ours / deepspeed for time and memory. Every arm starts from the same (seeded) weights
and data, so their per-step losses (recorded) agree. With ``--at``, ``--repeat N`` runs the arms N times
in alternating order, DeepSpeed's twice per repetition (the noise arm, as in the CPU benchmark), and
judges each ratio against that noise; ``--profile`` has the last repetition's trials profile one more step,
phase by phase (:mod:`benchmarks.gpu.kernels`), and prints the operators where each arm's device time differs most from
DeepSpeed's. Run on the GPU machine:

    python -m benchmarks.gpu.longest --model llama-3.2-3b --out benchmarks/results/gpu.jsonl
    python -m benchmarks.gpu.longest --model llama-3.2-1b --at 65536 262144

and see benchmarks/gpu/README.md for an install without a package index. ``--device cpu`` runs the same
arms in fp32 on the CPU (peak memory is then the process's RSS high-water mark), with ``--model tiny``,
the CPU benchmark's model: what the arms do per step where there is no GPU.

Dimension legend::  S sequence length (tokens)   V vocabulary   h hidden
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.arms import MODEL_DEFAULTS as CPU_MODEL
from benchmarks.gpu.kernels import profiled_step

MODELS = {  # Llama-3 family shapes (config numbers only)
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    # the CPU benchmark's model (README, "Benchmarks"), for --device cpu; untied: DeepSpeed's tiled loss
    # cannot train a tied head on a single reduce bucket (README, drop-in table)
    "tiny": dict(hidden_size=CPU_MODEL["hidden"], intermediate_size=CPU_MODEL["intermediate"],
                 num_hidden_layers=CPU_MODEL["layers"], num_attention_heads=CPU_MODEL["heads"],
                 num_key_value_heads=CPU_MODEL["kv_heads"], head_dim=CPU_MODEL["hidden"] // CPU_MODEL["heads"],
                 vocab_size=CPU_MODEL["vocab"], tie_word_embeddings=False),
}
IMPLEMENTATIONS = ("ours", "deepspeed", "ours-no-offload")
DEFAULT_IMPLEMENTATIONS = ("ours", "deepspeed")


def ds_config(device: str = "cuda") -> dict:
    """bf16 and pinned optimizer transfers on a GPU; fp32 on the CPU."""
    gpu = device == "cuda"
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": gpu},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": gpu}},
            "steps_per_print": 1 << 30}


def _model(name: str, attn: str, device: str = "cuda"):
    """The same weights in every trial (seeded), partitioned while built (no full copy) and initialised as
    Transformers initialises the model, as a Trainer user or DeepSpeed's ALST tutorial builds it: through
    Transformers' ZeRO-3 integration (the caller keeps an ``HfDeepSpeedConfig`` alive), which builds under
    ``zero.Init`` and then initialises each module's gathered weights. A bare ``zero.Init`` around
    ``from_config`` leaves Transformers' initialisation acting on empty partitions (the untrained loss was
    1886 on Llama-3.2-1B's shape, not ln V), and fails on the CPU with torch 2.13 (README, "Errors")."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**MODELS[name], max_position_embeddings=1 << 24, rope_theta=500000.0, use_cache=False)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)


def _sample(seq_len: int, vocab: int) -> dict:
    import torch

    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq_len)[None]}


def _ours(model, seq_len, device, offload=True):
    import ds_ulysses

    section = {"sequence_parallel_size": 1, "tiled_mlp": {"enabled": True}, "tiled_loss": {"enabled": True},
               "activation_checkpoint_offload": {"enabled": offload}}
    if not offload:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    sample = _sample(seq_len, model.config.vocab_size)
    engine, _, loader, _ = ds_ulysses.initialize(model=model, config={**ds_config(device), "ulysses": section},
                                                 training_data=[{k: v[0] for k, v in sample.items()}])
    batch = {k: v.to(engine.device) for k, v in next(iter(loader)).items()}
    return engine, lambda: engine(**batch).loss


def _deepspeed(model, seq_len, device):
    import deepspeed
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP

    def tiled_mlp_forward(mlp, x):
        def mlp_forward(module, tile):
            return module.down_proj(module.act_fn(module.gate_proj(tile)) * module.up_proj(tile))

        shards = max(1, -(-x.shape[1] // x.shape[2]))  # ceil(S / h), ArcticTraining's rule
        return TiledMLP.apply(mlp_forward, mlp, x, shards, [mlp.gate_proj.weight, mlp.up_proj.weight,
                                                           mlp.down_proj.weight])

    for layer in model.model.layers:
        layer.mlp.forward = tiled_mlp_forward.__get__(layer.mlp)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vocab = model.config.vocab_size
    shards = max(1, -(-seq_len * vocab * 4 // (1 << 27)))  # tiles of 128 MiB of fp32 logits, as ours

    def loss_fn(head, x, y):
        return torch.nn.functional.cross_entropy(head(x).float(), y, ignore_index=-100)

    def forward(input_ids, position_ids, labels):  # the causal LM's forward, its loss tiled
        hidden = model.model(input_ids=input_ids, position_ids=position_ids)[0]
        shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        return TiledFusedLogitsLoss.apply(loss_fn, model.lm_head, hidden, shift, None, shards,
                                          [model.lm_head.weight], "mean")

    model.forward = forward
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(device))
    sample = {k: v.to(engine.device) for k, v in _sample(seq_len, vocab).items()}
    return engine, lambda: engine(**sample)


def allocator_counts() -> dict:
    """torch's allocators so far: pinned host blocks created and the seconds spent creating them, cudaMalloc
    calls and allocation retries (zeros where this torch does not count them, or before CUDA is initialised)."""
    import torch

    host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    device = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {"pinned_allocs": host.get("num_host_alloc", 0),
            "pinned_alloc_s": host.get("host_alloc_time.total", 0) / 1e6,
            "cuda_mallocs": device.get("num_device_alloc", 0), "alloc_retries": device.get("num_alloc_retries", 0)}


def timed_steps(engine, forward, steps: int, sync, counts=dict) -> tuple[list[list[float]], list[float], list[dict]]:
    """``steps`` training steps; each one's [forward, backward, optimizer] seconds (``sync()`` waits for the
    device before each clock read), its loss, and how much each of the running totals ``counts()`` returns
    grew in it."""
    phases, losses, grew = [], [], []
    for _ in range(steps):
        sync()
        before = counts()
        clock = [time.perf_counter()]
        loss = forward()
        sync()
        clock.append(time.perf_counter())
        engine.backward(loss)
        sync()
        clock.append(time.perf_counter())
        engine.step()
        sync()
        clock.append(time.perf_counter())
        phases.append([round(b - a, 3) for a, b in zip(clock, clock[1:])])
        losses.append(float(loss.detach()))
        grew.append({k: round(v - before[k], 6) for k, v in counts().items()})
    return phases, losses, grew


def trial(impl: str, model_name: str, seq_len: int, attn: str, steps: int, device: str = "cuda",
          profile: bool = False) -> dict:
    """``steps`` steps at ``seq_len`` in this process (run through :func:`launch`). Time is the last step's:
    the first pays one-off costs (pinned host buffers, kernel selection, the optimizer's first touch of
    its states) that a training run pays once; the first is reported too, and every step's loss. Peak
    memory is over all: CUDA's allocated peak, or on the CPU the process's RSS high-water mark. With
    `profile`, one more step, after the timed ones and the peak's reading, is profiled phase by phase
    (:mod:`benchmarks.gpu.kernels`)."""
    import resource

    import deepspeed
    import torch
    from transformers.integrations import HfDeepSpeedConfig

    gpu = device == "cuda"
    deepspeed.init_distributed()
    if gpu:
        torch.cuda.set_device(0)
    zero3 = HfDeepSpeedConfig(ds_config(device))  # Transformers builds the model under ZeRO-3 while it lives
    model = _model(model_name, attn, device)
    built_partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
    setups = {"ours": _ours, "deepspeed": _deepspeed,
              "ours-no-offload": lambda model, seq_len, device: _ours(model, seq_len, device, offload=False)}
    engine, forward = setups[impl](model, seq_len, device)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    sync()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    phases, losses, allocators = timed_steps(engine, forward, steps, sync, allocator_counts if gpu else dict)
    seconds = sum(phases[-1])
    peak = torch.cuda.max_memory_allocated() if gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    result = {"impl": impl, "model": model_name, "seq_len": seq_len, "device": device, "ok": True, "loss": losses[0],
              "losses": losses, "steps": phases, "allocators_per_step": allocators, "first_step_s": sum(phases[0]),
              "seconds": seconds, "tokens_per_s": seq_len / seconds, "peak_gib": peak / (1 << 30),
              "built_partitioned": built_partitioned}
    if profile:
        result["profile"] = profiled_step(engine, forward, sync, gpu)
    return result


def launch(impl: str, model_name: str, seq_len: int, attn: str, timeout: float, steps: int = 3,
           device: str = "cuda", profile: bool = False) -> dict:
    """:func:`trial` in a fresh process; a crash or out-of-memory is a failed trial, not an error."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29511"),
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    cmd = [sys.executable, "-m", "benchmarks.gpu.longest", "--trial", impl, "--model", model_name,
           "--seq-len", str(seq_len), "--attn", attn, "--steps", str(steps), "--device", device] \
        + (["--profile"] if profile else [])
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "model": model_name, "seq_len": seq_len, "ok": False, "why": "timeout"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["exit " + str(done.returncode)]
    return {"impl": impl, "model": model_name, "seq_len": seq_len, "ok": False, "why": tail[0][:300]}


def longest(impl, model_name, start, resolution, attn, timeout, log, steps=3, device="cuda") -> tuple[int, list[dict]]:
    """Double from ``start`` until a step fails, then bisect: the longest S that trains, and every trial."""
    trials, good, bad, s = [], 0, None, start
    while bad is None:
        result = launch(impl, model_name, s, attn, timeout, steps, device)
        trials.append(result)
        log(result)
        good, bad, s = (s, None, 2 * s) if result["ok"] else (good, s, s)
    while bad - good > resolution:
        mid = (good + bad) // 2 // resolution * resolution or resolution
        if mid in (good, bad):
            break
        result = launch(impl, model_name, mid, attn, timeout, steps, device)
        trials.append(result)
        log(result)
        good, bad = (mid, bad) if result["ok"] else (good, mid)
    return good, trials


def arms(impls, noise: bool) -> list[tuple[str, str]]:
    """(arm, implementation) per arm: the implementations, and with `noise` DeepSpeed's again after it
    (``deepspeed[again]``, the same code in a fresh process: its ratio to ``deepspeed`` is the noise)."""
    from benchmarks.arms import NOISE_ARM

    out = []
    for impl in impls:
        out.append((impl, impl))
        if impl == "deepspeed" and noise:
            out.append((NOISE_ARM, impl))
    return out


def side_by_side(impls, model_name, seq_lens, attn, timeout, log, steps=3, device="cuda", repeat=1, noise=False,
                 profile=False) -> dict:
    """Each arm at each length (no search), `repeat` times, the arms' order reversed every other repetition
    so that no arm always runs first or last: {S: {arm: [trial per repetition]}}. A trial is logged with its
    arm and repetition. With `profile`, the last repetition's trials profile their extra step (the noise
    arm's not: the profiles compare each arm with ``deepspeed``, and each costs the trial a step and the
    profiler's processing)."""
    by_len = {}
    for s in seq_lens:
        trials = by_len[s] = {arm: [] for arm, _ in arms(impls, noise)}
        for rep in range(repeat):
            order = arms(impls, noise)
            for arm, impl in order if rep % 2 == 0 else order[::-1]:
                profiled = profile and rep == repeat - 1 and arm == impl
                trials[arm].append(log({**launch(impl, model_name, s, attn, timeout, steps, device, profiled),
                                        "arm": arm, "rep": rep}))
    return by_len


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.longest", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-3.2-3b")
    parser.add_argument("--impl", nargs="+", choices=IMPLEMENTATIONS, default=list(DEFAULT_IMPLEMENTATIONS))
    parser.add_argument("--start", type=int, default=32768, help="first sequence length tried")
    parser.add_argument("--resolution", type=int, default=16384, help="bisect until this close")
    parser.add_argument("--at", type=int, nargs="+", metavar="S",
                        help="no search: each implementation at these lengths, side by side, with the ratios")
    parser.add_argument("--steps", type=int, default=3,
                        help="steps per trial; time is the last one's, the first is reported beside it")
    parser.add_argument("--attn", default="sdpa", help="sdpa or flash_attention_2 (needs flash-attn)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: fp32, no pinned memory, peak = RSS; for checking the arms where there is no "
                             "GPU (with --model tiny)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="with --at: run the arms this many times, alternating their order; from 2 on, "
                             "DeepSpeed's arm runs twice per repetition (the noise arm) and ratios get verdicts")
    parser.add_argument("--no-noise", dest="noise", action="store_false",
                        help="with --repeat 2 or more: leave out the noise arm (no verdicts)")
    parser.add_argument("--profile", action="store_true",
                        help="the last repetition's trials profile one more step, phase by phase; prints the "
                             "operators where each arm's device time differs most from DeepSpeed's")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per trial")
    parser.add_argument("--out", default="benchmarks/results/gpu.jsonl", help="every trial, as JSON lines")
    parser.add_argument("--trial", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    if (args.repeat > 1 or args.profile) and not args.at and not args.trial:
        parser.error("--repeat and --profile compare arms at fixed lengths: give the lengths with --at S ...")
    if args.trial:  # inside one trial's process
        print(json.dumps(trial(args.trial, args.model, args.seq_len, args.attn, args.steps, args.device,
                               args.profile)), flush=True)
        return 0
    import torch

    from benchmarks.records import stamp
    from benchmarks.gpu.summary import profile_lines, ratio_lines

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    where = {**stamp(), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"}

    def log(result):
        with out.open("a") as f:
            f.write(json.dumps({**result, **where, "steps_per_trial": args.steps}) + "\n")
        state = (f"ok, {result['seconds']:.2f} s/step, {result['tokens_per_s']:,.0f} tok/s, "
                 f"{result['peak_gib']:.1f} GiB" if result["ok"] else f"failed: {result['why']}")
        print(f"{result.get('arm', result['impl']):>16} S={result['seq_len']:>9,}: {state}", flush=True)
        return result

    hardware = f"{where['gpu']}, bf16" if args.device == "cuda" else f"{where['machine']}, fp32, peak RSS"
    setting = f"{args.model}, {hardware}, ZeRO-3 + CPU optimizer, last of {args.steps} steps"
    if args.at:
        by_len = side_by_side(args.impl, args.model, args.at, args.attn, args.timeout, log, args.steps, args.device,
                              args.repeat, args.noise and args.repeat > 1, args.profile)
        print(f"\nside by side ({setting}):", *ratio_lines(by_len), sep="\n")
        if args.profile:
            print("\nwhere the profiled steps differ:", *profile_lines(by_len), sep="\n")
        return 0
    best = {impl: longest(impl, args.model, args.start, args.resolution, args.attn, args.timeout, log, args.steps,
                          args.device) for impl in args.impl}
    print(f"\nlongest sequence that trains ({setting}):")
    for impl, (s, trials) in best.items():
        speed = next((t["tokens_per_s"] for t in trials if t["ok"] and t["seq_len"] == s), float("nan"))
        print(f"  {impl:>15}: {s:>10,} tokens, {speed:,.0f} tokens/s")
    theirs = best.get("deepspeed", (0, []))[0]
    for impl, (s, _) in best.items():
        if impl != "deepspeed" and theirs:
            print(f"  ratio {impl} / deepspeed: {s / theirs:.2f}x the length")
    return 0


if __name__ == "__main__":
    sys.exit(main())

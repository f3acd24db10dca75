"""The ``ds-ulysses plan`` command: its arguments, and the plan printed as a table of terms and the section to use.

The memory model and the search it prints are :mod:`ds_ulysses.planner`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .constants import GIB
from .plan_search import max_seq_len, recommend, ulysses_section
from .planner import (INDEX_LIMIT, KNOWN_MODELS, MEASURED_TERMS, RECIPES, ModelDims, Setup, breakdown, largest_tensor,
                      layer_traffic, load_dims, parse_size, segment_peaks)

__all__ = ["format_breakdown", "add_arguments", "run_command"]


def format_breakdown(dims: ModelDims, setup: Setup, overhead: float) -> str:
    terms = breakdown(dims, setup)
    rows = [f"| {name} | {d / GIB:.2f} | {h / GIB:.2f} |" for name, (d, h) in terms.items()]
    rows.append(f"| runtime overhead (CUDA context, NCCL, allocator) | {overhead / GIB:.2f} | 0.00 |")
    dev = sum(d for d, _ in terms.values()) + overhead
    host = sum(h for _, h in terms.values())
    rows.append(f"| **total per rank** | **{dev / GIB:.2f}** | **{host / GIB:.2f}** |")
    return "\n".join(["| term | device GiB | host GiB |", "|---|---|---|", *rows])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help=f"HF config.json, a directory holding one, or one of "
                                                       f"{', '.join(KNOWN_MODELS)}")
    parser.add_argument("--seq-len", required=True, help="global sequence length (e.g. 500K), or 'max'")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs (ranks)")
    parser.add_argument("--gpu-mem", type=float, required=True, help="GiB per GPU")
    parser.add_argument("--cpu-mem", type=float, help="host GiB per node (<= 8 GPUs each): offloaded optimizer "
                                                      "states and checkpoints (one hidden-sized tensor per layer "
                                                      "per token) of the node's ranks; unchecked if omitted")
    parser.add_argument("--recipe", choices=RECIPES, default="ours",
                        help="whose ALST tools the plan uses: ours (the section), or DeepSpeed's recipe "
                             "(TiledMLP, TiledFusedLogitsLoss, checkpointing: ArcticTraining's setup), both from "
                             "measured terms")
    parser.add_argument("--past-int32", action="store_true",
                        help="let tensors pass 2**31 elements (by default no plan has one: kernels indexing with "
                             "32-bit integers fail there, as ALST's 1-GPU recipe does at 555K tokens)")
    parser.add_argument("--overhead", type=float, default=4.0, help="GiB per GPU for CUDA context, NCCL, fragmentation")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="activation dtype")
    parser.add_argument("--write", metavar="FILE", help="write the recommended {\"ulysses\": ..., "
                                                        "\"zero_optimization\": ...} to FILE")


def run_command(args: argparse.Namespace) -> int:
    try:
        dims = load_dims(args.model)
        if args.gpus < 1 or args.gpu_mem <= 0:
            raise ValueError(f"--gpus and --gpu-mem must be positive, got {args.gpus} and {args.gpu_mem}")
        act = 2 if args.dtype == "bf16" else 4
        cpu = None if args.cpu_mem is None else args.cpu_mem * GIB
        limit = None if args.past_int32 else INDEX_LIMIT
        if args.seq_len == "max":
            seq_len, setup = max_seq_len(dims, args.gpus, args.gpu_mem * GIB, cpu, act, args.overhead * GIB,
                                         args.recipe, limit)
            print(f"longest sequence that fits: {seq_len:,} tokens ({seq_len / 1024:.0f}K)")
        else:
            seq_len = parse_size(args.seq_len)
            setup = recommend(dims, seq_len, args.gpus, args.gpu_mem * GIB, cpu, act, args.overhead * GIB,
                              args.recipe, limit)
    except ValueError as exc:
        print(f"ds-ulysses plan: {exc}", file=sys.stderr)
        return 2
    if setup is None:
        print(f"ds-ulysses plan: nothing fits: S={seq_len:,} on {args.gpus} x {args.gpu_mem} GiB even with sp="
              f"{args.gpus} and every switch on; add GPUs or shorten the sequence", file=sys.stderr)
        return 1
    print(f"model: {dims.params / 1e9:.2f}B params, {dims.layers} layers, h={dims.hidden}, I={dims.intermediate}, "
          f"V={dims.vocab}; S={seq_len:,}, {args.gpus} GPU(s)")
    print(f"plan: sp={setup.sp} (dp={args.gpus // setup.sp}), gradient checkpointing "
          f"{'on' if setup.checkpointing else 'off'}, ZeRO-3 offload optimizer={setup.offload_optimizer} "
          f"param={setup.offload_param}")
    if setup.ring > 1:
        traffic = layer_traffic(dims, setup)
        print(f"ring: sp={setup.sp} exceeds the model's {dims.heads} query heads, so sp = Ulysses "
              f"{setup.sp // setup.ring} x ring {setup.ring}; sent per layer and rank (forward + backward): Ulysses "
              f"all-to-all {traffic['ulysses'] / 2 ** 20:.1f} MiB, ring {traffic['ring'] / 2 ** 20:.1f} MiB")
    measured = segment_peaks(dims, setup) is not None
    print(f"recipe: {setup.recipe}; activation terms "
          + (f"measured ({MEASURED_TERMS['source']})" if measured else "estimated (no record measures this setup)")
          + f"; largest tensor {largest_tensor(dims, setup):,} elements (limit "
          + ("none" if args.past_int32 else f"2**31 = {INDEX_LIMIT:,}") + ")")
    print(format_breakdown(dims, setup, args.overhead * GIB))
    config = {"ulysses": ulysses_section(setup),
              "zero_optimization": {"stage": 3, **({"offload_optimizer": {"device": "cpu"}} if setup.offload_optimizer
                                                   else {}),
                                    **({"offload_param": {"device": "cpu"}} if setup.offload_param else {})}}
    text = json.dumps(config, indent=2)
    print(text)
    if args.write:
        Path(args.write).write_text(text + "\n")
        print(f"wrote {args.write}")
    if not setup.checkpointing:
        return 0
    print("note: the plan assumes gradient checkpointing (model.gradient_checkpointing_enable()); "
          "activation_checkpoint_offload turns it on by itself")
    return 0


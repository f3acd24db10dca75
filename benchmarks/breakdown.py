"""``python -m benchmarks.breakdown``: what a training step holds at its peak, tensor by tensor, for DeepSpeed's
ALST recipe and ours, at several lengths; the per-token slope and the fitted terms the planner uses.

This module is the command line only. How it measures: every tensor an aten op allocates during a measured
step is followed until its storage is freed (:class:`benchmarks.measure.LiveTensors`), in segments of the step,
each live tensor sorted into a family by its shape (:mod:`benchmarks.breakdown_loop`), one launch per arm and
sp training every length (:func:`benchmarks.suites.run_breakdown`); the peaks, slopes and the planner's terms
come from the records (:mod:`benchmarks.breakdown_fit`).

Arms: ``deepspeed-alst`` (the engine loop's ArcticTraining setup, :mod:`benchmarks.recipes`: DeepSpeed's TiledMLP,
TiledFusedLogitsLoss, gradient checkpointing) and ``ours`` with the section's ALST switches (``tiled_mlp`` and
``activation_checkpoint_offload`` on, ``tiled_loss`` on by default); ``--tiled-attention N`` adds
``ours[tiled_attention]`` with ``"tiled_attention": {"enabled": true, "shards": N}`` on top, and
``--tiled-norms`` one more arm with ``"tiled_norms": {"enabled": true}`` on top of the last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .arms import ALST_SECTION, BREAKDOWN_RECIPES, LLAMA8B_SHAPED
from .bench import parse_pairs
from .breakdown_fit import format_breakdown, measured_terms
from .records import read_records
from .suites import run_breakdown

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from ds_ulysses.planner import parse_size
    from ds_ulysses.train import ops

    parser = argparse.ArgumentParser(prog="python -m benchmarks.breakdown", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", nargs="+", default=["4K", "8K", "12K"], help="global lengths (three or more)")
    parser.add_argument("--sp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--arm", nargs="+", choices=BREAKDOWN_RECIPES, default=list(BREAKDOWN_RECIPES))
    parser.add_argument("--tiled-attention", type=int, default=0, metavar="N",
                        help="add an arm ours[tiled_attention] with \"tiled_attention\": {\"enabled\": true, "
                             "\"shards\": N} (needs a ds_ulysses whose section has that field)")
    parser.add_argument("--tiled-norms", action="store_true",
                        help="add an arm with \"tiled_norms\": {\"enabled\": true} on top of ours (of "
                             "ours[tiled_attention] with --tiled-attention)")
    parser.add_argument("--model", action="append", default=[], metavar="KEY=INT",
                        help="model overrides on issue 67's Llama-3.1-8B-shaped model (hidden 1024, ...)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/breakdown.jsonl")
    parser.add_argument("--report-only", action="store_true", help="print the tables of the records in --out")
    parser.add_argument("--terms", action="store_true", help="also print the planner's fitted terms (as "
                                                             "ds_ulysses.planner.MEASURED_TERMS holds them)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not args.report_only:
        try:
            seq_lens = [parse_size(s) for s in args.seq_len]
            model = {**LLAMA8B_SHAPED, **parse_pairs(args.model, "--model", int)}
        except ValueError as exc:
            print(f"breakdown: {exc}", file=sys.stderr)
            return 2
        if len(seq_lens) < 3:
            print(f"breakdown: a slope needs three lengths or more, got {args.seq_len}", file=sys.stderr)
            return 2
        arms = {arm: (arm, ALST_SECTION if arm == "ours" else {}) for arm in args.arm}
        if args.tiled_attention:
            arms["ours[tiled_attention]"] = ("ours", {**ALST_SECTION, "tiled_attention": {
                "enabled": True, "shards": args.tiled_attention}})
        if args.tiled_norms:  # on top of the tiled-attention arm when there is one
            base = arms["ours[tiled_attention]"][1] if args.tiled_attention else ALST_SECTION
            name = "ours[tiled_attention,tiled_norms]" if args.tiled_attention else "ours[tiled_norms]"
            arms[name] = ("ours", {**base, "tiled_norms": {"enabled": True}})
        ops.use_venv_cache()
        ops.build()
        run_breakdown(sorted(seq_lens), args.sp, arms, out, model, args.warmup, args.steps)
    records = [r for r in read_records(out) if r.get("kind") == "breakdown" and "error" not in r]
    print(format_breakdown(records))
    if args.terms:
        print(json.dumps(measured_terms(records, str(out)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``ds-ulysses bench`` (or ``python -m benchmarks.bench``): DeepSpeed's ALST module and ours, side by
side, in alternating fresh launches, with the benchmark's own noise measured in the same run.

This module is the command line only: it parses and checks the flags, then hands them to the suite the mode
names and prints its tables. The harness reads top down (docs/benchmarks.md, "Layout of `benchmarks/`"):

- :mod:`benchmarks.suites` (training steps in every ``--loop``, ``--layer-iters``, ``--tiled-iters``) and
  :mod:`benchmarks.maxseq` (``--max-seq BUDGET``): which launches each mode runs and the record each leaves;
- :mod:`benchmarks.report`, :mod:`benchmarks.mode_tables`, :mod:`benchmarks.tables`: the tables and plots
  (``--report DIR``), every ratio taken within a repetition and judged against the noise arm;
- :mod:`benchmarks.launch` (one fresh process per rank) and :mod:`benchmarks.records` (the JSON lines, a
  launch's figures, the pairing of launches);
- :mod:`benchmarks.rank` and the loops it picks, inside each launched rank: :mod:`benchmarks.engine_loop`,
  :mod:`benchmarks.trainer`, :mod:`benchmarks.accelerate_loop`, :mod:`benchmarks.trl_loop`, :mod:`benchmarks.layer`,
  :mod:`benchmarks.tiled`, on the arms of :mod:`benchmarks.recipes`;
- :mod:`benchmarks.measure`, :mod:`benchmarks.tap`, :mod:`benchmarks.profile`: the instruments.

The arms: ``deepspeed`` (DeepSpeed's module + tutorial recipe), the same again as ``deepspeed[again]`` (the
noise arm: identical code, so its ratio to ``deepspeed`` is what this machine does to a ratio),
``ours-dropin``, ``ours``, ``deepspeed-alst`` and any ``ours[variant]`` (:mod:`benchmarks.arms`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ds_ulysses.planner import parse_size

from .arms import IMPLEMENTATIONS, LOOP_IMPLEMENTATIONS, LOOPS, TILED_OPS
from .launch import HARNESS_ENV
from .maxseq import run_maxseq
from .mode_tables import format_layer, format_maxseq, format_tiled
from .records import read_records
from .report import format_run, write_report
from .suites import run_layer_suite, run_suite, run_tiled_suite

__all__ = ["add_arguments", "run_command", "main", "parse_bytes", "parse_pairs"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-len", nargs="+", default=["4K"], help="global sequence lengths (4096, 16K, ...)")
    parser.add_argument("--sp", nargs="+", type=int, default=[2], help="sequence-parallel sizes (= processes)")
    parser.add_argument("--impl", nargs="*", choices=IMPLEMENTATIONS, default=["deepspeed", "ours-dropin", "ours"],
                        help="deepspeed: DeepSpeed's module + tutorial recipe; ours-dropin: our drop-in API with "
                             "the same user code; ours: ds_ulysses.initialize with the section's defaults; "
                             "deepspeed-alst: DeepSpeed with TiledMLP, TiledFusedLogitsLoss and checkpointing "
                             "(ArcticTraining's setup)")
    parser.add_argument("--loop", choices=sorted(LOOPS), default="engine",
                        help="engine: the user loop of engine(**batch), engine.backward, engine.step (DeepSpeed's "
                             "tutorial); trainer: the same arms through Transformers' Trainer (deepspeed: its "
                             "parallelism_config; ours: ds_ulysses.install() and the section; ours-dropin: "
                             "install() and the parallelism_config, which then takes our section defaults); "
                             "accelerate: the same three arms in a plain Accelerate loop (accelerator.prepare, "
                             "accelerator.backward; DeepSpeed's user's loss as Accelerate's guide writes it); "
                             "trl: the Trainer's arms through TRL's SFTTrainer (SFTConfig's defaults, gradient "
                             "checkpointing included, in fp32)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="an extra 'ours' arm with this \"ulysses\" section override, e.g. "
                             "'mlp={\"tiled_mlp\": {\"enabled\": true}}' (repeatable)")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="leave out the unrecorded first launch that warms the machine up")
    parser.add_argument("--no-noise", dest="noise", action="store_false",
                        help="leave out the noise arm (DeepSpeed launched twice per repetition)")
    parser.add_argument("--packed-docs", type=int, default=0, help="documents packed per sample (0: one)")
    parser.add_argument("--reps", type=int, default=3,
                        help="launches per arm, in rotating order (with --tiled-iters: processes per operation "
                             "and length; with --layer-iters: launches per length and sp)")
    parser.add_argument("--cycles", type=int, default=1, help="measured adapter refill cycles (sp steps each) per "
                                                              "launch; the launch's time is the fastest cycle's")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per launch (overrides --cycles)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps per launch")
    parser.add_argument("--profile-reps", type=int, default=1, metavar="N",
                        help="profile one extra refill cycle (sp steps) per launch in the first N repetitions "
                             "(0: none; default 1)")
    parser.add_argument("--model", action="append", default=[], metavar="KEY=INT",
                        help="model size override: vocab, hidden, intermediate, layers, heads, kv_heads")
    parser.add_argument("--host-env", action="append", default=[], metavar="NAME=VALUE",
                        help="set NAME=VALUE in every rank of every arm (repeatable), e.g. THP_MEM_ALLOC_ENABLE=1 "
                             "(torch's CPU buffers in huge pages); such launches are a configuration of their own in "
                             "the report, tagged 'env NAME=VALUE' in its model column")
    parser.add_argument("--out", default="benchmarks/results/runs.jsonl", help="JSON lines file to append to")
    parser.add_argument("--report", metavar="DIR", help="after running, write the Markdown report and plots of "
                                                        "every record in --out to DIR")
    parser.add_argument("--report-only", action="store_true", help="skip running; only --report")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    parser.add_argument("--layer-iters", type=int, default=0, metavar="N",
                        help="instead of training steps, time the attention layer alone (DeepSpeed's wrapper, "
                             "its noise arm and ours interleaved in one process group) for N iterations")
    parser.add_argument("--tiled-iters", type=int, default=0, metavar="N",
                        help="instead of training steps, time TiledMLP and sequence_tiled_compute against "
                             "DeepSpeed's (and DeepSpeed's against itself: the noise) at equal shards, N "
                             "interleaved iterations per process, --reps processes per operation and length")
    parser.add_argument("--tiled-ops", nargs="+", choices=TILED_OPS, default=list(TILED_OPS),
                        help="with --tiled-iters: the operations to time (all by default)")
    parser.add_argument("--max-seq", metavar="BUDGET", default=None,
                        help="instead of a fixed S, search the longest S whose step fits BUDGET of RSS per rank "
                             "(e.g. 4G) for each --impl / --variant")
    parser.add_argument("--max-seq-step", default="1K", help="granularity of the --max-seq search")
    parser.add_argument("--max-seq-cap", default=None, metavar="LEN",
                        help="search no further than LEN (e.g. 38K): an arm that fits there is reported as at "
                             "least LEN (for arms whose steps past it take too long on this machine)")
    parser.add_argument("--max-seq-steps", type=int, default=3, metavar="N",
                        help="training steps per --max-seq probe (its peak is the largest over all of them)")


def parse_bytes(text: str) -> int:
    """A memory budget: ``3G``, ``2.5GiB``, ``3000M``, ``512MiB`` (binary units) or plain bytes."""
    text = str(text).strip()
    number = text.rstrip("BbIi")
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(number[-1:].lower(), 1)
    try:
        value = float(number[:-1] if scale > 1 else number) * scale
    except ValueError:
        raise ValueError(f"expected a memory budget like 3G, 2.5GiB or 3000M, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"expected a positive memory budget, got {text!r}")
    return int(value)


def parse_pairs(pairs, what: str, value=json.loads) -> dict:
    out = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"{what} must look like NAME=VALUE, got {pair!r}")
        try:
            out[name] = value(text)
        except ValueError as exc:
            raise ValueError(f"{what} {name!r}: cannot parse {text!r} ({exc})") from None
    return out


def _check_loop(args: argparse.Namespace) -> None:
    """``--loop trainer``, ``accelerate`` and ``trl`` take the training-step suite's arms that a user of that
    loop can switch on; ``trl`` trains unpacked samples."""
    if args.loop == "engine":
        return
    other = [impl for impl in args.impl if impl not in LOOP_IMPLEMENTATIONS]
    if other:
        raise ValueError(f"--loop {args.loop} runs the arms {list(LOOP_IMPLEMENTATIONS)}, got {other}; leave those out "
                         f"(DeepSpeed's tiled recipe has no {args.loop} switch)")
    if args.max_seq or args.tiled_iters or args.layer_iters:
        raise ValueError(f"--loop {args.loop} times training steps; it does not combine with --max-seq, "
                         "--tiled-iters or --layer-iters")
    if args.loop == "trl" and args.packed_docs:
        raise ValueError(f"--loop trl trains TRL's samples as they come, got --packed-docs {args.packed_docs}; "
                         "leave it out (TRL packs with its own SFTConfig(packing=True))")


def _parse_host_env(args: argparse.Namespace) -> dict:
    """``--host-env``'s settings: for the training-step runs only, and none the harness sets for its ranks."""
    host_env = parse_pairs(args.host_env, "--host-env", str)
    if host_env and (args.max_seq or args.tiled_iters or args.layer_iters):
        raise ValueError(f"--host-env sets the ranks' environment of training-step runs, got it with --max-seq, "
                         f"--tiled-iters or --layer-iters; leave it out (or set {', '.join(host_env)} in the shell)")
    taken = [name for name in host_env if name in HARNESS_ENV]
    if taken:
        raise ValueError(f"--host-env cannot set {', '.join(taken)}: the harness sets it for every rank "
                         f"({', '.join(HARNESS_ENV)}); leave it out")
    return host_env


def run_command(args: argparse.Namespace) -> int:
    """The ``ds-ulysses bench`` runner: run, print this run's tables, optionally write the report."""
    from ds_ulysses.config import UlyssesConfig

    try:
        seq_lens = [parse_size(s) for s in args.seq_len]
        model = parse_pairs(args.model, "--model", int)
        variants = parse_pairs(args.variant, "--variant")
        for name, section in variants.items():
            UlyssesConfig.from_dict({"sequence_parallel_size": 1, **section})
        budget = parse_bytes(args.max_seq) if args.max_seq else None
        if args.max_seq_steps < 1:
            raise ValueError(f"--max-seq-steps must be 1 or more (training steps per probe), got {args.max_seq_steps}")
        if args.cycles < 1:
            raise ValueError(f"--cycles must be 1 or more (measured refill cycles per launch), got {args.cycles}")
        granularity = parse_size(args.max_seq_step)
        cap = parse_size(args.max_seq_cap) if args.max_seq_cap else None
        _check_loop(args)
        host_env = _parse_host_env(args)
    except ValueError as exc:
        print(f"ds-ulysses bench: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.report_only:
        pass
    elif budget is not None:
        records = run_maxseq(budget, args.sp, args.impl, variants, out, model, granularity, args.timeout,
                             args.max_seq_steps, cap=cap)
        print(format_maxseq(records))
    elif args.tiled_iters > 0:
        print(format_tiled(run_tiled_suite(seq_lens, args.tiled_iters, out, args.timeout, ops=args.tiled_ops,
                                           reps=args.reps)))
    elif args.layer_iters > 0:
        print(format_layer(run_layer_suite(seq_lens, args.sp, args.layer_iters, out, args.timeout, reps=args.reps)))
    else:
        records = run_suite(seq_lens, args.sp, args.impl, args.reps, args.steps, args.warmup, out,
                            args.packed_docs, model, variants, args.timeout, args.noise, args.profile_reps,
                            args.cycles, args.warm_up, loop=args.loop, host_env=host_env)
        print(format_run(records, LOOPS[args.loop]))
    if args.report:
        for path in write_report(read_records(out), Path(args.report)):
            print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse, then build DeepSpeed's ops before the first launch, so no launch deadline covers a build
    (the ranks inherit the virtualenv's op cache through ``TORCH_EXTENSIONS_DIR``)."""
    from ds_ulysses.train import ops

    parser = argparse.ArgumentParser(prog="ds-ulysses bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    ops.use_venv_cache()
    if not args.report_only:
        ops.build()
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())

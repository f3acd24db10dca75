"""The ``ds-ulysses`` command line: ``validate``, ``plan``, ``export``, ``eval``, ``universal`` and ``bench``.

Subcommands live in :data:`SUBCOMMANDS` (name -> :class:`Subcommand`), so adding ``bench``,
``plan`` or ``export`` is one entry: a function that declares its arguments and one that runs and
returns the exit code. Runners import what they need when they run, so one subcommand's heavy
dependencies (a benchmark's, say) are not loaded by another.

Exit codes: 0 success, 2 invalid input (bad config, or argparse's own usage errors).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["EXIT_INVALID", "EXIT_OK", "SUBCOMMANDS", "Subcommand", "build_parser", "main"]

EXIT_OK = 0
EXIT_INVALID = 2


class Subcommand(NamedTuple):
    """One ``ds-ulysses <name>`` command: its help line, argument setup and runner."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _add_validate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG.json",
                        help="DeepSpeed config file whose \"ulysses\" section is checked")
    parser.add_argument("--world-size", type=int, metavar="N",
                        help="also check that the mesh tiles N ranks (dp times sp equal to N)")


def _summary(cfg, world_size: int | None) -> str:
    """One line a user can eyeball: the mesh, the attention, and which ALST tools are on."""
    if world_size is not None:
        from ds_ulysses.distributed.mesh import mesh_shape

        dp, sp = mesh_shape(world_size, cfg.sp, cfg.mesh_param)
    else:
        dp, sp = (cfg.mesh_param[0] if cfg.mesh_param else "auto"), cfg.sp

    def tool(section) -> str:
        return f"{section.shards}" if section.enabled else "off"

    return (f"ok: mesh dp={dp} sp={sp} | attention {cfg.attn_implementation} | "
            f"tiled_mlp {tool(cfg.tiled_mlp)}, tiled_loss {tool(cfg.tiled_loss)}, "
            f"ckpt_offload {'on' if cfg.activation_checkpoint_offload.enabled else 'off'}")


def _run_validate(args: argparse.Namespace) -> int:
    """Print a one-line summary (stdout) or every error, one per line (stderr)."""
    from ds_ulysses.config import UlyssesConfigError, parse_ds_config

    try:
        _, cfg = parse_ds_config(args.config)
        if cfg is None:
            print(f"ok: no \"ulysses\" section in {args.config}; sequence parallelism is off")
            return EXIT_OK
        print(_summary(cfg, args.world_size))
    except UlyssesConfigError as exc:
        for error in exc.errors:  # file errors already start with the file name
            print(error if error.startswith(args.config) else f"{args.config}: {error}",
                  file=sys.stderr)
        return EXIT_INVALID
    except ValueError as exc:  # mesh() for --world-size
        print(f"{args.config}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK


def _benchmarks():
    """The side-by-side harness, which lives in the source checkout's ``benchmarks/`` (it imports
    DeepSpeed's ALST module, so it is not installed with the library)."""
    import importlib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "bench.py").is_file():
        raise SystemExit(f"ds-ulysses bench: expected the benchmark harness at {root / 'benchmarks'}, found none; "
                         "it ships with the source checkout, not the installed package; fix: clone the repository "
                         "and run `pip install -e .` there")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("benchmarks.bench")


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The harness parses its own arguments (:func:`main` hands them over before parsing)."""


def _run_bench(args: argparse.Namespace) -> int:
    return _benchmarks().main([])


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    from ds_ulysses.plan_command import add_arguments

    add_arguments(parser)


def _run_plan(args: argparse.Namespace) -> int:
    from ds_ulysses.plan_command import run_command

    return run_command(args)


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    from ds_ulysses.train.export import add_arguments

    add_arguments(parser)


def _run_export(args: argparse.Namespace) -> int:
    from ds_ulysses.train.export import run_command

    return run_command(args)


def _add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    from ds_ulysses.train.evaluate import add_arguments

    add_arguments(parser)


def _run_eval(args: argparse.Namespace) -> int:
    from ds_ulysses.train.evaluate import run_command

    return run_command(args)


def _add_universal_arguments(parser: argparse.ArgumentParser) -> None:
    from ds_ulysses.train.universal import add_arguments

    add_arguments(parser)


def _run_universal(args: argparse.Namespace) -> int:
    from ds_ulysses.train.universal import run_command

    return run_command(args)


SUBCOMMANDS: dict[str, Subcommand] = {
    "validate": Subcommand("check a DeepSpeed config's \"ulysses\" section against the schema",
                           _add_validate_arguments, _run_validate),
    "bench": Subcommand("benchmark ours against DeepSpeed's ALST module side by side (CPU processes)",
                        _add_bench_arguments, _run_bench),
    "plan": Subcommand("predict per-GPU memory and recommend sp, tiles and switches for a sequence length",
                       _add_plan_arguments, _run_plan),
    "export": Subcommand("write a training checkpoint as a plain HF save_pretrained directory (no SP, no DeepSpeed)",
                         _add_export_arguments, _run_export),
    "eval": Subcommand("held-out loss by token position of a saved HF model (CSV + PNG)",
                       _add_eval_arguments, _run_eval),
    "universal": Subcommand("convert a ZeRO checkpoint to DeepSpeed's universal form, to resume at another world size",
                            _add_universal_arguments, _run_universal),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per entry of SUBCOMMANDS."""
    parser = argparse.ArgumentParser(
        prog="ds-ulysses",
        description="Ulysses sequence parallelism and ALST memory tools for DeepSpeed.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ds-ulysses`` console script; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the harness owns every argument after the subcommand
        return _benchmarks().main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

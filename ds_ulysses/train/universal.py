"""The training app's resume at another world size: DeepSpeed's universal checkpoint, made once per
checkpoint (``step_*/universal/``) before the job's process groups exist, and ``ds-ulysses universal``
for checkpoints the app did not write.

The conversion, its checksums and the per-group repair of DeepSpeed's ZeRO-3 load live in
:mod:`ds_ulysses.reshard`, shared with the engine hook that serves HF Trainer and Accelerate. Here rank 0
converts before ``init_process_group``: a long conversion then cannot time out a collective the other
ranks wait in.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..reshard import (MIN_DEEPSPEED, UNIVERSAL_MANIFEST, UNIVERSAL_SUFFIX, CheckpointError, convert,
                       require_deepspeed, restore_param_groups, verify_universal, wait_for_universal)
from .checkpoint import MANIFEST

__all__ = ["MIN_DEEPSPEED", "UNIVERSAL_TAG", "launch_rank", "launch_world_size", "require_deepspeed",
           "convert", "convert_checkpoint", "verify_universal", "ensure_universal", "restore_param_groups",
           "add_arguments", "run_command"]

UNIVERSAL_TAG = "universal"


def launch_rank() -> int:
    """This process's rank, known before the process groups are (the launcher's ``RANK``)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def launch_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def convert_checkpoint(path) -> Path:
    """``ds-ulysses universal``: the universal form next to a checkpoint; returns its directory.

    ``path`` is a training-app checkpoint (``step_*`` with ``manifest.json``: written to its
    ``universal/``), or a DeepSpeed checkpoint directory as HF Trainer and Accelerate write it (a
    ``latest`` file naming the tag: written to ``<tag>_universal`` and named by ``latest_universal``,
    which DeepSpeed's ``load_checkpoint`` reads when ``load_universal`` is set).
    """
    path = Path(path)
    require_deepspeed("load the checkpoint at the world size that wrote it")
    if (path / MANIFEST).is_file():
        if (path / UNIVERSAL_TAG / UNIVERSAL_MANIFEST).is_file():
            verify_universal(path / UNIVERSAL_TAG)
            return path / UNIVERSAL_TAG
        return convert(path / "ds", path / UNIVERSAL_TAG)
    latest = path / "latest"
    if not latest.is_file():
        raise CheckpointError(
            f"expected a training checkpoint (a step_* directory with {MANIFEST}) or a DeepSpeed checkpoint "
            f"directory (with a 'latest' file naming its tag) at {path}, got neither; fix: pass the directory "
            "given to engine.save_checkpoint (for the HF Trainer: the checkpoint-N directory)")
    tag = latest.read_text().strip()
    target = convert(path / tag, path / f"{tag}{UNIVERSAL_SUFFIX}")
    tmp = path / ".latest_universal.tmp"
    tmp.write_text(target.name)
    os.replace(tmp, path / "latest_universal")
    return target


def ensure_universal(checkpoint: Path, source_world: int) -> Path:
    """The checkpoint's verified universal form, converted by rank 0 if it is not there yet.

    Called before the process groups exist: rank 0 converts, the other ranks wait for the renamed
    directory (a failed rank 0 ends the launch, which ends them). Every rank then verifies it.
    """
    target = checkpoint / UNIVERSAL_TAG
    require_deepspeed(f"resume on {source_world} ranks (any dp x sp split of them loads without a conversion)")
    if launch_rank() == 0:
        if not (target / UNIVERSAL_MANIFEST).is_file():
            convert(checkpoint / "ds", target)
    else:
        wait_for_universal(target)
    verify_universal(target)
    return target


def add_arguments(parser) -> None:
    """``ds-ulysses universal CHECKPOINT``."""
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a training-app checkpoint (step_* or a run's checkpoints/, its latest complete one), "
                             "or a DeepSpeed checkpoint directory with a 'latest' file (HF Trainer: checkpoint-N)")


def run_command(args) -> int:
    """Convert in this one process (no GPU, no process group); exit 0, or 2 with the reason on stderr."""
    import sys

    from .checkpoint import find_checkpoint, verify_checkpoint

    path = Path(args.checkpoint)
    try:
        if not (path / "latest").is_file():
            path = find_checkpoint(path)
            verify_checkpoint(path)
        out = convert_checkpoint(path)
    except (CheckpointError, FileNotFoundError) as exc:
        print(f"universal: {exc}", file=sys.stderr)
        return 2
    if (path / MANIFEST).is_file():
        how = "examples/train.py --resume loads it on any world size"
    else:
        how = ("the HF Trainer or Accelerate loads it on any world size after ds_ulysses.install() (or load it with "
               "\"checkpoint\": {\"load_universal\": true} in the DeepSpeed config: it reads latest_universal); "
               "docs/resume.md")
    print(f"converted {path} -> {out}: {how}")
    return 0

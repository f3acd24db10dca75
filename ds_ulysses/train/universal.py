"""Resume at another world size: DeepSpeed's universal checkpoint, made once, atomically, and loaded with
the two per-group repairs its ZeRO-3 load needs.

ZeRO splits the optimizer state over the ranks of its group, which under our mesh is the whole world
(``dp * sp`` ranks), so a checkpoint loads with DeepSpeed's ordinary ``load_checkpoint`` on any mesh of
the same world size and on no other (``ZeRORuntimeException``). For another world size DeepSpeed's
``ds_to_universal`` rewrites the partitions as one file per parameter and state, which a job of any
world size loads with ``"checkpoint": {"load_universal": true}``.

The conversion runs in one process, before the job's process groups exist: a long conversion then
cannot time out a collective the other ranks wait in. It writes into a temporary directory and renames
it into place after its own manifest (``universal.json``, checksums like the checkpoint's) was written,
so a conversion killed half way leaves the checkpoint as it was and the next attempt starts over.

DeepSpeed's ZeRO-3 universal load (0.18-0.19) restores the first parameter group only (its ZeRO-1/2
load restores each group): every group
gets group 0's hyperparameters (weight decay ``[0.5, 0.0]`` came back ``[0.5, 0.5]``) and one shared
Adam ``step`` tensor, which an optimizer that steps tensors in place then advances once per group
(4 steps after a resume read 12, not 8). :func:`restore_param_groups` puts each group's own back.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import time
from pathlib import Path

import torch

from .checkpoint import MANIFEST, CheckpointError, _fsync_dir, _sha256, safe_torch_load

__all__ = ["MIN_DEEPSPEED", "UNIVERSAL_TAG", "launch_rank", "launch_world_size", "require_deepspeed",
           "convert", "convert_checkpoint", "verify_universal", "ensure_universal", "restore_param_groups",
           "add_arguments", "run_command"]

MIN_DEEPSPEED = "0.18.0"  # ZeRO-3 universal loads at a larger world size fail before it
UNIVERSAL_TAG = "universal"
UNIVERSAL_MANIFEST = "universal.json"
_WAIT_SECONDS = 0.5


def launch_rank() -> int:
    """This process's rank, known before the process groups are (the launcher's ``RANK``)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def launch_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def require_deepspeed(alternative: str) -> None:
    """Raise if the installed DeepSpeed cannot load a universal checkpoint at another world size;
    ``alternative`` is the fix that needs no conversion."""
    import deepspeed
    from packaging.version import Version

    if Version(deepspeed.__version__) < Version(MIN_DEEPSPEED):
        raise CheckpointError(
            f"DeepSpeed too old: resuming at another world size needs DeepSpeed >= {MIN_DEEPSPEED} (its ZeRO-3 "
            f"universal load), got {deepspeed.__version__}; fix: pip install 'deepspeed>={MIN_DEEPSPEED}', or "
            f"{alternative}")


def convert(source: Path, target: Path) -> Path:
    """Write DeepSpeed's universal form of the checkpoint in ``source`` to ``target``, atomically.

    DeepSpeed's converter prints its progress; that is kept and shown only when it fails.
    """
    from deepspeed.checkpoint import ds_to_universal

    tmp = target.parent / f".{target.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a conversion that was killed part way
    # inject_missing_state: ZeRO-1/2 checkpoints of a model without tensor parallelism carry no
    # universal_checkpoint_info; the converter then records just its format version
    args = argparse.Namespace(input_folder=str(source), output_folder=str(tmp), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal.main(args)
    except Exception as exc:
        raise CheckpointError(
            f"DeepSpeed's ds_to_universal could not convert {source}: {type(exc).__name__}: {exc}; its output:\n"
            f"{log.getvalue()[-2000:]}\nfix: resume on the world size that wrote the checkpoint") from exc
    files = {p.relative_to(tmp).as_posix(): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    import deepspeed

    record = tmp / UNIVERSAL_MANIFEST
    with record.open("w", encoding="utf-8") as f:
        f.write(json.dumps({"source": source.name, "deepspeed": deepspeed.__version__, "files": files},
                           indent=2, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    if target.exists():  # a damaged earlier conversion
        shutil.rmtree(target)
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    return target


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
    target = convert(path / tag, path / f"{tag}_{UNIVERSAL_TAG}")
    tmp = path / ".latest_universal.tmp"
    tmp.write_text(target.name)
    os.replace(tmp, path / "latest_universal")
    return target


def verify_universal(directory: Path) -> dict:
    """The record of a complete conversion whose files all match their checksums; raises otherwise."""
    record_path = directory / UNIVERSAL_MANIFEST
    if not record_path.is_file():
        raise CheckpointError(f"universal checkpoint {directory} is incomplete: expected {UNIVERSAL_MANIFEST}, got "
                              f"none; fix: delete {directory} and resume again (it is converted anew)")
    record = json.loads(record_path.read_text(encoding="utf-8"))
    bad = [f for f, digest in record["files"].items()
           if not (directory / f).is_file() or _sha256(directory / f) != digest]
    if bad:
        raise CheckpointError(f"universal checkpoint {directory} is damaged: {len(bad)} files missing or changed "
                              f"{bad[:3]}; fix: delete {directory} and resume again (it is converted anew)")
    return record


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
        while not (target / UNIVERSAL_MANIFEST).is_file():
            time.sleep(_WAIT_SECONDS)
    verify_universal(target)
    return target


def restore_param_groups(engine, universal: Path) -> int:
    """Give each parameter group back its own hyperparameters and Adam step after a ZeRO-3 universal load.

    Returns the number of groups restored. Each ZeRO-3 sub-group gets its own copy of its group's step:
    a tensor shared between sub-groups would be advanced once per sub-group per optimizer step.
    """
    zero = engine.optimizer
    saved = safe_torch_load(universal / "zero" / "optimizer_state.pt")["optimizer_state_dict"]
    groups, state = saved["param_groups"], saved["state"]
    base = zero.optimizer
    if len(groups) != len(base.param_groups):
        raise CheckpointError(
            f"universal checkpoint {universal}: expected {len(base.param_groups)} optimizer parameter groups "
            f"(this job's), got {len(groups)}; fix: build the optimizer with the checkpoint's parameter groups")
    for group, kept in zip(base.param_groups, groups):
        group.update({k: v for k, v in kept.items() if k != "params"})
    for sub_group, flat in enumerate(zero.fp32_partitioned_groups_flat):
        kept = groups[zero.sub_group_to_group_id[sub_group]]
        step = state[kept["params"][0]]["step"]
        base.state[flat]["step"] = step.clone() if torch.is_tensor(step) else step
    return len(groups)


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
        how = ("load it with \"checkpoint\": {\"load_universal\": true} in the DeepSpeed config (it reads "
               "latest_universal); see docs/resume.md for the per-group repair")
    print(f"converted {path} -> {out}: {how}")
    return 0

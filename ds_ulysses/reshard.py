"""Resume on another mesh: what the training app (:mod:`ds_ulysses.train`) and the engine hook
(:func:`ds_ulysses.install`'s ``engine.load_checkpoint``, which HF Trainer and Accelerate call) share.

ZeRO splits the optimizer state over the ranks of its group, which under our mesh is the whole world
(``dp * sp`` ranks), so a checkpoint loads with DeepSpeed's ordinary ``load_checkpoint`` on any mesh of
the same world size and on no other (``ZeRORuntimeException``). For another world size DeepSpeed's
``ds_to_universal`` rewrites the partitions as one file per parameter and state, which a job of any
world size loads with ``"checkpoint": {"load_universal": true}``.

A conversion writes into a temporary directory and renames it into place after its own manifest
(``universal.json``, the sha256 of every file) was written, so a conversion killed half way leaves the
checkpoint as it was and the next attempt starts over; every reader verifies the checksums first.
One process converts and the others wait on the filesystem, not in a collective, so a long conversion
cannot time out a process group.

DeepSpeed's ZeRO-3 universal load (0.18-0.19) restores the first parameter group only (its ZeRO-1/2
load restores each group): every group gets group 0's hyperparameters (weight decay ``[0.5, 0.0]``
came back ``[0.5, 0.5]``) and one shared Adam ``step`` tensor, which an optimizer that steps tensors
in place then advances once per group (4 steps after a resume read 12, not 8).
:func:`restore_param_groups` puts each group's own back.

The data position: another mesh continues a run exactly when the global batch (``dp x micro batch x
accumulation``, :class:`Layout`) is the checkpoint's and the samples trained so far are a prefix of
the data order (:meth:`Layout.prefix_after`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CheckpointError", "MIN_DEEPSPEED", "UNIVERSAL_SUFFIX", "UNIVERSAL_MANIFEST", "sha256", "fsync_dir",
           "safe_torch_load", "require_deepspeed", "convert", "verify_universal", "wait_for_universal",
           "restore_param_groups", "ranks", "Layout", "batch_fix", "saved_layout", "zero_partitions",
           "load_on_any_mesh"]

MIN_DEEPSPEED = "0.18.0"  # ZeRO-3 universal loads at a larger world size fail before it
UNIVERSAL_SUFFIX = "_universal"  # DeepSpeed's own naming: <tag>_universal, named by latest_universal
UNIVERSAL_MANIFEST = "universal.json"
WAIT_SECONDS = 0.5


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted, made by a different job, or that this job
    cannot continue exactly."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(directory: Path) -> None:
    """Make a rename durable: the directory entry itself must reach the disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _deepspeed_safe_globals() -> list:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [LossScaler, ZeroStageEnum]


def safe_torch_load(path, map_location=None, mmap: bool = False):
    """``torch.load(weights_only=True)`` that also admits DeepSpeed's two checkpoint bookkeeping classes;
    ``mmap`` maps the tensors instead of reading them (a file read for its metadata only)."""
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


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
    files = {p.relative_to(tmp).as_posix(): sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
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
    fsync_dir(target.parent)
    return target


def verify_universal(directory: Path) -> dict:
    """The record of a complete conversion whose files all match their checksums; raises otherwise."""
    record_path = directory / UNIVERSAL_MANIFEST
    if not record_path.is_file():
        raise CheckpointError(f"universal checkpoint {directory} is incomplete: expected {UNIVERSAL_MANIFEST}, got "
                              f"none; fix: delete {directory} and resume again (it is converted anew)")
    record = json.loads(record_path.read_text(encoding="utf-8"))
    bad = [f for f, digest in record["files"].items()
           if not (directory / f).is_file() or sha256(directory / f) != digest]
    if bad:
        raise CheckpointError(f"universal checkpoint {directory} is damaged: {len(bad)} files missing or changed "
                              f"{bad[:3]}; fix: delete {directory} and resume again (it is converted anew)")
    return record


def wait_for_universal(target: Path) -> None:
    """Wait until another process's conversion into ``target`` is renamed into place. No timeout: a
    conversion takes as long as the checkpoint is large, and a converter that fails ends the launch."""
    while not (target / UNIVERSAL_MANIFEST).is_file():
        time.sleep(WAIT_SECONDS)


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


def ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


@dataclass(frozen=True)
class Layout:
    """How a job reads the data: ranks, SP degree, micro batch per rank, micro-batches per step.

    Each rank reads a distinct sample per refill and its SP group then trains the ``sp`` samples of the
    refill one micro-batch at a time: a refill reads ``world * micro_batch`` consecutive samples and
    yields ``sp`` micro-batches, one micro-batch trains ``dp * micro_batch`` samples over the mesh and
    one optimizer step ``dp * micro_batch * grad_accum``, the global batch.
    """

    world_size: int
    sp: int
    micro_batch: int
    grad_accum: int

    @property
    def dp(self) -> int:
        return self.world_size // self.sp

    @property
    def refill(self) -> int:
        """Samples one refill reads (one per rank and micro-batch slot)."""
        return self.world_size * self.micro_batch

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.grad_accum

    def describe(self) -> str:
        return (f"dp {self.dp} x sp {self.sp} on {ranks(self.world_size)}, micro batch {self.micro_batch}, "
                f"gradient_accumulation_steps {self.grad_accum}")

    def prefix_after(self, micro_batches: int) -> bool:
        """Whether the first ``micro_batches`` micro-batches trained exactly the first samples of the data.

        A refill left part way holds trained and untrained samples interleaved (micro-batch k trains the
        k-th sample of each SP group), unless one micro-batch trains one sample.
        """
        return micro_batches % self.sp == 0 or self.dp * self.micro_batch == 1

    @classmethod
    def of_checkpoint(cls, manifest) -> Layout:
        """The layout a training-app checkpoint's manifest records."""
        return cls(manifest.world_size, manifest.sp, manifest.data["micro_batch_size"],
                   manifest.data["gradient_accumulation_steps"])


def batch_fix(global_batch: int, layout: Layout) -> str:
    """The setting that gives ``layout``'s mesh the global batch ``global_batch``."""
    per_step = layout.dp * layout.micro_batch
    if global_batch % per_step == 0:
        return f"set gradient_accumulation_steps to {global_batch // per_step} for this mesh"
    if global_batch % layout.dp == 0:
        return (f"choose train_micro_batch_size_per_gpu x gradient_accumulation_steps = {global_batch // layout.dp} "
                f"for this mesh (e.g. micro batch 1, gradient_accumulation_steps {global_batch // layout.dp})")
    return f"launch a mesh whose dp divides {global_batch}"


def zero_partitions(tag_dir: Path) -> int:
    """The ranks ZeRO split a DeepSpeed checkpoint's optimizer state over (its ``*zero_pp_rank_*`` files);
    0 without ZeRO (stage 0 saves the whole state once, which loads on any world size)."""
    return len(list(Path(tag_dir).glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt")))


def saved_layout(tag_dir: Path) -> Layout:
    """The layout of the job that wrote a DeepSpeed checkpoint, from the config DeepSpeed saved with it
    (``ds_config``, with the ``sequence_parallel_size`` :func:`ds_ulysses.initialize` sets) and the ranks it
    split ZeRO over. Read memory-mapped: under ZeRO-0/1/2 that file also holds the weights."""
    tag_dir = Path(tag_dir)
    files = sorted(tag_dir.glob("*model_states.pt"))
    if not files:
        raise CheckpointError(f"expected DeepSpeed's model states (*model_states.pt) in {tag_dir}, got none; fix: "
                              "pass a checkpoint directory written by a DeepSpeed engine (HF Trainer: checkpoint-N)")
    saved = safe_torch_load(files[0], map_location="cpu", mmap=True)
    config = saved.get("ds_config") or {}
    world = zero_partitions(tag_dir) or int(saved.get("dp_world_size", 1))
    return Layout(world, int(config.get("sequence_parallel_size", 1)),
                  int(config.get("train_micro_batch_size_per_gpu", 1)), int(config.get("gradient_accumulation_steps", 1)))


def _tag_of(load_dir: Path, tag) -> str | None:
    latest = load_dir / "latest"
    if tag is not None:
        return str(tag)
    return latest.read_text().strip() if latest.is_file() else None


def _universal_of(load_dir: Path, tag: str, partitions: int, rank: int) -> Path:
    """The verified universal form of ``load_dir/tag``, converted by rank 0 if it is not there yet."""
    target = load_dir / f"{tag}{UNIVERSAL_SUFFIX}"
    if not (target / UNIVERSAL_MANIFEST).is_file():
        require_deepspeed(f"resume on {ranks(partitions)} (any dp x sp split of them loads without a conversion)")
        if not os.access(load_dir, os.W_OK):
            raise CheckpointError(
                f"checkpoint {load_dir / tag} was written by {ranks(partitions)} and needs DeepSpeed's universal form "
                f"to load on another world size, but {load_dir} is not writable; fix: convert it once where it is "
                f"writable with `ds-ulysses universal {load_dir}` (one process, no GPU), or resume on "
                f"{ranks(partitions)}")
        if rank == 0:
            convert(load_dir / tag, target)
        else:
            wait_for_universal(target)
    verify_universal(target)
    return target


def load_on_any_mesh(engine, load_checkpoint, load_dir, tag=None, *args, **kwargs):
    """``engine.load_checkpoint`` (``load_checkpoint``, DeepSpeed's) on any world size.

    A checkpoint ZeRO split over as many ranks as this engine's ZeRO group has (any ``dp x sp`` split of
    the same world), without ZeRO, or a load the config already sends to a universal checkpoint, is
    DeepSpeed's ordinary load. Any other is converted once into ``<tag>_universal`` next to it (by rank 0
    while the other ranks wait on the filesystem; reused on later loads, also when ``ds-ulysses universal``
    made it) and loaded from there with ``load_universal`` for this one load; under ZeRO-3 each optimizer
    group's step and hyperparameters are then restored (:func:`restore_param_groups`).
    """
    import inspect

    import torch.distributed as dist

    name = _tag_of(Path(load_dir), tag)
    if engine.load_universal_checkpoint() or name is None:
        return load_checkpoint(load_dir, tag, *args, **kwargs)
    partitions = zero_partitions(Path(load_dir) / name)
    if partitions in (0, engine.seq_dp_world_size):
        return load_checkpoint(load_dir, tag, *args, **kwargs)
    universal = _universal_of(Path(load_dir), name, partitions, dist.get_rank() if dist.is_initialized() else 0)
    engine._config.load_universal_checkpoint = True  # read by DeepSpeed at load time only
    try:
        out = load_checkpoint(load_dir, universal.name, *args, **kwargs)
    finally:
        engine._config.load_universal_checkpoint = False
    asked = inspect.signature(load_checkpoint).bind(load_dir, universal.name, *args, **kwargs)
    asked.apply_defaults()
    optimizer_loaded = asked.arguments["load_optimizer_states"] and not asked.arguments["load_module_only"]
    repaired = out[0] is not None and optimizer_loaded and engine.zero_optimization_stage() == 3
    if repaired:
        restore_param_groups(engine, universal)
    from deepspeed.utils import log_dist

    log_dist(f"ds_ulysses: {Path(load_dir) / name} was written by {ranks(partitions)}, this job has "
             f"{ranks(engine.seq_dp_world_size)}: loaded its universal form {universal.name}/"
             + ("; each optimizer group's step and hyperparameters restored" if repaired else ""), ranks=[0])
    return out

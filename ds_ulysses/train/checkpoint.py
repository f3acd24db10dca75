"""Atomic, verifiable training checkpoints around DeepSpeed's own, for exact resume.

Layout under ``root`` (e.g. ``runs/demo/checkpoints``)::

    step_00000010/           complete: renamed into place only after everything below was written
        ds/ latest           DeepSpeed's engine.save_checkpoint (ZeRO partitions, optimizer, scheduler)
        rng/rank_00000.pt    each rank's torch / Python / NumPy RNG state
        model/config.json    the HF config (and tokenizer files), for export without the training code
        manifest.json        written last: step, mesh, ZeRO partition count, model hash, data position
                             (global batch, samples consumed, held-out count), files + sha256
        universal/           written on the first resume at another world size (see universal.py)
    .step_00000020.tmp/      a save in progress, or one that crashed: never read

A save writes everything into the temp directory, then rank 0 writes the manifest and renames the
directory, which is atomic on one filesystem: a crash at any point leaves the previous checkpoint as
the latest complete one. Loading verifies every file against the manifest's checksums and the
mesh and model against the running job before DeepSpeed reads anything (a file a power loss left
short is caught, not unpickled), and DeepSpeed's reads are done with
``torch.load(weights_only=True)`` (its two bookkeeping classes allowed by name).
The directory must be on a filesystem every rank sees (one node here).

Manifests written before the mesh-change fields existed still load: :meth:`Manifest.read` fills in
what they imply (their runs never changed batch or mesh, so the ZeRO partition count is the world size
and the samples consumed are step x global batch).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..reshard import CheckpointError, fsync_dir, safe_torch_load, sha256

__all__ = ["CheckpointError", "Manifest", "model_fingerprint", "save_checkpoint", "find_checkpoint",
           "verify_checkpoint", "check_compatible", "load_checkpoint", "safe_torch_load"]

FORMAT = 1
DS_TAG = "ds"
MANIFEST = "manifest.json"
_PREFIX = "step_"
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "architectures")


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint records; ``data`` is where the next step's samples start."""

    step: int
    dp: int
    sp: int
    world_size: int
    model_hash: str
    seq_len: int
    tokenizer: str
    data: dict
    files: dict
    format: int = FORMAT
    tag: str = DS_TAG
    zero_partitions: int = 0  # ranks ZeRO split the optimizer state over (0: an older manifest)
    rng_ranks: int = 0  # rng/rank_*.pt files (0: an older manifest)
    deepspeed: str = ""  # the DeepSpeed version that wrote ds/

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        raw = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
        fields = {f.name for f in dataclasses.fields(cls)}
        manifest = cls(**{k: v for k, v in raw.items() if k in fields})
        return manifest._with_implied_fields()

    def _with_implied_fields(self) -> Manifest:
        """An older manifest's missing fields, from what its run could only have been (one mesh, one batch)."""
        data = dict(self.data)
        if "global_batch" not in data and "micro_batch_size" in data:
            data["global_batch"] = self.dp * data["micro_batch_size"] * data["gradient_accumulation_steps"]
            data["samples_consumed"] = self.step * data["global_batch"]
        return dataclasses.replace(self, data=data, zero_partitions=self.zero_partitions or self.world_size,
                                   rng_ranks=self.rng_ranks or self.world_size)


def model_fingerprint(config) -> str:
    """sha256 of an HF config's architecture fields (paths, versions and attention choice left out)."""
    raw = config.to_dict()
    kept = {k: v for k, v in raw.items() if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_attn")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rng_state() -> dict:
    """RNG state as tensors and ints only, so it loads back under ``weights_only=True``."""
    import numpy as np

    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": [version, list(mt), gauss],
            "numpy": [np_name, torch.from_numpy(np_keys.astype("int64")), np_pos, np_has_gauss, np_gauss]}


def _set_rng_state(state: dict) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def _save_rng(directory: Path) -> None:
    (directory / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), directory / "rng" / f"rank_{_rank():05d}.pt")


def _write_manifest(directory: Path, manifest: Manifest) -> None:
    tmp = directory / (MANIFEST + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(json.dumps(dataclasses.asdict(manifest), indent=2, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)


def save_checkpoint(engine, root, step: int, *, model_config, seq_len: int, tokenizer: str, data: dict,
                    hf_tokenizer=None, keep_last: int = 2) -> Path:
    """Save ``engine`` after ``step`` steps; every rank calls it. Returns the complete directory.

    ``data`` is the resume position (e.g. ``{"sample_offset": ..., "skip_micro_batches": ...}``),
    stored verbatim. Older complete checkpoints beyond ``keep_last`` are removed afterwards.
    """
    root = Path(root)
    name = f"{_PREFIX}{step:08d}"
    final, tmp = root / name, root / f".{name}.tmp"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt at this step
        tmp.mkdir()
    _barrier()
    engine.save_checkpoint(str(tmp), tag=DS_TAG)
    _save_rng(tmp)
    if _rank() == 0:
        model_config.save_pretrained(tmp / "model")
        if hf_tokenizer is not None:
            hf_tokenizer.save_pretrained(tmp / "model")
    _barrier()  # every rank's files are on disk before they are hashed
    if _rank() == 0:
        import deepspeed

        mesh = engine.mpu
        files = {p.relative_to(tmp).as_posix(): sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        _write_manifest(tmp, Manifest(step, mesh.dp, mesh.sp, mesh.world_size, model_fingerprint(model_config),
                                      seq_len, tokenizer, dict(data), files, zero_partitions=engine.seq_dp_world_size,
                                      rng_ranks=mesh.world_size, deepspeed=deepspeed.__version__))
        if final.exists():  # re-saving a step (resumed from an older checkpoint): replace it
            trash = root / f".{name}.old"
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash)
        else:
            os.rename(tmp, final)
        fsync_dir(root)
        for old in _complete(root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old)
    _barrier()
    return final


def _complete(root: Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and (p / MANIFEST).is_file())


def find_checkpoint(path) -> Path:
    """``path`` itself if it is a checkpoint, else the latest complete one under it.

    Unfinished saves (``.step_*.tmp``) are never candidates, so a crash mid-save resumes from the
    checkpoint before it.
    """
    path = Path(path)
    if (path / MANIFEST).is_file() or path.name.startswith(_PREFIX):
        return path
    found = _complete(path)
    if not found:
        partial = sorted(p.name for p in path.iterdir() if p.is_dir()) if path.is_dir() else []
        raise CheckpointError(
            f"expected a complete checkpoint ({_PREFIX}*/{MANIFEST}) under {path}, got "
            f"{'none (directories: ' + ', '.join(partial) + ')' if partial else 'no such directory or nothing in it'};"
            " fix: pass a step_* directory or the run's checkpoints directory (to train from scratch, drop --resume)")
    return found[-1]


def verify_checkpoint(directory) -> Manifest:
    """The manifest of a complete checkpoint whose files all match their checksums; raises otherwise."""
    directory = Path(directory)
    if not (directory / MANIFEST).is_file():
        raise CheckpointError(
            f"checkpoint {directory} is incomplete: expected {MANIFEST}, which is written last, got none "
            "(the save was interrupted or the directory was copied partially); fix: resume from the "
            f"checkpoints directory to pick the latest complete one, or delete {directory}")
    manifest = Manifest.read(directory)
    if manifest.format != FORMAT:
        raise CheckpointError(f"checkpoint {directory}: expected format {FORMAT}, got {manifest.format}; "
                              "fix: use the ds_ulysses version that wrote it")
    missing = [f for f in manifest.files if not (directory / f).is_file()]
    corrupt = [f for f, digest in manifest.files.items() if f not in missing and sha256(directory / f) != digest]
    if missing or corrupt:
        raise CheckpointError(
            f"checkpoint {directory} is damaged: expected the {len(manifest.files)} files of its manifest with "
            f"their sha256, got {len(missing)} missing {missing[:3]} and {len(corrupt)} changed {corrupt[:3]}; "
            "fix: resume from an earlier checkpoint (pass its directory to --resume) or restore the files")
    return manifest


def check_compatible(manifest: Manifest, directory, *, model_hash: str, seq_len: int, tokenizer: str) -> None:
    """Raise, naming each difference, if the checkpoint was made for another model or token stream.

    The mesh may differ (:mod:`.universal` and :mod:`.position` decide how a new mesh continues); the
    model, sequence length and tokenizer may not: they decide what the weights mean and which tokens
    the data position points at.
    """
    diffs, fixes = [], []
    if manifest.model_hash != model_hash:
        diffs.append(f"model config: checkpoint {manifest.model_hash[:12]}, this job {model_hash[:12]}")
        fixes.append(f"build the model of {Path(directory) / 'model' / 'config.json'} (same --model)")
    if manifest.seq_len != seq_len:
        diffs.append(f"seq_len: checkpoint {manifest.seq_len}, this job {seq_len}")
        fixes.append(f"pass --seq-len {manifest.seq_len}")
    if manifest.tokenizer != tokenizer:
        diffs.append(f"tokenizer: checkpoint {manifest.tokenizer!r}, this job {tokenizer!r}")
        fixes.append("pass the same --tokenizer")
    if diffs:
        raise CheckpointError(
            f"checkpoint {directory} does not match this job: " + "; ".join(diffs) + ". fix: " + ", ".join(fixes)
            + "; or export it (ds-ulysses export) and start a new run from the export with --model")


def load_checkpoint(engine, directory, manifest: Manifest, tag: str | None = None) -> None:
    """Restore engine, optimizer, scheduler and this rank's RNG from a verified checkpoint.

    ``tag`` is the DeepSpeed directory to read (default the manifest's, ``ds``; ``universal`` after a
    conversion). A job on more ranks than wrote the checkpoint gives rank ``r`` the RNG of rank
    ``r mod rng_ranks``: the training itself draws no random numbers (no dropout in the app's models),
    so this only decides what a user's own sampling continues from.
    """
    directory, tag = Path(directory), tag or manifest.tag
    ckpt_engine = engine.checkpoint_engine
    ckpt_engine.load = safe_torch_load  # this engine's reads only; DeepSpeed's default unpickles anything
    try:
        path, _ = engine.load_checkpoint(str(directory), tag=tag, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
    finally:
        del ckpt_engine.load
    if path is None:
        raise CheckpointError(f"DeepSpeed found nothing to load in {directory / tag}; fix: pass a "
                              "checkpoint written by ds_ulysses.train.checkpoint.save_checkpoint")
    _set_rng_state(safe_torch_load(directory / "rng" / f"rank_{_rank() % manifest.rng_ranks:05d}.pt"))

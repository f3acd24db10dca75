"""A training checkpoint -> a plain HF ``save_pretrained`` directory: no SP, no DeepSpeed needed to load it.

Under ZeRO-3 no file holds a whole parameter: each rank's optimizer file holds its flat fp32
partition. DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` stitches them back together
(these fp32 master weights are exactly what the engine computes with in fp32 training); the HF
config saved beside them rebuilds the architecture with its ordinary attention, so
``AutoModelForCausalLM.from_pretrained(out_dir)`` gives the trained model's logits. DeepSpeed's
reader unpickles without restrictions, so every file is first checked against the manifest's
checksums and loaded once with ``weights_only=True``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from .checkpoint import CheckpointError, find_checkpoint, safe_torch_load, verify_checkpoint

__all__ = ["export_checkpoint", "add_arguments", "run_command"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _state_dict(directory: Path, tag: str) -> dict:
    ds_dir = directory / tag
    pt_files = sorted(ds_dir.glob("*.pt"))
    for path in pt_files:
        safe_torch_load(path, map_location="cpu")  # raises on anything but tensors and plain data
    if any(p.name.endswith("optim_states.pt") for p in pt_files):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag)
    model_states = ds_dir / "mp_rank_00_model_states.pt"  # ZeRO-0: the whole module in one file
    if not model_states.is_file():
        raise CheckpointError(f"{ds_dir}: expected ZeRO optimizer partitions or {model_states.name}, got "
                              f"{[p.name for p in pt_files]}; fix: export a checkpoint saved by train.py")
    return safe_torch_load(model_states, map_location="cpu")["module"]


def export_checkpoint(checkpoint, out_dir, dtype: str = "float32") -> Path:
    """Write the model of ``checkpoint`` (a step directory, or a run's checkpoints directory for its
    latest complete one) to ``out_dir`` with ``save_pretrained``; tokenizer files are copied along."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}; fix: pass --dtype float32")
    directory = find_checkpoint(checkpoint)
    manifest = verify_checkpoint(directory)
    state = _state_dict(directory, manifest.tag)
    config = AutoConfig.from_pretrained(directory / "model", local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    expected = set(model.state_dict())
    if set(state) - expected or expected - set(state) - _tied_keys(model):
        raise CheckpointError(
            f"{directory}: expected the parameters of {config.model_type} from model/config.json, got "
            f"{len(set(state) - expected)} unexpected {sorted(set(state) - expected)[:3]} and missing "
            f"{sorted(expected - set(state) - _tied_keys(model))[:3]}; fix: export a checkpoint whose "
            "model/config.json matches its weights")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model = model.to(_DTYPES[dtype])
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    for extra in (directory / "model").iterdir():
        if extra.name != "config.json" and extra.is_file():
            shutil.copy2(extra, out_dir / extra.name)
    return out_dir


def _tied_keys(model) -> set[str]:
    """State-dict keys that alias another parameter (a tied lm_head): DeepSpeed stores one copy."""
    if not model.config.get_text_config().tie_word_embeddings:
        return set()
    head = model.get_output_embeddings()
    return {name + ".weight" for name, module in model.named_modules() if module is head}


def add_arguments(parser) -> None:
    """``ds-ulysses export CHECKPOINT OUT_DIR``."""
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a step_* checkpoint directory, or a run's checkpoints/ (its latest complete one)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory for the HF model (save_pretrained)")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="dtype of the saved weights")


def run_command(args) -> int:
    """Export; exit 0, or 2 with the reason on stderr for a missing, partial or damaged checkpoint."""
    import contextlib
    import sys

    try:
        source = find_checkpoint(args.checkpoint)
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's gatherer prints progress to stdout
            out = export_checkpoint(source, args.out_dir, args.dtype)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {source} -> {out} (load with AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0

"""Checks on a data loader batch, made where it enters (the adapter) and failed on every SP rank alike.

A check that raises on one rank while its SP peers enter a collective turns a clear error into a
hang (or a gloo abort on mismatched dtypes). So each rank checks its own batch and the verdict rides
on the adapter's metadata exchange, which runs anyway: every rank learns every other rank's verdict
and raises the same message (:func:`first_error`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..constants import IGNORE_INDEX
from .packed import padding_hole

__all__ = ["VARLEN_KEYS", "check_batch", "first_error", "is_int_tensor"]


# Transformers' varlen attention kwargs (DataCollatorWithFlattening(return_flash_attn_kwargs=True), TRL's
# padding-free and packing collators): the document boundaries of one flattened, unsharded row
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def is_int_tensor(t: torch.Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


def check_batch(batch, vocab_size: int | None = None) -> None:
    """Raise ValueError (expected, got, fix) for the first thing wrong with one collated batch."""
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"each batch must be a dict of tensors (input_ids [bs, sl], labels, position_ids); got a "
            f"{type(batch).__name__}; fix: collate samples into a dict (a trainer whose loader yields raw samples "
            "and builds the model's inputs itself, such as TRL's GRPOTrainer or RLOOTrainer generating "
            "completions, cannot be served: train it without sequence parallelism)")
    for key in batch:
        if not isinstance(key, str):
            raise ValueError(f"batch keys must be strings, got {key!r}; fix: name every batch entry with a str")
    ids = batch.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2:
        got = (f"shape {list(ids.shape)}" if torch.is_tensor(ids) else type(ids).__name__) if "input_ids" in batch \
            else f"keys {sorted(batch)}"
        raise ValueError(
            f"each batch needs a tensor 'input_ids' of shape [bs, sl]; got {got}; "
            "collate samples into a dict with input_ids (and labels, position_ids)")
    bs, sl = ids.shape
    if bs == 0 or sl == 0:
        raise ValueError(f"input_ids is empty (shape {list(ids.shape)}); expected bs >= 1 and sl >= 1 tokens; "
                         "fix: drop empty samples in the dataset or collator")
    for key, value in batch.items():
        if not torch.is_tensor(value):
            continue
        if value.dim() < 2 or value.shape[1] != sl:
            raise ValueError(
                f"batch tensors must share the sequence length on dim 1: input_ids has {sl} tokens "
                f"but '{key}' has shape {list(value.shape)}; pad or truncate every tensor of a sample "
                "to the same length")
        if value.shape[0] != bs and not (key == "position_ids" and value.shape[0] == 1):
            raise ValueError(
                f"batch tensors must share the batch size on dim 0: input_ids has {bs} rows but '{key}' "
                f"has shape {list(value.shape)}; fix: collate every entry of a batch from the same samples")
    if "labels" in batch and "shift_labels" in batch:
        raise ValueError("the batch has both 'labels' and 'shift_labels'; expected one (the adapter derives "
                         "shift_labels from labels); fix: drop one of them")
    _check_ints("input_ids", ids, 0, vocab_size, None)
    if "position_ids" in batch:
        pos = batch["position_ids"]
        if not torch.is_tensor(pos) or pos.dim() != 2:
            got = list(pos.shape) if torch.is_tensor(pos) else type(pos).__name__
            raise ValueError(f"position_ids must have shape [bs, sl] or [1, sl] = [{bs}, {sl}] or [1, {sl}]; "
                             f"got {got}; fix: one position per token, restarting at 0 per packed document")
        _check_ints("position_ids", pos, 0, None, None)
    for key in ("labels", "shift_labels"):
        if key in batch:
            _check_ints(key, batch[key], 0, vocab_size, IGNORE_INDEX)
    mask = batch.get("attention_mask")
    if torch.is_tensor(mask):
        _check_attention_mask(mask)
        _check_padding_unlabelled(mask, batch)


def _check_ints(key, value, low, high, ignore) -> None:
    if not torch.is_tensor(value) or not is_int_tensor(value):
        got = value.dtype if torch.is_tensor(value) else type(value).__name__
        raise ValueError(f"'{key}' must be an integer tensor, got {got}; fix: build it with dtype=torch.long")
    valid = value >= low
    if high is not None:
        valid &= value < high
    if ignore is not None:
        valid |= value == ignore
    if not bool(valid.all()):
        bad = int(value[~valid][0])
        allowed = f"[{low}, {high})" if high is not None else f">= {low}"
        allowed = f"{ignore} or {allowed}" if ignore is not None else allowed
        raise ValueError(
            f"'{key}' has a value out of range: expected {allowed}, got {bad}; fix: check that the "
            "tokenizer matches the model's vocabulary" + (" and that ignored tokens are labelled -100"
                                                          if ignore is not None else ""))


def _check_attention_mask(mask: torch.Tensor) -> None:
    """SP rebuilds attention from global positions and the model call's padding, which serves padding before
    the real tokens (left padding: attended by no one, and attending to nothing, as the padding mask makes it
    without SP) and after them (causal attention never lets a real token see it), but not a hole between
    real tokens."""
    keep = mask != 0
    if keep.dim() != 2:
        return
    hole = padding_hole(keep)
    if hole is not None:
        row, pos = hole
        raise ValueError(
            f"attention_mask has padding between real tokens (row {row}, token {pos}); Ulysses SP serves padding "
            "before the real tokens (left padding) and after them, but a hole needs a mask its per-document "
            "attention cannot give, so real tokens would attend to it; expected each row's real tokens "
            "contiguous; fix: pad on the left or the right only, or pack documents with position_ids restarting "
            "at 0")


def _check_padding_unlabelled(mask: torch.Tensor, batch) -> None:
    """Padding after the real tokens attends to the padding before it under SP (without SP the mask hides
    it): its own predictions differ from training without SP (real tokens' do not), which is harmless only
    when every label such a position predicts is -100. Left padding attends to nothing either way, so its
    predictions (the last pad's is the first real token) are those of training without SP."""
    if mask.dim() != 2:
        return
    if "shift_labels" in batch:
        predicted = batch["shift_labels"]
    elif "labels" in batch:
        predicted = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    else:
        return
    trailing = (mask == 0) & ((mask != 0).long().cumsum(dim=1) > 0)         # padding after a real token
    learnt = trailing & (predicted != IGNORE_INDEX)
    if bool(learnt.any()):
        row, pos = (int(i) for i in learnt.nonzero()[0])
        raise ValueError(
            f"attention_mask marks token {pos} of row {row} as padding, but the label it predicts (the next "
            f"token's) is {int(predicted[row, pos])}, not -100; under Ulysses SP padding after the real tokens "
            "attends to the padding before it, so its predictions would differ from training without SP; expected "
            "labels -100 on padding; fix: label pad tokens -100 (as DataCollatorForLanguageModeling does)")


def first_error(errors: list) -> str | None:
    """One message for a list of (sp_rank, message) verdicts, identical on every rank."""
    if not errors:
        return None
    rank, message = errors[0]
    others = [r for r, _ in errors[1:]]
    also = f" (ranks {others} failed too)" if others else ""
    return f"SP rank {rank}{also}: {message}"

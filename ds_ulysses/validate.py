"""Checks on everything a user hands to SP, made where it enters and failed on every rank alike.

A check that raises on one rank while its SP peers enter a collective turns a clear error into a
hang (or a gloo abort on mismatched dtypes). So checks here are of two kinds:

- deterministic ones (model layout, ``mesh_param``): every rank sees the same input and raises the
  same error without talking;
- per-rank ones (batches, position_ids, labels): each rank checks its own input and the verdict
  rides on a collective that runs anyway (the adapter's metadata exchange, the attention's
  once-per-forward shard-length gather, the loss's all_reduce), so every rank learns every other
  rank's verdict and raises the same message. No check adds a collective; the forward's run once
  per forward, not per layer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

__all__ = ["check_batch", "check_mesh_param", "check_model_servable", "decoder_of", "sliding_layers",
           "position_verdict", "verdict_ok", "forward_row", "check_forward_rows", "first_error"]

IGNORE_INDEX = -100

# Layer types (Transformers' ``layer_types``) whose token mixing is attention SP can serve, or that
# do not mix tokens at all (MLP/MoE kinds). Anything else mixes tokens in a way a shard cannot see.
SERVABLE_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention", "dense", "sparse",
                                  "moe", "mlp"})
# Models whose every layer is recurrent and whose config carries no layer_types.
RECURRENT_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"})
# Module class names of token mixers outside attention (state-space, linear attention, recurrences,
# short convolutions), as Transformers names them.
_TOKEN_MIXER = re.compile(r"Mamba|Mixer|DeltaNet|ShortConv|Lightning|Rglru|RecurrentBlock|Rwkv|xLSTM|"
                          r"mLSTM|sLSTM|LinearAttention|Hyena|StateSpace")


# -- models (deterministic: every rank raises the same error on its own) -------------------------

def _layer_kinds(text) -> list:
    for name in ("layer_types", "layers_block_type", "block_types"):
        kinds = getattr(text, name, None)
        if isinstance(kinds, (list, tuple)) and kinds:
            return [(name, i, kind) for i, kind in enumerate(kinds)]
    return []


def check_model_servable(config, model=None) -> None:
    """Refuse models whose outputs SP would compute wrongly without any error.

    Ulysses shards the sequence everywhere except inside attention, so a layer that mixes tokens by
    any other means (a state-space scan, linear attention, a causal convolution) sees only its
    rank's tokens and silently computes something else (Accelerate #4177). Chunked attention would
    need its chunk mask, which SP drops with the local mask.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", "") or getattr(config, "model_type", "")
    if model_type in RECURRENT_MODEL_TYPES:
        raise ValueError(
            f"model not servable by Ulysses SP: {model_type!r} mixes tokens with a recurrence/state-space "
            "scan, not attention, so each rank would see only its own shard; expected a transformer whose "
            "token mixing is attention; fix: train it without sequence parallelism")
    bad = [(name, i, kind) for name, i, kind in _layer_kinds(text) if kind not in SERVABLE_LAYER_TYPES]
    if bad:
        kinds = sorted({kind for _, _, kind in bad})
        layers = [i for _, i, _ in bad]
        shown = ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")
        raise ValueError(
            f"model not servable by Ulysses SP: {bad[0][0]} has {kinds} at layers [{shown}]; expected only "
            f"{sorted(SERVABLE_LAYER_TYPES)}: these layers mix tokens outside attention (or need a mask SP "
            "drops), so a shard would see only its own tokens and train silently wrong; fix: train this "
            "model without sequence parallelism")
    chunk = getattr(text, "attention_chunk_size", None)
    if chunk:
        raise ValueError(
            f"model not servable by Ulysses SP: chunked attention (attention_chunk_size={chunk}) is not "
            "honoured on the gathered sequence (its chunk mask is dropped with the local mask); expected "
            "attention_chunk_size=None; fix: train without SP, or set attention_chunk_size to None only if "
            "full causal attention is what you want")
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(
            f"model not servable by Ulysses SP: its config has no attention head count "
            f"(num_attention_heads={heads!r}); expected a transformer with num_attention_heads >= 1")
    if model is not None:
        _check_modules(model)


def decoder_of(model):
    """The text decoder (the language model of a multimodal model; the model itself otherwise).

    Only it is scanned for token mixers: vision and audio towers hold convolutions that are theirs.
    """
    get_decoder = getattr(model, "get_decoder", None)
    try:
        return (get_decoder() if callable(get_decoder) else None) or model
    except (AttributeError, NotImplementedError):
        return model


def _check_modules(model) -> None:
    for name, module in decoder_of(model).named_modules():
        kind = type(module).__name__
        if isinstance(module, torch.nn.Conv1d) or _TOKEN_MIXER.search(kind):
            raise ValueError(
                f"model not servable by Ulysses SP: '{name}' ({kind}) mixes tokens outside attention, so "
                "under SP it would see only its rank's shard and train silently wrong; expected token "
                "mixing by attention only; fix: train this model without sequence parallelism")


def sliding_layers(config) -> frozenset:
    """Indices of layers that attend within a sliding window (empty when the model has none)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if not window:
        return frozenset()
    kinds = getattr(text, "layer_types", None)
    if kinds:
        return frozenset(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    return frozenset(range(getattr(text, "num_hidden_layers", 0)))


# -- mesh_param (deterministic) -------------------------------------------------------------------

def check_mesh_param(mesh_param) -> tuple[int, int]:
    """``[dp, sp]`` as two positive ints, or a ValueError saying what came in."""
    ok = (isinstance(mesh_param, (list, tuple)) and len(mesh_param) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in mesh_param))
    if not ok:
        raise ValueError(
            f"mesh_param: expected [dp, sp], two integers >= 1 with dp * sp == world size, got "
            f"{mesh_param!r}; fix: e.g. mesh_param=[1, 2] for one SP group of 2 ranks")
    return int(mesh_param[0]), int(mesh_param[1])


# -- batches (per rank; the adapter exchanges the verdict) ------------------------------------------

def _is_int(t: torch.Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


def check_batch(batch, vocab_size: int | None = None) -> None:
    """Raise ValueError (expected, got, fix) for the first thing wrong with one collated batch."""
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"each batch must be a dict of tensors (input_ids [bs, sl], labels, position_ids); got a "
            f"{type(batch).__name__}; fix: collate samples into a dict")
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


def _check_ints(key, value, low, high, ignore) -> None:
    if not torch.is_tensor(value) or not _is_int(value):
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
    """SP drops the attention mask (it is rebuilt from global positions), which is harmless only for
    right padding: causal attention never lets a real token see the pad tokens after it."""
    keep = mask != 0
    # a row is ones then zeros exactly when it never goes from 0 back to 1
    if keep.dim() == 2 and bool((keep[:, 1:] & ~keep[:, :-1]).any()):
        raise ValueError(
            "attention_mask has padding before real tokens (left padding or holes); Ulysses SP ignores "
            "the attention mask, so real tokens would attend to that padding; expected right padding "
            "(ones, then zeros) with labels -100 on the padding; fix: pad on the right, or pack documents "
            "with position_ids restarting at 0")


def first_error(errors: list) -> str | None:
    """One message for a list of (sp_rank, message) verdicts, identical on every rank."""
    if not errors:
        return None
    rank, message = errors[0]
    others = [r for r, _ in errors[1:]]
    also = f" (ranks {others} failed too)" if others else ""
    return f"SP rank {rank}{also}: {message}"


# -- the once-per-forward verdict of the attention wrapper ------------------------------------------

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
_OK, _NO_POS, _POS_DTYPE, _POS_SHAPE, _POS_NEG, _HEADS = range(6)
ROW_LEN = 10  # sl_l bs q_dtype heads code pos_dtype pos_ndim pos_d0 pos_d1 pos_min


def _dtype_code(dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_DTYPES) else "an unsupported dtype"


def position_verdict(position_ids, bs: int, sl_l: int) -> list[int]:
    """``[code pos_dtype pos_ndim pos_d0 pos_d1 pos_min]``: this rank's position_ids against its shard."""
    if position_ids is None:
        return [_NO_POS, -1, 0, 0, 0, 0]
    if not torch.is_tensor(position_ids) or not _is_int(position_ids):
        return [_POS_DTYPE, _dtype_code(position_ids.dtype) if torch.is_tensor(position_ids) else -1, 0, 0, 0, 0]
    shape = list(position_ids.shape) + [0, 0]
    verdict = [_OK, -1, position_ids.dim(), shape[0], shape[1], 0]
    if position_ids.dim() != 2 or position_ids.shape[1] != sl_l or position_ids.shape[0] not in (1, bs):
        verdict[0] = _POS_SHAPE
    elif position_ids.numel() and int(position_ids.min()) < 0:
        verdict[0], verdict[5] = _POS_NEG, int(position_ids.min())
    return verdict


def verdict_ok(verdict) -> bool:
    return verdict[0] == _OK


def forward_row(query: torch.Tensor, verdict: list[int], heads: int) -> list[int]:
    """This rank's facts for one forward, as ints: its verdict travels with the shard lengths."""
    bs, hc, sl_l, _ = query.shape
    row = [sl_l, bs, _dtype_code(query.dtype), hc, *verdict]
    if hc != heads:
        row[4] = _HEADS
    return row


def _row_error(row, heads: int) -> str:
    sl_l, bs, _, hc, code, pos_dtype, ndim, d0, d1, low = row
    if code == _HEADS:
        return (f"query has {hc} attention heads but the model config declares {heads}; expected the layout "
                "SP was registered with; fix: register the SP attention on the model that runs it")
    if code == _NO_POS:
        return ("Ulysses SP needs position_ids in the model call (each rank's positions within the whole "
                "sequence); got none; fix: pass the batch from UlyssesSPDataLoaderAdapter, or position_ids = "
                "arange(sl) sharded like input_ids")
    if code == _POS_DTYPE:
        return (f"position_ids must be an integer tensor, got {_dtype_name(pos_dtype)}; fix: build them with "
                "dtype=torch.long")
    if code == _POS_SHAPE:
        shape = [d0, d1][:ndim] + (["..."] if ndim > 2 else [])
        return (f"position_ids must have shape [bs, sl_l] = [{bs}, {sl_l}] or [1, {sl_l}], got {shape}; fix: "
                "shard position_ids on dim 1 exactly like input_ids")
    return (f"position_ids must be >= 0, got {low}; fix: positions count from 0 within each packed "
            "document")


def check_forward_rows(rows: list[list[int]], heads: int, fixed_length: int | None) -> None:
    """Raise the same ValueError on every SP rank when any rank's forward input is wrong."""
    message = first_error([(r, _row_error(row, heads)) for r, row in enumerate(rows) if row[4] != _OK])
    if message is None:
        for col, what in ((1, "batch size"), (2, "attention dtype")):
            values = [row[col] for row in rows]
            if len(set(values)) > 1:
                shown = [_dtype_name(v) for v in values] if col == 2 else values
                message = (f"SP ranks disagree on the {what}: per SP rank {shown}; expected every rank of "
                           "the group to run its shard of the same micro-batch; fix: feed the model through "
                           "UlyssesSPDataLoaderAdapter (or shard one batch on dim 1 across the group)")
                break
    if message is None and fixed_length is not None and sum(row[0] for row in rows) != fixed_length:
        total = sum(row[0] for row in rows)
        message = (f"seq_length_is_variable is false with seq_length={fixed_length}, but this forward's "
                   f"shards add up to {total} tokens {[row[0] for row in rows]}; fix: pad or pack every "
                   "sample to seq_length, or set seq_length_is_variable to true")
    if message is not None:
        raise ValueError(message)

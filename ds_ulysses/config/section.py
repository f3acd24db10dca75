"""The DeepSpeed config's ``"ulysses"`` section: JSON Schema in, typed frozen config out.

``schemas/ulysses.schema.json`` is the single source of truth for field names, types, allowed
values and defaults. :mod:`ds_ulysses.config.schema` validates a section against it (every error names
its JSON path, the value that came in and what is allowed); this module fills defaults from the
schema and builds :class:`UlyssesConfig`. The dataclass defaults mirror the schema only so that direct
construction is convenient; ``tests/unit/config/test_section.py`` fails if the two drift. Library code reads
the typed object, never the raw dict.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from .schema import SECTION_KEY, JsonPath, UlyssesConfigError, load_schema, raise_if, section_errors, show, subschema

__all__ = ["SECTION_KEY", "ActivationCheckpointOffloadConfig", "TiledLossConfig", "TiledMLPConfig",
           "UlyssesConfig", "UlyssesConfigError", "load_schema", "parse_ds_config", "resolve_ring_size"]

_MISSING = object()


class _Section:
    """Shared behaviour of the frozen config dataclasses: schema-driven build, checks, to_dict."""

    _path: ClassVar[JsonPath] = ()
    _nested: ClassVar[dict[str, type]] = {}

    @classmethod
    def from_dict(cls, section: Any):
        """Validate `section` against its part of the schema and build the typed config.

        Missing fields take the schema's defaults. Raises UlyssesConfigError listing every error.
        """
        raise_if(section_errors(section, cls._path))
        return cls._build(section)

    @classmethod
    def _build(cls, section: Mapping):
        values = {}
        for name, prop in subschema(cls._path)["properties"].items():
            value = section.get(name, copy.deepcopy(prop["default"]))
            values[name] = cls._nested[name]._build(value) if name in cls._nested else value
        return cls(**values)

    def __post_init__(self):
        # Direct construction and dataclasses.replace() get the same checks as from_dict().
        for name, nested in self._nested.items():
            if isinstance(getattr(self, name), Mapping):
                object.__setattr__(self, name, nested.from_dict(getattr(self, name)))
        raise_if(section_errors(self.to_dict(), self._path))
        for f in dataclasses.fields(self):
            if isinstance(getattr(self, f.name), list):  # frozen and hashable: arrays as tuples
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))

    def to_dict(self) -> dict:
        """The section as JSON-ready data; ``from_dict(c.to_dict()) == c``."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = (value.to_dict() if isinstance(value, _Section)
                           else list(value) if isinstance(value, tuple) else value)
        return out


@dataclass(frozen=True)
class TiledMLPConfig(_Section):
    """``ulysses.tiled_mlp``: ALST tiled MLP, trading recompute for the MLP's activation memory."""

    _path: ClassVar[JsonPath] = ("tiled_mlp",)

    enabled: bool = False
    """Tile each decoder MLP over the sequence; costs an extra MLP forward per tile in backward."""
    shards: int | Literal["auto"] = "auto"
    """Number of sequence tiles, or "auto" to pick from local sequence length and hidden size."""


@dataclass(frozen=True)
class TiledAttentionConfig(_Section):
    """``ulysses.tiled_attention``: each attention block a group of heads at a time, trading an attention
    forward for its per-head activations."""

    _path: ClassVar[JsonPath] = ("tiled_attention",)

    enabled: bool = False
    """Tile each decoder attention block over head groups; costs an extra attention forward in backward."""
    shards: int | Literal["auto"] = "auto"
    """Number of head groups, or "auto" for the most that split evenly over the SP ranks."""


@dataclass(frozen=True)
class TiledNormsConfig(_Section):
    """``ulysses.tiled_norms``: the decoder's norms recomputed from their input, trading a norm forward for
    the normalised copies autograd keeps."""

    _path: ClassVar[JsonPath] = ("tiled_norms",)

    enabled: bool = False
    """Recompute each decoder norm in backward; tiled attention and MLP blocks then keep the norm's input."""


@dataclass(frozen=True)
class TiledLossConfig(_Section):
    """``ulysses.tiled_loss``: fused logits+loss in tiles so [bs, sl, vocab] logits never exist."""

    _path: ClassVar[JsonPath] = ("tiled_loss",)

    enabled: bool = True
    """On by default: full logits are usually the largest activation at long sequence lengths."""
    shards: int | Literal["auto"] = "auto"
    """Number of sequence tiles, or "auto" to pick from local sequence length and vocab size."""


@dataclass(frozen=True)
class ActivationCheckpointOffloadConfig(_Section):
    """``ulysses.activation_checkpoint_offload``: park checkpointed layer inputs in CPU memory."""

    _path: ClassVar[JsonPath] = ("activation_checkpoint_offload",)

    enabled: bool = False
    """Off by default: costs host memory and PCIe traffic and needs activation checkpointing."""
    layers: int | Literal["all"] = "all"
    """Checkpointed decoder layers that offload, from the first; the others keep their checkpoints on the device."""


@dataclass(frozen=True)
class UlyssesConfig(_Section):
    """The validated ``"ulysses"`` section. Build it with ``from_dict`` or ``parse_ds_config``.

    Invariant: ``sequence_parallel_size == mesh_param[1]`` whenever mesh_param is set (a section
    giving only mesh_param has sequence_parallel_size filled from it), so ``sp`` is one number.
    """

    _nested: ClassVar[dict[str, type]] = {
        "tiled_mlp": TiledMLPConfig, "tiled_attention": TiledAttentionConfig, "tiled_norms": TiledNormsConfig,
        "tiled_loss": TiledLossConfig,
        "activation_checkpoint_offload": ActivationCheckpointOffloadConfig}

    sequence_parallel_size: int = 1
    """Ranks sharing one sequence: the Ulysses degree times ring_size (each Ulysses rank gets a contiguous run of
    heads, any count, sp / ring_size <= heads)."""
    ring_size: int | Literal["auto"] = 1
    """Ranks of the SP group that rotate key/value blocks (ring attention) rather than split heads, so sp can exceed
    the head count; divides sp. "auto" picks the smallest that fits the heads and a node at setup
    (:func:`resolve_ring_size`)."""
    mesh_param: tuple[int, int] | None = None
    """Explicit (dp, sp) grid; None infers dp = world_size / sp (``ds_ulysses.distributed.mesh_shape``)."""
    attn_implementation: str = "sdpa"
    """Core attention run on full sequences after the all-to-all: one of the schema's enum
    (``ds_ulysses.config.attn_implementations()``); eager's S x S mask is refused."""
    seq_length_is_variable: bool = True
    """False declares every batch to be exactly seq_length tokens; a forward of another length raises."""
    seq_length: int | None = None
    """Fixed global (unsharded) sequence length, a multiple of sp; required when not variable."""
    pad_to_multiple: bool = True
    """Pad S up to a multiple of sp in the data adapter (labels -100) so shards are equal."""
    pad_token_id: int = 0
    """input_ids value for padded positions; their labels are -100, so it never reaches the loss."""
    disable_in_eval: bool = False
    """Bypass SP in eval mode, for eval loops that feed each rank its own unsharded batch."""
    tiled_mlp: TiledMLPConfig = field(default_factory=TiledMLPConfig)
    """ALST tiled MLP settings."""
    tiled_attention: TiledAttentionConfig = field(default_factory=TiledAttentionConfig)
    """Tiled attention settings."""
    tiled_norms: TiledNormsConfig = field(default_factory=TiledNormsConfig)
    """Tiled norms settings."""
    model_loss: bool = True
    """``model(**batch).loss`` is the sample's SP loss for a batch with ``shift_labels``; False leaves the loss
    to the caller (logits returned, no loss: DeepSpeed's module's behaviour). Needs ``tiled_loss`` off."""
    tiled_loss: TiledLossConfig = field(default_factory=TiledLossConfig)
    """ALST tiled logits+loss settings."""
    activation_checkpoint_offload: ActivationCheckpointOffloadConfig = field(
        default_factory=ActivationCheckpointOffloadConfig)
    """ALST activation-checkpoint offload settings."""
    trim_host_heap: bool = True
    """Give the C heap's free pages back to the OS after each engine.step() (:mod:`ds_ulysses.memory.host`):
    a step's freed activations otherwise stay resident under the next step's peak RSS."""
    comm_timeout_seconds: float = 600
    """Timeout of the SP groups' collectives, so a dead peer fails the job instead of hanging it."""

    @classmethod
    def _build(cls, section: Mapping):
        if section.get("mesh_param") is not None and "sequence_parallel_size" not in section:
            section = {**section, "sequence_parallel_size": section["mesh_param"][1]}
        return super()._build(section)

    @property
    def sp(self) -> int:
        """The resolved sequence-parallel size (from sequence_parallel_size or mesh_param)."""
        return self.sequence_parallel_size

    @property
    def comm_timeout(self) -> datetime.timedelta:
        """comm_timeout_seconds in the form torch.distributed.new_group(timeout=...) takes."""
        return datetime.timedelta(seconds=self.comm_timeout_seconds)


def resolve_ring_size(ring_size, sp: int, head_counts, node_size: int | None = None) -> int:
    """The ring degree for ``sp`` ranks: ``ring_size`` checked, or ``"auto"`` resolved.

    Ulysses splits heads, so its degree ``sp / ring_size`` may not exceed the fewest query heads of any layer
    (``head_counts``); the ring takes the rest of sp. ``"auto"`` is the smallest divisor of sp that makes the Ulysses
    degree fit the heads and ``node_size`` (ranks per node, when known: the all-to-all wants the node's links; the
    ring's point-to-point blocks tolerate slower ones). A ring_size that does not fit raises naming the smallest
    one that does.
    """
    heads = min(head_counts)
    divisors = [r for r in range(1, sp + 1) if sp % r == 0]
    fits_heads = [r for r in divisors if sp // r <= heads]
    if ring_size == "auto":
        in_node = [r for r in fits_heads if node_size is None or sp // r <= node_size]
        return (in_node or fits_heads)[0]
    if isinstance(ring_size, bool) or not isinstance(ring_size, int) or ring_size < 1 or sp % ring_size:
        raise ValueError(
            f"ring_size: expected \"auto\" or a divisor of sequence_parallel_size={sp} (sp = Ulysses degree x "
            f"ring_size), got {ring_size!r}; fix: use one of {divisors}")
    if sp // ring_size > heads:
        raise ValueError(
            f"ring_size={ring_size} leaves a Ulysses degree of sequence_parallel_size / ring_size = {sp // ring_size}, "
            f"more than the model's {heads} query heads (Ulysses gives every rank at least one head); expected "
            f"sp / ring_size <= {heads}; fix: set ring_size to {fits_heads[0]} (the smallest that works) or \"auto\"")
    return ring_size


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    # DeepSpeed's own loader rejects duplicate keys too; silently keeping the last one hides typos.
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str):  # Python's json would otherwise accept NaN and Infinity
    raise ValueError(f"{name} is not a JSON number")


def _read_json(path: str | os.PathLike) -> Any:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UlyssesConfigError([f"{os.fspath(path)}: expected a readable UTF-8 JSON DeepSpeed "
                                  f"config, got an error reading it: {reason}"]) from exc
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except ValueError as exc:
        where = f":{exc.lineno}:{exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise UlyssesConfigError([f"{os.fspath(path)}{where}: expected a DeepSpeed config in JSON "
                                  f"(no comments, trailing commas or NaN), got: "
                                  f"{getattr(exc, 'msg', exc)}"]) from exc


def parse_ds_config(config: dict | str | os.PathLike) -> tuple[dict, UlyssesConfig | None]:
    """Split a DeepSpeed config (dict or JSON file path) into (deepspeed part, ulysses part).

    The first item is a deep copy without the ``"ulysses"`` key, ready for deepspeed.initialize;
    the second is the typed section, or None when the config has none. Files are read as JSON
    only: user data is never evaluated. Raises UlyssesConfigError listing every problem.
    """
    if isinstance(config, (str, os.PathLike)):
        config = _read_json(config)
    elif not isinstance(config, Mapping):
        raise TypeError(f"parse_ds_config: expected a dict or a path to a JSON file, got "
                        f"{type(config).__name__}; fix: pass the DeepSpeed config dict or its path")
    if not isinstance(config, Mapping):
        raise UlyssesConfigError([f"config: expected a JSON object (a DeepSpeed config), got "
                                  f"{show(config)}"])
    ds_config = copy.deepcopy(dict(config))
    section = ds_config.pop(SECTION_KEY, _MISSING)
    errors = []
    if section is _MISSING:
        for key in ds_config:
            if difflib.get_close_matches(str(key).lower(), [SECTION_KEY], cutoff=0.75):
                errors.append(((), f"{key}: unknown top-level key; did you mean {SECTION_KEY!r}? "
                                   "DeepSpeed would ignore it and sequence parallelism would stay "
                                   f"off; fix: rename it to {SECTION_KEY!r}"))
    else:
        errors += section_errors(section)
    typed = None if errors or section is _MISSING else UlyssesConfig._build(section)
    top_sp = ds_config.get("sequence_parallel_size")
    if typed and isinstance(top_sp, int) and not isinstance(top_sp, bool) and top_sp != typed.sp:
        errors.append(((), f"sequence_parallel_size: expected DeepSpeed's top-level value to equal "
                           f"ulysses sp={typed.sp}, got {top_sp}; fix: remove the top-level key or "
                           f"set it to {typed.sp}"))
    raise_if(errors)
    return ds_config, typed

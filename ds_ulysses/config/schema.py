"""Validating a ``"ulysses"`` section against its JSON Schema, with messages a user can act on.

Every error names the JSON path (``ulysses.tiled_mlp.shards``), the value that came in, what is
allowed and, for an unknown key, the nearest valid one. All errors are collected, so one run of
``ds-ulysses validate`` shows them all. :mod:`ds_ulysses.config` builds the typed object on top.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import math
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

__all__ = ["SECTION_KEY", "UlyssesConfigError", "load_schema", "attn_implementations", "section_errors", "raise_if",
           "subschema", "show", "JsonPath"]

SECTION_KEY = "ulysses"
_SCHEMA_FILE = "ulysses.schema.json"

# Values the schema rejects for a reason worth spelling out: (field, value) -> why and what instead.
_VALUE_HINTS = {("attn_implementation", "eager"): (
    "eager needs a full S x S attention mask (O(S^2) memory, the cost sequence parallelism exists "
    'to avoid); use "sdpa" instead')}

JsonPath = tuple  # inside the section: ("tiled_mlp", "shards") or ("mesh_param", 0)


class UlyssesConfigError(ValueError):
    """Every problem found in a config, so one run of ``ds-ulysses validate`` shows them all.

    ``errors`` is a list of one-line messages sorted by JSON path, each of the form
    ``ulysses.<path>: expected ..., got ...; <fix>``.
    """

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        count = len(self.errors)
        head = f"invalid DeepSpeed/ulysses config ({count} error{'' if count == 1 else 's'}):"
        super().__init__("\n  ".join([head, *self.errors]))

    def __reduce__(self):
        # Rebuild from the error list (not the joined message) when sent between processes.
        return type(self), (self.errors,)


def load_schema() -> dict:
    """Return a fresh copy of the section's JSON Schema (callers may mutate it freely)."""
    return copy.deepcopy(_schema())


@functools.cache
def _schema() -> dict:
    try:
        resource = resources.files("ds_ulysses.schemas").joinpath(_SCHEMA_FILE)
    except ModuleNotFoundError:
        # A source checkout put on PYTHONPATH without `pip install`: setup.cfg maps the package
        # ds_ulysses.schemas onto the top-level schemas/ directory only when installed.
        resource = Path(__file__).resolve().parents[2] / "schemas" / _SCHEMA_FILE
    try:
        return json.loads(resource.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"ds_ulysses: expected the config schema {_SCHEMA_FILE} as package "
                                f"data of ds_ulysses.schemas, got nothing at {resource}; fix: "
                                "reinstall ds_ulysses (from a checkout: pip install -e .)") from exc


def attn_implementations() -> tuple[str, ...]:
    """The core attentions SP runs after its all-to-all (the schema's ``attn_implementation`` enum)."""
    return tuple(_schema()["properties"]["attn_implementation"]["enum"])


# Python callers naturally write mesh_param=(2, 4), so tuples count as arrays. Integers are ints
# only: JSON Schema would accept 2.0, which would then leak a float into range() and tensor shapes.
_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many({
        "array": lambda _checker, instance: isinstance(instance, (list, tuple)),
        "integer": lambda _checker, instance: (isinstance(instance, int)
                                               and not isinstance(instance, bool)),
    }))


def subschema(path: JsonPath) -> dict:
    node = _schema()
    for name in path:
        node = node["properties"][name]
    return node


@functools.cache
def _validator(path: JsonPath):
    return _Validator(subschema(path))


def _dotted(path: JsonPath) -> str:
    text = SECTION_KEY
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def show(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(schema: dict, plural: bool = False) -> str:
    """What a (sub)schema allows, in words: '"auto" or an integer >= 1'."""
    if "const" in schema:
        return json.dumps(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    if "anyOf" in schema:
        return " or ".join(_describe(sub, plural) for sub in schema["anyOf"])
    types = schema.get("type", [])
    bounds = "".join(f" {op} {schema[key]}" for key, op in
                     (("minimum", ">="), ("exclusiveMinimum", ">")) if key in schema)
    words = {"integer": "integers" if plural else "an integer",
             "number": "numbers" if plural else "a number",
             "string": "strings" if plural else "a string",
             "object": "objects" if plural else "an object", "boolean": "true or false"}
    named = []
    for kind in [types] if isinstance(types, str) else types:
        if kind == "array":
            items = _describe(schema.get("items", {}), plural=True)
            named.append(f"an array of {schema['minItems']} {items}" if "minItems" in schema
                         else f"an array of {items}")
        elif kind in words:
            named.append(words[kind] + (bounds if kind in ("integer", "number") else ""))
    return " or ".join(named + (["null"] if "null" in types else [])) or "a valid value"


def _rule_note(error, root: JsonPath) -> str:
    """The description of the if/then rule an error came from, or '' for plain field checks."""
    node, note = subschema(root), ""
    for step in error.absolute_schema_path:
        if isinstance(node, dict) and step == "then" and "if" in node:
            note = node.get("description", "")
        node = node[step]
    return note


def _format(error, root: JsonPath) -> list[tuple[JsonPath, str]]:
    path = root + tuple(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed, out = list(error.schema["properties"]), []
        for key in (str(key) for key in error.instance if key not in allowed):
            near = difflib.get_close_matches(key, allowed, n=1)
            fix = f"did you mean {near[0]!r}?" if near else "allowed fields: " + ", ".join(allowed)
            out.append((path + (key,), f"{_dotted(path + (key,))}: unknown field; {fix}"))
        return out
    note = _rule_note(error, root)
    if error.validator == "required":
        return [(path + (name,), f"{_dotted(path + (name,))}: missing; {note or 'required'}")
                for name in error.validator_value if name not in error.instance]
    message = f"{_dotted(path)}: expected {_describe(error.schema)}, got {show(error.instance)}"
    if error.validator == "enum" and isinstance(error.instance, str):
        hint = _VALUE_HINTS.get((path[-1] if path else "", error.instance))
        near = difflib.get_close_matches(error.instance, [str(v) for v in error.validator_value], 1)
        message += f"; {hint}" if hint else f"; did you mean {near[0]!r}?" if near else ""
    if note:
        message += f"; {note}"
    return [(path, message)]


def _given(section: Mapping, name: str) -> bool:
    """True when `name` is present, not null, and valid on its own (so cross-checks can use it)."""
    value = section.get(name)
    return value is not None and _validator((name,)).is_valid(value)


def _cross_field_errors(section: Mapping) -> list[tuple[JsonPath, str]]:
    """Rules JSON Schema cannot state: agreement between fields."""
    out = []
    sp = section["sequence_parallel_size"] if _given(section, "sequence_parallel_size") else 1
    if _given(section, "mesh_param"):
        mesh_sp = section["mesh_param"][1]
        if _given(section, "sequence_parallel_size") and mesh_sp != sp:
            out.append((("mesh_param",), (
                f"{_dotted(('mesh_param',))}: expected its sp (second entry) to equal "
                f"sequence_parallel_size={sp}, got {show(list(section['mesh_param']))}; fix: make "
                "them agree or give only one of the two")))
        sp = mesh_sp
    ring = section.get("ring_size")
    if _given(section, "ring_size") and ring != "auto" and sp % ring:
        fits = [r for r in range(1, sp + 1) if sp % r == 0]
        out.append((("ring_size",), (
            f"{_dotted(('ring_size',))}: expected a divisor of sp={sp} (sp = Ulysses degree x ring_size), got "
            f"{ring}; fix: use one of {fits}, or \"auto\"")))
    if section.get("seq_length_is_variable") is False and _given(section, "seq_length"):
        length = section["seq_length"]
        if _given(section, "ring_size") and ring not in ("auto", 1) and sp % ring == 0:
            multiple = math.lcm(sp, 2 * ring)
            if length % multiple:
                nearest = sorted({max(multiple, length - length % multiple), length - length % multiple + multiple})
                out.append((("seq_length",), (
                    f"{_dotted(('seq_length',))}: expected a multiple of lcm(sp={sp}, 2 x ring_size={ring}) = "
                    f"{multiple} (equal shards, each ring rank a head and a tail chunk), got {length}; fix: use "
                    f"{' or '.join(map(str, nearest))}, or set seq_length_is_variable to true")))
        elif length % sp:
            nearest = sorted({max(sp, length - length % sp), length - length % sp + sp})
            out.append((("seq_length",), (
                f"{_dotted(('seq_length',))}: expected a multiple of sp={sp} (each rank holds "
                f"seq_length / sp tokens), got {length}; fix: use {' or '.join(map(str, nearest))}"
                ", or set seq_length_is_variable to true")))
    tiled_loss = section.get("tiled_loss")
    tiled_loss = tiled_loss.get("enabled", True) if isinstance(tiled_loss, Mapping) else True
    if section.get("model_loss") is False and tiled_loss is not False:
        out.append((("model_loss",), (
            f"{_dotted(('model_loss',))}: false leaves the loss to your code, but tiled_loss (on by default) "
            "computes it inside the model and returns no logits; expected tiled_loss.enabled false with it; fix: "
            "add \"tiled_loss\": {\"enabled\": false}, or drop model_loss")))
    return out


def section_errors(section: Any, root: JsonPath = ()) -> list[tuple[JsonPath, str]]:
    found: dict[str, JsonPath] = {}
    for error in _validator(root).iter_errors(section):
        for path, message in _format(error, root):
            found.setdefault(message, path)
    out = [(path, message) for message, path in found.items()]
    if not root and isinstance(section, Mapping):
        out += _cross_field_errors(section)
    return out


def raise_if(errors: list[tuple[JsonPath, str]]) -> None:
    """Raise one UlyssesConfigError carrying every message, ordered by JSON path."""
    def key(item):
        return [(0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in item[0]], item[1]
    if errors:
        raise UlyssesConfigError([message for _, message in sorted(errors, key=key)])


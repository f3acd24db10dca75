"""The "ulysses" config section: schema, typed config, error messages, parsing, packaging.

The schema is the single source of truth; the drift test below fails when a field, default or
docstring in ds_ulysses.config stops matching it."""

import ast
import copy
import dataclasses
import datetime
import inspect
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ds_ulysses.config import (ActivationCheckpointOffloadConfig, TiledLossConfig, TiledMLPConfig, UlyssesConfig,
                               UlyssesConfigError, load_schema, parse_ds_config, resolve_ring_size,
                               section as config_module)
from tests.support import REPO

SCHEMA = load_schema()


PROPS = SCHEMA["properties"]


ATTN = PROPS["attn_implementation"]["enum"]


def errors_of(section) -> list[str]:
    with pytest.raises(UlyssesConfigError) as info:
        UlyssesConfig.from_dict(section)
    return info.value.errors


def _objects(schema, path="ulysses"):
    yield path, schema
    for name, prop in schema.get("properties", {}).items():
        if prop.get("type") == "object":
            yield from _objects(prop, f"{path}.{name}")


def test_schema_is_valid_2020_12():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


@pytest.mark.parametrize("path,obj", list(_objects(SCHEMA)), ids=lambda v: str(v)[:40])
def test_every_object_is_closed_and_every_field_documented(path, obj):
    assert obj["additionalProperties"] is False, path
    for name, prop in obj["properties"].items():
        assert {"description", "type", "default"} <= prop.keys(), f"{path}.{name}"
        assert len(prop["description"]) > 20, f"{path}.{name}: say why, not just what"
        assert jsonschema.Draft202012Validator(prop).is_valid(prop["default"]), f"{path}.{name}"


def test_load_schema_returns_an_independent_copy():
    schema = load_schema()
    schema["properties"].clear()
    assert load_schema()["properties"] == PROPS
    assert "sequence_parallel_size" in load_schema()["properties"]


def _field_default(f):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _assert_no_drift(cls, schema, path):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert set(fields) == set(schema["properties"]), (
        f"{path}: schema-only {set(schema['properties']) - set(fields)}, "
        f"dataclass-only {set(fields) - set(schema['properties'])}")
    for name, prop in schema["properties"].items():
        default = _field_default(fields[name])
        if dataclasses.is_dataclass(default):
            assert prop["type"] == "object", f"{path}.{name}"
            assert cls._nested[name] is type(default), f"{path}.{name}: not registered in _nested"
            assert default.to_dict() == prop["default"], f"{path}.{name}"
            _assert_no_drift(type(default), prop, f"{path}.{name}")
        else:
            # type() as well as ==, because True == 1 and 1 == 1.0 in Python
            assert (type(default), default) == (type(prop["default"]), prop["default"]), \
                f"{path}.{name}: dataclass default {default!r} != schema {prop['default']!r}"


def test_dataclasses_mirror_schema_fields_and_defaults():
    _assert_no_drift(UlyssesConfig, SCHEMA, "ulysses")


def test_every_dataclass_field_has_a_docstring():
    tree = ast.parse(inspect.getsource(config_module))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for cls in (UlyssesConfig, TiledMLPConfig, TiledLossConfig, ActivationCheckpointOffloadConfig):
        body = classes[cls.__name__].body
        documented = {stmt.target.id for stmt, nxt in zip(body, body[1:])
                      if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                      and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)}
        missing = {f.name for f in dataclasses.fields(cls)} - documented
        assert not missing, f"{cls.__name__}: fields without a docstring: {missing}"


def test_empty_section_gives_the_schema_defaults():
    cfg = UlyssesConfig.from_dict({})
    assert cfg == UlyssesConfig()
    assert cfg.to_dict() == {name: prop["default"] for name, prop in PROPS.items()}
    assert cfg.sp == 1 and cfg.mesh_param is None
    assert cfg.attn_implementation == "sdpa" and cfg.seq_length_is_variable is True
    assert cfg.tiled_mlp == TiledMLPConfig(enabled=False, shards="auto")
    assert cfg.tiled_loss == TiledLossConfig(enabled=True, shards="auto")
    assert cfg.activation_checkpoint_offload.enabled is False
    assert cfg.comm_timeout == datetime.timedelta(seconds=600)


def test_full_valid_section_gives_typed_values():
    cfg = UlyssesConfig.from_dict({
        "mesh_param": [2, 4], "sequence_parallel_size": 4,
        "attn_implementation": "flash_attention_2", "seq_length_is_variable": False,
        "seq_length": 8192, "pad_to_multiple": False, "pad_token_id": 7, "disable_in_eval": True,
        "tiled_mlp": {"enabled": True, "shards": 16}, "tiled_loss": {"enabled": False},
        "activation_checkpoint_offload": {"enabled": True}, "comm_timeout_seconds": 1.5})
    assert cfg.sp == 4 and cfg.mesh_param == (2, 4)
    assert cfg.attn_implementation == "flash_attention_2"
    assert (cfg.seq_length_is_variable, cfg.seq_length) == (False, 8192)
    assert (cfg.pad_to_multiple, cfg.pad_token_id, cfg.disable_in_eval) == (False, 7, True)
    assert cfg.tiled_mlp == TiledMLPConfig(enabled=True, shards=16)
    assert cfg.tiled_loss == TiledLossConfig(enabled=False, shards="auto")
    assert cfg.activation_checkpoint_offload == ActivationCheckpointOffloadConfig(enabled=True)
    assert cfg.comm_timeout == datetime.timedelta(seconds=1.5)


def test_mesh_param_alone_sets_sp_and_tuples_are_accepted():
    cfg = UlyssesConfig.from_dict({"mesh_param": (3, 2)})
    assert (cfg.sp, cfg.sequence_parallel_size, cfg.mesh_param) == (2, 2, (3, 2))


def test_typed_config_is_frozen_and_hashable():
    cfg = UlyssesConfig.from_dict({"mesh_param": [1, 2]})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sequence_parallel_size = 4
    assert hash(cfg) == hash(UlyssesConfig.from_dict({"mesh_param": [1, 2]}))


def test_direct_construction_and_replace_are_validated_too():
    with pytest.raises(UlyssesConfigError, match=r"ulysses.sequence_parallel_size: expected an "
                                                 r"integer >= 1, got 0"):
        UlyssesConfig(sequence_parallel_size=0)
    with pytest.raises(UlyssesConfigError, match=r"ulysses.tiled_mlp.shards"):
        TiledMLPConfig(shards=0)
    with pytest.raises(UlyssesConfigError, match="eager"):
        dataclasses.replace(UlyssesConfig(), attn_implementation="eager")
    nested = UlyssesConfig(tiled_mlp={"enabled": True})
    assert nested.tiled_mlp == TiledMLPConfig(enabled=True, shards="auto")


INVALID = [
    ("unknown key with suggestion", {"sequence_paralel_size": 2},
     ["ulysses.sequence_paralel_size: unknown field; did you mean 'sequence_parallel_size'?"]),
    ("unknown key without a near match", {"zzz": 1},
     ["ulysses.zzz: unknown field; allowed fields: sequence_parallel_size, ring_size, mesh_param"]),
    ("unknown nested key", {"tiled_mlp": {"enable": True}},
     ["ulysses.tiled_mlp.enable: unknown field; did you mean 'enabled'?"]),
    ("wrong type", {"sequence_parallel_size": "4"},
     ['ulysses.sequence_parallel_size: expected an integer >= 1, got "4"']),
    ("bool is not an integer", {"pad_token_id": True},
     ["ulysses.pad_token_id: expected an integer >= 0, got true"]),
    ("float is not an integer", {"sequence_parallel_size": 2.0},
     ["ulysses.sequence_parallel_size: expected an integer >= 1, got 2.0"]),
    ("sp 0", {"sequence_parallel_size": 0},
     ["ulysses.sequence_parallel_size: expected an integer >= 1, got 0"]),
    ("mesh_param wrong length", {"mesh_param": [8]},
     ["ulysses.mesh_param: expected an array of 2 integers >= 1 or null, got [8]"]),
    ("mesh_param entry 0", {"mesh_param": [0, 2]},
     ["ulysses.mesh_param[0]: expected an integer >= 1, got 0"]),
    ("mesh_param/sp disagreement", {"mesh_param": [2, 4], "sequence_parallel_size": 2},
     ["ulysses.mesh_param: expected its sp (second entry) to equal sequence_parallel_size=2, "
      "got [2, 4]"]),
    ("ring_size not a divisor of sp", {"sequence_parallel_size": 6, "ring_size": 4},
     ["ulysses.ring_size: expected a divisor of sp=6", "got 4", "use one of [1, 2, 3, 6], or \"auto\""]),
    ("ring_size not a divisor of mesh_param's sp", {"mesh_param": [1, 4], "ring_size": 3},
     ["ulysses.ring_size: expected a divisor of sp=4", "got 3"]),
    ("seq_length not a multiple of the ring's chunks",
     {"sequence_parallel_size": 4, "ring_size": 4, "seq_length_is_variable": False, "seq_length": 36},
     ["ulysses.seq_length: expected a multiple of lcm(sp=4, 2 x ring_size=4) = 8", "got 36", "use 32 or 40"]),
    ("ring_size 0", {"ring_size": 0}, ['ulysses.ring_size: expected "auto" or an integer >= 1, got 0']),
    ("ring_size word", {"ring_size": "max"}, ['ulysses.ring_size: expected "auto" or an integer >= 1, got "max"']),
    ("eager attention", {"attn_implementation": "eager"},
     ["ulysses.attn_implementation: expected one of \"sdpa\"",
      "eager needs a full S x S attention mask", 'use "sdpa" instead']),
    ("attention typo", {"attn_implementation": "flash_attention2"},
     ["did you mean 'flash_attention_2'?"]),
    ("shards 0", {"tiled_mlp": {"shards": 0}},
     ['ulysses.tiled_mlp.shards: expected "auto" or an integer >= 1, got 0']),
    ("shards many", {"tiled_loss": {"shards": "many"}},
     ['ulysses.tiled_loss.shards: expected "auto" or an integer >= 1, got "many"']),
    ("seq_length missing when not variable", {"seq_length_is_variable": False},
     ["ulysses.seq_length: missing; seq_length_is_variable is false, so a fixed seq_length is "
      "required"]),
    ("seq_length null when not variable", {"seq_length_is_variable": False, "seq_length": None},
     ["ulysses.seq_length: expected an integer, got null; seq_length_is_variable is false"]),
    ("seq_length not a multiple of sp",
     {"sequence_parallel_size": 4, "seq_length_is_variable": False, "seq_length": 1030},
     ["ulysses.seq_length: expected a multiple of sp=4", "got 1030", "use 1028 or 1032"]),
    ("model_loss off with the default tiled loss", {"model_loss": False},
     ["ulysses.model_loss: false leaves the loss to your code, but tiled_loss (on by default) computes it",
      "fix: add \"tiled_loss\": {\"enabled\": false}, or drop model_loss"]),
    ("model_loss off with the tiled loss on", {"model_loss": False, "tiled_loss": {"enabled": True}},
     ["ulysses.model_loss: false leaves the loss to your code"]),
    ("non-dict section", [1, 2], ["ulysses: expected an object, got [1, 2]"]),
    ("non-dict nested", {"tiled_loss": True}, ["ulysses.tiled_loss: expected an object, got true"]),
    ("timeout 0", {"comm_timeout_seconds": 0},
     ["ulysses.comm_timeout_seconds: expected a number > 0, got 0"]),
    ("enabled not a bool", {"activation_checkpoint_offload": {"enabled": "yes"}},
     ['ulysses.activation_checkpoint_offload.enabled: expected true or false, got "yes"']),
]


@pytest.mark.parametrize("section,phrases", [case[1:] for case in INVALID],
                         ids=[case[0] for case in INVALID])
def test_invalid_section_names_path_value_and_allowed(section, phrases):
    errors = errors_of(section)
    assert len(errors) == 1, errors
    for phrase in phrases:
        assert phrase in errors[0]


def test_all_errors_are_collected_and_sorted_by_path():
    errors = errors_of({"tiled_mlp": {"shards": 0}, "attn_implementation": "eager",
                        "mesh_param": [0, 0], "sequence_paralel_size": 2})
    assert [e.split(":")[0] for e in errors] == [
        "ulysses.attn_implementation", "ulysses.mesh_param[0]", "ulysses.mesh_param[1]",
        "ulysses.sequence_paralel_size", "ulysses.tiled_mlp.shards"]


def test_error_is_a_value_error_listing_every_message_and_survives_pickling():
    with pytest.raises(ValueError) as info:
        UlyssesConfig.from_dict({"a": 1, "b": 2})
    err = info.value
    assert isinstance(err, UlyssesConfigError) and "2 errors" in str(err)
    assert all(message in str(err) for message in err.errors)
    assert pickle.loads(pickle.dumps(err)).errors == err.errors


DS = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
      "ulysses": {"sequence_parallel_size": 2, "tiled_mlp": {"enabled": True}}}


def test_parse_dict_strips_section_and_deep_copies():
    original = copy.deepcopy(DS)
    ds, cfg = parse_ds_config(DS)
    assert ds == {k: v for k, v in DS.items() if k != "ulysses"}
    assert cfg == UlyssesConfig(sequence_parallel_size=2, tiled_mlp=TiledMLPConfig(enabled=True))
    ds["zero_optimization"]["stage"] = 0
    assert DS == original


@pytest.mark.parametrize("as_type", [str, Path])
def test_parse_json_file_path(tmp_path, as_type):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS))
    ds, cfg = parse_ds_config(as_type(path))
    assert "ulysses" not in ds and cfg.sp == 2 and cfg.tiled_mlp.enabled


def test_parse_without_section_returns_none():
    ds, cfg = parse_ds_config({"train_batch_size": 8})
    assert (ds, cfg) == ({"train_batch_size": 8}, None)


@pytest.mark.parametrize("text,phrase", [
    ('{"ulysses": {', "ds.json:1:14: expected a DeepSpeed config in JSON"),
    ('{"a": 1,}', "ds.json:1:9: expected a DeepSpeed config in JSON"),
    ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ('{"ulysses": {"comm_timeout_seconds": NaN}}', "NaN is not a JSON number"),
    ('[1, 2]', "config: expected a JSON object (a DeepSpeed config), got [1, 2]"),
])
def test_parse_rejects_files_that_are_not_a_json_object(tmp_path, text, phrase):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(UlyssesConfigError) as info:
        parse_ds_config(path)
    assert phrase in info.value.errors[0]


def test_parse_reports_an_unreadable_file(tmp_path):
    with pytest.raises(UlyssesConfigError, match="expected a readable UTF-8 JSON DeepSpeed config, "
                                                 "got an error reading it: No such file"):
        parse_ds_config(tmp_path / "missing.json")


def test_parse_rejects_non_path_non_dict():
    with pytest.raises(TypeError, match="expected a dict or a path to a JSON file, got int"):
        parse_ds_config(3)


def test_parse_flags_a_misspelled_section_that_would_silently_turn_sp_off():
    with pytest.raises(UlyssesConfigError, match="ulyses: unknown top-level key; did you mean "
                                                 "'ulysses'"):
        parse_ds_config({"ulyses": {"sequence_parallel_size": 2}})


def test_parse_checks_deepspeed_top_level_sequence_parallel_size():
    assert parse_ds_config({**DS, "sequence_parallel_size": 2})[1].sp == 2
    with pytest.raises(UlyssesConfigError, match="sequence_parallel_size: expected DeepSpeed's "
                                                 "top-level value to equal ulysses sp=2, got 4"):
        parse_ds_config({**DS, "sequence_parallel_size": 4})


def test_parse_raises_for_an_invalid_section():
    with pytest.raises(UlyssesConfigError, match="ulysses.sequence_parallel_size"):
        parse_ds_config({"ulysses": {"sequence_parallel_size": 0}})


def test_example_configs_parse_to_the_documented_setups():
    ds, cfg = parse_ds_config(REPO / "examples" / "ds_config_cpu.json")
    assert (cfg.sp, cfg.attn_implementation, cfg.tiled_loss.enabled) == (2, "sdpa", True)
    assert "bf16" not in ds and "fp16" not in ds and ds["optimizer"]["type"] == "AdamW"
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "cpu"
    ds, cfg = parse_ds_config(REPO / "examples" / "ds_config.json")
    assert ds["bf16"]["enabled"] and cfg.attn_implementation == "flash_attention_2"
    assert cfg.tiled_mlp.enabled and cfg.activation_checkpoint_offload.enabled
    assert "offload_param" not in ds["zero_optimization"]


SHARDS = st.one_of(st.just("auto"), st.integers(1, 4096))


TILED = st.fixed_dictionaries({}, optional={"enabled": st.booleans(), "shards": SHARDS})


@st.composite
def valid_sections(draw):
    """Random valid sections: any subset of fields, each drawn from its allowed values."""
    sp = draw(st.integers(1, 64))
    section = {}
    mode = draw(st.sampled_from(["sp", "mesh", "both", "neither"]))
    if mode in ("sp", "both"):
        section["sequence_parallel_size"] = sp
    if mode in ("mesh", "both"):
        section["mesh_param"] = [draw(st.integers(1, 64)), sp]
    elif draw(st.booleans()):
        section["mesh_param"] = None
    if mode == "neither":
        sp = 1
    optional = {
        "attn_implementation": st.sampled_from(ATTN),
        "pad_to_multiple": st.booleans(),
        "pad_token_id": st.integers(0, 2**31),
        "disable_in_eval": st.booleans(),
        "tiled_mlp": TILED,
        "tiled_loss": TILED,
        "activation_checkpoint_offload": st.fixed_dictionaries(
            {}, optional={"enabled": st.booleans()}),
        "comm_timeout_seconds": st.one_of(st.integers(1, 10**6),
                                          st.floats(1e-3, 1e6, allow_nan=False)),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            section[name] = draw(strategy)
    variable = draw(st.sampled_from([True, False, None]))
    if variable is False:
        section["seq_length_is_variable"] = False
        section["seq_length"] = sp * draw(st.integers(1, 4096))
    elif variable:
        section["seq_length_is_variable"] = True
        if draw(st.booleans()):
            section["seq_length"] = draw(st.one_of(st.none(), st.integers(1, 10**6)))
    return section, sp


@settings(max_examples=300, deadline=None)
@given(valid_sections())
def test_random_valid_sections_validate_and_round_trip(case):
    section, sp = case
    cfg = UlyssesConfig.from_dict(section)
    assert cfg.sp == sp
    for name, value in section.items():
        got = getattr(cfg, name)
        if isinstance(value, dict):
            assert got.to_dict() == {**PROPS[name]["default"], **value}
        else:
            assert got == (tuple(value) if isinstance(value, list) else value)
    assert UlyssesConfig.from_dict(cfg.to_dict()) == cfg
    assert UlyssesConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert parse_ds_config({"ulysses": section})[1] == cfg


FIELD_PATHS = [(name,) for name in PROPS] + [
    (name, sub) for name, prop in PROPS.items() for sub in prop.get("properties", {})]


JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=False),
                        st.text(max_size=8), st.lists(st.integers(), max_size=3),
                        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def _json_types(value) -> set:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _schema_at(path):
    node = SCHEMA
    for name in path:
        node = node["properties"][name]
    return node


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(valid_sections(), st.sampled_from(FIELD_PATHS), JSON_VALUES)
def test_random_wrong_types_are_rejected_naming_the_path(case, path, value):
    allowed = _schema_at(path)["type"]
    allowed = {allowed} if isinstance(allowed, str) else set(allowed)
    if _json_types(value) & allowed:
        return  # right type: this test is about wrong ones
    section = copy.deepcopy(case[0])
    target = section
    for name in path[:-1]:
        target = target.setdefault(name, {})
    target[path[-1]] = value
    dotted = "ulysses." + ".".join(path) + ":"
    assert any(e.startswith(dotted) for e in errors_of(section)), (dotted, errors_of(section))


@settings(max_examples=300, deadline=None)
@given(valid_sections(),
       st.sampled_from([()] + [(n,) for n, p in PROPS.items() if p["type"] == "object"]),
       st.text(min_size=1, max_size=20))
def test_random_unknown_keys_are_rejected_naming_the_path(case, where, key):
    if key in _schema_at(where)["properties"]:
        return
    section = copy.deepcopy(case[0])
    target = section
    for name in where:
        target = target.setdefault(name, {})
    target[key] = 1
    dotted = ".".join(("ulysses",) + where + (key,))
    assert any(e.startswith(f"{dotted}: unknown field;") for e in errors_of(section))


@pytest.mark.timeout(300)
def test_schema_ships_in_a_non_editable_wheel(tmp_path):
    """Build a wheel from a copy of the tree and load the schema from the unpacked wheel alone."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
        else:
            (src / name).write_text("placeholder\n")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "ds_ulysses", src / "ds_ulysses", ignore=ignore)
    shutil.copytree(REPO / "schemas", src / "schemas", ignore=ignore)
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", str(src), "-w", str(out)], check=True, timeout=240,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (wheel,) = out.glob("ds_ulysses-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert "ds_ulysses/schemas/ulysses.schema.json" in names, names
        for layer in ("config/section.py", "distributed/mesh.py", "sp/attention.py", "memory/tiles.py",
                      "hf/register.py", "train/job.py", "engine.py"):
            assert f"ds_ulysses/{layer}" in names, layer
        assert not any(name.startswith("benchmarks/") for name in names)  # the harness is not installed
        assert json.loads(archive.read("ds_ulysses/schemas/ulysses.schema.json")) == SCHEMA
        archive.extractall(site)
    # Only config's packaging is under test here, so the package __init__ (which imports the
    # torch-based modules) is bypassed: a bare package object pointing at the unpacked wheel.
    probe = (
        "import sys, types, json\n"
        f"pkg = types.ModuleType('ds_ulysses'); pkg.__path__ = [{str(site / 'ds_ulysses')!r}]\n"
        "sys.modules['ds_ulysses'] = pkg\n"
        "from importlib import resources\n"
        "import ds_ulysses.config as c\n"
        "print(json.dumps([c.__file__, str(resources.files('ds_ulysses.schemas')),"
        " c.load_schema()['title'], c.UlyssesConfig.from_dict({}).sp]))\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    config_file, schemas_dir, title, sp = json.loads(result.stdout.strip().splitlines()[-1])
    assert config_file.startswith(str(site)) and schemas_dir.startswith(str(site))
    assert (title, sp) == ("ulysses", 1)


SCHEMA_PROPS = load_schema()["properties"]


BOUNDED = [name for name, prop in SCHEMA_PROPS.items() if "minimum" in prop or "exclusiveMinimum" in prop]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(BOUNDED), st.integers(1, 10**6), st.booleans())
def test_random_values_below_a_minimum_are_rejected_naming_the_field(name, below, as_float):
    prop = SCHEMA_PROPS[name]
    if "minimum" in prop:
        value = prop["minimum"] - below
    else:
        value = prop["exclusiveMinimum"] - below + 1
    if as_float and "number" in prop["type"]:
        value = float(value) - 0.5
    with pytest.raises(UlyssesConfigError) as info:
        UlyssesConfig.from_dict({name: value})
    assert any(e.startswith(f"ulysses.{name}: expected ") for e in info.value.errors), info.value.errors


@pytest.mark.parametrize("ring", [1, 2, 4, "auto"])
def test_ring_size_is_typed_and_round_trips(ring):
    cfg = UlyssesConfig.from_dict({"sequence_parallel_size": 4, "ring_size": ring})
    assert cfg.ring_size == ring and UlyssesConfig.from_dict(cfg.to_dict()) == cfg
    assert UlyssesConfig.from_dict({}).ring_size == 1


@pytest.mark.parametrize("ring,sp,heads,node,expected", [
    (1, 4, [8], None, 1), (2, 4, [2], None, 2), (4, 4, [2], None, 4),
    ("auto", 4, [8], None, 1), ("auto", 8, [2, 4], None, 4), ("auto", 6, [4], None, 2),
    ("auto", 16, [32], 8, 2), ("auto", 16, [4], 8, 4), ("auto", 8, [1], None, 8)])
def test_ring_size_resolves_to_a_divisor_that_fits_the_heads(ring, sp, heads, node, expected):
    assert resolve_ring_size(ring, sp, heads, node) == expected


def test_ring_size_too_small_names_the_smallest_that_works():
    with pytest.raises(ValueError, match=r"Ulysses degree of sequence_parallel_size / ring_size = 4, more than the "
                                         r"model's 2 query heads.*fix: set ring_size to 2 \(the smallest"):
        resolve_ring_size(1, 4, [2, 8], None)
    with pytest.raises(ValueError, match=r"fix: set ring_size to 3 \(the smallest"):
        resolve_ring_size(1, 6, [2], None)


@pytest.mark.parametrize("ring", [3, 0, True, "2"])
def test_ring_size_not_a_divisor_is_refused(ring):
    with pytest.raises(ValueError, match=r"ring_size: expected \"auto\" or a divisor of sequence_parallel_size=4"):
        resolve_ring_size(ring, 4, [8], None)

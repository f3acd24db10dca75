"""Properties of the package as a whole: its layers import only downwards, third-party frameworks
enter where they belong, the public API is all in ``__all__``, each shared fact has one home, and
nothing unpickles or evaluates data."""

import ast
import re
import types

import pytest
import torch

import ds_ulysses
from tests.support import REPO

PACKAGE = REPO / "ds_ulysses"

# Which package modules each layer may import (besides itself). Lower layers never reach up.
LAYERS = {
    "constants": set(), "patching": set(),
    "config": {"constants"},
    "distributed": {"constants", "patching", "config"},
    "sp": {"constants", "patching", "config", "distributed"},
    "memory": {"constants", "patching", "config", "distributed"},
    "reshard": set(),
    "hf": {"constants", "patching", "config", "distributed", "sp", "memory", "reshard"},
    "engine": {"constants", "patching", "config", "distributed", "sp", "memory", "hf", "reshard"},
    "planner": {"constants", "config", "sp", "memory"},
    "plan_search": {"constants", "config", "sp", "memory", "planner"},
    "plan_command": {"constants", "planner", "plan_search"},
    "train": {"constants", "patching", "config", "distributed", "sp", "memory", "hf", "engine", "planner", "reshard"},
    "cli": {"config", "distributed", "planner", "plan_command", "train"},
    "__init__": {"constants", "patching", "config", "distributed", "sp", "memory", "hf", "engine"},
}
# Third-party frameworks, by the layers allowed to import them.
FRAMEWORKS = {"transformers": {"hf", "train"}, "deepspeed": {"engine", "memory", "reshard", "train"}}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield path, parts, parts[0]


def _imports(path, parts):
    """(absolute module name, line) of every import in ``path``, lazy ones inside functions included."""
    package = ["ds_ulysses", *parts[:-1]] if parts[-1] != "__init__" else ["ds_ulysses", *parts[:-1]]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if node.module is None:  # from . import x
                for alias in node.names:
                    yield f"{module}.{alias.name}", node.lineno
            else:
                yield module, node.lineno


def _layer_of(module: str):
    parts = module.split(".")
    if parts[0] != "ds_ulysses":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def test_layers_import_only_downwards_and_frameworks_only_where_they_belong():
    wrong = []
    for path, parts, layer in _modules():
        layer = "__init__" if parts == ("__init__",) else layer
        for module, line in _imports(path, parts):
            where = f"{path.relative_to(REPO)}:{line} imports {module}"
            target = _layer_of(module)
            if target is not None and target != layer and target not in LAYERS[layer]:
                wrong.append(where)
            top = module.split(".")[0]
            if top in FRAMEWORKS and layer not in FRAMEWORKS[top]:
                wrong.append(where)
            if top == "deepspeed" and layer == "memory" and not module.startswith("deepspeed"):
                wrong.append(where)
            if top == "benchmarks":
                wrong.append(where)
    assert not wrong, "\n".join(wrong)


def test_the_layer_table_has_no_cycles():
    order = []
    pending = dict(LAYERS)
    while pending:
        ready = [name for name, below in pending.items() if below <= set(order)]
        assert ready, f"cycle among {sorted(pending)}"
        order += ready
        for name in ready:
            del pending[name]


def test_memory_uses_only_zero_helpers_of_deepspeed():
    for path in (PACKAGE / "memory").glob("*.py"):
        for module, line in _imports(path, ("memory", path.stem)):
            if module.startswith("deepspeed"):
                assert module == "deepspeed", f"{path.name}:{line} imports {module}"
                assert "deepspeed.zero." in path.read_text(), path


def test_every_public_name_is_exported_and_importable():
    assert sorted(ds_ulysses.__all__) == sorted(set(ds_ulysses.__all__))
    for name in ds_ulysses.__all__:
        assert getattr(ds_ulysses, name) is not None
    for name in ("UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute",
                 "SequenceTiledCompute", "TiledMLP", "TiledFusedLogitsLoss", "initialize", "install", "uninstall",
                 "UlyssesConfigError", "SPCommError"):
        assert name in ds_ulysses.__all__, name
    public = {n for n, v in vars(ds_ulysses).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public <= set(ds_ulysses.__all__), public - set(ds_ulysses.__all__)


def test_every_public_name_of_deepspeed_s_module_is_ours_too():
    """The drop-in promise, name by name: each class and function DeepSpeed's ALST module defines."""
    import inspect

    from deepspeed.runtime.sequence_parallel import ulysses_sp

    theirs = {n for n, v in vars(ulysses_sp).items() if not n.startswith("_")
              and (inspect.isclass(v) or inspect.isfunction(v)) and v.__module__ == ulysses_sp.__name__}
    assert "UlyssesSPAttentionHF" in theirs
    assert theirs <= set(ds_ulysses.__all__), theirs - set(ds_ulysses.__all__)


def _deepspeed_calls():
    """(name, DeepSpeed's callable, ours) for each public function and method of DeepSpeed's ALST module an
    import switch reaches with its own arguments (not autograd's ``forward``/``backward``/``apply``, which
    take DeepSpeed's arguments through ``apply`` and are compared side by side in tests/unit/memory)."""
    import inspect

    from deepspeed.runtime.sequence_parallel import ulysses_sp

    for name, value in vars(ulysses_sp).items():
        if name.startswith("_") or getattr(value, "__module__", None) != ulysses_sp.__name__:
            continue
        ours = getattr(ds_ulysses, name)
        if inspect.isfunction(value):
            yield name, value, ours
        elif inspect.isclass(value) and not issubclass(value, torch.autograd.Function):
            yield name, value.__init__, ours.__init__
            for method, member in vars(value).items():
                if not method.startswith("_") and callable(getattr(value, method)):
                    yield f"{name}.{method}", getattr(value, method), getattr(ours, method)


def _bound_as(param):
    """What a call binds to: a named parameter by its name and kind, ``*args``/``**kwargs`` by kind alone."""
    return (param.kind,) if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) else (param.name, param.kind)


def test_deepspeed_s_positional_parameters_are_ours_in_the_same_order():
    """A call written for DeepSpeed's module binds the same way to ours: DeepSpeed's parameters, in order,
    are the first of ours (ours may add keyword-only ones, or trailing ones with defaults)."""
    import inspect

    checked = 0
    for name, theirs, ours in _deepspeed_calls():
        want = [_bound_as(p) for p in inspect.signature(theirs).parameters.values()]
        got = [_bound_as(p) for p in inspect.signature(ours).parameters.values()]
        assert got[:len(want)] == want, (name, want, got)
        assert all(p.default is not p.empty or p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD)
                   for p in list(inspect.signature(ours).parameters.values())[len(want):]), name
        checked += 1
    assert checked >= 5


def _number_literals(path):
    """Every integer literal in code (docstrings and messages excluded), as (value, line)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            yield -node.operand.value, node.lineno
        elif isinstance(node, ast.BinOp) and all(isinstance(x, ast.Constant) for x in (node.left, node.right)):
            try:
                yield eval(compile(ast.Expression(node), "<literal>", "eval")), node.lineno  # constants only
            except Exception:
                continue


@pytest.mark.parametrize("value,what", [(-100, "the ignore index"), (1 << 30, "bytes per GiB")])
def test_shared_numbers_live_in_constants(value, what):
    found = [f"{path.relative_to(REPO)}:{line}" for path, _, _ in _modules() if path.name != "constants.py"
             for number, line in _number_literals(path) if number == value]
    assert not found, f"{what} written out instead of imported from ds_ulysses.constants: {found}"


@pytest.mark.parametrize("pattern,home", [
    (r"\"flash_attention_2\",\s*\"flash_attention_3\"", "schemas"),
    (r"get_backend\(", "distributed/collectives.py"),
    (r"world_size % sp|world % sp|dp \* sp !=|dp \* sp ==", "distributed/mesh.py"),
    (r"num_embeddings|out_features", "hf/model_facts.py"),
])
def test_each_shared_fact_has_one_home(pattern, home):
    found = [f"{path.relative_to(REPO)}:{n}" for path, _, _ in _modules()
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(pattern, line.split("#")[0]) and not str(path.relative_to(PACKAGE)).startswith(home)]
    assert not found, f"outside {home}: {found}"


def _unsafe(code: str) -> bool:
    if re.search(r"^\s*(import pickle|from pickle)", code) \
            or re.search(r"torch\.load\((?![^)]*weights_only=True)", code):
        return True
    for m in re.finditer(r"\b(all_gather_object|broadcast_object_list|scatter_object_list|gather_object|"
                         r"recv_object_list|pickle\.loads?|yaml\.load|eval|exec)\(", code):
        if not (m.group(1) == "eval" and code[:m.start()].endswith(".")):  # model.eval() is fine
            return True
    return False


def test_package_never_unpickles_or_evaluates_data():
    """Peers' batches travel as JSON, configs are JSON, checkpoints load with weights_only=True."""
    assert _unsafe("dist.all_gather_object(out, meta)") and _unsafe("torch.load(f)") and not _unsafe("m.eval()")
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for path, _, _ in _modules()
             for number, line in enumerate(path.read_text().splitlines(), start=1)
             if _unsafe(line.split("#")[0])]
    assert not found, found

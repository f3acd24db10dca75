"""The benchmark harness reads in one direction: its command lines, what each mode runs, the tables, the
launches and their records, the code that runs inside a launched rank, and the instruments at the bottom.

Its modules once imported each other in one circle (the command line, the report, the searches, the rank's
loop, the Trainer's, ...), so none could be read, tested or changed without all the others. Here every
import (lazy ones inside functions included) goes to a module of the same layer or one below, no chain of
imports comes back to where it started, and ``measure.py`` (timers, memory high-water marks, live-tensor
tracking) imports nothing of the harness. docs/benchmarks.md ("Layout of `benchmarks/`") says the same in
words; a new module takes its place in :data:`LAYERS`.
"""

import ast

from tests.support import REPO

HARNESS = REPO / "benchmarks"

# The harness's layers, top first: a module imports modules of its own layer or of layers below it.
LAYERS = (
    ("command lines", {"bench", "breakdown", "gpu.longest"}),
    ("suites", {"suites", "maxseq"}),
    ("report", {"report", "mode_tables", "breakdown_fit", "tables", "gpu.summary"}),
    ("launch and records", {"launch", "records"}),
    ("per-rank loops", {"rank", "engine_loop", "framework_loop", "trainer", "accelerate_loop", "trl_loop",
                        "breakdown_loop", "layer", "tiled", "recipes"}),
    ("instruments and arms", {"measure", "tap", "profile", "arms", "gpu.kernels"}),
)
STANDALONE = {"ring_layouts"}  # its own launcher, imports nothing of the harness (docs/ring.md)


def _modules() -> dict:
    """Module name relative to ``benchmarks`` (``gpu.longest``) -> path; packages' ``__init__`` left out."""
    return {".".join(path.relative_to(HARNESS).with_suffix("").parts): path
            for path in sorted(HARNESS.rglob("*.py")) if path.name != "__init__.py"}


def _imports(name: str, path) -> set[str]:
    """The harness modules ``name`` imports, lazy imports included: ``from .x import``, ``from . import x``,
    ``from benchmarks.x import``, ``import benchmarks.x``."""
    package = ["benchmarks", *name.split(".")[:-1]]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{module}.{alias.name}" for alias in node.names] + [module]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] == "benchmarks" and len(parts) > 1:
                found.add(".".join(parts[1:]))
    modules = _modules()
    return {target for target in found if target in modules and target != name}


def _graph() -> dict[str, set[str]]:
    return {name: _imports(name, path) for name, path in _modules().items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as the chain of modules, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_chain_of_imports_in_the_harness_comes_back_to_its_start():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle in benchmarks/: " + " -> ".join(cycle)


def test_measure_imports_nothing_of_the_harness():
    path = HARNESS / "measure.py"
    assert path.is_file(), "benchmarks/measure.py (timers, memory, live tensors) is missing"
    assert _imports("measure", path) == set()


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_ones():
    layer_of = {module: i for i, (_, modules) in enumerate(LAYERS) for module in modules}
    graph = _graph()
    unplaced = sorted(set(graph) - set(layer_of) - STANDALONE)
    assert not unplaced, f"benchmarks modules without a layer in LAYERS: {unplaced}"
    upward = [f"{module} ({LAYERS[layer_of[module]][0]}) imports {target} ({LAYERS[layer_of[target]][0]})"
              for module, targets in sorted(graph.items()) if module in layer_of
              for target in sorted(targets) if layer_of[target] < layer_of[module]]
    assert not upward, "imports that go up the layers:\n" + "\n".join(upward)
    assert all(not graph[module] for module in STANDALONE)

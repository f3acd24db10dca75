"""Every collective takes its tensors on the device its backend needs, decided in one place.

NCCL moves CUDA tensors only, gloo CPU tensors only: a CPU tensor handed to a collective on an NCCL group
fails a user's first GPU step, and no CPU run can show it (every tensor is on the CPU there). So this
checks the source: every function in the package, the training app and the benchmarks that hands a
tensor it made to a torch.distributed collective asks :func:`ds_ulysses.distributed.collective_device`
for the device. The few collectives that move the model's own activations (already on the rank's
device, which is the group's device under NCCL) are listed with the reason. The same flows run on a
GPU under ``make test-gpu``.
"""

import ast

from tests.support import REPO

COLLECTIVES = {"all_gather", "all_reduce", "all_to_all_single", "all_to_all", "broadcast", "reduce_scatter",
               "reduce_scatter_tensor", "all_gather_into_tensor", "gather", "scatter", "reduce", "send", "recv"}
# (file, function): why its tensors are already where the collective needs them
MODEL_TENSORS = {
    ("ds_ulysses/distributed/all_to_all.py", "_all_to_all"): "q/k/v and attention outputs: the model's activations",
    ("benchmarks/recipes.py", "forward"): "the tutorial loss's per-rank loss, on the model's device",
    ("benchmarks/recipes.py", "backward"): "the gradient of that loss, on the model's device",
    ("benchmarks/recipes.py", "_aggregate"): "token counts made from the labels on the model's device",
    ("benchmarks/recipes.py", "tiled_forward"): "the tile count, made on the MLP input's device",
}


def _calls_collective(node) -> list[str]:
    found = []
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in COLLECTIVES:
            base = call.func.value
            if isinstance(base, ast.Name) and base.id == "dist":
                found.append(call.func.attr)
    return found


def _functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_every_collective_gets_its_device_from_the_one_place_that_decides_it():
    unchecked, sites = [], 0
    for root in ("ds_ulysses", "benchmarks"):
        for path in sorted((REPO / root).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            for fn in _functions(ast.parse(path.read_text())):
                inner = {id(n) for f in ast.walk(fn) if f is not fn and isinstance(f, ast.FunctionDef)
                         for n in ast.walk(f)}
                calls = [c for c in _calls_collective(fn)]
                if not calls or all(id(n) in inner for n in ast.walk(fn) if isinstance(n, ast.Call)
                                    and isinstance(n.func, ast.Attribute) and n.func.attr in COLLECTIVES):
                    continue
                sites += 1
                if (rel, fn.name) in MODEL_TENSORS:
                    continue
                if "collective_device" not in ast.unparse(fn):
                    unchecked.append(f"{rel}:{fn.lineno} {fn.name}() calls dist.{calls[0]}")
    assert sites >= 8  # the check sees the package's collectives
    assert not unchecked, "collectives whose device nobody chose:\n" + "\n".join(unchecked)

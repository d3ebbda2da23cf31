"""The package's shape, checked on its sources with ``ast``: the core imports none of the layers built on it,
no two modules import each other (directly or through others), and no module grows past what a reader takes in.

An import counts wherever it is written — at the top of a module or inside a function — since a function-level
import is as much a dependency as a module-level one."""

from __future__ import annotations

import ast
import pathlib

import peft_sparse

PACKAGE = pathlib.Path(peft_sparse.__file__).parent
# what core/ must not import: the layers that build on it (ARCHITECTURE: methods → schedules → optim → core ← accel)
ABOVE_THE_CORE = ("accel", "optim", "methods", "schedules")
MAX_LINES = 450
# the Triton kernel sources (one kernel family after another), and SpIEL's scheduler (501 lines, to be split)
LONG_ALLOWED = {"accel/triton_kernels.py", "methods/spiel/scheduler.py"}


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name → source file, for every module of the package (a package's name → its __init__)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["peft_sparse", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> list[tuple[str, int]]:
    """The package's modules ``name`` imports, anywhere in its source, with the line of each import. ``from X
    import y`` names module X.y where y is a module, else X."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "peft_sparse"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "peft_sparse":
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.append((full if full in modules else target, node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {target for target, _ in _imports(name, path, modules) if target in modules} for name, path in modules.items()}


def test_the_core_imports_nothing_built_on_it():
    modules = _modules()
    offenders = [
        f"{path.relative_to(PACKAGE)}:{line} imports {target}"
        for name, path in modules.items() if name.startswith("peft_sparse.core.") or name == "peft_sparse.core"
        for target, line in _imports(name, path, modules)
        if target.split(".")[1:2] and target.split(".")[1] in ABOVE_THE_CORE
    ]  # fmt: skip
    assert not offenders


def test_no_import_cycles():
    graph = _graph()
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles


def test_no_module_is_too_long_to_read():
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES and str(path.relative_to(PACKAGE)) not in LONG_ALLOWED
    }
    assert not long


def test_the_checks_see_what_they_check():
    """The graph holds the imports the checks look for (a parser that found nothing would pass them all)."""
    graph = _graph()
    assert "peft_sparse.core.dispatch" in graph["peft_sparse.core.layer"]
    assert "peft_sparse.core.kernels" in graph["peft_sparse.accel.training_merge"]
    assert "peft_sparse.core.dispatch" in graph["peft_sparse.optim.surgery"]
    assert "peft_sparse.core.layer" in graph["peft_sparse.methods.spiel.model"]  # (a relative import three levels up)

"""The package's import graph has no cycle, deferred or not: every `import` statement counts, at module level, inside
functions and under `if TYPE_CHECKING:`, as does importing a subpackage's `__init__` on the way to its modules (the
top-level `lightning_dpar/__init__.py`, which registers the strategies, is the one entry point left out). A cycle
hidden behind a function-local import still means two modules that cannot be read, or tested, one without the
other."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import lightning_dpar

ROOT = Path(lightning_dpar.__file__).parent
PACKAGE = "lightning_dpar"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _imported(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The package's modules one import statement loads (the module, or for `from X import name` the submodule
    `X.name` when there is one, else `X`)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                anchor = anchor.rpartition(".")[0]
            base = f"{anchor}.{base}".rstrip(".")
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        # `from X import Y` reads X's namespace, so X's `__init__` has run, even from a module inside X: a package
        # whose `__init__` imports that module back is a cycle (import the submodule by its full name instead).
        names.append(base)
    else:
        return set()
    found = set()
    for name in names:
        while name and name not in modules:  # `import a.b.c` of a non-module attribute: its nearest module
            name = name.rpartition(".")[0]
        if not name.startswith(PACKAGE):
            continue
        found.add(name)
        parent = name.rpartition(".")[0]
        # A subpackage's `__init__` runs first, unless the importing module is inside it (then it is running).
        while parent and parent != PACKAGE and not f"{module}.".startswith(f"{parent}."):
            found.add(parent)
            parent = parent.rpartition(".")[0]
    return found


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source (the top-level package excluded)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            edges |= _imported(node, name, path.name == "__init__.py", modules)
        graph[name] = {target for target in edges if target not in (name, PACKAGE)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_the_helpers_module_is_a_leaf():
    assert import_graph()["lightning_dpar.helpers"] == set()


def test_the_cycle_check_sees_function_local_and_type_checking_imports():
    graph = import_graph()
    local = ast.parse("def f():\n    from lightning_dpar.plan import ModulePlan\n")
    guarded = ast.parse("if TYPE_CHECKING:\n    from lightning_dpar.pipeline.split import PipelineSplit\n")
    modules = _modules()
    assert {"lightning_dpar.plan"} <= set().union(*(_imported(n, "x", False, modules) for n in ast.walk(local)))
    assert {"lightning_dpar.pipeline.split", "lightning_dpar.pipeline"} <= set().union(
        *(_imported(n, "x", False, modules) for n in ast.walk(guarded))
    )
    inside = ast.parse("from lightning_dpar.estimates import state_memory\n")
    found = set().union(*(_imported(n, "lightning_dpar.estimates.dry_run", False, modules) for n in ast.walk(inside)))
    assert found == {"lightning_dpar.estimates", "lightning_dpar.estimates.state_memory"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({**graph, "lightning_dpar.helpers": {"lightning_dpar.plan"}}) is not None


@pytest.mark.parametrize("module", ["lightning_dpar.checkpoint.hf_export"])
def test_checkpoint_export_does_not_import_pretrained(module):
    assert "lightning_dpar.hf_weights.pretrained" not in import_graph()[module]


def package_of(module: str) -> str:
    """The folder (or top-level module) `module` belongs to: `lightning_dpar.plan.planner` -> `lightning_dpar.plan`."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Folder -> the other folders (and top-level modules) its modules import."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module == PACKAGE:
            continue
        source = package_of(module)
        edges = packages.setdefault(source, set())
        edges |= {package_of(target) for target in targets if package_of(target) != source}
    return packages


def test_the_folders_have_no_import_cycle():
    """Folders are layers: one folder importing another, anywhere, means the other never imports it back."""
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, f"import cycle between folders: {' -> '.join(cycle or [])}"


def test_the_folder_cycle_check_sees_a_cycle_through_modules_of_different_names():
    graph = {
        "lightning_dpar.plan.planner": {"lightning_dpar.parallel.materialize"},
        "lightning_dpar.parallel.materialize": {"lightning_dpar.plan.ties"},
        "lightning_dpar.plan.ties": set(),
    }
    assert find_cycle(graph) is None
    assert find_cycle(package_graph(graph)) == [
        "lightning_dpar.parallel",
        "lightning_dpar.plan",
        "lightning_dpar.parallel",
    ]


#: The package's folders and top-level modules from the bottom layer up: each imports only layers before it.
LAYERS = [
    "_private_api",
    "helpers",
    "agreement",
    "progress",
    "cli",
    "parallel_dims",
    "steps",
    "conformance",
    "pipeline",
    "context_parallel",
    "activation_checkpointing",
    "loss_parallel",
    "float8",
    "plan",
    "experts",
    "parallel",
    "hf_weights",
    "checkpoint",
    "optim",
    "launch",
    "fault_tolerance",
    "strategies",
    "estimates",
    "layout_search",
    "fabric",
    "performance_monitor",
    "ray",
    "examples",
    "__main__",
]


def test_every_folder_imports_only_the_layers_below_it():
    packages = package_graph(import_graph())
    layer = {f"{PACKAGE}.{name}": index for index, name in enumerate(LAYERS)}
    assert set(packages) <= set(layer), f"folders missing from LAYERS: {sorted(set(packages) - set(layer))}"
    upward = {
        (source, target) for source, targets in packages.items() for target in targets if layer[target] > layer[source]
    }
    assert upward == set(), f"imports of a layer above: {sorted(upward)}"

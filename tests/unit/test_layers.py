"""The import structure docs/architecture.md draws holds: no module imports one of a higher layer or a sibling unit of
its own layer, and no modules import each other in a circle, directly or through others.

The layers, from the bottom (`LAYERS`; a unit imports only itself and the layers below it):
  0  `learner/algo/` (the math)  and  `sync/` (weight sync)
  1  `learner/passes/` (running a model over token rows: layout, passes, packing, device)
  2  `rewards/`
  3  `actors/`  and  `learner/` (the rest of it: the training code)
  4  `cluster/`
Every import counts for both rules: at the top of a module, inside a function (a lazy import) and under
`if TYPE_CHECKING:`. For the layers, a type named is a dependency like any other. For circles too, although a
TYPE_CHECKING import never runs: two modules that each need the other to be read are one module split in two, and
turning the annotation into a runtime use (an isinstance, a default) would make the circle fail at import. A package's
`__init__` counts as a module; importing `package.module` is an edge to that module only (Python runs the package's
`__init__` first, but a package importing its own modules is no circle with them).
Config modules import nothing heavier than pydantic (and a few small standard modules: `ipaddress` and `urllib` check
where a bearer token may travel): `cluster/config.py` composes the packages' own.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from itertools import takewhile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "cluster", "learner", "rewards", "sync")
LAYERS = (  # bottom first; docs/architecture.md, "The layers", draws the same
    ("learner.algo", "sync"),
    ("learner.passes",),
    ("rewards",),
    ("actors", "learner"),
    ("cluster",),
)
CONFIGS = ["actors/config.py", "learner/config.py", "rewards/config.py", "sync/config.py", "cluster/data_config.py",
           "cluster/run_sections.py"]
LIGHT = ("__future__", "typing", "re", "pathlib", "collections", "ipaddress", "urllib", "json", "difflib", "pydantic",
         "yaml")

# TEMPORARY: known circles and upward imports not fixed yet, each as the one import (importer, imported) that should go.
# Empty these lists: a test fails once an entry is no longer needed, so they only shrink.
TEMPORARY_CIRCLE_IMPORTS: dict[tuple[str, str], str] = {}
TEMPORARY_UPWARD_IMPORTS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    target: str  # the project module imported
    line: int
    where: str  # "", " (inside a function)" or " (under TYPE_CHECKING)"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


@cache
def defined_names(module: str) -> frozenset[str] | None:
    """The names a project module binds at its top (also under an `if` or a `try`); None when it cannot be known
    (a star import, a module `__getattr__`)."""
    names: set[str] = set()
    statements = list(ast.parse(MODULES[module].read_text()).body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        statements.extend(child for child in ast.iter_child_nodes(node)
                          if isinstance(node, (ast.If, ast.Try, ast.With, ast.ExceptHandler))
                          and isinstance(child, (ast.stmt, ast.excepthandler)))
    return None if "__getattr__" in names else frozenset(names)


def project_imports(source: str, modules: dict | set = MODULES) -> list[Import | str]:
    """Every import of a project module in `source`, anywhere in it; `from package import module` is an import of
    `package.module`, `from module import name` one of `module`. A string for an import of a project module or name
    that does not exist (or a relative import)."""
    found: list[Import | str] = []

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = where or " (inside a function)"
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, " (under TYPE_CHECKING)")
            for child in node.orelse:
                visit(child, where)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    found.append(Import(alias.name, node.lineno, where) if alias.name in modules
                                 else f"line {node.lineno}: import {alias.name}: no such module")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append(f"line {node.lineno}: a relative import; the project uses absolute ones")
            elif node.module.split(".")[0] in PACKAGES:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    if target not in modules:  # a name of the module
                        target, names = node.module, defined_names(node.module) if node.module in MODULES else None
                        if names is not None and alias.name != "*" and alias.name not in names:
                            target = f"{node.module}.{alias.name}"  # reported as missing, module or name
                    found.append(Import(target, node.lineno, where) if target in modules
                                 else f"line {node.lineno}: from {node.module} import {alias.name}: no such module "
                                      "or name")
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):  # imports are statements
                visit(child, where)

    visit(ast.parse(source), "")
    return found


@cache
def import_graph() -> dict[str, dict[str, Import]]:
    """Each project module -> the modules it imports -> the first such import."""
    graph: dict[str, dict[str, Import]] = {}
    for name, path in MODULES.items():
        edges = graph.setdefault(name, {})
        for found in project_imports(path.read_text()):
            if isinstance(found, Import) and found.target != name:
                edges.setdefault(found.target, found)
    return graph


def unit(module: str) -> str:
    """The most specific unit of `LAYERS` that holds `module`."""
    units = [u for layer in LAYERS for u in layer if module == u or module.startswith(u + ".")]
    assert units, f"{module} is in no layer: add its package to LAYERS"
    return max(units, key=len)


def layer(module: str) -> int:
    return next(i for i, units in enumerate(LAYERS) if unit(module) in units)


def upward(importer: str, imported: str) -> bool:
    """The import runs against the layers: into another unit of the same layer or of a higher one."""
    return unit(importer) != unit(imported) and layer(imported) >= layer(importer)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle [a, b, ..., a] through each group of modules that import each other (a strongly connected component
    of more than one module: Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_circle_through(graph, set(component)) for component in components]


def _circle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest circle from the component's first module back to it, inside the component (breadth first)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    return paths[v] + [start]
                if w in component and w not in paths:
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"no circle through {sorted(component)}")


def describe(graph: dict[str, dict[str, Import]], circle: list[str]) -> str:
    steps = [f"{a} imports {b} ({MODULES[a].relative_to(ROOT)}:{graph[a][b].line}{graph[a][b].where})"
             for a, b in zip(circle, circle[1:])]
    return " -> ".join(circle) + ":\n    " + "\n    ".join(steps)


def test_every_project_import_names_a_module_or_name_that_exists():
    """Also in tests/ and bench/: a lazy import of a moved module or name fails only when it runs; this sees it at
    once."""
    files = [*MODULES.values(), *sorted((ROOT / "tests").rglob("*.py")), *sorted((ROOT / "bench").rglob("*.py"))]
    wrong = [f"{path.relative_to(ROOT)}: {found}" for path in files for found in project_imports(path.read_text())
             if isinstance(found, str)]
    assert not wrong, "\n".join(wrong)


def test_no_modules_import_each_other_in_a_circle():
    graph = import_graph()
    edges = {a: set(targets) - {b for (i, b) in TEMPORARY_CIRCLE_IMPORTS if i == a} for a, targets in graph.items()}
    found = [describe(graph, circle) for circle in circles(edges)]
    assert not found, "import circles (move what both sides need into a module below both):\n" + "\n".join(found)
    everything = {a: set(targets) for a, targets in graph.items()}
    stale = [f"{a} -> {b}" for a, b in TEMPORARY_CIRCLE_IMPORTS
             if b not in everything[a] or not any(a in c and b in c for c in circles(everything))]
    assert not stale, f"no longer in a circle: remove {stale} from TEMPORARY_CIRCLE_IMPORTS"


def test_each_layer_imports_only_itself_and_the_layers_below_it():
    graph = import_graph()
    wrong = [f"{MODULES[a].relative_to(ROOT)}:{found.line}{found.where}: {a} (layer {layer(a)}) imports {b} "
             f"(layer {layer(b)})" for a, targets in sorted(graph.items()) for b, found in sorted(targets.items())
             if upward(a, b) and (a, b) not in TEMPORARY_UPWARD_IMPORTS]
    assert not wrong, "imports against the layers (LAYERS, docs/architecture.md):\n" + "\n".join(wrong)
    stale = [pair for pair in TEMPORARY_UPWARD_IMPORTS if pair[1] not in graph.get(pair[0], {})]
    assert not stale, f"no longer imported: remove {stale} from TEMPORARY_UPWARD_IMPORTS"


def test_the_architecture_draws_these_layers():
    """docs/architecture.md's diagram has a line `layer N  units...` per layer, naming the same units."""
    lines = [line.split() for line in (ROOT / "docs" / "architecture.md").read_text().splitlines()
             if line.strip().startswith("layer ") and line.split()[1].isdigit()]
    drawn = {int(words[1]): {w.rstrip("/").replace("/", ".") for w in takewhile(lambda w: w.endswith("/"), words[2:])}
             for words in lines}  # the units, then what they are
    assert drawn == {i: set(units) for i, units in enumerate(LAYERS)}


def test_the_math_imports_no_model_code():
    """`learner/algo/` is importable without transformers: the passes over models are `learner/passes/`."""
    heavy = [f"{path.relative_to(ROOT)} imports {alias}" for name, path in MODULES.items()
             if unit(name) == "learner.algo" for node in ast.walk(ast.parse(path.read_text()))
             for alias in ([a.name for a in node.names] if isinstance(node, ast.Import)
                           else [node.module] if isinstance(node, ast.ImportFrom) else [])
             if alias.split(".")[0] not in ("__future__", "collections", "dataclasses", "math", "typing", "torch",
                                            "learner")]
    assert not heavy, heavy


@pytest.mark.parametrize("relative", CONFIGS + ["cluster/config.py"])
def test_config_modules_import_only_pydantic_and_the_other_configs(relative):
    tree = ast.parse((ROOT / relative).read_text())
    named = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    named |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    heavy = {m for m in named if m.split(".")[0] not in LIGHT + PACKAGES}
    assert not heavy, f"{relative} imports {sorted(heavy)}: config must validate without torch or Ray"
    own = {found.target for found in project_imports((ROOT / relative).read_text())}
    expected = {c.removesuffix(".py").replace("/", ".") for c in CONFIGS} if relative == "cluster/config.py" else set()
    assert own <= expected, f"{relative} imports {sorted(own - expected)}"


def test_the_rules_can_fail():
    """The checker sees what it is for: imports in a function and under TYPE_CHECKING, a missing module, an import
    against the layers, and a circle through three modules."""
    source = ("from typing import TYPE_CHECKING\nimport sync.calls\nif TYPE_CHECKING:\n"
              "    from learner.config import LearnerConfig\ndef f():\n    from learner.passes import device\n"
              "    from learner.algo.sequences import Rows\n    from learner import device\n")
    found = project_imports(source)
    assert [(i.target, i.where) for i in found if isinstance(i, Import)] == [
        ("sync.calls", ""), ("learner.config", " (under TYPE_CHECKING)"),
        ("learner.passes.device", " (inside a function)")]
    assert [f for f in found if isinstance(f, str)] == [  # both now in learner/passes/
        "line 7: from learner.algo.sequences import Rows: no such module or name",
        "line 8: from learner import device: no such module or name"]
    assert upward("actors.rollout", "learner.learner")  # a sibling's training code
    assert upward("learner.learner", "actors.rollout")
    assert upward("learner.passes.sequences", "learner.learner") and upward("learner.algo.losses", "sync.calls")
    assert upward("rewards.http", "cluster.config") and upward("sync.calls", "learner.passes.device")
    assert not upward("actors.reference", "learner.passes.sequences") and not upward("learner.learner", "sync.calls")
    assert circles({"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []

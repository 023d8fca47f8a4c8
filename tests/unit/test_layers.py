"""The import direction docs/architecture.md draws holds: each layer imports only the layers below it.

From the bottom: the math (`learner/algo/`) and device placement (`learner/device.py`) import nothing of the project;
`sync/` imports only itself; `rewards/` only itself; `actors/` itself, `sync/`, `rewards/` (the rollout workers run
episodes against its environments) and those two leaves of `learner/`;
`learner/` itself and `sync/`; `cluster/` anything. No package below `cluster/` imports it. Config modules import
nothing heavier than pydantic (and a few small standard modules: `ipaddress` and `urllib` check where a bearer token
may travel): `cluster/config.py` composes the packages' own. Every import counts, also one inside a
function or under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("actors", "cluster", "learner", "rewards", "sync")
LEAVES = ("learner.algo", "learner.device")  # the math and device placement: the rest of learner/ is above actors/
ALLOWED = {  # a module path prefix -> the project modules (prefixes) it may import
    "learner/algo/": ("learner.algo",),
    "learner/device.py": (),
    "sync/": ("sync",),
    "rewards/": ("rewards",),
    "actors/": ("actors", "sync", "rewards", *LEAVES),
    "learner/": ("learner", "sync"),
    "cluster/": PROJECT,
}
CONFIGS = ["actors/config.py", "learner/config.py", "rewards/config.py", "sync/config.py"]
LIGHT = ("__future__", "typing", "re", "pathlib", "collections", "ipaddress", "urllib", "pydantic", "yaml")


def imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it; `from package import module` counts as `package.module`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import; the project uses absolute ones"
            package = (ROOT / node.module.replace(".", "/")).is_dir()
            found.update(f"{node.module}.{a.name}" for a in node.names) if package else found.add(node.module)
    return found


def project_imports(path: Path) -> set[str]:
    return {m for m in imports(path) if m.split(".")[0] in PROJECT}


def layer(relative: str) -> str:
    return next(prefix for prefix in ALLOWED if relative.startswith(prefix))  # the dict is most specific first


def allowed(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("package", PROJECT)
def test_each_layer_imports_only_the_layers_below_it(package):
    wrong = [f"{path.relative_to(ROOT)} imports {module}" for path in sorted((ROOT / package).rglob("*.py"))
             for module in sorted(project_imports(path))
             if not allowed(module, ALLOWED[layer(str(path.relative_to(ROOT)))])]
    assert not wrong, "\n".join(wrong)


def test_nothing_below_cluster_imports_it():
    below = [p for package in PROJECT if package != "cluster" for p in (ROOT / package).rglob("*.py")]
    assert not [str(p.relative_to(ROOT)) for p in below if any(m.startswith("cluster") for m in project_imports(p))]


@pytest.mark.parametrize("relative", CONFIGS + ["cluster/config.py"])
def test_config_modules_import_only_pydantic_and_the_other_configs(relative):
    path = ROOT / relative
    heavy = {m for m in imports(path) if m.split(".")[0] not in LIGHT + PROJECT}
    assert not heavy, f"{relative} imports {sorted(heavy)}: config must validate without torch or Ray"
    own = project_imports(path)
    expected = {c.removesuffix(".py").replace("/", ".") for c in CONFIGS} if relative == "cluster/config.py" else set()
    assert own <= expected, f"{relative} imports {sorted(own - expected)}"


def test_the_rules_can_fail():
    """The checker sees an upward import: one from actors/ into the learner's training code."""
    assert not allowed("learner.learner", ALLOWED["actors/"])
    assert allowed("learner.algo.sequences", ALLOWED["actors/"])
    assert "cluster.config" in project_imports(ROOT / "cluster" / "run" / "driver.py")

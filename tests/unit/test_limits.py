"""The size limits STYLE.md sets hold in every module of actors/, cluster/, learner/, rewards/, sync/ and deploy/
(tests/ and bench/ aside):
- a module has at most 500 lines (`MODULE_LINES`), learner/algo/ aside (each of its modules tells one algorithm);
- a function or method, nested ones too, has at most 60 lines from `def` to its last line (`FUNCTION_LINES`), unless
  its docstring has a line that starts with "Long because" and says why splitting it would read worse (a route table,
  an equation in one piece); a function that fits needs no such line, and one that has it is reported;
- a module's docstring has at most 12 lines (`DOCSTRING_LINES`): what the module owns and what it does not.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "cluster", "learner", "rewards", "sync", "deploy")
LONG_MODULES_ALLOWED = ("learner/algo/",)
MODULE_LINES = 500
FUNCTION_LINES = 60
DOCSTRING_LINES = 12
MARKER = "Long because"


def modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def says_why(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether the function's docstring has a line that starts with `MARKER`."""
    docstring = ast.get_docstring(function) or ""
    return any(line.strip().startswith(MARKER) for line in docstring.splitlines())


def module_too_long(relative: str, source: str) -> str | None:
    lines = len(source.splitlines())
    if lines > MODULE_LINES and not relative.startswith(LONG_MODULES_ALLOWED):
        return f"{relative}: {lines} lines (at most {MODULE_LINES}): move a cohesive part into a module of its own"
    return None


def functions_too_long(relative: str, source: str) -> list[str]:
    """Functions over `FUNCTION_LINES` whose docstring does not say why, and functions that say why but fit."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        lines = node.end_lineno - node.lineno + 1
        where = f"{relative}:{node.lineno} {node.name}"
        if lines > FUNCTION_LINES and not says_why(node):
            found.append(f"{where}: {lines} lines (at most {FUNCTION_LINES} unless the docstring says "
                         f"'{MARKER} ...'): extract well-named helpers")
        elif lines <= FUNCTION_LINES and says_why(node):
            found.append(f"{where}: {lines} lines fit the limit: drop the docstring's '{MARKER}' line")
    return found


def docstring_too_long(relative: str, source: str) -> str | None:
    lines = len((ast.get_docstring(ast.parse(source)) or "").splitlines())
    if lines > DOCSTRING_LINES:
        return f"{relative}: module docstring of {lines} lines (at most {DOCSTRING_LINES}): what it owns and does not"
    return None


def sources() -> list[tuple[str, str]]:
    return [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in modules()]


def test_the_scope_holds_the_packages_modules():
    found = {relative.split("/")[0] for relative, _ in sources()}
    assert {"actors", "cluster", "learner", "rewards", "sync"} <= found


def test_no_module_is_over_500_lines():
    too_long = [message for relative, source in sources() if (message := module_too_long(relative, source))]
    assert not too_long, "\n".join(too_long)


def test_no_function_is_over_60_lines_unless_its_docstring_says_why():
    too_long = [message for relative, source in sources() for message in functions_too_long(relative, source)]
    assert not too_long, "\n".join(too_long)


def test_no_module_docstring_is_over_12_lines():
    too_long = [message for relative, source in sources() if (message := docstring_too_long(relative, source))]
    assert not too_long, "\n".join(too_long)


def test_the_checks_catch_what_is_over_the_limits():
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES - 1))  # 59 body lines + `def` = 60
    fits = f"def f():\n{body}"
    over = f"def f():\n{body}    x = 0\n"
    excused = f'def f():\n    """Does f.\n\n    Long because: one table.\n    """\n{body}'
    nested = "def outer():\n    def inner():\n" + "".join(f"        x{i} = {i}\n" for i in range(FUNCTION_LINES))
    assert functions_too_long("m.py", fits) == []
    assert [m.split(":")[1] for m in functions_too_long("m.py", over)] == ["1 f"]
    assert functions_too_long("m.py", excused) == []
    assert [m.split(":")[1] for m in functions_too_long("m.py", nested)] == ["1 outer", "2 inner"]
    assert "drop the docstring" in functions_too_long("m.py", '''def f():\n    """Long because: no."""\n''')[0]

    assert module_too_long("cluster/NAME.py", "x = 1\n" * MODULE_LINES) is None
    assert module_too_long("cluster/NAME.py", "x = 1\n" * (MODULE_LINES + 1)) is not None
    assert module_too_long("learner/algo/NAME.py", "x = 1\n" * (MODULE_LINES + 1)) is None

    assert docstring_too_long("m.py", '"""' + "line\n" * (DOCSTRING_LINES - 1) + 'last."""\n') is None
    assert docstring_too_long("m.py", '"""' + "line\n" * DOCSTRING_LINES + 'last."""\n') is not None

"""Sentences of the docs that state what the code does, checked against the code: the critic rule, the placement of
the demo's shipped models, the commands the docs give for a finished run, the demo's time, and the table of invalid
combinations against the checks the config models make."""

from __future__ import annotations

import ast
import itertools
import re
import typing
from pathlib import Path

from cluster.config import ConfigError, load_config
from learner.config import CriticConfig, LearnerConfig

ROOT = Path(__file__).resolve().parents[2]


def paragraph(doc: str, start: str) -> str:
    """The text of `doc` from `start` to the next blank line or list item."""
    text = doc[doc.index(start):]
    return re.split(r"\n\s*\n|\n- ", text, maxsplit=1)[0]


def test_the_critic_rule_names_every_advantage_that_reads_a_value_model():
    names = {name: typing.get_args(LearnerConfig.model_fields[name].annotation) for name in ("advantage", "baseline")}
    accepted = set()
    for advantage, baseline in itertools.product(names["advantage"], names["baseline"]):
        try:
            load_config(None, ["critic.enabled=true", f"learner.advantage={advantage}", f"learner.baseline={baseline}"])
        except ConfigError:
            continue
        accepted.add((advantage, baseline))
    assert accepted == {("gae", "none"), ("reinforce", "value")}
    algorithms = (ROOT / "docs" / "algorithms.md").read_text()
    for text in (CriticConfig.model_fields["enabled"].description, paragraph(algorithms, "**Where it runs.**")):
        text = " ".join(text.split())
        assert "gae" in text and "reinforce" in text and "baseline" in text and "value" in text, text


def test_a_saved_config_runs_again_and_continues_with_the_commands_the_docs_give(tmp_path):
    from cluster.config import dump_config
    from cluster.run.launch import resolve_run_dir

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(load_config(None, [f"run_dir={run}"])))  # as a run saves it
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    operations = " ".join((ROOT / "docs" / "operations.md").read_text().split())
    again = re.search(r"`relay train PATH/config.yaml([^`]*)` runs it again", operations)
    assert again, "docs/operations.md no longer says how to run a saved config again"
    overrides = [item.replace("NEW_PATH", str(tmp_path / "again")) for item in again.group(1).split()]
    assert resolve_run_dir(load_config(run / "config.yaml", overrides)) == tmp_path / "again"
    resumed = re.search(r"`relay train PATH/config.yaml([^`]*)` continues it", operations)
    assert resumed, "docs/operations.md no longer says how to continue a saved config's run"
    assert resolve_run_dir(load_config(run / "config.yaml", resumed.group(1).split())) == run


def test_the_demo_models_ship_and_nothing_says_they_are_built_on_first_use():
    shipped = {p.name for p in (ROOT / "cluster" / "demo" / "models").iterdir() if (p / "config.json").exists()}
    assert {"demo-model-v1", "demo-chain-model-v1", "demo-calc-model-v1"} <= shipped
    packages = ("cluster", "actors", "learner", "rewards", "sync")
    texts = [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"), *(ROOT / "configs").glob("*.yaml"),
             *(p for package in packages for p in (ROOT / package).rglob("*.py"))]
    saying = [str(p.relative_to(ROOT)) for p in texts if "built on first use" in " ".join(p.read_text().split())]
    assert not saying, f"{saying} say the demo models are built on first use; relay ships them"


def test_the_readme_gives_the_demo_one_duration():
    readme = " ".join((ROOT / "README.md").read_text().split())
    make_demo = re.search(r'GRPO on "a\+b=" arithmetic \(~(\d+) min\)', readme)
    tour = re.search(r"the whole run takes about (\d+) minutes", readme)
    assert make_demo and tour, "README.md no longer states the demo's time where it did"
    assert make_demo.group(1) == tour.group(1)


CONFIG_MODULES = ["cluster/config.py", "cluster/data_config.py", "actors/config.py", "learner/config.py",
                  "rewards/config.py", "sync/config.py"]


def literal_parts(node: ast.AST) -> list[str]:
    """The literal text of a message expression: its strings, an f-string's constant parts, both sides of a `+`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [part.value for part in node.values if isinstance(part, ast.Constant)]
    if isinstance(node, ast.BinOp):
        return literal_parts(node.left) + literal_parts(node.right)
    return []


def config_checks() -> list[tuple[str, str]]:
    """(where, the longest literal part of its message) of every check the config modules make: each message a
    `_inconsistencies` rule yields, each `ValueError` a validator raises, each message a public `*_error` helper
    returns (a check that validators share, as `clear_text_token_error`)."""
    checks = []
    for path in CONFIG_MODULES:
        tree = ast.parse((ROOT / path).read_text())
        helpers = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name.endswith("_error")
                   and not f.name.startswith("_")]  # `_format_error` words pydantic's errors, not a check
        returned = [n.value for f in helpers for n in ast.walk(f) if isinstance(n, ast.Return) and n.value]
        for node in ast.walk(tree):
            if isinstance(node, ast.Yield) and node.value is not None:
                message = node.value
            elif (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args
                  and getattr(node.exc.func, "id", None) == "ValueError"):
                message = node.exc.args[0]
            elif any(node is value for value in returned):
                message = node
            else:
                continue
            parts = [" ".join(part.split()) for part in literal_parts(message)]
            if any(parts):  # `raise ValueError(problem)` re-raises a message found elsewhere
                checks.append((f"{path}:{node.lineno}", max(parts, key=len).strip()))
    return checks


def test_the_invalid_combinations_table_lists_every_check_of_the_config():
    checks = config_checks()
    assert len(checks) > 60, checks  # _inconsistencies' rules and the sections' validators were all found
    algorithms = (ROOT / "docs" / "algorithms.md").read_text()
    table = algorithms[algorithms.index("## Invalid combinations"):]
    table = " ".join(table[:table.index("\n## ")].split())
    missing = [f"{where}: {text}" for where, text in checks if text not in table]
    assert not missing, f"docs/algorithms.md, \"Invalid combinations\", lacks these checks: {missing}"

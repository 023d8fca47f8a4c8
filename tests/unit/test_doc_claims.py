"""Sentences of the docs that state what the code does, checked against the code: the critic rule, the placement of
the demo's actors, the commands the docs give for a finished run, the files the Dockerfiles cite."""

from __future__ import annotations

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
    names = {field: typing.get_args(LearnerConfig.model_fields[field].annotation) for field in ("advantage", "baseline")}
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

"""The chain_sum task's prompt source (cluster/run/data.py), its config and the per-step accuracy of the demo build.

A chained sum `12+34+56=` is answered `46 102`: each partial sum is one step.
"""

from __future__ import annotations

import pytest

from cluster.config import ConfigError, DataConfig, load_config
from cluster.demo.accuracy import step_accuracy
from cluster.demo.task import Problem
from cluster.run.data import ChainSumPrompts, make_prompt_source


def draw(source, batches: int) -> list[Problem]:
    return [problem for _ in range(batches) for problem in source.next_batch()]


def test_the_chain_source_draws_its_configured_problems():
    config = DataConfig(task="chain_sum", num_terms=4, min_operand=1, max_operand=9, prompts_per_step=5)
    problems = draw(ChainSumPrompts(config, seed=0), 4)
    assert len(problems) == 20
    for problem in problems:
        terms = [int(x) for x in problem.prompt.removesuffix("=").split("+")]
        assert len(terms) == 4 and all(1 <= t <= 9 for t in terms)
        assert problem.label == " ".join(str(sum(terms[:i])) for i in range(2, 5))


def test_the_chain_source_depends_on_seed_and_cursor_only():
    config = DataConfig(task="chain_sum", prompts_per_step=8)
    first, again, other = ChainSumPrompts(config, seed=3), ChainSumPrompts(config, seed=3), ChainSumPrompts(config, 4)
    batches = [first.next_batch() for _ in range(3)]
    assert batches == [again.next_batch() for _ in range(3)]
    assert batches[0] != batches[1]  # a new batch per cursor
    assert other.next_batch() != batches[0]  # and per seed


def test_make_prompt_source_picks_the_chain_task():
    source = make_prompt_source(DataConfig(task="chain_sum", prompts_per_step=32), seed=0, batch_size=3,
                                model_path=None, max_prompt_tokens=10)
    assert isinstance(source, ChainSumPrompts)
    batch = source.next_batch()
    assert len(batch) == 3 and all(p.prompt.count("+") == 2 and p.label.count(" ") == 1 for p in batch)


def test_num_terms_is_bounded_and_defaults_to_three():
    assert DataConfig().num_terms == 3
    assert load_config(None, ["data.task=chain_sum", "data.num_terms=8"]).data.num_terms == 8
    for bad in ("1", "9"):
        with pytest.raises(ConfigError, match="num_terms"):
            load_config(None, ["data.task=chain_sum", f"data.num_terms={bad}"])


@pytest.mark.parametrize(
    ("completions", "expected"),
    [
        (["46 102", "3 6"], 4 / 4),
        (["46 103", "3 6"], 3 / 4),  # second step of the first answer wrong
        (["45 102", "3"], 2 / 4),  # a right step after a wrong one still counts; a missing step does not
        (["46102", "3 6 9"], 2 / 4),  # no space: one wrong field; an extra step costs nothing here
        ([" 46 102", ""], 0 / 4),  # steps are read in place: a leading space shifts them
    ],
)
def test_step_accuracy_counts_steps_right_in_place(completions, expected):
    problems = [Problem(prompt="12+34+56=", label="46 102"), Problem(prompt="1+2+3=", label="3 6")]
    assert step_accuracy(problems, completions) == expected


def test_step_accuracy_of_one_step_labels_is_exact_match():
    problems = [Problem(prompt="1+2=", label="3"), Problem(prompt="5+5=", label="10")]
    assert step_accuracy(problems, ["3", "1"]) == 0.5

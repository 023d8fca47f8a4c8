"""Process supervision's driver side: steps split on the sampled token ids, the step verifier, and the scorer's
combination of step and outcome sources (in-process, with the demo's character tokenizer)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from actors.rollout_types import Rollout
from cluster.demo.task import Problem
from cluster.demo.tokenizer import build_char_tokenizer
from cluster.run.scoring import Scorer
from rewards.config import RewardConfig
from rewards.registry import load_verifier
from rewards.steps import StepSplitter, token_step_rewards
from rewards.verifiers import step_match
from sync.calls import RunError

TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id


def ids(text: str, eos: bool = True) -> list[int]:
    return TOKENIZER.encode(text) + ([EOS] if eos else [])


def test_steps_end_at_delimiter_tokens_and_at_the_last_token():
    splitter = StepSplitter(TOKENIZER, " ")
    steps = splitter.split(ids("46 102"))  # 4 6 ' ' 1 0 2 <eos>
    assert steps.ends.tolist() == [2, 6] and steps.texts == ["46", "102"]
    steps = splitter.split(ids("46 102 "))  # a trailing delimiter ends a step; the <eos> alone is an empty last one
    assert steps.ends.tolist() == [2, 6, 7] and steps.texts == ["46", "102", ""]
    steps = splitter.split(ids("46  1", eos=False))  # two delimiters in a row: an empty step between them
    assert steps.ends.tolist() == [2, 3, 4] and steps.texts == ["46", "", "1"]
    assert splitter.split(ids("7", eos=False)).ends.tolist() == [0]
    empty = splitter.split([])
    assert empty.ends.tolist() == [] and empty.texts == []
    plus = StepSplitter(TOKENIZER, "+").split(ids("1+2+3"))  # any delimiter; the <eos> joins the last step
    assert plus.ends.tolist() == [1, 3, 5] and plus.texts == ["1", "2", "3"]
    with pytest.raises(ValueError, match="non-empty"):
        StepSplitter(TOKENIZER, "")


def test_dense_rows_put_each_steps_reward_on_its_last_token():
    values, ends = token_step_rewards(np.array([2, 6]), np.array([1.0, -0.5], np.float32), 7)
    assert values.tolist() == [0, 0, 1.0, 0, 0, 0, -0.5] and ends.tolist() == [0, 0, 1, 0, 0, 0, 1]
    assert values.dtype == ends.dtype == np.float32
    with pytest.raises(ValueError, match="1 step rewards for 2 steps"):
        token_step_rewards(np.array([2, 6]), np.array([1.0]), 7)


def test_step_match_compares_each_step_with_the_labels():
    assert step_match(["46", "102"], "46 102") == [1.0, 1.0]
    assert step_match(["45", "102"], "46 102") == [0.0, 1.0]  # each step on its own
    assert step_match(["46", "102", "7"], "46 102") == [1.0, 1.0, 0.0]  # an extra step earns nothing
    assert step_match([" 46 "], ["46", "102"]) == [1.0]  # a list label; whitespace around a step ignored
    assert step_match(["1", "2"], "1;2", separator=";") == [1.0, 1.0]
    assert step_match([], "46 102") == []


def test_step_verifiers_resolve_by_level():
    assert load_verifier("step_match", steps=True)(["3"], "3") == [1.0]
    with pytest.raises(ValueError, match="is a step verifier: use it with level=steps"):
        load_verifier("step_match")
    with pytest.raises(ValueError, match="is an outcome verifier: use it with level=outcome"):
        load_verifier("exact_match", steps=True)
    with pytest.raises(ValueError, match="does not accept parameter 'tolerance'"):
        load_verifier("step_match", {"tolerance": 1}, steps=True)


def first_step_bonus(steps, label):  # a user's step verifier, by import path
    return [2.0 if j == 0 else 0.0 for j in range(len(steps))]


def scorer(sources: dict, **steps) -> Scorer:
    config = RewardConfig(sources=sources, steps={"delimiter": " ", **steps})
    scoring = Scorer(config, reward_timeout=10)
    scoring.splitter = StepSplitter(TOKENIZER, config.steps.delimiter)  # what `attach` loads from the model dir
    return scoring


def rollout(text: str) -> Rollout:
    response = ids(text)
    return Rollout([2], np.asarray(response, np.int32), np.zeros(len(response), np.float32), text, "stop", 0)


def test_scorer_combines_step_sources_per_step_and_outcome_sources_per_completion():
    scoring = scorer({"steps": {"verifier": "step_match", "level": "steps", "weight": 0.5},
                      "bonus": {"verifier": f"{__name__}:first_step_bonus", "level": "steps"},
                      "correct": {"verifier": "exact_match", "weight": 2.0}})
    problems = [Problem("12+34+56=", "46 102"), Problem("1+2+3=", "3 6")]
    groups = [[rollout("46 102"), rollout("45 101")], [rollout("3 6"), rollout("3")]]
    result = scoring.score(problems, groups)
    assert result.rewards == [[2.0, 0.0], [2.0, 0.0]]  # outcome sources only: 2 x exact_match
    got = [[(s.ends.tolist(), s.rewards.tolist()) for s in group] for group in result.steps]
    # step j: 0.5 x step_match + (2 at the first step): "46 102" -> (2.5, 0.5); "45 101" -> (2, 0); "3" -> (2.5)
    assert got == [[([2, 6], [2.5, 0.5]), ([2, 6], [2.0, 0.0])], [([1, 3], [2.5, 0.5]), ([1], [2.5])]]
    assert result.per_source["steps"] == [1.0, 0.0, 1.0, 1.0]  # each completion's mean step score
    assert result.per_source["correct"] == [1.0, 0.0, 1.0, 0.0]
    assert result.steps[0][0].rewards.dtype == np.float32


def test_scorer_without_step_sources_has_no_steps_and_refuses_to_score_steps_unattached():
    plain = Scorer(RewardConfig(), reward_timeout=10)
    assert plain.score([Problem("1+2=", "3")], [[rollout("3")]]).steps is None
    unattached = Scorer(RewardConfig(sources={"s": {"verifier": "step_match", "level": "steps"}},
                                     steps={"delimiter": " "}), reward_timeout=10)
    with pytest.raises(RuntimeError, match="attach"):
        unattached.score([Problem("1+2=", "3")], [[rollout("3")]])


def wrong_count(steps, label):
    return [1.0]


def not_finite(steps, label):
    return [math.nan] * len(steps)


@pytest.mark.parametrize("verifier, message", [
    (f"{__name__}:wrong_count", r"returned \[1.0\] for the 2 steps"),
    (f"{__name__}:not_finite", "one finite number per step"),
])
def test_a_step_verifier_that_miscounts_or_returns_nan_stops_the_run(verifier, message):
    scoring = scorer({"s": {"verifier": verifier, "level": "steps"}})
    with pytest.raises(RunError, match=message):
        scoring.score([Problem("1+2+3=", "3 6")], [[rollout("3 6")]])


def test_level_steps_needs_a_delimiter():
    with pytest.raises(ValueError, match="reward.steps.delimiter is empty"):
        RewardConfig(sources={"s": {"verifier": "step_match", "level": "steps"}})

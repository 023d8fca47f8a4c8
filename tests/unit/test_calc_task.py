"""The calc task: its problems (cluster/demo/task.py), the `Calculator` tool's rules (rewards/environments/examples.py)
and its prompt source (cluster/run/data.py).

An episode of `37*48=`: the model calls `[37*48]`, the tool answers `1776 `, the model answers `1776`.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.config import DataConfig
from cluster.demo.task import Problem, make_calc_problems
from cluster.run.data import CalcPrompts, make_prompt_source
from rewards.environments.examples import Calculator, calculate
from rewards.environments.interface import InProcessEnvironments, StepResult, load_environment

# ---------------------------------------------------------------- problems


def test_calc_problems_are_products_of_operands_in_range():
    problems = make_calc_problems(random.Random(0), 200)
    for problem in problems:
        a, b = map(int, problem.prompt.removesuffix("=").split("*"))
        assert problem.prompt == f"{a}*{b}=" and problem.label == str(a * b)
        assert 10 <= a <= 99 and 10 <= b <= 99
    operands = {int(x) for p in problems for x in p.prompt.removesuffix("=").split("*")}
    assert {10, 99} <= operands  # the bounds are drawn: inclusive


def test_calc_problems_are_deterministic_per_rng_state():
    assert make_calc_problems(random.Random(5), 50) == make_calc_problems(random.Random(5), 50)
    assert make_calc_problems(random.Random(5), 50) != make_calc_problems(random.Random(6), 50)
    assert make_calc_problems(random.Random(0), 1, min_operand=7, max_operand=7) == [Problem("7*7=", "49")]
    assert make_calc_problems(random.Random(0), 0) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": -1}, "n must be >= 0, got -1"),
        ({"n": 1, "min_operand": 50, "max_operand": 40}, r"0 <= min_operand <= max_operand, got \[50, 40\]"),
        ({"n": 1, "min_operand": -1}, r"got \[-1, 99\]"),
    ],
)
def test_calc_problems_refuse_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_calc_problems(random.Random(0), **kwargs)


# ---------------------------------------------------------------- the Calculator's rules


def calculator(label="1776", max_calls=2) -> Calculator:
    environment = Calculator(max_calls=max_calls)
    assert environment.reset("37*48=", label) == ""  # no initial observation
    return environment


def test_a_valid_call_is_answered_with_the_result_and_a_space():
    assert calculator().step("[37*48]") == StepResult("1776 ", 0.0, False, {"tool_call": True})


@pytest.mark.parametrize(
    ("action", "observation"),
    [
        ("[37*48]", "1776 "),
        ("[ 37 * 48 ]", "1776 "),  # spaces around the operands and the operator
        ("[5+7]", "12 "),
        ("[5-7]", "-2 "),
        ("[-3*-4]", "12 "),
        ("[3--4]", "7 "),
        ("[0*123456789012345678]", "0 "),  # 18 digits: still a number
        ("12[3*4]", "12 "),  # text before the call is ignored
        ("[1*2][3*4]", "12 "),  # the last `[` counts
        ("[3*4]5", "12 "),  # nothing follows the `]` of a stopped turn; if it does, it is ignored
    ],
)
def test_valid_calls(action, observation):
    result = calculator().step(action)
    assert (result.observation, result.reward, result.done, result.info) == (observation, 0.0, False,
                                                                              {"tool_call": True})


@pytest.mark.parametrize(
    "action",
    [
        "[37*48",  # no `]`: generation was cut off
        "[37/48]",  # not an operator of the tool
        "[37*48*2]",  # two operations
        "[37]",
        "[]",
        "[a*b]",
        "[3.5*2]",
        "[1234567890123456789*2]",  # 19 digits
        "[1*2]+[3*4",  # the last call is not closed: the `]` of an earlier one does not count
    ],
)
def test_invalid_calls_are_answered_with_error_and_the_episode_goes_on(action):
    assert calculator().step(action) == StepResult("error ", 0.0, False, {"invalid_call": True})


def test_calculate_reads_the_text_after_the_bracket():
    assert calculate("37*48]") == 1776
    assert calculate("37*48") is None  # not closed
    assert calculate("37*48] and more") == 1776
    assert calculate("9" * 5000 + "*2]") is None  # no ValueError from int() on huge numbers


def test_the_final_answer_is_scored_by_exact_match_after_stripping():
    assert calculator().step("1776") == StepResult("", 1.0, True, {})
    assert calculator().step(" 1776\n") == StepResult("", 1.0, True, {})
    assert calculator().step("1777") == StepResult("", 0.0, True, {})
    assert calculator().step("17 76").reward == 0.0
    assert calculator().step("").reward == 0.0
    assert calculator(label=1776).step("1776").reward == 1.0  # a numeric label is compared as its text


def test_a_full_episode_call_then_answer():
    environment = calculator()
    assert environment.step("[37*48]").observation == "1776 "
    assert environment.step("1776") == StepResult("", 1.0, True, {})


def test_the_call_after_max_calls_ends_the_episode_with_no_reward():
    environment = calculator(max_calls=2)
    assert environment.step("[37*48]").info == {"tool_call": True}
    assert environment.step("[37/48]").info == {"invalid_call": True}  # an invalid call counts too
    assert environment.step("[37*48]") == StepResult("", 0.0, True, {"too_many_calls": True})
    no_calls = calculator(max_calls=0)
    assert no_calls.step("[37*48]") == StepResult("", 0.0, True, {"too_many_calls": True})


def test_reset_starts_a_new_episode():
    environment = calculator(max_calls=1)
    environment.step("[37*48]")
    assert environment.reset("2*3=", "6") == ""
    assert environment.step("[2*3]").observation == "6 "  # the call count starts again
    assert environment.step("6").reward == 1.0  # and the label is the new one


def test_max_calls_must_not_be_negative():
    with pytest.raises(ValueError, match="max_calls must be at least 0"):
        Calculator(max_calls=-1)


def test_calculator_runs_in_episode_sessions_by_its_spec():
    factory = load_environment("rewards.environments.examples:Calculator", {"max_calls": 1})

    async def episode():
        with InProcessEnvironments(factory) as environments:
            session = environments.open()
            assert await session.reset("37*48=", "1776") == ""
            steps = [await session.step("[37*48]"), await session.step("1776")]
            await session.close()
            return steps

    call, answer = asyncio.run(episode())
    assert (call.observation, call.done, answer.reward, answer.done) == ("1776 ", False, 1.0, True)
    with pytest.raises(ValueError, match="does not accept parameter 'max_turns'"):
        load_environment("rewards.environments.examples:Calculator", {"max_turns": 2})


# ---------------------------------------------------------------- the prompt source


def draw(source, batches: int) -> list[Problem]:
    return [problem for _ in range(batches) for problem in source.next_batch()]


def test_the_calc_source_draws_its_configured_problems():
    config = DataConfig(task="calc", min_operand=10, max_operand=12, prompts_per_step=5)
    problems = draw(CalcPrompts(config, seed=0), 4)
    assert len(problems) == 20
    for problem in problems:
        a, b = map(int, problem.prompt.removesuffix("=").split("*"))
        assert 10 <= a <= 12 and 10 <= b <= 12 and problem.label == str(a * b)


def test_the_calc_source_depends_on_seed_and_cursor_only():
    config = DataConfig(task="calc", min_operand=10, prompts_per_step=8)
    first, again, other = CalcPrompts(config, seed=3), CalcPrompts(config, seed=3), CalcPrompts(config, seed=4)
    batches = [first.next_batch() for _ in range(3)]
    assert batches == [again.next_batch() for _ in range(3)]
    assert batches[0] != batches[1]  # a new batch per cursor
    assert other.next_batch() != batches[0]  # and per seed
    # The same stream as the other demo tasks: batch k is drawn from the seeded rng of (seed, k).
    assert batches[1] == make_calc_problems(random.Random("relay-data:3:1"), 8, 10, 99)


def test_make_prompt_source_picks_the_calc_task():
    config = DataConfig(task="calc", min_operand=10, max_operand=99, prompts_per_step=32)
    source = make_prompt_source(config, seed=0, batch_size=3, model_path=None, max_prompt_tokens=10)
    assert type(source) is CalcPrompts
    batch = source.next_batch()
    assert len(batch) == 3 and all(p.prompt.count("*") == 1 and p.prompt.endswith("=") for p in batch)

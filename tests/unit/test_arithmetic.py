"""The arithmetic task: exact-match reward and the problem generator."""

import random

import pytest

from cluster.demo.task import Problem, exact_match, make_problems


@pytest.mark.parametrize(
    ("completion", "label", "expected"),
    [
        ("82", "82", 1.0),
        ("0", "0", 1.0),
        ("198", "198", 1.0),
        ("83", "82", 0.0),  # wrong digit
        ("8", "82", 0.0),  # prefix of the answer
        ("820", "82", 0.0),  # answer followed by more digits
        ("82 ", "82", 0.0),  # trailing space is not stripped
        (" 82", "82", 0.0),  # nor leading space
        ("82\n", "82", 0.0),
        ("082", "82", 0.0),  # leading zero
        ("", "82", 0.0),  # empty completion
        ("", "", 1.0),
    ],
)
def test_exact_match(completion: str, label: str, expected: float) -> None:
    assert exact_match(completion, label) == expected


def test_make_problems_is_deterministic_per_seed() -> None:
    first = make_problems(random.Random(7), 50)
    second = make_problems(random.Random(7), 50)
    other = make_problems(random.Random(8), 50)
    assert first == second
    assert first != other


def test_make_problems_format_and_labels() -> None:
    problems = make_problems(random.Random(0), 200)
    assert len(problems) == 200
    for problem in problems:
        assert isinstance(problem, Problem)
        a, rest = problem.prompt.split("+")
        b = rest.removesuffix("=")
        assert problem.prompt == f"{int(a)}+{int(b)}="  # no leading zeros, ends with "="
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        assert problem.label == str(int(a) + int(b))


def test_make_problems_respects_operand_range() -> None:
    problems = make_problems(random.Random(1), 300, min_operand=10, max_operand=12)
    operands = {int(x) for p in problems for x in p.prompt.removesuffix("=").split("+")}
    assert operands == {10, 11, 12}  # both ends reached, nothing outside


def test_make_problems_hand_checked_example() -> None:
    assert make_problems(random.Random(0), 0) == []
    (problem,) = make_problems(random.Random(0), 1, min_operand=5, max_operand=5)
    assert problem == Problem(prompt="5+5=", label="10")


def test_make_problems_rejects_bad_range() -> None:
    with pytest.raises(ValueError, match="min_operand"):
        make_problems(random.Random(0), 1, min_operand=9, max_operand=3)
    with pytest.raises(ValueError, match="n must be"):
        make_problems(random.Random(0), -1)


def test_problem_is_frozen() -> None:
    problem = Problem(prompt="1+1=", label="2")
    with pytest.raises(AttributeError):
        problem.label = "3"  # type: ignore[misc]

"""The demo tasks: exact-match reward and the problem generators (arithmetic `a+b=`, chained sums `a+b+c=`)."""

import random

import pytest

from cluster.demo.task import Problem, exact_match, make_chain_problems, make_problems


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


# --- chained sums ---------------------------------------------------------------------------------------------------


def test_make_chain_problems_hand_checked_example() -> None:
    assert make_chain_problems(random.Random(0), 0) == []
    (problem,) = make_chain_problems(random.Random(0), 1, num_terms=3, min_operand=7, max_operand=7)
    assert problem == Problem(prompt="7+7+7=", label="14 21")  # 7+7 = 14, 14+7 = 21


@pytest.mark.parametrize("num_terms", [2, 3, 5, 8])
def test_make_chain_problems_format_and_labels(num_terms: int) -> None:
    problems = make_chain_problems(random.Random(0), 200, num_terms=num_terms)
    assert len(problems) == 200
    for problem in problems:
        terms = [int(x) for x in problem.prompt.removesuffix("=").split("+")]
        assert problem.prompt == "+".join(map(str, terms)) + "="  # no leading zeros, no spaces, ends with "="
        assert len(terms) == num_terms and all(0 <= t <= 99 for t in terms)
        steps = problem.label.split(" ")
        assert problem.label == " ".join(steps) and "" not in steps  # single spaces, none leading or trailing
        assert [int(s) for s in steps] == [sum(terms[:i]) for i in range(2, num_terms + 1)]  # the partial sums
        assert steps == [str(int(s)) for s in steps]


def test_make_chain_problems_respects_operand_range() -> None:
    problems = make_chain_problems(random.Random(1), 300, num_terms=4, min_operand=10, max_operand=12)
    operands = {int(x) for p in problems for x in p.prompt.removesuffix("=").split("+")}
    assert operands == {10, 11, 12}  # both ends reached, nothing outside


def test_make_chain_problems_is_deterministic_per_seed() -> None:
    first = make_chain_problems(random.Random(7), 50)
    assert first == make_chain_problems(random.Random(7), 50)
    assert first != make_chain_problems(random.Random(8), 50)


def test_two_term_chains_are_the_arithmetic_problems() -> None:
    assert make_chain_problems(random.Random(3), 100, num_terms=2) == make_problems(random.Random(3), 100)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": -1}, "n must be >= 0, got -1"),
        ({"num_terms": 1}, "num_terms must be >= 2"),
        ({"min_operand": 9, "max_operand": 3}, r"min_operand <= max_operand, got \[9, 3\]"),
        ({"min_operand": -1}, "0 <= min_operand"),
    ],
)
def test_make_chain_problems_rejects_bad_args(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        make_chain_problems(random.Random(0), **{"n": 1} | kwargs)
    assert "\n" not in str(error.value)

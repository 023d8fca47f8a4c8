"""The tasks of the built-in demo: ``37+45=`` (arithmetic), ``12+34+56=`` (chained sums) and ``37*48=`` (calc, a
product best answered with a calculator tool), scored by exact match.

Owns `Problem` (a prompt and its label, the unit every prompt source yields) and the three problem generators. A
chained sum is answered with its partial sums separated by single spaces (``46 102``), each partial sum one step
for process supervision; its label is that whole string, so ``exact_match`` scores the whole answer. A calc
problem's label is the product; its episodes (a tool call ``[37*48]``, the tool's answer, the final answer) are
`rewards.environments.examples.Calculator`'s and `cluster.demo.model`'s business. Does not
own the reward (``exact_match`` lives in `rewards/verifiers.py`; re-exported here, the task's reward), tokenisation,
sampling or batching; pure Python, no torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from rewards.verifiers import exact_match

__all__ = ["Problem", "exact_match", "make_calc_problems", "make_chain_problems", "make_problems"]


@dataclass(frozen=True)
class Problem:
    """One prompt and the exact completion that earns reward 1.0."""

    prompt: str  # e.g. "37+45=" (for a dataset: the text after the chat template, as the engine receives it)
    # "82" here; a dataset's label field may hold any JSON value (number, list, object), or None without one.
    label: Any
    # The prompt's token ids when the driver already tokenised it (a dataset, to filter by length): the engines then
    # get these and do not tokenise the text again. Not compared: the text says the same.
    prompt_ids: Any = field(default=None, compare=False, repr=False)


def make_problems(rng: random.Random, n: int, min_operand: int = 0, max_operand: int = 99) -> list[Problem]:
    """Draws ``n`` addition problems ``a+b=`` with ``a, b`` uniform in ``[min_operand, max_operand]`` (a chain of two
    terms: its one partial sum is the answer).

    Deterministic given the state of ``rng``; duplicates are possible.
    """
    return make_chain_problems(rng, n, 2, min_operand, max_operand)


def make_chain_problems(
    rng: random.Random, n: int, num_terms: int = 3, min_operand: int = 0, max_operand: int = 99
) -> list[Problem]:
    """Draws ``n`` chained sums ``x1+x2+...+xk=`` (k = ``num_terms``, each uniform in ``[min_operand, max_operand]``).

    The label lists the partial sums ``x1+x2``, ``x1+x2+x3``, ... up to the total, separated by single spaces:
    ``12+34+56=`` -> ``46 102`` (k - 1 steps). With ``num_terms=2`` the problems are exactly `make_problems`'s.
    Deterministic given the state of ``rng``; duplicates are possible.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if num_terms < 2:
        raise ValueError(f"num_terms must be >= 2 (a chain needs at least one sum), got {num_terms}")
    _check_operands(min_operand, max_operand)
    problems = []
    for _ in range(n):
        terms = [rng.randint(min_operand, max_operand) for _ in range(num_terms)]
        partial_sums = [sum(terms[: i + 1]) for i in range(1, num_terms)]
        prompt = "+".join(map(str, terms)) + "="
        problems.append(Problem(prompt=prompt, label=" ".join(map(str, partial_sums))))
    return problems


def make_calc_problems(rng: random.Random, n: int, min_operand: int = 10, max_operand: int = 99) -> list[Problem]:
    """Draws ``n`` products ``a*b=`` with ``a, b`` uniform in ``[min_operand, max_operand]``, labelled ``str(a*b)``:
    ``37*48=`` -> ``1776``.

    Two-digit operands by default: too hard for the demo's tiny model to multiply, easy to hand to a calculator.
    Deterministic given the state of ``rng``; duplicates are possible.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    _check_operands(min_operand, max_operand)
    problems = []
    for _ in range(n):
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        problems.append(Problem(prompt=f"{a}*{b}=", label=str(a * b)))
    return problems


def _check_operands(min_operand: int, max_operand: int) -> None:
    if not 0 <= min_operand <= max_operand:
        raise ValueError(
            f"operand range must satisfy 0 <= min_operand <= max_operand, got [{min_operand}, {max_operand}]"
        )

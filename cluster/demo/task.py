"""The arithmetic task of the built-in demo: problems like ``37+45=``, scored by exact match.

Owns `Problem` (a prompt and its label, the unit every prompt source yields) and the problem generator. Does not
own the reward (``exact_match`` lives in `rewards/verifiers.py`; re-exported here, the task's reward), tokenisation,
sampling or batching; pure Python, no torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from rewards.verifiers import exact_match

__all__ = ["Problem", "exact_match", "make_problems"]


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
    """Draws ``n`` addition problems ``a+b=`` with ``a, b`` uniform in ``[min_operand, max_operand]``.

    Deterministic given the state of ``rng``; duplicates are possible.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(
            f"operand range must satisfy 0 <= min_operand <= max_operand, got [{min_operand}, {max_operand}]"
        )
    problems = []
    for _ in range(n):
        a = rng.randint(min_operand, max_operand)
        b = rng.randint(min_operand, max_operand)
        problems.append(Problem(prompt=f"{a}+{b}=", label=str(a + b)))
    return problems


"""The arithmetic task of the built-in demo: problems like ``37+45=`` and their exact-match reward.

Owns the problem generator and the reward. Does not own tokenisation, sampling or batching; pure Python so
that verifiers and tests import it without torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One prompt and the exact completion that earns reward 1.0."""

    prompt: str  # e.g. "37+45="
    label: str  # e.g. "82"


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


def exact_match(completion: str, label: str) -> float:
    """1.0 iff the completion is exactly the label, else 0.0.

    No stripping: the completion already stops before end-of-sequence, so trailing text or whitespace is an error.
    """
    return 1.0 if completion == label else 0.0

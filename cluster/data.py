"""Prompt sources for the driver: seeded, resumable iterators of (prompt, label) problems.

Owns: which problems step k trains on. A batch depends only on (seed, cursor), so a resumed run draws exactly the
batches an uninterrupted one would. Does not own: tokenization (the engines do it) or rewards (rewards/).
"""

from __future__ import annotations

import random

from cluster.config import DataConfig
from rewards.arithmetic import Problem, make_problems


class ArithmeticPrompts:
    """`a+b=` problems, `prompts_per_step` per batch."""

    def __init__(self, config: DataConfig, seed: int):
        self.config = config
        self.seed = seed
        self.cursor = 0  # batches drawn so far

    def next_batch(self) -> list[Problem]:
        rng = random.Random(f"relay-data:{self.seed}:{self.cursor}")
        self.cursor += 1
        return make_problems(rng, self.config.prompts_per_step, self.config.min_operand, self.config.max_operand)


def sampling_seeds(seed: int, step: int, n: int, round_: int = 0) -> list[int]:
    """One sampling seed per prompt of a step's generation round, independent of how prompts are split across
    workers (rounds > 0 happen with dynamic sampling)."""
    rng = random.Random(f"relay-sample:{seed}:{step}" + (f":{round_}" if round_ else ""))
    return [rng.getrandbits(31) for _ in range(n)]

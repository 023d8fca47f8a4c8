"""A small deterministic environment, for tests, the docs and trying `relay env serve`.

Owns: `GuessNumber`. Does not own: anything the loop or a service needs (rewards/environments/interface.py).
"""

from __future__ import annotations

import re
from typing import Any

from rewards.environments.interface import StepResult

_INTEGER = re.compile(r"-?\d+")


class GuessNumber:
    """Guess the label, an integer: each turn the action's last integer is a guess, and the observation says
    `higher`, `lower` or `correct`.

    A correct guess earns reward 1.0 and ends the episode; after `max_turns` guesses it ends with reward 0.0. An
    action without an integer is an invalid call: observation `no number`, `info={"invalid_call": True}`, and it
    uses up its turn. The initial observation is empty.
    """

    def __init__(self, max_turns: int = 4):
        if max_turns < 1:
            raise ValueError(f"GuessNumber: max_turns must be at least 1 (got {max_turns})")
        self.max_turns = max_turns
        self.target = 0
        self.turn = 0

    def reset(self, prompt: str, label: Any) -> str:
        self.target = int(label)
        self.turn = 0
        return ""

    def step(self, action: str) -> StepResult:
        self.turn += 1
        last_turn = self.turn >= self.max_turns
        numbers = _INTEGER.findall(action)
        if not numbers:
            return StepResult("no number", done=last_turn, info={"invalid_call": True})
        guess = int(numbers[-1])
        if guess == self.target:
            return StepResult("correct", reward=1.0, done=True)
        return StepResult("higher" if guess < self.target else "lower", done=last_turn)

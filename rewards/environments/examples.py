"""Small deterministic environments, for tests, the docs, trying `relay env serve`, and the calc demo task.

Owns: `GuessNumber` and `Calculator` (the tool of the calc task, cluster/demo/task.py) with its `calculate`. Does
not own: anything the loop or a service needs (rewards/environments/interface.py).
"""

from __future__ import annotations

import re
from typing import Any

from rewards.environments.interface import StepResult

_INTEGER = re.compile(r"-?\d+")
_CALCULATION = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")  # integer op integer: "37*48", " -3 - -4 "
_OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_MAX_OPERAND_DIGITS = 18  # longer operands are invalid: Python refuses int("9" * 5000), and no answer needs them


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


class Calculator:
    """A calculator tool for the calc task (`37*48=` -> `1776`): the model calls it or answers.

    Each action is one of:
    - A tool call, if it contains `[`: the text after its last `[` up to the next `]` must be an integer, an
      operator `+`, `-` or `*`, and an integer (spaces allowed), e.g. `[37*48]`. A valid call is answered with
      the result and one space (observation `1776 `, `info={"tool_call": True}`), an invalid one (no `]`, as when
      generation was cut off; anything else inside; an operand over 18 digits) with `error ` and
      `info={"invalid_call": True}`; both earn 0.0 and the episode goes on. Call number `max_calls + 1`, valid or
      not, ends the episode instead: reward 0.0, no observation, `info={"too_many_calls": True}`.
    - Otherwise the final answer: reward 1.0 if its text, stripped of surrounding whitespace, equals the label
      (`str(label)`), else 0.0; the episode ends.
    The initial observation is empty. Deterministic, no I/O.
    """

    def __init__(self, max_calls: int = 2):
        if max_calls < 0:
            raise ValueError(f"Calculator: max_calls must be at least 0 (got {max_calls})")
        self.max_calls = max_calls
        self.label = ""
        self.calls = 0

    def reset(self, prompt: str, label: Any) -> str:
        self.label = str(label)
        self.calls = 0
        return ""

    def step(self, action: str) -> StepResult:
        if "[" not in action:
            return StepResult("", reward=float(action.strip() == self.label), done=True)
        self.calls += 1
        if self.calls > self.max_calls:
            return StepResult("", done=True, info={"too_many_calls": True})
        result = calculate(action[action.rindex("[") + 1 :])
        if result is None:
            return StepResult("error ", info={"invalid_call": True})
        return StepResult(f"{result} ", info={"tool_call": True})


def calculate(call: str) -> int | None:
    """The value of a closed call's text after `[`, e.g. `37*48]` -> 1776; None if it is not `integer op integer]`."""
    expression, closed, _ = call.partition("]")
    match = _CALCULATION.match(expression) if closed else None
    if match is None:
        return None
    a, operator, b = match.groups()
    if max(len(a.lstrip("-")), len(b.lstrip("-"))) > _MAX_OPERAND_DIGITS:
        return None
    return _OPERATIONS[operator](int(a), int(b))

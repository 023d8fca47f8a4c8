"""Environments the tests run episodes against (importable as `tests.envs:Class`, in the tests' processes and in
Ray workers alike: the suite puts the repository root on PYTHONPATH)."""

from __future__ import annotations

from typing import Any

from rewards.environments.interface import StepResult


class Counter:
    """Answers turn t (from 0) with the observation `"{t}{t} "` and reward t + 1 (digits: in the character
    vocabulary); done after `turns` steps. With `fail_at` >= 0, `step` raises on that turn; with `invalid_at`, that
    turn's info says `invalid_call`; with `fail_below`, `reset` raises for an integer label below it. The initial
    observation is `start`."""

    def __init__(self, turns: int = 3, fail_at: int = -1, invalid_at: int = -1, start: str = "",
                 fail_below: int | None = None):
        self.turns, self.fail_at, self.invalid_at, self.start = turns, fail_at, invalid_at, start
        self.fail_below = fail_below
        self.turn = 0
        self.actions: list[str] = []

    def reset(self, prompt: str, label: Any) -> str:
        if self.fail_below is not None and int(label) < self.fail_below:
            raise RuntimeError(f"Counter refuses label {label}")
        self.turn = 0
        return self.start

    def step(self, action: str) -> StepResult:
        turn, self.turn = self.turn, self.turn + 1
        if turn == self.fail_at:
            raise RuntimeError(f"Counter fails at turn {turn}")
        return StepResult(f"{turn}{turn} ", reward=float(turn + 1), done=self.turn >= self.turns,
                          info={"invalid_call": True} if turn == self.invalid_at else {})


async def play_episode(environments: Any, prompt: str, label: Any, actions: list[str]) -> list:
    """[initial observation, StepResult, ...] of one episode on `environments` (any `Environments`), stopping at
    done; the session is closed."""
    session = environments.open()
    try:
        out = [await session.reset(prompt, label)]
        for action in actions:
            out.append(await session.step(action))
            if out[-1].done:
                break
        return out
    finally:
        await session.close()

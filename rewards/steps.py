"""Process supervision's steps: where a response's steps end, found on its token ids, and each step's text.

Owns: `StepSplitter`, which splits a sampled response into steps at the tokens whose text holds the delimiter
(`reward.steps.delimiter`), so a step's reward lands on a token the model sampled (never on a re-tokenised text),
and decodes each step's text for the verifiers. Does not own: scoring the steps (the step verifiers in
`rewards/verifiers.py`, remote services, process reward models), combining them (cluster/run/scoring.py) or turning
them into advantages (`learner.algo.advantages.process_group_relative`). Needs only a tokenizer's `decode`.

The rule, on token ids: a token whose text (decoded alone, special tokens skipped) holds the delimiter ends a step;
the response's last token ends the last step (so every token belongs to exactly one step, and a response of n >= 1
tokens has at least one step). A step's text is its tokens decoded together, without the delimiter at its end.
A token that holds the delimiter and more (a BPE token like ".\\n") ends its step with all of its text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Steps:
    """One response's steps: `ends[j]` is the response index of step j's last token, `texts[j]` its text."""

    ends: np.ndarray  # [S] int64, increasing; the last is len(response) - 1
    texts: list[str]  # [S]


class StepSplitter:
    """Splits responses into steps with the policy's tokenizer (whose ids the engines sample)."""

    def __init__(self, tokenizer: Any, delimiter: str):
        if not delimiter:
            raise ValueError("the step delimiter must be a non-empty string (reward.steps.delimiter)")
        self.tokenizer = tokenizer
        self.delimiter = delimiter
        self._ends_step: dict[int, bool] = {}  # token id -> its text holds the delimiter (filled as ids are seen)

    def split(self, response_ids: Sequence[int]) -> Steps:
        """The steps of one response; an empty response has none."""
        ids = [int(i) for i in response_ids]
        if not ids:
            return Steps(np.zeros(0, np.int64), [])
        ends = [t for t, token in enumerate(ids[:-1]) if self._holds_delimiter(token)] + [len(ids) - 1]
        starts = [0] + [end + 1 for end in ends[:-1]]
        texts = [self._strip(self.tokenizer.decode(ids[start:end + 1], skip_special_tokens=True))
                 for start, end in zip(starts, ends)]
        return Steps(np.asarray(ends, np.int64), texts)

    def _holds_delimiter(self, token: int) -> bool:
        holds = self._ends_step.get(token)
        if holds is None:
            holds = self.delimiter in self.tokenizer.decode([token], skip_special_tokens=True)
            self._ends_step[token] = holds
        return holds

    def _strip(self, text: str) -> str:
        """The step's text without the delimiter (repeated) at its end."""
        while text.endswith(self.delimiter):
            text = text[:-len(self.delimiter)]
        return text


def token_step_rewards(ends: np.ndarray, rewards: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Dense per-token rows for the learner from one response's step ends and step rewards: (each step's reward at
    its last token, 0 elsewhere; 1 at step ends, 0 elsewhere), both [length] float32."""
    if len(rewards) != len(ends):
        raise ValueError(f"{len(rewards)} step rewards for {len(ends)} steps")
    values, marks = np.zeros(length, np.float32), np.zeros(length, np.float32)
    values[ends] = np.asarray(rewards, np.float32)
    marks[ends] = 1.0
    return values, marks

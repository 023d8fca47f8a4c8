"""OpenEnv-native environments for the interop tests: subclasses of openenv-core's `Environment`, with its
`Action` / `Observation` types, served by openenv-core's own `create_app` (never our copy of its protocol).

`Calculator` is relay's calculator tool (rewards/environments/examples.py) as OpenEnv serves it: actions carry the
model's text in `message`, observations the answer in `text` (and relay's `info`), as DESIGN.md's OpenEnv mapping
says. The other classes each show one thing the client must handle: other field names and null rewards, an
environment that raises, a slow step, sessions counted while they are open.
"""

from __future__ import annotations

import threading
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from rewards.environments import examples


class TextAction(Action):
    message: str
    """The model's text of one turn."""


class TextObservation(Observation):
    text: str = ""
    """The text appended to the episode."""
    info: dict[str, Any] = {}
    """relay's `StepResult.info` (e.g. `invalid_call`)."""


class Calculator(Environment[TextAction, TextObservation, State]):
    """relay's `Calculator(max_calls)` behind OpenEnv's interface: `reset` takes the episode's `prompt` and `label`
    as keyword arguments (OpenEnv passes the reset data's keys that `reset` names). Every reset's (prompt, label) is
    kept in `resets` (the class's, shared by all sessions of the process)."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    resets: list[tuple[str, Any]] = []

    def __init__(self, max_calls: int = 2):
        super().__init__()
        self._calculator = examples.Calculator(max_calls)
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, prompt: str = "", label: Any = None,
              **kwargs: Any) -> TextObservation:
        type(self).resets.append((prompt, label))
        self._state = State(episode_id=episode_id, step_count=0)
        return TextObservation(text=self._calculator.reset(prompt, label))

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        result = self._calculator.step(action.message)
        self._state.step_count += 1
        return TextObservation(text=result.observation, reward=result.reward, done=result.done, info=result.info)

    @property
    def state(self) -> State:
        return self._state


class ShellAction(Action):
    command: str


class ShellObservation(Observation):
    output: str = ""
    exit_code: int = 0


class Shell(Environment[ShellAction, ShellObservation, State]):
    """Other field names (`command` in, `output` out) and OpenEnv's default null reward: answers each command with
    `ran: <command>`, no reward; the command `exit` earns 1.0 and ends the episode; `boom` raises (the environment's
    error); `slow` first waits until the test sets `release` (30 s at most). `opened` counts the instances alive
    (made and not yet closed), `most` the largest count seen, `steps` every command received."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    lock = threading.Lock()
    opened = most = 0
    steps: list[str] = []
    release = threading.Event()

    def __init__(self):
        super().__init__()
        with Shell.lock:
            Shell.opened += 1
            Shell.most = max(Shell.most, Shell.opened)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> ShellObservation:
        return ShellObservation(output="$ ")

    def step(self, action: ShellAction, timeout_s: float | None = None, **kwargs: Any) -> ShellObservation:
        Shell.steps.append(action.command)
        if action.command == "boom":
            raise RuntimeError("boom: no such command\nsecond line")
        if action.command == "slow":
            Shell.release.wait(30)
        if action.command == "exit":
            return ShellObservation(output="bye", reward=1.0, done=True)
        return ShellObservation(output=f"ran: {action.command}")

    @property
    def state(self) -> State:
        return State()

    def close(self) -> None:
        with Shell.lock:
            Shell.opened -= 1

    @classmethod
    def forget(cls) -> None:
        with cls.lock:
            cls.opened = cls.most = 0
            cls.steps = []
            cls.release = threading.Event()

"""A run's start-up: the phases it passes before its first step, timed from the `relay train` process's start, each
actor's state while the fleet starts (from the marks its process makes: sync/startup.py), the console's start-up line
from the first second, and the `time/startup/*` keys of the run's first record.

Owns: the phases' names and order (`PHASES`), timing them (`Startup.begin`), the console's line (a live line on a
terminal, one plain line per change in a log; nothing with `--quiet`), the first record's `time/startup/*` keys
(`Startup.stamp`: docs/operations.md), and naming the log file of each actor that did not start (`Startup.logs`).
Reads the actors' marks (`read_marks`, `clear_marks`). Does not own: making the marks (sync/startup.py),
starting the actors (cluster/fleet/placement.py), or the steps' display (cluster/run/metrics.py).
"""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any

from rich.console import Console

from sync.startup import LABELS, NAMESPACE, STATES, marks_key

if TYPE_CHECKING:
    from cluster.config import RunConfig

# In the order a run passes them: the process's imports (to `run_training`), the input checks, Ray's start, the run's
# directory, metrics and registry, the actors' start, the sync probe's calibration (noise floor), the first step.
PHASES = ("imports", "checks", "ray", "registry", "actors", "probe", "first_step")
POLL_S = 0.5  # how often the actors' marks are read while they start


class Startup:
    """Times the phases of one run's start and shows them (`show`); `origin` is when the process started (epoch
    seconds; None: the phases start at the first `begin`, as for a run started inside another program)."""

    def __init__(self, origin: float | None = None, show: bool = True, console: Console | None = None):
        self.origin = origin
        self.began: dict[str, float] = {}  # phase -> when it began (epoch seconds)
        self.marks: dict[str, dict[str, Any]] = {}  # actor name -> its marks (sync/startup.py)
        self.console = console or Console(stderr=True)
        self.show = show
        self.stamped = False
        self._job: str | None = None
        self.expected: list[str] = []  # the actors the fleet's start names (`begin`)
        self._shown = ""
        self._status: Any = None
        self.control: Any = None  # the run's mailbox (`attach`): `relay status` shows start-up from it
        self._published: tuple = ()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    def begin(self, phase: str, actors: list[str] | None = None) -> None:
        """`phase` (one of `PHASES`) begins now; the one before it ends. `actors` reads the actors' marks until the
        next phase (the console shows each of `actors`, the names the fleet gives them, as starting until its first
        mark); `first_step` ends the console's line (the steps' display follows)."""
        if self.origin is not None and not self.began:
            self.began["imports"] = self.origin
        if self.phase == "actors":
            self._read()  # the marks as the actors' phase ends
        if phase == "actors":
            import ray

            self._job = ray.get_runtime_context().get_job_id()
            clear_marks(self._job)  # marks of an earlier fleet of this driver are not this one's
            self.expected = list(actors or [])
        self.began[phase] = time.time()
        if self.show or self.control is not None:  # the clock and the actors' states, every POLL_S
            self._start_polling()
        self._refresh()
        self._publish()
        if phase == "first_step":
            self.close()

    def attach(self, control: Any) -> None:
        """From now until the first step, publish start-up's `state` to the run's mailbox (a `RunHandle`:
        cluster/fleet/control.py) whenever it changes, with `--quiet` too: `relay status` shows it."""
        self.control = control
        self._start_polling()
        self._publish()

    def state(self) -> dict[str, Any]:
        """What `relay status` shows during start-up: the phase, the seconds since start-up began, and each actor's
        state (`LABELS`: starting, importing, loading the model, warming up, ready)."""
        since = next(iter(self.began.values()), time.time())
        return {"phase": (self.phase or "imports").replace("_", " "), "seconds": round(time.time() - since, 1),
                "actors": {name: LABELS[state_of(self.marks.get(name, {}))] for name in self._names()}}

    def stamp(self, record: dict[str, Any]) -> dict[str, Any]:
        """`record` with the `time/startup/*` keys if it is the run's first, else as it is."""
        if self.stamped or not self.began:
            return record
        self.stamped = True
        self.close()
        return {**record, **self.metrics(time.time())}

    def metrics(self, now: float) -> dict[str, float]:
        """Seconds per phase (`time/startup/<phase>`), in all (`total`, to `now`), the slowest engine's load and
        warm-up (`engine`), and per actor: its process's start (`process`, from the `actors` phase's start), Ray's
        worker start in it (`boot`), its imports (`imports`), its model's load (`load`) and warm-up (`warm_up`)."""
        phases = [p for p in PHASES if p in self.began]
        ends = [self.began[p] for p in phases[1:]] + [now]
        out = {f"time/startup/{p}": end - self.began[p] for p, end in zip(phases, ends)}
        out["time/startup/total"] = now - self.began[phases[0]]
        submitted = self.began.get("actors", now)
        engines = []
        for name, marks in sorted(self.marks.items()):
            key = "time/startup/" + name.replace("'", "").replace(" ", "_")
            steps = [("process", submitted, marks.get("started")),
                     ("boot", marks.get("started"), marks.get("importing")),
                     ("imports", marks.get("importing"), marks.get("loading")),
                     ("load", marks.get("loading"), marks.get("warming", marks.get("ready"))),
                     ("warm_up", marks.get("warming"), marks.get("ready"))]
            out.update({f"{key}/{part}": max(0.0, end - start) for part, start, end in steps
                        if start is not None and end is not None})
            if name.startswith("rollout") and "loading" in marks and "ready" in marks:
                engines.append(marks["ready"] - marks["loading"])
        if engines:
            out["time/startup/engine"] = max(engines)
        return out

    def logs(self, error: BaseException) -> str:
        """`; NAME's log: PATH` for the actors that did not start, to add to the error's one line: the ones `error`
        names, else (Ray names no actor whose constructor raised) the ones whose log holds the error's last words (logs
        on this node), else every one not ready; empty when none marked a log."""
        if self._job is not None:
            self._read()
        message = str(error)
        waiting = {n: m for n, m in self.marks.items() if "ready" not in m and m.get("log")}
        named = {n: m for n, m in waiting.items() if n in message}
        if not named and "raised " in message:
            cause = message.rsplit("raised ", 1)[1].split(";")[0].strip()[-60:]
            named = {n: m for n, m in waiting.items() if cause and cause in _tail(m["log"])}
        return "".join(f"; {name}'s log: {marks['log']}" for name, marks in sorted((named or waiting).items()))

    def close(self) -> None:
        """Stop reading marks and end the console's line."""
        self._stop_polling()
        if self._status is not None:
            self._status.stop()
            self._status = None

    @property
    def phase(self) -> str | None:
        """The phase start-up is in (None before the first)."""
        return next(reversed(self.began), None)

    def line(self) -> str:
        """`start-up 12 s: actors  learner ready, rollout worker 0 warming up`: the phase and each actor's state."""
        state = self.state()
        actors = ", ".join(f"{name} {label}" for name, label in state["actors"].items())
        return f"start-up {state['seconds']:.0f} s: {state['phase']}" + (f"  {actors}" if actors else "")

    def _names(self) -> list[str]:
        return self.expected + sorted(set(self.marks) - set(self.expected))

    def _start_polling(self) -> None:
        if self._poller is None:
            self._poller = threading.Thread(target=self._poll, name="relay-startup", daemon=True)
            self._poller.start()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            if self.phase == "actors":
                self._read()
            self._refresh()
            self._publish()

    def _publish(self) -> None:
        """The mailbox gets `state` when the phase or an actor's state changed, or a second passed (fire and forget:
        start-up does not wait for it)."""
        if self.control is None or self.phase == "first_step":
            return
        state = self.state()
        seen = (state["phase"], tuple(state["actors"].items()), int(state["seconds"]))
        if seen != self._published:
            self._published = seen
            try:
                self.control.publish({"startup": state})
            except Exception:  # noqa: BLE001 (Ray shutting down under it: `relay status` only misses a change)
                pass

    def _read(self) -> None:
        if self._job is None:
            return
        try:
            self.marks = read_marks(self._job)
        except Exception:  # noqa: BLE001 (Ray shutting down under the reader: the display only misses a change)
            pass

    def _stop_polling(self) -> None:
        if self._poller is not None:
            self._stop.set()
            self._poller.join()
            self._poller = None

    def _refresh(self) -> None:
        if not self.show:
            return
        line = self.line()
        if self.console.is_terminal:
            if self._status is None:
                self._status = self.console.status(line)
                self._status.start()
            self._status.update(line)
            return
        # A log gets a line per change of phase or state (not per second), from Ray's start on: a config error found
        # by the checks before stays the one line on stderr.
        changed = line.split(": ", 1)[1]
        if changed != self._shown and set(self.began) - {"imports", "checks"}:
            self._shown = changed
            self.console.print(f"relay: {line}", soft_wrap=True, highlight=False)


def fleet_actors(config: RunConfig) -> list[str]:
    """The names a fleet's start gives its actors (cluster/fleet/placement.py), in the order the console lists them."""
    from rewards.config import ModelSource

    ranks = config.learner.num_ranks
    return ((["learner"] if ranks == 1 else [f"learner rank {rank}" for rank in range(ranks)])
            + (["reference"] if config.uses_reference else []) + (["teacher"] if config.uses_teacher else [])
            + [f"reward model '{name}'" for name, s in config.reward.sources.items() if isinstance(s, ModelSource)]
            + [f"rollout worker {i}" for i in range(config.rollout.num_workers)])


def _tail(path: str, size: int = 1 << 16) -> str:
    """The last `size` bytes of a log file, as text; empty when it is not on this node."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, 2) - size))
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def state_of(marks: dict[str, Any]) -> str:
    """An actor's latest state of `STATES` by its marks."""
    return next((state for state in reversed(STATES) if state in marks), "started")


def read_marks(job_id: str) -> dict[str, dict[str, object]]:
    """Every actor's marks of the driver's job `job_id`, by actor name (only the actors that marked something)."""
    from ray.experimental import internal_kv

    prefix = marks_key(job_id, "")
    found = {}
    for key in internal_kv._internal_kv_list(prefix, namespace=NAMESPACE):
        value = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        if value is not None:
            found[key.decode()[len(prefix):]] = json.loads(value)
    return found


def clear_marks(job_id: str) -> None:
    """Forget the marks of `job_id` (the next fleet the same driver starts marks afresh)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(marks_key(job_id, ""), del_by_prefix=True, namespace=NAMESPACE)

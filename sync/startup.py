"""Start-up marks: when each actor process of a run reached each state of its start (its process started and began
importing, began loading its model, began warming up, was ready), kept where the driver reads them while the actors
start (the console shows them) and once they are up (the first record's `time/startup/*` keys).

Owns: the states' names (`STATES`), the environment variable that names an actor to its own process (`ENV`, set by
the driver in the actor's runtime environment: cluster/fleet/placement.py), writing an actor's marks (`mark`; Ray's
worker setup hook `process_started` writes the first) to Ray's internal key-value store under the driver's job
(`marks_key`). Here, in `sync/`, because both `actors/` and `learner/` mark. It imports no Ray: `mark` uses the Ray a
process already has, so the learner stays importable where Ray is not installed (bench/gpu_learner.py). Does not
own: reading, showing or recording the marks (cluster/run/startup.py). Without Ray, or without `ENV` (an actor built
in a test), `mark` does nothing.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

ENV = "RELAY_STARTUP"  # the actor's name ("learner", "rollout worker 0"), in its process's environment
NAMESPACE = "relay_startup"
# In the order an actor passes them; "started" is its process's start (the first mark, with `process_started`).
STATES = ("started", "importing", "loading", "warming", "ready")
LABELS = {"started": "starting", "importing": "importing", "loading": "loading the model", "warming": "warming up",
          "ready": "ready"}

_marks: dict[str, object] = {}  # this process's marks, written whole at every mark


def mark(state: str) -> None:
    """Note that this actor process reached `state` (one of `STATES`) now, if the driver named it (`ENV`) and the
    process runs in Ray."""
    name = os.environ.get(ENV)
    ray = sys.modules.get("ray")  # an actor's process has imported Ray before its class
    if not name or state in _marks or ray is None or not ray.is_initialized():
        return
    internal_kv = importlib.import_module("ray.experimental.internal_kv")
    if not _marks:
        _marks.update(process_facts())
    _marks[state] = time.time()
    internal_kv._internal_kv_put(marks_key(ray.get_runtime_context().get_job_id(), name), json.dumps(_marks),
                                 overwrite=True, namespace=NAMESPACE)


def process_started() -> None:
    """Ray's `worker_process_setup_hook` for a run's actors: runs in the new worker process before the actor's class
    is imported, so the time from here to `loading` is the actor's imports."""
    mark("importing")


def process_facts() -> dict[str, object]:
    """This process's start (`started`, epoch seconds), pid, node and log file (where Ray sends its stderr), for the
    driver to show and to name in an error."""
    facts: dict[str, object] = {"pid": os.getpid(), "node": os.uname().nodename, "started": process_start_time()}
    try:
        facts["log"] = os.readlink("/proc/self/fd/2")
    except OSError:
        pass
    return facts


def process_start_time(pid: int | None = None) -> float:
    """When process `pid` (this one by default) started, in epoch seconds, from /proc; where there is none (not
    Linux), now."""
    pid = pid or os.getpid()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: starttime, in clock ticks
    except (OSError, IndexError, StopIteration, ValueError):
        return time.time()


def marks_key(job_id: str, name: str) -> str:
    """Where the marks of actor `name` of the driver's job `job_id` are kept (`NAMESPACE`); name "" for the prefix."""
    return f"{job_id}/{name}"

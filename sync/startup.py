"""Start-up marks: when each actor process of a run reached each state of its start (its process started and began
importing, began loading its model, began warming up, was ready), kept where the driver reads them while the actors
start (the console shows them) and once they are up (the first record's `time/startup/*` keys).

Owns: the states' names (`STATES`), the environment variable that names an actor to its own process (`ENV`, set by
the driver in the actor's runtime environment: cluster/fleet/placement.py), writing an actor's marks (`mark`; Ray's
worker setup hook `process_started` writes the first) to Ray's internal key-value store under the driver's job, and
reading them back (`read_marks`, `clear_marks`). Here, in `sync/`, because it is the lowest layer that calls Ray
(as `calls` is) and both `actors/` and `learner/` mark. Does not own: showing or recording the marks
(cluster/run/startup.py). Without Ray, or without `ENV` (an actor built in a test), `mark` does nothing.
"""

from __future__ import annotations

import json
import os
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
    """Note that this actor process reached `state` (one of `STATES`) now, if the driver named it (`ENV`)."""
    name = os.environ.get(ENV)
    if not name or state in _marks:
        return
    import ray

    if not ray.is_initialized():
        return
    from ray.experimental import internal_kv

    if not _marks:
        _marks.update(process_facts())
    _marks[state] = time.time()
    internal_kv._internal_kv_put(_key(ray.get_runtime_context().get_job_id(), name), json.dumps(_marks),
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
    """When process `pid` (this one by default) started, in epoch seconds: from /proc (Linux), else psutil's."""
    pid = pid or os.getpid()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: starttime, in clock ticks
    except (OSError, IndexError, StopIteration, ValueError):
        import psutil

        return psutil.Process(pid).create_time()


def read_marks(job_id: str) -> dict[str, dict[str, object]]:
    """Every actor's marks of the driver's job `job_id`, by actor name (only the actors that marked something)."""
    from ray.experimental import internal_kv

    prefix = _key(job_id, "")
    found = {}
    for key in internal_kv._internal_kv_list(prefix, namespace=NAMESPACE):
        value = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        if value is not None:
            found[key.decode()[len(prefix):]] = json.loads(value)
    return found


def clear_marks(job_id: str) -> None:
    """Forget the marks of `job_id` (the next fleet the same driver starts marks afresh)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(_key(job_id, ""), del_by_prefix=True, namespace=NAMESPACE)


def _key(job_id: str, name: str) -> str:
    return f"{job_id}/{name}"

"""Reaching a running run from outside: every run's mailbox in one registry actor per cluster, and the `relay scale` /
`relay status` client.

Owns: `RunControl`, a run's mailbox (the driver publishes the fleet after every step: the workers serving and those
on their way in; `relay scale` leaves a request that the driver takes at the start of the next step), the cluster's
`RunRegistry` holding every going run's mailbox by name (the run_dir's name), which a run's driver joins
(`start_control`) and leaves when it ends, and the client functions that find a run on a cluster and talk to it.
Requests are checked here, against the fleet the driver last published, so a bad request fails in the user's
terminal, not in the run.
`ScaleRequests` is the driver's end: it asks for the next request while a step's record is published (the answer is
there when the next step starts) and applies it between steps through the rollout pool.
Does not own: resizing and admitting workers (`RolloutWorkers.resize` and `admit`, cluster/fleet/workers.py).
"""

from __future__ import annotations

import time
from typing import Any

from sync.calls import get, time_left

NAMESPACE = "relay"
# The registry's name carries its interface's version: a cluster that outlives an upgrade gets a second registry
# rather than calls the old one does not know.
REGISTRY = "relay/runs-v1"
MAX_WORKERS = 4096


class ControlError(ValueError):
    """A request the run cannot take, or no run to talk to; the message is one line."""


class RunControl:
    """The run's mailbox. A plain class: the driver makes it a named actor (`start_control`)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.fleet: dict[str, Any] = {}  # what the driver published last
        self.request: dict[str, Any] | None = None  # {"num_workers": int, "remove": [ids]}
        self.requests = 0

    def publish(self, fleet: dict[str, Any]) -> None:
        """The driver's view after a step: step, weights version, workers [{id, node_id}], workers_pending [{id,
        state, seconds}] (placing or starting), learner node, ..."""
        self.fleet = fleet

    def request_scale(self, num_workers: int | None = None, remove: list[int] | None = None) -> dict[str, Any]:
        """Ask for `num_workers` rollout workers, serving or on their way in (and/or the removal of the workers with
        ids `remove`, serving or pending); the run applies it at its next step. Returns what the fleet will be. A
        later request replaces an earlier one not yet applied."""
        current = [w["id"] for w in [*self.fleet.get("workers", []), *self.fleet.get("workers_pending", [])]]
        remove = sorted(set(remove or []))
        unknown = [i for i in remove if i not in current]
        if unknown:
            raise ControlError(f"no rollout worker with id {unknown[0]}; the run's workers are {current}")
        if num_workers is None:
            num_workers = len(current) - len(remove)
        if not 1 <= num_workers <= MAX_WORKERS:
            raise ControlError(f"--rollout-workers must be between 1 and {MAX_WORKERS}, got {num_workers}")
        serving = [w["id"] for w in self.fleet.get("workers", [])]
        if serving and set(serving) <= set(remove):
            raise ControlError(f"removing every serving rollout worker ({serving}) leaves none to generate until new "
                               "ones start; keep at least one")
        self.request = {"num_workers": num_workers, "remove": remove}
        self.requests += 1
        return {"run_dir": self.run_dir, "workers_now": len(current), **self.request}

    def take_request(self) -> dict[str, Any] | None:
        """The pending request, if any (the driver applies it before the next step)."""
        request, self.request = self.request, None
        return request

    def status(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "pending": self.request, **self.fleet}


class NameTaken(ControlError):
    """Another run of this name is going (`RunRegistry.join`)."""


class RunRegistry:
    """The going runs' mailboxes by run name. A plain class: `registry()` makes it the cluster's detached actor.

    One registry, not an actor per run: a Ray actor is a worker process of its own, whose start costs a run its share
    of the cores (docs/benchmarks.md); the registry starts once per cluster and stays (detached, no CPU). A run whose
    driver died without leaving it (killed) is noticed by its token, an object the driver owns: Ray fails it once its
    owner is gone."""

    LIVENESS_TIMEOUT = 2.0  # s: a token not fetched by then counts as alive (its owner answers when it is)

    def __init__(self) -> None:
        self.runs: dict[str, tuple[RunControl, Any]] = {}  # name -> (mailbox, its driver's token)

    def join(self, name: str, run_dir: str, token: list) -> None:
        """Register run `name`, alive while the object `token[0]` (owned by its driver) is; refused while another
        live run has that name."""
        if name in self.runs and self._alive(name):
            raise NameTaken(f"a run named '{name}' is already going on this Ray cluster; give this run another "
                            "run_dir name")
        self.runs[name] = RunControl(run_dir), token[0]

    def leave(self, name: str, token: list) -> None:
        """Unregister run `name` if `token` is still the one it joined with (not a later run's of the same name)."""
        if name in self.runs and self.runs[name][1] == token[0]:
            del self.runs[name]

    def names(self) -> list[str]:
        """The going runs, dropping those whose driver is gone."""
        return sorted(name for name in list(self.runs) if self._alive(name))

    def call(self, name: str, method: str, *args: Any) -> Any:
        """`RunControl.<method>(*args)` on run `name`'s mailbox."""
        if name not in self.runs or not self._alive(name):
            raise ControlError(f"no relay run named '{name}' on this cluster; running: "
                               f"{', '.join(self.names()) or 'none'}")
        return getattr(self.runs[name][0], method)(*args)

    def _alive(self, name: str) -> bool:
        import ray
        from ray.exceptions import GetTimeoutError, ObjectLostError

        try:
            ray.get(self.runs[name][1], timeout=self.LIVENESS_TIMEOUT)
        except ObjectLostError:  # its owner, the run's driver, is gone (OwnerDiedError)
            del self.runs[name]
            return False
        except GetTimeoutError:
            pass
        return True


class RunHandle:
    """One run's mailbox in the registry; each method sends the call and returns its ObjectRef."""

    def __init__(self, registry: Any, name: str, token: Any = None):
        self.registry, self.name, self.token = registry, name, token

    def publish(self, fleet: dict[str, Any]) -> Any:
        return self.registry.call.remote(self.name, "publish", fleet)

    def take_request(self) -> Any:
        return self.registry.call.remote(self.name, "take_request")

    def request_scale(self, num_workers: int | None = None, remove: list[int] | None = None) -> Any:
        return self.registry.call.remote(self.name, "request_scale", num_workers, remove)

    def status(self) -> Any:
        return self.registry.call.remote(self.name, "status")

    def leave(self, timeout: float = 10) -> None:
        """Unregister the run this driver joined (`start_control`); waited for, within `timeout`, so that a next run
        of the same name finds the name free."""
        from sync.calls import wait_all

        wait_all([self.registry.leave.remote(self.name, [self.token])], timeout, "control")


def run_name(run_dir: str) -> str:
    from pathlib import Path

    return Path(run_dir).resolve().name


def registry() -> Any:
    """The cluster's run registry, started by the first run that asks (detached, no CPU of its own)."""
    import ray

    return ray.remote(RunRegistry).options(name=REGISTRY, namespace=NAMESPACE, lifetime="detached",
                                           get_if_exists=True, num_cpus=0).remote()


JOIN_TIMEOUT = 120.0  # s: the registry's first start on a cluster is a worker process's start
# s: how long a run whose name is taken tries again. A driver killed a moment ago (resume=auto after a crash) looks
# alive until Ray has noticed its owner gone (docs/operations.md).
NAME_GRACE = 5.0


def start_control(run_dir: str) -> RunHandle:
    """Join the registry as run `run_name(run_dir)`, alive while this driver is; refused (RunError) while another run
    of that name is going (after `NAME_GRACE`)."""
    import time

    import ray

    from sync.calls import RunError, wait_all

    name, token = run_name(run_dir), ray.put(run_dir)
    handle = RunHandle(registry(), name, token)
    deadline = time.monotonic() + NAME_GRACE
    while True:
        [outcome] = wait_all([handle.registry.join.remote(name, run_dir, [token])], JOIN_TIMEOUT, "control")
        if outcome.ok:
            return handle
        if outcome.kind == "late":
            raise RunError(f"the cluster's relay run registry did not answer within {JOIN_TIMEOUT:g} s")
        if not outcome.cause.startswith(f"{NameTaken.__name__}: ") or time.monotonic() > deadline:
            raise RunError(outcome.cause.removeprefix(f"{NameTaken.__name__}: "))
        time.sleep(0.25)


def connect(address: str) -> None:
    """Join the Ray cluster at `address` (`auto`, host:port of the GCS, or ray://host:10001) as a client."""
    import ray

    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING",
                 configure_logging=True)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise ControlError(f"cannot reach a Ray cluster at --address {address}: {str(err).splitlines()[0]}") \
            from None


def find_run(run: str | None, timeout: float = 30) -> RunHandle:
    """The mailbox of run `run` (its run_dir name), or of the only run on the cluster when `run` is None."""
    import ray

    try:
        reg = ray.get_actor(REGISTRY, namespace=NAMESPACE)
    except ValueError:  # no run ever started on this cluster
        reg, runs = None, []
    else:
        runs = call(reg.names.remote(), timeout=timeout)
    if run is None:
        if len(runs) != 1:
            raise ControlError("no relay run is going on this cluster" if not runs else
                               f"{len(runs)} relay runs are going on this cluster ({', '.join(runs)}); "
                               "name one with --run")
        run = runs[0]
    if run not in runs:
        raise ControlError(f"no relay run named '{run}' on this cluster; running: {', '.join(runs) or 'none'}")
    return RunHandle(reg, run)


def call(ref: Any, timeout: float = 30) -> Any:
    """The result of a registry call (`RunHandle`'s methods give their ObjectRef) within a deadline (sync/calls.py);
    a refused request, or a run that does not answer, becomes ControlError (one line)."""
    from sync.calls import wait_all

    [outcome] = wait_all([ref], timeout, "control")
    if outcome.kind == "late":
        raise ControlError(f"the run did not answer within {timeout:g} s")
    if not outcome.ok:
        raise ControlError(outcome.cause.removeprefix(f"{ControlError.__name__}: "))
    return outcome.value


class ScaleRequests:
    """`relay scale` and `relay status` for one run; a no-op without a mailbox (`control` None: `relay eval`)."""

    def __init__(self, config: Any, control: Any, rollouts: Any, placement: Any):
        self.config = config
        self.control = control  # the run's mailbox in the cluster's registry (a RunHandle), if any
        self.rollouts = rollouts
        self.asked: tuple[Any, float] | None = None  # the pending ask for a request: (ref, when asked)
        from cluster.fleet.placement import node_of  # not in the registry's process

        # The learner's placement group is fixed for the run: ask Ray for its node once, not in every step.
        self.learner_node = node_of(placement) if control is not None else None

    def apply(self) -> None:
        """Between steps: apply what `relay scale` asked since the last step (removals at once, new workers placed in
        the background), and let in the new workers whose engines are up."""
        if self.control is None:
            return
        asked, since = self.asked or (self.control.take_request(), time.monotonic())
        self.asked = None
        [request] = get([asked], time_left(self.config.timeouts.sync, since), ["run control"], "sync")
        if request is not None:
            self.rollouts.resize(request["num_workers"], request["remove"])
        self.rollouts.admit()

    def publish(self, record: dict[str, Any], weights_version: int) -> None:
        """Tell the run's mailbox what the fleet is after this step (`relay status` shows it)."""
        if self.control is None:
            return
        self.control.publish({  # fire and forget: the step does not wait for it
            "step": record["step"], "weights_version": weights_version, "learner_node": self.learner_node,
            "reward_mean": record.get("reward/mean"), "time_step": record.get("time/step"),
            **self.rollouts.status()})
        # Ask for the next request now: the answer is there when the next step starts; a request made after this is
        # taken one step later.
        self.asked = self.control.take_request(), time.monotonic()

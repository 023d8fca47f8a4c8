"""Reaching a running run from outside: a named Ray actor per run, and the `relay scale` / `relay status` client.

Owns: `RunControl`, the run's mailbox (the driver publishes the fleet after every step: the workers serving and those
on their way in; `relay scale` leaves a request that the driver takes at the start of the next step), its name
(`relay/<run_dir name>` in Ray namespace `relay`), starting it as a named actor (`start_control`), and the client
functions that find a run on a cluster and talk to it. Requests are checked here, against the fleet the driver last
published, so a bad request fails in the user's terminal, not in the run.
Does not own: applying a request (`Scaling.resize` and `admit`, cluster/fleet/scaling.py, called by the
driver between steps).
"""

from __future__ import annotations

from typing import Any

NAMESPACE = "relay"
PREFIX = "relay/"
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


def control_name(run_dir: str) -> str:
    from pathlib import Path

    return PREFIX + Path(run_dir).resolve().name


def start_control(run_dir: str) -> Any:
    """The run's named control actor (no CPU of its own; it dies with the driver)."""
    import ray

    from sync.calls import RunError

    name = control_name(run_dir)
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise RunError(f"a run named '{name}' is already going on this Ray cluster; give this run another "
                           "run_dir name")
    return ray.remote(RunControl).options(name=name, namespace=NAMESPACE, num_cpus=0).remote(run_dir)


def connect(address: str) -> None:
    """Join the Ray cluster at `address` (`auto`, host:port of the GCS, or ray://host:10001) as a client."""
    import ray

    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING",
                 configure_logging=True)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise ControlError(f"cannot reach a Ray cluster at --address {address}: {str(err).splitlines()[0]}") \
            from None


def find_run(run: str | None) -> Any:
    """The control actor of run `run` (its run_dir name), or of the only run on the cluster when `run` is None."""
    import ray

    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a.get("namespace") == NAMESPACE and a["name"].startswith(PREFIX))
    runs = [name[len(PREFIX):] for name in names]
    if run is None:
        if len(runs) != 1:
            raise ControlError("no relay run is going on this cluster" if not runs else
                               f"{len(runs)} relay runs are going on this cluster ({', '.join(runs)}); "
                               "name one with --run")
        run = runs[0]
    if run not in runs:
        raise ControlError(f"no relay run named '{run}' on this cluster; running: {', '.join(runs) or 'none'}")
    return ray.get_actor(PREFIX + run, namespace=NAMESPACE)


def call(method: Any, *args: Any, timeout: float = 30) -> Any:
    """Call a control method with a deadline (sync/calls.py); a refused request, or a run that does not answer,
    becomes ControlError (one line)."""
    from sync.calls import wait_all

    [outcome] = wait_all([method.remote(*args)], timeout, "control")
    if outcome.kind == "late":
        raise ControlError(f"the run did not answer within {timeout:g} s")
    if not outcome.ok:
        raise ControlError(outcome.cause.removeprefix(f"{ControlError.__name__}: "))
    return outcome.value

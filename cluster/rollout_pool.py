"""The rollout fleet as the driver sees it: generation split over the workers, verified weight sync, and replacing
workers that die or hang.

Owns: splitting prompts into contiguous chunks (one per worker), the deadline on every worker call, putting the
learner's weights in the object store once and loading them into every engine, the probe check that each engine
serves exactly the learner's weights, and recovery: a worker that dies or misses its deadline is killed, started
again in its placement-group bundle, given the current weights (checked by the probe) and handed its chunk again,
so no prompt is lost; past `rollout.max_restarts` replacements the run stops naming the worker and the cause.
Does not own: what a step does with the rollouts (cluster/driver.py) or placement (cluster/remote.py).
"""

from __future__ import annotations

import time
from typing import Any

import ray

from cluster.config import RunConfig
from cluster.remote import Fleet, RunError, get
from cluster.transport import collect, make_transport


class SyncError(RunError):
    """An engine does not serve the learner's weights after a sync."""


class RolloutPool:
    """Calls the fleet's rollout workers; `restarts` and `recovery_seconds` count the replacements."""

    def __init__(self, config: RunConfig, fleet: Fleet):
        self.config = config
        self.fleet = fleet
        self.weights_version = 0  # what every worker serves
        self.restarts = 0
        self.recovery_seconds = 0.0
        self.transport = make_transport(self)

    @property
    def workers(self) -> list[Any]:
        return self.fleet.rollout_workers

    def generate(self, prompts: list[str], seeds: list[int], sampling: Any) -> list[list[Any]]:
        """[prompts][G] rollouts in prompt order, each prompt sampled with its own seed (so a re-dispatched chunk
        gives the same completions). Chunks of failed workers are re-dispatched to their replacements."""
        bounds = [round(i * len(prompts) / len(self.workers)) for i in range(len(self.workers) + 1)]
        pending = {i: (bounds[i], bounds[i + 1]) for i in range(len(self.workers)) if bounds[i + 1] > bounds[i]}
        results: dict[int, list[list[Any]]] = {}
        while pending:
            refs = {i: self.workers[i].generate.remote(prompts[a:b], seeds[a:b], sampling)
                    for i, (a, b) in pending.items()}
            done, failed = collect(refs, self.config.timeouts.generate, "generate")
            results.update(done)
            for i, cause in failed.items():
                self.replace(i, cause)
            pending = {i: pending[i] for i in failed}
        groups = [group for i in sorted(results) for group in results[i]]
        stale = {r.weights_version for g in groups for r in g} - {self.weights_version}
        if stale:
            raise SyncError(f"rollouts came from weights version {sorted(stale)} but the learner is at "
                            f"{self.weights_version}: a worker missed a sync")
        return groups

    def sync(self, version: int) -> float:
        """Load the learner's weights (version `version`) into every worker and verify them; returns the probe's
        largest gap (NaN without the probe)."""
        self.weights_version = version
        failed = self._load(list(range(len(self.workers))))
        for i, cause in failed.items():
            self.replace(i, cause)  # the replacement is loaded and probed on its own
        return self.verify() if self.config.sync.probe else float("nan")

    def verify(self, indices: list[int] | None = None) -> float:
        """Compare engines' logprobs of a seeded probe sample with the learner's; return the largest gap."""
        cfg = self.config
        indices = list(range(len(self.workers))) if indices is None else indices
        names = [self.fleet.rollout_names[i] for i in indices]
        probes = get([self.workers[i].probe.remote(cfg.sync.probe_prompt, cfg.sync.probe_tokens,
                                                   cfg.rollout.temperature, self.weights_version) for i in indices],
                     cfg.timeouts.sync, names, "sync")
        learner_lps = get([self.fleet.learner.compute_logprobs.remote([p[0] for p in probes], [p[1] for p in probes])],
                          cfg.timeouts.sync, ["learner"], "sync")[0]
        worst = 0.0
        for name, (_, _, engine_lps, version), ours in zip(names, probes, learner_lps):
            gap = max((abs(a - b) for a, b in zip(engine_lps, ours)), default=0.0)
            if not gap <= cfg.sync.probe_tolerance:
                raise SyncError(
                    f"weight sync check failed: {name} (version {version}) gives probe logprobs that differ from the "
                    f"learner's by {gap:.3g} > sync.probe_tolerance={cfg.sync.probe_tolerance:g}; the engine is not "
                    "serving the learner's weights")
            worst = max(worst, gap)
        return worst

    def replace(self, index: int, cause: str) -> None:
        """Kill worker `index`, start a new one in its bundle, load the current weights and probe them."""
        name = self.fleet.rollout_names[index]
        limit = self.config.rollout.max_restarts
        if self.restarts >= limit:
            raise RunError(f"{name} {cause}, and {self.restarts} rollout workers were already replaced "
                           f"(rollout.max_restarts={limit}); the engines keep failing, check the Ray logs")
        started = time.perf_counter()
        self.restarts += 1
        ray.kill(self.workers[index], no_restart=True)
        self.workers[index] = self.fleet.start_rollout_worker(index)
        self.transport.fleet_changed()
        get([self.workers[index].__ray_ready__.remote()], self.config.timeouts.start, [name], "start")
        failed = self._load([index])
        if failed:
            raise RunError(f"{name} was replaced after it {cause}, but its replacement {failed[index]} while loading "
                           "the weights")
        if self.config.sync.probe:
            self.verify([index])
        self.recovery_seconds += time.perf_counter() - started

    def _load(self, indices: list[int]) -> dict[int, str]:
        """Load the learner's current weights into the given workers through the configured transport; returns
        {index: cause} of the workers that died or missed the deadline."""
        done, failed = self.transport.load(indices)
        for i, version in done.items():
            if version != self.weights_version:
                raise SyncError(f"{self.fleet.rollout_names[i]} serves weights version {version}, expected "
                                f"{self.weights_version}")
        return failed

"""Scoring one generation round with every reward source of the run, and combining them into one reward.

Owns: loading each source (`rule` verifiers by name or import path, `remote` verifier clients, `model` reward-model
actors started by `cluster/fleet/placement.py`), scoring every completion with every source (reward models and remote
services run concurrently with the in-process rules), per-source means and failure counts for the metrics, batch
normalisation of reward-model scores, and the weighted sum. Samples a remote source could not score under
`on_failure=drop` mark their whole group as dropped. Does not own: the verifiers (`rewards/`), the HTTP protocol
(`rewards/remote.py`), the model (`actors/reward_model.py`), or what the driver does with dropped groups.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from rewards.config import ModelSource, RemoteSource, RewardConfig, RuleSource
from sync.calls import RunError, get


@dataclass
class RoundScores:
    """Rewards of one round's completions, grouped like the rollouts: [prompts][G]."""

    rewards: list[list[float]]  # combined reward per completion (meaningless where the group is dropped)
    dropped: list[bool]  # [prompts] the group lost a sample to a remote failure under on_failure=drop
    per_source: dict[str, list[float]] = field(default_factory=dict)  # name -> scores of the kept samples
    metrics: dict[str, float] = field(default_factory=dict)  # verifier/* counters of this round


class Scorer:
    """Scores rounds of completions with every source in `reward.sources` and combines them by weight."""

    def __init__(self, config: RewardConfig, reward_timeout: float):
        """Loads the rule verifiers and configures the remote clients; raises ValueError (one line, naming the
        source) on a bad verifier name, import path, parameter or token variable. Reward-model actors are attached
        later (`reward_models`), once the fleet has started them."""
        from rewards.remote import RemoteVerifier
        from rewards.verifiers import load_verifier

        self.config = config
        self.reward_models: dict[str, Any] = {}  # name -> RewardModelWorker actor handle
        self.reward_timeout = reward_timeout
        self.rules: dict[str, Any] = {}
        self.remotes: dict[str, Any] = {}
        for name, source in config.sources.items():
            try:
                if isinstance(source, RuleSource):
                    self.rules[name] = load_verifier(source.verifier, source.params)
                elif isinstance(source, RemoteSource):
                    self.remotes[name] = RemoteVerifier(name, source)
            except ValueError as err:
                self.close()
                raise ValueError(f"reward.sources.{name}: {err}") from None

    def close(self) -> None:
        for client in self.remotes.values():
            client.close()

    def score(self, problems: list[Any], groups: list[list[Any]]) -> RoundScores:
        """Every source scores every completion; returns combined rewards, dropped groups and metrics."""
        from rewards.remote import RemoteVerifierError, VerifierSample

        flat = [(i, problem, rollout) for i, (problem, group) in enumerate(zip(problems, groups)) for rollout in group]
        prompts = [problem.prompt for _, problem, _ in flat]
        completions = [rollout.text for _, _, rollout in flat]
        # Reward models first: they run in their actors while the driver does the rules and the HTTP calls.
        pending = {name: self.reward_models[name].score.remote(prompts, completions) for name in self.reward_models}
        scores: dict[str, list[float | None]] = {}
        metrics = {"verifier/failures": 0.0, "verifier/retries": 0.0}
        samples = [VerifierSample(id=str(k), prompt=p.prompt, completion=r.text, label=p.label)
                   for k, (_, p, r) in enumerate(flat)] if self.remotes else []  # one list for every remote source
        for name, client in self.remotes.items():
            try:
                result = client.score(samples)
            except RemoteVerifierError as err:  # on_failure=fail: the run stops with the client's one-line reason
                raise RunError(str(err)) from err
            scores[name] = result.rewards
            metrics["verifier/failures"] += result.metrics["failures"]
            metrics["verifier/retries"] += result.metrics["retries"]
            metrics[f"verifier/{name}/latency_mean_s"] = result.metrics["latency_mean_s"]
            metrics[f"verifier/{name}/latency_max_s"] = result.metrics["latency_max_s"]
        for name, verifier in self.rules.items():
            scores[name] = [self._rule(name, verifier, p, r) for _, p, r in flat]
        for name, ref in pending.items():
            (values,) = get([ref], self.reward_timeout, [f"reward model '{name}'"], "reward")
            if not all(math.isfinite(v) for v in values):
                raise RunError(f"reward model '{name}' returned a non-finite score; check the model at "
                               f"{self.config.sources[name].path}")
            scores[name] = self._normalised(self.config.sources[name], values)

        dropped = [False] * len(groups)
        for values in scores.values():
            for (i, _, _), value in zip(flat, values):
                dropped[i] |= value is None
        combined = [sum(self.config.sources[name].weight * values[k] for name, values in scores.items())
                    if not dropped[i] else math.nan for k, (i, _, _) in enumerate(flat)]
        size = len(groups[0]) if groups else 0
        per_source = {name: [v for (i, _, _), v in zip(flat, values) if not dropped[i]] for name, values in scores.items()}
        metrics["verifier/dropped_groups"] = float(sum(dropped))
        return RoundScores([combined[g * size:(g + 1) * size] for g in range(len(groups))], dropped, per_source, metrics)

    def _rule(self, name: str, verifier: Any, problem: Any, rollout: Any) -> float:
        """One rule score; a verifier that raises or returns a non-number stops the run (never a silent 0)."""
        try:
            value = float(verifier(rollout.text, problem.label))
        except Exception as err:
            raise RunError(f"reward source '{name}' ({self.config.sources[name].verifier}) failed on prompt "
                           f"{problem.prompt[:80]!r}: {err!r}") from err
        if not math.isfinite(value):
            raise RunError(f"reward source '{name}' returned {value} for prompt {problem.prompt[:80]!r}; a reward "
                           "must be a finite number")
        return value

    @staticmethod
    def _normalised(source: ModelSource, values: list[float]) -> list[float]:
        if source.normalize == "none" or len(values) < 2:
            return values
        mean, std = statistics.fmean(values), statistics.stdev(values)
        return [(v - mean) / (std + 1e-6) for v in values]

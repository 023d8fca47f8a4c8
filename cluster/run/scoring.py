"""Scoring one generation round with every reward source of the run, and combining them into one reward.

Owns: loading each source (`rule` verifiers, `remote` verifier clients, `model` reward-model actors), scoring every
completion with every source (reward models and remote services concurrently with the in-process rules), per-source
means and failure counts, batch normalisation of reward-model scores, and the weighted sum; process supervision's
steps (split on token ids by `rewards.steps.StepSplitter`, each scored by every step source); an environment's turn
rewards (`env.weight`, `env.turn_rewards`) and failures (`env.on_failure`); marking a group dropped when a sample of it
could not be scored under `on_failure=drop`; and OpenRLHF sources' queries (prompt and response token ids decoded
together with their special tokens); iterative GRPO's reward models fine-tuned in the run on its completions
(`RewardFitting`: their examples per step, fitting them at `train.every`, their checkpoints).
Does not own: the verifiers (`rewards/`), the HTTP protocols (`rewards/remote.py`), the models
(`actors/reward_model.py`, `actors/process_reward_model.py`), or what the driver does with dropped groups.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rewards.config import EnvironmentConfig, ModelSource, RemoteSource, RewardConfig, RuleSource
from sync.calls import RunError, get

if TYPE_CHECKING:
    from cluster.config import RunConfig
    from cluster.fleet.placement import Fleet


@dataclass(frozen=True)
class ScoredSteps:
    """One completion's steps and their combined reward (process supervision)."""

    ends: np.ndarray  # [S] response index of each step's last token
    rewards: np.ndarray  # [S] float32: the weighted sum of the step sources' rewards of each step


@dataclass
class RoundScores:
    """Rewards of one round's completions, grouped like the rollouts: [prompts][G]."""

    rewards: list[list[float]]  # combined outcome reward per completion (meaningless where the group is dropped)
    dropped: list[bool]  # [prompts] the group lost a sample to a remote failure under on_failure=drop
    per_source: dict[str, list[float]] = field(default_factory=dict)  # name -> scores of the kept samples
    metrics: dict[str, float] = field(default_factory=dict)  # verifier/* counters of this round
    steps: list[list[ScoredSteps]] | None = None  # [prompts][G] with sources of level steps, else None
    # Reward models fine-tuned during the run (`train`): name -> (prompts, completions, targets) of this round's
    # samples in whole groups (dropped groups left out), the targets from the source's `train.label_source`.
    fit: dict[str, tuple[list[str], list[str], list[float]]] = field(default_factory=dict)


class Scorer:
    """Scores rounds of completions with every source in `reward.sources` and combines them by weight."""

    def __init__(self, config: RewardConfig, reward_timeout: float, env: EnvironmentConfig | None = None):
        """Loads the rule verifiers and configures the remote clients; raises ValueError (one line, naming the
        source) on a bad verifier name, import path, parameter or token variable. Reward-model actors and the
        policy's tokenizer (to split steps) are attached later (`attach`), once the fleet has started. `env`: the
        run's environment, whose rewards the episodes carry (`Rollout.episode`)."""
        from rewards.registry import load_verifier
        from rewards.remote import RemoteVerifier

        self.config = config
        self.env = env if env is not None and env.enabled else None
        self.reward_models: dict[str, Any] = {}  # name -> RewardModelWorker / ProcessRewardModelWorker actor handle
        self.reward_timeout = reward_timeout
        self.splitter: Any = None  # a rewards.steps.StepSplitter with process supervision, once attached
        self.query_tokenizer: Any = None  # the policy's tokenizer with `protocol: openrlhf` sources, once attached
        self.rules: dict[str, Any] = {}
        self.remotes: dict[str, Any] = {}
        for name, source in config.sources.items():
            try:
                if isinstance(source, RuleSource):
                    self.rules[name] = load_verifier(source.verifier, source.params, steps=source.level == "steps")
                elif isinstance(source, RemoteSource):
                    self.remotes[name] = RemoteVerifier(name, source)
            except ValueError as err:
                self.close()
                raise ValueError(f"reward.sources.{name}: {err}") from None

    def attach(self, reward_models: dict[str, Any], model_path: str) -> None:
        """The fleet's reward-model actors, and (with process supervision, or `protocol: openrlhf` sources) the
        policy's tokenizer from `model_path`, whose token ids the steps are split on, or the queries decoded from."""
        self.reward_models = reward_models
        openrlhf = any(isinstance(source, RemoteSource) and source.protocol == "openrlhf"
                       for source in self.config.sources.values())
        if self.config.scores_steps or openrlhf:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path)
            if self.config.scores_steps:
                from rewards.steps import StepSplitter

                self.splitter = StepSplitter(tokenizer, self.config.steps.delimiter)
            self.query_tokenizer = tokenizer if openrlhf else None

    def close(self) -> None:
        for client in self.remotes.values():
            client.close()

    def level(self, name: str) -> str:
        return self.config.sources[name].level

    def score(self, problems: list[Any], groups: list[list[Any]]) -> RoundScores:
        """Every source scores every completion (or each of its steps); returns combined rewards, dropped groups and
        metrics."""
        flat = [(i, problem, rollout) for i, (problem, group) in enumerate(zip(problems, groups)) for rollout in group]
        prompts = [problem.prompt for _, problem, _ in flat]
        completions = [rollout.text for _, _, rollout in flat]
        steps = texts = None
        if self.config.scores_steps:
            if self.splitter is None:
                raise RuntimeError("Scorer.attach must give the policy's tokenizer before steps can be scored")
            steps = [self.splitter.split(rollout.response_ids) for _, _, rollout in flat]
            texts = [s.texts for s in steps]
        # Reward models first: they run in their actors while the driver does the rules and the HTTP calls.
        pending = {name: actor.score_steps.remote(prompts, texts, self.config.sources[name].separator
                                                  or self.config.steps.delimiter)
                   if self.level(name) == "steps" else actor.score.remote(prompts, completions)
                   for name, actor in self.reward_models.items()}
        scores: dict[str, list[Any]] = {}  # name -> per sample: a float (outcome) or a list (steps); None: dropped
        metrics = {"verifier/failures": 0.0, "verifier/retries": 0.0}
        self._score_remotes(flat, texts, scores, metrics)
        for name, verifier in self.rules.items():
            if self.level(name) == "steps":
                scores[name] = [self._step_rule(name, verifier, p, texts[k]) for k, (_, p, _) in enumerate(flat)]
            else:
                scores[name] = [self._rule(name, verifier, p, r) for _, p, r in flat]
        self._collect_models(pending, texts, scores)

        dropped = [False] * len(groups)
        for values in scores.values():
            for (i, _, _), value in zip(flat, values):
                dropped[i] |= value is None
        metrics["verifier/dropped_groups"] = float(sum(dropped))
        if self.env is not None:
            self._env_failures(flat, dropped, metrics)
        outcome = [name for name in scores if self.level(name) == "outcome"]
        combined = [sum((self.config.sources[name].weight * scores[name][k] for name in outcome), 0.0)
                    if not dropped[i] else math.nan for k, (i, _, _) in enumerate(flat)]
        if self.env is not None and self.env.turn_rewards == "outcome":
            combined = [value + self.env.weight * sum(r.episode.turn_rewards) for value, (_, _, r) in
                        zip(combined, flat)]
        size = len(groups[0]) if groups else 0
        per_source = {}  # an outcome source's score per kept sample; a step source's mean over the sample's steps
        for name, values in scores.items():
            kept = [v for (i, _, _), v in zip(flat, values) if not dropped[i]]
            per_source[name] = kept if self.level(name) == "outcome" else [statistics.fmean(v) for v in kept if v]
        if self.env is not None:  # an episode's total environment reward (unweighted)
            per_source["env"] = [sum(r.episode.turn_rewards) for i, _, r in flat if not dropped[i]]
        scored_steps = self._scored_steps(flat, steps, scores, size, len(groups))
        kept = [k for k, (i, _, _) in enumerate(flat) if not dropped[i]]
        fit = {name: ([prompts[k] for k in kept], [completions[k] for k in kept],
                      [scores[self.config.sources[name].train.label_source][k] for k in kept])
               for name in self.reward_models if getattr(self.config.sources[name], "train", None) is not None}
        grouped = [combined[g * size:(g + 1) * size] for g in range(len(groups))]
        return RoundScores(grouped, dropped, per_source, metrics, scored_steps, fit)

    def _score_remotes(self, flat: list[tuple], texts: list[list[str]] | None, scores: dict[str, list[Any]],
                       metrics: dict[str, float]) -> None:
        """Every remote verifier service scores every sample (one list of samples per level, shared by that level's
        sources); their scores go into `scores`, their failures, retries and latencies into `metrics`."""
        from rewards.remote import RemoteVerifierError, VerifierSample

        samples: dict[str, list[Any]] = {}
        queries = self._queries(flat) if self.remotes and self.query_tokenizer is not None else None
        for name, client in self.remotes.items():
            level = self.level(name)
            if level not in samples:
                samples[level] = [VerifierSample(id=str(k), prompt=p.prompt, completion=r.text, label=p.label,
                                                 steps=texts[k] if level == "steps" else None,
                                                 query=queries[k] if queries is not None else None)
                                  for k, (_, p, r) in enumerate(flat)]
            try:
                result = client.score(samples[level])
            except RemoteVerifierError as err:  # on_failure=fail: the run stops with the client's one-line reason
                raise RunError(str(err)) from err
            scores[name] = result.rewards
            metrics["verifier/failures"] += result.metrics["failures"]
            metrics["verifier/retries"] += result.metrics["retries"]
            metrics[f"verifier/{name}/latency_mean_s"] = result.metrics["latency_mean_s"]
            metrics[f"verifier/{name}/latency_max_s"] = result.metrics["latency_max_s"]

    def _collect_models(self, pending: dict[str, Any], texts: list[list[str]] | None,
                        scores: dict[str, list[Any]]) -> None:
        """The reward models' scores (`timeouts.reward`), checked finite and shaped like the samples, normalised."""
        for name, ref in pending.items():
            (values,) = get([ref], self.reward_timeout, [f"reward model '{name}'"], "reward")
            source = self.config.sources[name]
            if source.level == "steps":
                if [len(v) for v in values] != [len(t) for t in texts] or \
                        not all(math.isfinite(x) for v in values for x in v):
                    raise RunError(f"process reward model '{name}' returned scores that are not one finite number "
                                   f"per step; check the model at {source.path}")
                scores[name] = _split_like(self._normalised(source, [x for v in values for x in v]), values)
            else:
                if not all(math.isfinite(v) for v in values):
                    raise RunError(f"reward model '{name}' returned a non-finite score; check the model at "
                                   f"{source.path}")
                scores[name] = self._normalised(source, values)

    def _scored_steps(self, flat: list[tuple], steps: list[Any] | None, scores: dict[str, list[Any]], size: int,
                      num_groups: int) -> list[list[ScoredSteps]] | None:
        """Process supervision: each completion's steps with the weighted sum of the step sources' rewards (or an
        episode's turns as its steps, `env.turn_rewards=steps`), grouped; None without steps."""
        if steps is None:
            return self._turn_steps(flat, size) if self.env is not None and self.env.turn_rewards == "steps" else None
        stepped = [name for name in scores if self.level(name) == "steps"]
        flat_steps = []
        for k, split in enumerate(steps):
            total = np.zeros(len(split.ends))
            for name in stepped:
                values = scores[name][k]  # None where the group is dropped (never trained on)
                total += self.config.sources[name].weight * np.asarray(values if values is not None else 0.0)
            flat_steps.append(ScoredSteps(split.ends, total.astype(np.float32)))
        return [flat_steps[g * size:(g + 1) * size] for g in range(num_groups)]

    def _queries(self, flat: list[tuple[int, Any, Any]]) -> list[str]:
        """Each completion's prompt and response decoded together with their special tokens (EOS included), as
        OpenRLHF's client sends a query (`decode(prompt_ids + response_ids, skip_special_tokens=False)`)."""
        ids = [[*map(int, r.prompt_ids), *map(int, r.response_ids)] for _, _, r in flat]
        return self.query_tokenizer.batch_decode(ids, skip_special_tokens=False)

    def _env_failures(self, flat: list[tuple[int, Any, Any]], dropped: list[bool], metrics: dict[str, float]) -> None:
        """Episodes whose environment failed: the run stops (`env.on_failure=fail`), or their groups are dropped."""
        failed = [(i, r.episode.error) for i, _, r in flat if r.episode is not None and r.episode.error is not None]
        metrics["env/failures"] = float(len(failed))
        if failed and self.env.on_failure == "fail":
            raise RunError(f"{len(failed)} episode(s) failed in the environment, the first: {failed[0][1]} "
                           "(env.on_failure=fail; set env.on_failure=drop to drop their groups instead)")
        groups = {i for i, _ in failed if not dropped[i]}
        for i in groups:
            dropped[i] = True
        metrics["env/dropped_groups"] = float(len(groups))

    def _turn_steps(self, flat: list[tuple[int, Any, Any]], size: int) -> list[list[ScoredSteps]]:
        """`env.turn_rewards=steps`: each answered turn is a step ending at its last model token, worth its turn
        reward x `env.weight`; a last turn the environment did not answer (cut at the length limit) is a step worth
        0, so that the response's last token ends a step."""
        steps = []
        for _, _, rollout in flat:
            ends, rewards = list(rollout.episode.turn_ends), [self.env.weight * r for r in rollout.episode.turn_rewards]
            last = len(rollout.response_ids) - 1
            if not ends or ends[-1] != last:
                ends.append(last)
                rewards.append(0.0)
            steps.append(ScoredSteps(np.asarray(ends, np.int64), np.asarray(rewards, np.float32)))
        return [steps[g * size:(g + 1) * size] for g in range(len(steps) // size if size else 0)]

    def _step_rule(self, name: str, verifier: Any, problem: Any, steps: list[str]) -> list[float]:
        """One step verifier's rewards, one finite number per step; anything else stops the run."""
        try:
            values = [float(v) for v in verifier(steps, problem.label)]
        except Exception as err:
            raise RunError(f"reward source '{name}' ({self.config.sources[name].verifier}) failed on prompt "
                           f"{problem.prompt[:80]!r}: {err!r}") from err
        if len(values) != len(steps) or not all(math.isfinite(v) for v in values):
            raise RunError(f"reward source '{name}' returned {values} for the {len(steps)} steps of prompt "
                           f"{problem.prompt[:80]!r}; a step verifier returns one finite number per step")
        return values

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


def _split_like(flat: list[float], rows: list[list[float]]) -> list[list[float]]:
    """`flat` cut into rows of the lengths of `rows`."""
    out, start = [], 0
    for row in rows:
        out.append(flat[start:start + len(row)])
        start += len(row)
    return out


REWARD_MODELS_DIR = "reward_models"  # a checkpoint's fine-tuned reward models, one directory each


class RewardFitting:
    """The reward models a run fine-tunes (`reward.sources.<name>.train`)."""

    def __init__(self, config: RunConfig, fleet: Fleet):
        self.config = config
        self.fleet = fleet
        self.examples: dict[int, dict[str, tuple[list, list, list]]] = {}  # step -> reward model -> its examples
        self.trained = [name for name, source in config.reward.sources.items() if getattr(source, "train", None)]

    def add(self, step: int, fit: dict[str, tuple[list, list, list]]) -> None:
        """A scoring round's (prompts, completions, targets) for each reward model fine-tuned in the run."""
        for name, new in fit.items():
            data = self.examples.setdefault(step, {}).setdefault(name, ([], [], []))
            for kept, values in zip(data, new):
                kept += values

    def fit(self, step: int, timings: Any) -> dict[str, float]:
        """At steps that are multiples of a reward model's `train.every`, fine-tune it on step `step`'s completions
        labelled by its `train.label_source` (the next scoring uses the new weights; `time/reward_fit` into
        `timings`, a `Timings`); its `reward_model/<name>/*` metrics. Examples of steps up to `step` are let go."""
        data = self.examples.pop(step, {})
        for old in [s for s in self.examples if s < step]:
            del self.examples[old]
        due = {name: examples for name, examples in data.items()
               if step % self.config.reward.sources[name].train.every == 0}
        if not due:
            return {}
        with timings.timed("reward_fit"):
            refs = [self.fleet.reward_models[name].fit.remote(*examples, self.config.rollout.group_size)
                    for name, examples in due.items()]
            results = get(refs, self.config.timeouts.reward, [f"reward model '{name}' fine-tuning" for name in due],
                          "reward")
        return {f"reward_model/{name}/{key}": float(value) for name, result in zip(due, results)
                for key, value in result.items()}

    def save(self, directory: Path) -> None:
        """The fine-tuned reward models' weights and optimizer states, in `reward_models/<name>/`."""
        self._each("save_state", directory)

    def restore(self, directory: Path) -> None:
        self._each("load_state", directory)

    def _each(self, method: str, directory: Path) -> Any:
        refs = [getattr(self.fleet.reward_models[name], method).remote(str(directory / REWARD_MODELS_DIR / name))
                for name in self.trained]
        get(refs, self.config.timeouts.reward, [f"reward model '{name}'" for name in self.trained], "checkpoint")

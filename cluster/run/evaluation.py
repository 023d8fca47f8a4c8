"""Evaluation on held-out prompts: while a run trains (`eval.every`), and of a checkpoint or the base model
(`relay eval`), with the same code.

Owns: the evaluation prompts (`eval.data`, or the training data's held-out problems, `data.held_out`), the check that
training does not draw them (`eval.disjoint`), their sampling (the run's engines, their own seeds, the same every
time, an even split over the workers, their own prefix-cache space: nothing the training batches get changes), their
reward (the weighted sum of `eval.sources`) and its full marks (`full_marks`: what `eval.pass_threshold` is a share of),
and the metrics: `eval/reward/mean`, `eval/reward/<source>`, `eval/response_length/mean`, `eval/pass@k` (the unbiased
estimator of Chen et al. 2021) and `eval/mean@n`.
Does not own: when the step dispatches and collects it (cluster/run/trainer.py), the requests (cluster/fleet/
rollout_pool.py), the verifiers (rewards/), or starting a fleet for `relay eval` (cluster/run/launch.py).
"""

from __future__ import annotations

import math
import random
import re
import statistics
import time
from collections import deque
from typing import Any

from cluster.config import ConfigError, RunConfig
from cluster.demo.task import Problem
from cluster.run.data import is_held_out, make_prompt_source
from cluster.run.prompt_format import DataError

DEMO_TASKS = ("arithmetic", "chain_sum", "calc")
CACHE_SALT = "relay-eval"  # the evaluation requests' own prefix-cache space in the engines
_DRAWS_PER_PROMPT = 200  # a demo task's held-out problems are drawn until this many draws per prompt found none new


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c pass (Chen et al. 2021, "Evaluating Large Language
    Models Trained on Code", eq. 1): 1 - C(n - c, k) / C(n, k), computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i)
    (no large binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def reported_ks(n: int) -> list[int]:
    """The k of `eval/pass@k` for n samples per prompt: 1, 2, 4, ... below n, and n."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i < n]
    return ks + [n]


def eval_metrics(rewards: list[list[float]], per_source: dict[str, list[float]], lengths: list[int],
                 threshold: float) -> dict[str, float]:
    """The metrics of one evaluation: `rewards` [prompts][n] (groups a failed remote source dropped are left out),
    each source's scores of those samples, every completion's length. A sample passes when its reward is at least
    `threshold`."""
    flat = [r for group in rewards for r in group]
    metrics = {"eval/reward/mean": statistics.fmean(flat) if flat else math.nan,
               **{f"eval/reward/{name}": statistics.fmean(values) if values else math.nan
                  for name, values in per_source.items()},
               "eval/response_length/mean": statistics.fmean(lengths) if lengths else math.nan,
               "eval/prompts": float(len(rewards))}
    n = len(rewards[0]) if rewards else 0
    for k in reported_ks(n) if n else []:
        metrics[f"eval/pass@{k}"] = statistics.fmean(pass_at_k(n, sum(r >= threshold for r in g), k) for g in rewards)
    if n:
        metrics[f"eval/mean@{n}"] = statistics.fmean(statistics.fmean(g) for g in rewards)
    return metrics


def full_marks(config: RunConfig) -> float:
    """The evaluation reward of a completion that every evaluation source gives full marks: 1 for a source of positive
    weight (a verifier's right answer), 0 for one of negative weight (a penalty not incurred). That is the sum of the
    positive weights of `eval.sources`' outcome sources (step sources are not in the evaluation reward), and of
    `env.weight` when an episode's rewards add to the outcome (`env.turn_rewards=outcome`). A completion passes
    (`eval/pass@k`) when its reward is at least `eval.pass_threshold` x this."""
    sources = config.reward.sources
    weights = [sources[name].weight for name in config.eval.sources or sources if sources[name].level == "outcome"]
    if config.env.enabled and config.env.turn_rewards == "outcome":
        weights.append(config.env.weight)
    return sum(max(weight, 0.0) for weight in weights)


def eval_seeds(seed: int, n: int) -> list[int]:
    """One sampling seed per evaluation prompt, the same at every evaluation of a run (and in `relay eval`): the
    steps' evaluations differ only by their weights."""
    rng = random.Random(f"relay-eval-sample:{seed}")
    return [rng.getrandbits(31) for _ in range(n)]


# --- the prompts -----------------------------------------------------------------------------------------------------


def eval_problems(config: RunConfig, model_path: str | None, training: Any) -> list[Problem]:
    """The evaluation prompts (`eval.max_prompts` of them at most): `eval.data`'s, or the training data's held-out
    problems; with `eval.disjoint`, refused (ConfigError, one line) when training also draws one of them. `training`
    is the run's prompt source (cluster/run/data.py): without `eval.data` the held-out problems come from it (a
    dataset's or reasoning-gym's, kept aside when it loaded; a demo task's, drawn with its `draw_one`)."""
    ev = config.eval
    if ev.data is None:
        source, held_out = training, config.data.held_out
    else:
        ro = config.rollout
        longest = ev.data.max_prompt_tokens or max(1, ro.max_model_len - (ev.max_new_tokens or ro.max_new_tokens))
        try:
            source, held_out = make_prompt_source(ev.data, config.seed, 1, model_path, longest), 0.0
        except DataError as err:
            raise ConfigError(f"eval.data: {err}") from None
    if (ev.data or config.data).task in DEMO_TASKS:
        problems = _distinct_draws(source, config.seed, ev.max_prompts, held_out)
    else:
        problems = (source.held_out if ev.data is None else source.problems)[:ev.max_prompts]
    if not problems:
        raise ConfigError(f"data.held_out={config.data.held_out:g} holds out none of the training prompts; raise "
                          "data.held_out or give eval.data")
    if ev.disjoint:
        check_disjoint(config, problems, training)
    return problems


def _distinct_draws(source: Any, seed: int, count: int, held_out: float) -> list[Problem]:
    """Up to `count` distinct problems of a demo task, drawn in a fixed order from `seed` (only held-out ones when
    `held_out` > 0), until that many are found or `_DRAWS_PER_PROMPT` x `count` draws were made."""
    rng = random.Random(f"relay-eval:{seed}")
    found: dict[str, Problem] = {}
    for _ in range(_DRAWS_PER_PROMPT * count):
        problem = source.draw_one(rng)
        if (held_out <= 0 or is_held_out(problem.prompt, held_out)) and problem.prompt not in found:
            found[problem.prompt] = problem
            if len(found) == count:
                break
    return list(found.values())


def check_disjoint(config: RunConfig, problems: list[Problem], training: Any) -> None:
    """Raise ConfigError when training may draw one of `problems`: a dataset's or reasoning-gym's prompt it keeps, or
    a problem of the demo task it draws from (same shape, operands in its range, not held out)."""
    if config.data.task in DEMO_TASKS:
        shape = _shape(config.data)
        lo, hi = config.data.min_operand, config.data.max_operand
        shared = [p for p in problems if re.sub(r"\d+", "#", p.prompt) == shape
                  and all(lo <= int(x) <= hi for x in re.findall(r"\d+", p.prompt))
                  and not is_held_out(p.prompt, config.data.held_out)]
    else:
        trained = {p.prompt for p in training.problems}
        shared = [p for p in problems if p.prompt in trained]
    if shared:
        raise ConfigError(
            f"eval.data: {len(shared)} of the {len(problems)} evaluation prompts are training prompts too (the first: "
            f"{shared[0].prompt[:60]!r}); evaluate on a split training does not draw (or set data.held_out and leave "
            "eval.data empty), or set eval.disjoint=false")


def _shape(data: Any) -> str:
    """A demo task's prompts with every number replaced by `#` (`#+#=` for arithmetic)."""
    terms = {"arithmetic": 2, "chain_sum": data.num_terms}.get(data.task)
    return "#*#=" if terms is None else "+".join("#" * terms) + "="


# --- one evaluation --------------------------------------------------------------------------------------------------


class Evaluation:
    """Samples the evaluation prompts on the rollout pool with a weights version, scores them, and reports the
    metrics. `dispatch` queues them like any batch (the workers load that version first if they serve another);
    `collect` waits for them."""

    def __init__(self, config: RunConfig, pool: Any, scorer: Any, problems: list[Problem], prompts: list[Any]):
        """`pool`: the run's RolloutPool; `scorer`: a Scorer of `eval.sources` (`eval_scorer`); `prompts`: what the
        engines get for each of `problems` (`Trainer.prompts_of`)."""
        from actors.rollout_types import SamplingSettings

        ev, ro = config.eval, config.rollout
        self.config = config
        self.pool = pool
        self.scorer = scorer
        self.problems = problems
        self.prompts = prompts
        self.seeds = eval_seeds(config.seed, len(problems))
        self.sampling = SamplingSettings(ev.num_samples, ev.max_new_tokens or ro.max_new_tokens, ev.temperature,
                                         ro.top_p, cache_salt=CACHE_SALT)
        self.pending: deque[tuple[int, Any]] = deque()  # (the step whose weights it samples, its batch), oldest first
        # The reward a completion passes at; a relative 1e-9 below, as the Scorer sums the weights in another order
        # (remote sources first), which can differ in the last bit (0.7 + 0.2 + 0.1 < 0.1 + 0.2 + 0.7).
        self.threshold = ev.pass_threshold * full_marks(config) * (1 - 1e-9)

    def due(self, step: int) -> bool:
        every = self.config.eval.every
        return bool(every) and (step % every == 0 or step == self.config.max_steps)

    def dispatch(self, step: int, version: int) -> None:
        """Queue the evaluation of weights version `version`, the weights step `step`'s update produced."""
        self.pending.append((step, self.pool.dispatch(self.prompts, self.seeds, self.sampling, version,
                                                      evaluation=True)))

    def collect(self) -> dict[str, float]:
        """Wait for the oldest pending evaluation: its metrics, with `eval/step` (whose weights) and `time/eval` (how
        long the driver waited for it and scored it)."""
        started = time.perf_counter()
        step, batch = self.pending.popleft()
        groups = self.pool.collect(batch)
        scores = self.scorer.score(self.problems, groups)
        kept = [i for i, dropped in enumerate(scores.dropped) if not dropped]
        metrics = eval_metrics([scores.rewards[i] for i in kept], scores.per_source,
                               [len(r.response_ids) for group in groups for r in group], self.threshold)
        return {"eval/step": step, **metrics, "eval/dropped_groups": float(len(groups) - len(kept)),
                "time/eval": time.perf_counter() - started}


def eval_scorer(config: RunConfig) -> Any:
    """A Scorer of the evaluation's sources (`eval.sources`; every training source when empty), with the run's weights
    and environment; its reward models are attached by the caller (`Scorer.attach`)."""
    from cluster.run.scoring import Scorer

    names = config.eval.sources or list(config.reward.sources)
    reward = config.reward.model_copy(update={"sources": {n: config.reward.sources[n] for n in names}})
    try:
        return Scorer(reward, config.timeouts.reward, config.env)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def evaluation_inputs(config: RunConfig, model_path: str | None, training: Any) -> tuple[list[Problem], Any]:
    """What a run with `eval.every` (or `relay eval`) evaluates with, checked before anything starts: the prompts
    (`eval_problems`) and the Scorer of `eval.sources`. Raises ConfigError (one line) on bad input, or when no
    completion could pass (`full_marks` 0: no evaluation source of positive weight)."""
    if full_marks(config) <= 0:
        names = ", ".join(config.eval.sources or config.reward.sources) or "none"
        raise ConfigError(f"eval.pass_threshold is a share of full marks, the sum of the positive weights of the "
                          f"evaluation's outcome sources ({names}; env.weight with env.turn_rewards=outcome), and "
                          "there are none, so no completion could pass: evaluate with a source of positive weight")
    problems = eval_problems(config, model_path, training)
    return problems, eval_scorer(config)

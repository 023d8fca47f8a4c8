"""A step's groups from its generation rounds: DAPO's dynamic sampling and overlong shaping.

Owns: the rounds of one step (`sample_rounds`: generate, score, count, until enough groups are kept), counting one
round's scored groups (`add_round`: groups a verifier or environment lost under `on_failure=drop`
left out, the uninformative ones set aside, overlong shaping added) and choosing the step's groups from the rounds
(`choose`: kept ones first, topped up with set-aside ones, counted). A group is uninformative when the learner would
give every one of its tokens a zero advantage: all its rewards equal, or under process supervision all the per-step
values the learner normalises (`step_values`) equal.
Does not own: generating or scoring (cluster/fleet/rollout_pool.py, cluster/run/scoring.py), the advantages
themselves (learner/algo/advantages.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cluster.config import RunConfig
from rewards.shaping import overlong_penalty
from sync.calls import RunError


@dataclass
class Tally:
    """A step's scored groups so far, over its generation rounds."""

    sources: Any  # the reward sources' names
    kept: list[tuple[list[Any], list[float]]] = field(default_factory=list)
    uninformative: list[tuple[list[Any], list[float]]] = field(default_factory=list)  # set aside (dynamic sampling)
    # every completion's total reward (outcome, shaped, plus its step rewards), uninformative groups included
    scored: list[float] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    per_source: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self):
        self.per_source = {name: [] for name in self.sources}


def step_values(reward: float, ends: np.ndarray, step_rewards: np.ndarray, last: int) -> list[float]:
    """The values process supervision normalises over a group (`process_group_relative`) for one completion: each
    step's reward, plus the outcome reward for the step that ends at the completion's last token (the outcome lands
    there; at any other token it is not a step's and the learner ignores it)."""
    return [float(r) + (reward if int(end) == last else 0.0) for end, r in zip(ends, step_rewards)]


def informative(rewards: list[float], group: list[Any], steps: list[Any] | None) -> bool:
    """Whether the learner gives some token of the group a nonzero advantage: rewards that differ or, under process
    supervision (`steps`: each completion's scored steps), per-step values that differ over at least two steps."""
    if steps is None:
        return len(set(rewards)) > 1
    values = [v for reward, rollout, scored in zip(rewards, group, steps)
              for v in step_values(reward, scored.ends, scored.rewards, _last_model_token(rollout))]
    return len(values) > 1 and len(set(values)) > 1


def _last_model_token(rollout: Any) -> int:
    """The index of the completion's last token the model sampled (where the learner puts the outcome reward)."""
    if rollout.model_mask is None:
        return len(rollout.response_ids) - 1
    sampled = np.flatnonzero(np.asarray(rollout.model_mask))
    return int(sampled[-1]) if sampled.size else len(rollout.response_ids) - 1


def sample_rounds(config: RunConfig, step: int, rounds_from: Callable[[int], tuple[list[Any], list[list[Any]]]],
                  scorer: Any, timings: Any, fitting: Any) -> tuple[list[list[Any]], list[float], dict[str, Any]]:
    """Score generation rounds (`rounds_from(round)`: a round's problems and their groups) into `prompts_per_step`
    groups; returns [prompts][G] rollouts, their rewards, and stats. Groups a remote verifier or environment lost
    under `on_failure=drop` are left out (counted). With `rollout.dynamic_sampling` (DAPO), uninformative groups are
    set aside and fresh prompts are drawn until enough groups are kept or `max_sampling_rounds` rounds ran, after
    which set-aside groups top the batch up (counted, never hidden). `timings`: a `Timings` (`time/generate`,
    `time/score`); `fitting`: the `RewardFitting` that keeps the examples of reward models trained in the run."""
    ro, want = config.rollout, config.data.prompts_per_step
    tally = Tally([*config.reward.sources, *(["env"] if config.env.enabled else [])])
    rounds = 0
    while len(tally.kept) < want and rounds < (ro.max_sampling_rounds if ro.dynamic_sampling else 1):
        with timings.timed("generate"):
            problems, groups = rounds_from(rounds)
        with timings.timed("score"):
            result = scorer.score(problems, groups)
        fitting.add(step, result.fit)
        add_round(config, tally, groups, result)
        rounds += 1
    return choose(config, step, tally, rounds)


def add_round(config: RunConfig, tally: Tally, groups: list[list[Any]], result: Any) -> None:
    """Count one generation round's scored groups into `tally`: dropped groups (`on_failure=drop`) left out, the
    uninformative ones (dynamic sampling) set aside, overlong shaping added after that choice, as in DAPO, so that
    length alone does not make a group informative."""
    dynamic = config.rollout.dynamic_sampling
    for key, value in result.metrics.items():
        tally.counters[key] = tally.counters.get(key, 0.0) + value if "latency" not in key else max(
            tally.counters.get(key, 0.0), value)
    for name, values in result.per_source.items():
        tally.per_source[name] += values
    steps = result.steps or [None] * len(groups)
    for group, group_rewards, lost, group_steps in zip(groups, result.rewards, result.dropped, steps):
        if lost:
            continue
        if group_steps is not None:  # process supervision: the steps' rewards go with the rollouts
            for rollout, scored in zip(group, group_steps):
                rollout.step_ends, rollout.step_rewards = scored.ends, scored.rewards
        keep = not dynamic or informative(group_rewards, group, group_steps)
        shaped = shape(config, group_rewards, group)
        tally.scored += shaped if group_steps is None else [
            reward + float(scored.rewards.sum()) for reward, scored in zip(shaped, group_steps)]
        (tally.kept if keep else tally.uninformative).append((group, shaped))


def choose(config: RunConfig, step: int, tally: Tally, rounds: int
           ) -> tuple[list[list[Any]], list[float], dict[str, Any]]:
    """The step's groups from `tally` (kept ones first, topped up with set-aside ones), their rewards, stats."""
    ro, want = config.rollout, config.data.prompts_per_step
    kept, uninformative, counters = tally.kept, tally.uninformative, tally.counters
    if not kept and not uninformative:
        raise RunError(f"step {step}: every group was dropped because a remote verifier could not score it "
                       f"({counters.get('verifier/failures', 0):.0f} failed samples) or its environment failed "
                       f"({counters.get('env/failures', 0):.0f} failed episodes); check the service")
    filler = uninformative[:max(0, want - len(kept))]
    chosen = kept[:want] + filler
    stats: dict[str, Any] = {"reward/mean": statistics.fmean(tally.scored),
                             "reward/std": statistics.pstdev(tally.scored),
                             **{f"reward/{name}": statistics.fmean(v) for name, v in tally.per_source.items() if v},
                             **counters}
    if ro.dynamic_sampling:
        stats.update({"sampling/rounds": rounds, "sampling/kept_groups": min(len(kept), want),
                      "sampling/surplus_groups": max(0, len(kept) - want),
                      "sampling/dropped_groups": len(uninformative), "sampling/filler_groups": len(filler)})
    return [g for g, _ in chosen], [r for _, rs in chosen for r in rs], stats


def shape(config: RunConfig, rewards: list[float], group: list[Any]) -> list[float]:
    """Add DAPO's soft overlong penalty to one group's rewards (a no-op when `reward.overlong_buffer` is 0)."""
    rc = config.reward
    if not rc.overlong_buffer:
        return rewards
    max_length = config.rollout.max_new_tokens
    return [reward + overlong_penalty(len(rollout.response_ids), max_length, rc.overlong_buffer, rc.overlong_penalty)
            for reward, rollout in zip(rewards, group)]

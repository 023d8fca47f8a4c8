"""Dynamic sampling judges a group on what the learner will do with it (cluster/run/sampling.py): a group is kept
exactly when some token gets a nonzero advantage. Under process supervision that is decided per step, by the values
`process_group_relative` normalises, not by the union of outcome and step rewards."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cluster.config import load_config
from cluster.run.sampling import Tally, add_round, informative
from cluster.run.scoring import ScoredSteps
from learner.algo.advantages import last_token_rewards, process_group_relative

LENGTH = 6  # every completion's response tokens


def rollout(model_mask=None):
    return SimpleNamespace(response_ids=list(range(LENGTH)), model_mask=model_mask, step_ends=None, step_rewards=None)


def learner_advantages(outcomes, steps, group):
    """The learner's process-supervised GRPO advantages of one group: the outcome on each row's last model token plus
    the step rewards at their steps' ends (learner.learner.Learner._token_rewards), normalised per step."""
    masks = torch.tensor([[1.0] * LENGTH if r.model_mask is None else list(map(float, r.model_mask)) for r in group])
    token_rewards = last_token_rewards(torch.tensor(outcomes), masks)
    ends = torch.zeros(len(group), LENGTH)
    for row, scored in enumerate(steps):
        token_rewards[row, scored.ends] += torch.tensor(scored.rewards)
        ends[row, scored.ends] = 1.0
    return process_group_relative(token_rewards, ends, masks, len(group))


def steps(*pairs):
    return ScoredSteps(np.array([e for e, _ in pairs]), np.array([r for _, r in pairs], np.float32))


CASES = {
    # outcomes differ, but they land on no step's end: the learner normalises the equal step rewards only
    "outcomes off the step ends": ([1.0, 0.0], [steps((1, 0.5), (3, 0.5)), steps((1, 0.5), (3, 0.5))], False),
    # the last token ends a step: the outcome is that step's, and the values differ
    "outcomes on the last step": ([1.0, 0.0], [steps((1, 0.5), (5, 0.5)), steps((1, 0.5), (5, 0.5))], True),
    "step rewards differ": ([0.0, 0.0], [steps((1, 0.5), (3, 0.0)), steps((2, 0.5))], True),
    "all equal": ([1.0, 1.0], [steps((1, 0.5), (3, 0.5)), steps((2, 0.5), (3, 0.5))], False),
    # equal completions, but the last step carries the outcome too: its value differs from the first step's
    "equal completions, unequal steps": ([1.0, 1.0], [steps((1, 0.5), (5, 0.5)), steps((2, 0.5), (5, 0.5))], True),
    "one step in all": ([1.0, 0.0], [steps((5, 0.5)), steps()], False),
}


@pytest.mark.parametrize("name", CASES)
def test_a_group_is_informative_exactly_when_the_learner_gives_it_an_advantage(name):
    outcomes, scored, expected = CASES[name]
    group = [rollout(), rollout()]
    advantages = learner_advantages(outcomes, scored, group)
    assert bool(advantages.abs().max() > 0) is expected  # what the learner does
    assert informative(outcomes, group, scored) is expected


def test_the_outcome_lands_on_the_last_token_the_model_sampled():
    """Multi-turn: tokens the environment added end the response; the outcome is on the model's last one."""
    mask = [1, 1, 1, 1, 0, 0]  # the model's last token is index 3, which ends a step
    group = [rollout(mask), rollout(mask)]
    scored = [steps((1, 0.5), (3, 0.5)), steps((1, 0.5), (3, 0.5))]
    assert bool(learner_advantages([1.0, 0.0], scored, group).abs().max() > 0)
    assert informative([1.0, 0.0], group, scored)


def test_dynamic_sampling_sets_aside_a_group_the_learner_would_not_learn_from():
    config = load_config(None, ["rollout.dynamic_sampling=true", "rollout.group_size=2"])
    outcomes, scored, _ = CASES["outcomes off the step ends"]
    group = [rollout(), rollout()]
    result = SimpleNamespace(metrics={}, per_source={}, rewards=[outcomes], dropped=[False], steps=[scored])
    tally = Tally([])
    add_round(config, tally, [group], result)
    assert not tally.kept and len(tally.uninformative) == 1
    assert [r.step_rewards.tolist() for r in group] == [[0.5, 0.5], [0.5, 0.5]]  # the steps go with the rollouts

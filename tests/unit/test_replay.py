"""The replay buffer of iterative GRPO: how many groups a step replays, drawn reproducibly from the groups of earlier
steps only, the oldest evicted first, and saved into a checkpoint and loaded back exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from actors.rollout_types import EpisodeInfo, Rollout
from cluster.run.replay import REPLAY_FILE, ReplayBuffer


def group(step: int, prompt: int, size: int = 2, steps: bool = False, tagged: bool = False,
          episodes: bool = False) -> list[Rollout]:
    rollouts = []
    for j in range(size):
        n = 1 + (prompt + j) % 3
        rollout = Rollout([prompt, 7], np.arange(n, dtype=np.int32) + 10 * j, np.linspace(-1, 0, n, dtype=np.float32),
                          f"s{step}p{prompt}c{j}", "stop" if j else "length", step - 1,
                          np.full(n, step - 1, np.int32) if tagged else None)
        if steps:
            rollout.step_ends, rollout.step_rewards = np.array([n - 1]), np.array([0.5 * j], np.float32)
        if episodes:  # a multi-turn episode: the environment added the first token; 0.1 is not exact in binary
            rollout.model_mask = np.array([0] + [1] * (n - 1), np.uint8)
            rollout.episode = EpisodeInfo(turns=1 + j, turn_ends=[n - 1], turn_rewards=[0.1 * (step + prompt)],
                                          calls=2 + j, invalid_calls=j, truncated_observations=prompt % 2,
                                          env_seconds=0.001 * (step + prompt + j) / 3,
                                          error=None if j else f"step {step} failed")
        rollouts.append(rollout)
    return rollouts


def batch(step: int, prompts: int = 4, **kwargs) -> tuple[list[list[Rollout]], list[float]]:
    groups = [group(step, p, **kwargs) for p in range(prompts)]
    return groups, [float(step + p + j / 10) for p in range(prompts) for j in range(2)]


def test_the_count_is_the_share_of_the_batch():
    assert ReplayBuffer(0.1, 100, 0, 32).count == 4  # 4 / 36 of the batch
    assert ReplayBuffer(0.5, 100, 0, 8).count == 8
    assert ReplayBuffer(0.0, 100, 0, 32).count == 0


def test_a_step_replays_earlier_groups_only_reproducibly_and_reports_it():
    runs = []
    for _ in range(2):
        buffer, stats = ReplayBuffer(0.5, 100, seed=3, prompts_per_step=4), {}
        groups, rewards = buffer.mix(1, *batch(1), version=0, stats=stats)
        assert len(groups) == 4 and len(rewards) == 8  # nothing to replay yet
        assert stats == {"replay/fraction": 0.0, "replay/staleness": 0.0, "replay/buffer_groups": 4}
        mixed, mixed_rewards = buffer.mix(3, *batch(3), version=2, stats=stats)
        assert len(mixed) == 8 and [g[0].text for g in mixed[:4]] == [g[0].text for g in batch(3)[0]]
        replayed = mixed[4:]
        assert all(r.text.startswith("s1") for g in replayed for r in g)  # from step 1, not the fresh step 3
        for g, rewards in zip(replayed, np.reshape(mixed_rewards[8:], (4, 2))):  # each group keeps its rewards
            assert rewards.tolist() == [1 + int(g[0].prompt_ids[0]), 1 + int(g[0].prompt_ids[0]) + 0.1]
        # 4 of 8 groups replayed; the learner trains from version 2, the replayed groups were sampled by 0.
        assert stats["replay/fraction"] == 0.5 and stats["replay/staleness"] == 2
        runs.append([r.text for g in mixed for r in g])
    assert runs[0] == runs[1]
    draws = []
    for seed in (3, 4):  # another seed draws other groups
        buffer = ReplayBuffer(0.2, 100, seed=seed, prompts_per_step=4)
        buffer.mix(1, *batch(1, prompts=8), version=0, stats={})
        draws.append([buffer.mix(s, *batch(s), version=s - 1, stats={})[0][-1][0].text for s in range(2, 8)])
    assert draws[0] != draws[1]
    assert ReplayBuffer(0.0, 10, 0, 4).mix(1, *batch(1), version=0, stats={})[0][0][0].text == "s1p0c0"


def test_the_oldest_groups_leave_first():
    buffer = ReplayBuffer(0.5, capacity=6, seed=0, prompts_per_step=4)
    for step in (1, 2):
        buffer.mix(step, *batch(step), version=step - 1, stats={})
    assert len(buffer.groups) == 6 and [g.step for g in buffer.groups] == [1, 1, 2, 2, 2, 2]


@pytest.mark.parametrize("kwargs", [{}, {"steps": True, "tagged": True, "episodes": True}])
def test_saved_and_loaded_exactly(tmp_path, kwargs):
    buffer = ReplayBuffer(0.5, 100, seed=1, prompts_per_step=4)
    for step in (1, 2):
        buffer.mix(step, *batch(step, **kwargs), version=step - 1, stats={})
    buffer.save(tmp_path)
    loaded = ReplayBuffer(0.5, 100, seed=1, prompts_per_step=4)
    loaded.load(tmp_path)
    assert len(loaded.groups) == len(buffer.groups) == 8
    for a, b in zip(buffer.groups, loaded.groups):
        assert (a.rewards, a.version, a.step) == (b.rewards, b.version, b.step)
        for x, y in zip(a.rollouts, b.rollouts):
            # Every field of a rollout, so that one added to `Rollout` and not to replay.npz fails here.
            for field in dataclasses.fields(Rollout):
                ours, theirs = getattr(x, field.name), getattr(y, field.name)
                if kwargs:  # the episodes' case sets every optional field too
                    assert ours is not None, f"the test does not set Rollout.{field.name}: add it to group()"
                assert (ours is None) == (theirs is None), field.name
                if isinstance(ours, np.ndarray):
                    assert np.array_equal(ours, theirs) and ours.dtype.kind == theirs.dtype.kind, field.name
                else:
                    assert ours == theirs, field.name
            assert y.behavior_logprobs.dtype == np.float32  # vLLM's logprobs: nothing lost or widened
    # The next step draws the same groups from either, with the same episodes (the `env/*` metrics count them).
    mixed = [b.mix(3, *batch(3, **kwargs), version=2, stats={})[0] for b in (buffer, loaded)]
    assert [[r.text for r in g] for g in mixed[0]] == [[r.text for r in g] for g in mixed[1]]
    replayed = [[r.episode for g in m[4:] for r in g] for m in mixed]
    assert replayed[0] == replayed[1] and all((e is not None) == bool(kwargs) for e in replayed[1])


def test_without_replay_nothing_is_written(tmp_path):
    ReplayBuffer(0.0, 10, 0, 4).save(tmp_path)
    assert not (tmp_path / REPLAY_FILE).exists()

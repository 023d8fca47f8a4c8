"""Replay of past scored groups (iterative GRPO's "about 10% of old data", `data.replay_fraction`).

Owns: `ReplayBuffer`, the most recent `data.replay_buffer_size` fresh groups a run trained on (each with its
rollouts, their rewards, the weights version that sampled them and the step that first trained on them); `mix`, which
draws a step's replayed groups reproducibly (from (seed, step) alone, so a resumed run draws the same ones) before
adding that step's fresh groups, and reports `replay/*`; and saving the buffer into a checkpoint (`replay.npz`: flat
arrays and JSON, no pickle) and loading it back exactly: every field of a rollout that the learner or the metrics
read, a multi-turn episode's `EpisodeInfo` too (`env/*` count the replayed episodes). Does not own: sampling or
scoring (the driver), the off-policy correction of replayed groups (the learner's `learner.rollout_correction`, `tis`
by default with replay), or where checkpoints live (cluster/run/checkpoint.py).
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from actors.rollout_types import EpisodeInfo, Rollout
from cluster.config import replayed_groups

REPLAY_FILE = "replay.npz"


@dataclass
class ReplayGroup:
    """One prompt's G scored completions, kept for replay."""

    rollouts: list[Rollout]
    rewards: list[float]  # [G] the rewards they were trained with (shaped)
    version: int  # the weights version that sampled them
    step: int  # the step that first trained on them


class ReplayBuffer:
    """Past fresh groups, mixed into later batches; `count` groups per step once it holds that many."""

    def __init__(self, fraction: float, capacity: int, seed: int, prompts_per_step: int):
        self.count = replayed_groups(prompts_per_step, fraction)
        self.seed = seed
        self.groups: deque[ReplayGroup] = deque(maxlen=capacity)

    def mix(self, step: int, groups: list[list[Any]], rewards: list[float], version: int,
            stats: dict[str, Any]) -> tuple[list[list[Any]], list[float]]:
        """Step `step`'s batch: its fresh `groups` (sampled by `version`, rewards flat in group order), then the
        groups replayed from the buffer (drawn before the fresh ones join it); `replay/*` go into `stats`.
        Staleness is counted against the version the learner trains this step from, `step - 1`."""
        if not self.count:
            return groups, rewards
        drawn = random.Random(f"relay-replay:{self.seed}:{step}").sample(range(len(self.groups)),
                                                                        min(self.count, len(self.groups)))
        replayed = [self.groups[i] for i in sorted(drawn)]
        start = 0
        for group in groups:
            self.groups.append(ReplayGroup(group, rewards[start:start + len(group)], version, step))
            start += len(group)
        stats.update({"replay/fraction": len(replayed) / (len(groups) + len(replayed)),
                      "replay/staleness": statistics.fmean(step - 1 - g.version for g in replayed) if replayed else 0.0,
                      "replay/buffer_groups": len(self.groups)})
        return groups + [g.rollouts for g in replayed], rewards + [r for g in replayed for r in g.rewards]

    def save(self, directory: Path) -> None:
        """Write the buffer to `directory/replay.npz` (nothing without replay)."""
        if not self.count:
            return
        rollouts = [r for g in self.groups for r in g.rollouts]
        stepped = bool(rollouts) and rollouts[0].step_ends is not None
        tagged = bool(rollouts) and rollouts[0].versions is not None
        masked = bool(rollouts) and rollouts[0].model_mask is not None  # multi-turn episodes
        arrays = {
            "group_sizes": np.array([len(g.rollouts) for g in self.groups], np.int64),
            "group_versions": np.array([g.version for g in self.groups], np.int64),
            "group_steps": np.array([g.step for g in self.groups], np.int64),
            "rewards": np.array([r for g in self.groups for r in g.rewards], np.float64),
            **_packed("prompt_ids", [r.prompt_ids for r in rollouts], np.int64),
            **_packed("response_ids", [r.response_ids for r in rollouts], np.int64),
            **_packed("behavior_logprobs", [r.behavior_logprobs for r in rollouts], np.float32),
            "weights_versions": np.array([r.weights_version for r in rollouts], np.int64),
            "texts": np.array(json.dumps([r.text for r in rollouts])),
            "finish_reasons": np.array(json.dumps([r.finish_reason for r in rollouts])),
        }
        if any(r.episode is not None for r in rollouts):  # multi-turn episodes: what each did (`env/*`)
            arrays["episodes"] = np.array(json.dumps([None if r.episode is None else dataclasses.asdict(r.episode)
                                                      for r in rollouts]))
        if tagged:
            arrays.update(_packed("versions", [r.versions for r in rollouts], np.int64))
        if masked:
            arrays.update(_packed("model_mask", [r.model_mask for r in rollouts], np.uint8))
        if stepped:
            arrays.update(_packed("step_ends", [r.step_ends for r in rollouts], np.int64))
            arrays.update(_packed("step_rewards", [r.step_rewards for r in rollouts], np.float32))
        np.savez(directory / REPLAY_FILE, **arrays)

    def load(self, directory: Path) -> None:
        """Restore the buffer `save` wrote into `directory` (a checkpoint without one: an empty buffer)."""
        self.groups.clear()
        path = directory / REPLAY_FILE
        if not self.count or not path.exists():
            return
        with np.load(path, allow_pickle=False) as data:
            texts, reasons = json.loads(str(data["texts"])), json.loads(str(data["finish_reasons"]))
            prompts = _unpacked(data, "prompt_ids")
            responses = _unpacked(data, "response_ids")
            logprobs = _unpacked(data, "behavior_logprobs")
            versions = _unpacked(data, "versions") if "versions_lengths" in data else None
            masks = _unpacked(data, "model_mask") if "model_mask_lengths" in data else None
            ends = _unpacked(data, "step_ends") if "step_ends_lengths" in data else None
            step_rewards = _unpacked(data, "step_rewards") if ends is not None else None
            episodes = json.loads(str(data["episodes"])) if "episodes" in data else [None] * len(texts)
            rollouts = []
            for k in range(len(texts)):
                rollout = Rollout(prompts[k].tolist(), responses[k], logprobs[k], texts[k], reasons[k],
                                  int(data["weights_versions"][k]), None if versions is None else versions[k])
                if ends is not None:
                    rollout.step_ends, rollout.step_rewards = ends[k], step_rewards[k]
                if masks is not None:
                    rollout.model_mask = masks[k]
                if episodes[k] is not None:
                    rollout.episode = EpisodeInfo(**episodes[k])
                rollouts.append(rollout)
            rewards = data["rewards"].tolist()
            start = 0
            for size, version, step in zip(data["group_sizes"].tolist(), data["group_versions"].tolist(),
                                           data["group_steps"].tolist()):
                self.groups.append(ReplayGroup(rollouts[start:start + size], rewards[start:start + size], version,
                                               step))
                start += size


def _packed(name: str, rows: list[Any], dtype: Any) -> dict[str, np.ndarray]:
    arrays = [np.asarray(row, dtype) for row in rows]
    return {f"{name}_lengths": np.array([len(a) for a in arrays], np.int64),
            name: np.concatenate(arrays) if arrays else np.zeros(0, dtype)}


def _unpacked(data: Any, name: str) -> list[np.ndarray]:
    lengths = data[f"{name}_lengths"]
    return np.split(data[name], np.cumsum(lengths)[:-1]) if len(lengths) else []

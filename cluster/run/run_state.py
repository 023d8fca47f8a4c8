"""What a checkpoint holds of a running run, written and restored through each part's own methods.

Owns: the list of the parts with state and the driver state's keys: the learner's state (weights, optimizer, its
weights version), the data cursor, the workers' measured speeds (they split the next batch: engine batches decide the
last bits of the behaviour logprobs), the reference's refresh, the replay buffer, the fine-tuned reward models, the
resolved config.
Does not own: the files' layout and atomic commit (cluster/run/checkpoint.py), which checkpoint a run resumes from
(cluster/run/resume.py), or when checkpoints are written (cluster/run/launch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config import RunConfig
from cluster.run import checkpoint, resume


@dataclass
class RunState:
    """The run's parts that a checkpoint holds."""

    config: RunConfig
    learner_group: Any  # cluster/fleet/learner_group.py
    updates: Any  # cluster/fleet/learner_group.py's `Updates`: the weights version
    rollouts: Any  # cluster/fleet/rollout_pool.py: the workers' speeds; told of a restored version
    data: Any  # a prompt source (cluster/run/data.py)
    logprobs: Any  # cluster/run/logprob_asks.py: the reference's refresh
    replay: Any  # cluster/run/replay.py
    fitting: Any  # cluster/run/scoring.py: the reward models fine-tuned in the run

    def save(self, run_dir: Path, step: int, resolved_config: str) -> Path:
        """Write `checkpoints/step_<step>` atomically, after a drain (nothing in flight)."""
        tmp = checkpoint.begin(run_dir, step)
        self.learner_group.save_checkpoint(str(tmp))
        checkpoint.write_driver_state(tmp, {"step": step, "weights_version": self.updates.version,
                                            "data": self.data.state(), "rollout_speeds": self.rollouts.save_speeds(),
                                            **self.logprobs.save(tmp)})
        self.replay.save(tmp)
        self.fitting.save(tmp)
        checkpoint.write_config(tmp, resolved_config)
        return checkpoint.commit(tmp, run_dir, step, self.config.checkpoint.keep)

    def restore(self, point: resume.ResumePoint) -> int:
        """Load a checkpoint into the learner, the driver's parts and every engine (each worker's next request loads
        and probes it); returns its step."""
        version = self.learner_group.load_checkpoint(str(point.path))
        self.data.load_state(point.state["data"])
        self.logprobs.restore(point.path, point.state)
        self.replay.load(point.path)
        self.fitting.restore(point.path)
        self.updates.restored(version)
        self.rollouts.restored(version, point.state.get("rollout_speeds", {}))
        return point.step

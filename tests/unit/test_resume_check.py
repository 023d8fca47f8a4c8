"""What a resumed run may change (cluster/run/resume.py): where and how fast it runs and on what hardware, never how
the same hardware computes (micro-batches, kernels) nor, with asynchronous training, where the pipeline drains."""

from __future__ import annotations

import re

import pytest

from cluster.config import ConfigError, dump_config, load_config
from cluster.run import checkpoint
from cluster.run.resume import find


def checkpointed_run(tmp_path, *overrides):
    """A run directory with one complete checkpoint (step 4) written by a run with `overrides`."""
    config = load_config(None, [f"run_dir={tmp_path}", *overrides])
    tmp = checkpoint.begin(tmp_path, 4)
    (tmp / "policy").mkdir()  # the learner's files, as stand-ins
    (tmp / "policy" / "config.json").write_text("{}")
    (tmp / "policy" / "model.safetensors").write_bytes(b"weights")
    (tmp / "learner_state.pt").write_bytes(b"state")
    checkpoint.write_driver_state(tmp, {"step": 4, "weights_version": 4, "data": {"batches": 4}})
    checkpoint.write_config(tmp, dump_config(config))
    checkpoint.commit(tmp, tmp_path, 4, keep=2)
    return tmp_path


def resumed(run_dir, *overrides):
    return find(load_config(None, [f"run_dir={run_dir}", "resume=auto", *overrides]), run_dir)


# Free (nothing computed depends on them), and placement (which hardware, how much: the docs name what then differs).
@pytest.mark.parametrize("change", ["timeouts.generate=10", "max_steps=100", "checkpoint.keep=5",
                                    "sync.transport=collective", "sync.probe_tolerance=0.01", "rollout.num_cpus=2",
                                    "learner.max_nonfinite_steps=1", "rollout.num_workers=3",
                                    "rollout.tensor_parallel_size=2", "learner.num_ranks=2", "learner.num_threads=2"])
def test_free_and_placement_keys_may_change(tmp_path, change):
    assert resumed(checkpointed_run(tmp_path), change).step == 4


@pytest.mark.parametrize("change, key", [("data.prompts_per_step=16", "data.prompts_per_step"),
                                         ("learner.lr=1e-3", "learner.lr"), ("seed=3", "seed")])
def test_keys_that_change_the_computation_are_refused_naming_them(tmp_path, change, key):
    # data.prompts_per_step sets the batches drawn, so the run that follows: the data cursor's docstring says so too.
    run_dir = checkpointed_run(tmp_path)
    with pytest.raises(ConfigError, match=f"cannot resume from .*the config changed what the run computes \\({key}"):
        resumed(run_dir, change)


# Speed settings on the same hardware that compute other floats: refused, saying why (issue 43, defect 3).
@pytest.mark.parametrize("change, said", [
    ("learner.micro_batch_size=8", "learner.micro_batch_size: None -> 8 sums floats in other micro-batches"),
    ("reference.max_tokens_per_micro_batch=512",
     "reference.max_tokens_per_micro_batch: 1024 -> 512 sums floats in other micro-batches"),
    ("learner.share_prompts=false", "learner.share_prompts: True -> False sums floats in another order"),
    ("rollout.enforce_eager=false", "rollout.enforce_eager: True -> False samples with other kernels")])
def test_speed_settings_that_change_the_floats_are_refused_saying_why(tmp_path, change, said):
    with pytest.raises(ConfigError, match=f"\\({re.escape(said)}\\); use the checkpoint's values"):
        resumed(checkpointed_run(tmp_path), change)


def test_checkpoint_every_may_change_on_policy_but_not_when_drains_fix_the_weights_versions(tmp_path):
    # On-policy a checkpoint step only writes a checkpoint; with rollout.max_staleness=1 the pipeline drains there,
    # and the drains decide which weights version samples each batch (max(c, t - 1 - k)).
    assert resumed(checkpointed_run(tmp_path / "on_policy"), "checkpoint.every=3").step == 4
    run_dir = checkpointed_run(tmp_path / "async", "rollout.max_staleness=1", "checkpoint.every=4")
    said = "checkpoint.every: 4 -> 3 changes which weights sample each batch with rollout.max_staleness=1"
    with pytest.raises(ConfigError, match=re.escape(f"({said}); use the checkpoint's values")):
        resumed(run_dir, "rollout.max_staleness=1", "checkpoint.every=3")
    assert resumed(run_dir, "rollout.max_staleness=1", "checkpoint.every=4", "checkpoint.keep=5").step == 4

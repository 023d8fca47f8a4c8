"""What a resumed run may change (cluster/run/resume.py): where and how fast it runs, never what it computes."""

from __future__ import annotations

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


@pytest.mark.parametrize("change", ["rollout.num_workers=3", "learner.micro_batch_size=8", "timeouts.generate=10",
                                    "max_steps=100"])
def test_keys_that_do_not_change_the_computation_may_change(tmp_path, change):
    run_dir = checkpointed_run(tmp_path)
    point = find(load_config(None, [f"run_dir={run_dir}", "resume=auto", change]), run_dir)
    assert point.step == 4


@pytest.mark.parametrize("change, key", [("data.prompts_per_step=16", "data.prompts_per_step"),
                                         ("learner.lr=1e-3", "learner.lr"), ("seed=3", "seed")])
def test_keys_that_change_the_computation_are_refused_naming_them(tmp_path, change, key):
    # data.prompts_per_step sets the batches drawn, so the run that follows: the data cursor's docstring says so too.
    run_dir = checkpointed_run(tmp_path)
    with pytest.raises(ConfigError, match=f"cannot resume from .*the config changed what the run computes \\({key}"):
        find(load_config(None, [f"run_dir={run_dir}", "resume=auto", change]), run_dir)

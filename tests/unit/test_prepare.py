"""The driver's checks before anything starts (`cluster.run.launch.check_inputs`), beyond config validation."""

from __future__ import annotations

import pytest

from cluster.config import ConfigError, load_config
from cluster.run.launch import check_inputs


def test_top_p_below_one_warns_that_the_mismatch_metric_holds_the_nucleus_renormalisation(capsys):
    _, scorer = check_inputs(load_config(None, ["rollout.top_p=0.9"]), None)
    scorer.close()
    err = capsys.readouterr().err
    assert "warning: rollout.top_p=0.9 < 1" in err and "logprob/mismatch" in err and err.count("\n") == 1
    _, scorer = check_inputs(load_config(None, []), None)
    scorer.close()
    assert capsys.readouterr().err == ""


def test_asynchronous_training_with_more_than_twice_as_many_threads_as_cores_warns(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    # The synchronous defaults' threads: learner 2 + two engines of 1 + reference 2 = 6 on 2 cores.
    _, scorer = check_inputs(load_config(None, ["rollout.max_staleness=1", "learner.num_threads=2",
                                           "reference.num_threads=2"]), None)
    scorer.close()
    err = capsys.readouterr().err
    assert "warning: rollout.max_staleness=1" in err and "6 threads on 2 cores" in err and err.count("\n") == 1
    # Asynchronous defaults (learner and reference 1 thread each: 4), one engine, and on-policy: no warning.
    for overrides in (["rollout.max_staleness=1"], ["rollout.max_staleness=1", "rollout.num_workers=1"], []):
        _, scorer = check_inputs(load_config(None, overrides), None)
        scorer.close()
        assert capsys.readouterr().err == ""


TRAINED_RM = ["reward.sources.correct.verifier=exact_match", "reward.sources.rm.type=model",
              "reward.sources.rm.train.every=1", "reward.sources.rm.train.label_source=correct"]


def test_a_run_that_asks_a_local_ray_for_more_cpus_than_it_has_is_refused_at_once(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("ray.is_initialized", lambda: False)  # as `relay train` finds it (the suite's Ray may be up)
    # The demo books 2 CPUs (learner 0.5, reference 0.5, two engines of 0.5); a reward model's 0.5 more is too many.
    config = load_config(None, TRAINED_RM)
    with pytest.raises(ConfigError, match=r"asks Ray for 2.5 CPUs \(learner.num_cpus x num_ranks 0.5 \+ "
                                          r"reference.num_cpus 0.5 \+ "
                                          r"rollout.num_cpus x num_workers x tensor_parallel_size 1 \+ "
                                          r"reward.sources.rm.num_cpus 0.5\) but the local Ray instance has 2"):
        check_inputs(config, None)
    for fits in (["reward.sources.rm.num_cpus=0.25", "reference.num_cpus=0.25"], ["ray.num_cpus=3"]):
        _, scorer = check_inputs(load_config(None, [*TRAINED_RM, *fits]), None)
        scorer.close()


def test_an_environment_that_does_not_load_is_refused_before_anything_starts():
    for spec, problem in [("tests.nowhere:Env", "cannot import module 'tests.nowhere'"),
                          ("tests.envs:Missing", "module 'tests.envs' has no attribute 'Missing'")]:
        with pytest.raises(ConfigError, match=f"env.spec: environment '{spec}': {problem}"):
            check_inputs(load_config(None, [f"env.spec={spec}"]), None)
    with pytest.raises(ConfigError, match="does not accept parameter 'nope'"):
        check_inputs(load_config(None, ["env.spec=tests.envs:Counter", "env.params={nope: 1}"]), None)
    _, scorer = check_inputs(load_config(None, ["env.spec=tests.envs:Counter", "env.params={turns: 2}"]), None)
    scorer.close()

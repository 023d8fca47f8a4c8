"""The driver's checks before anything starts (`cluster.run.driver.prepare`), beyond config validation."""

from __future__ import annotations

from cluster.config import load_config
from cluster.run.driver import prepare


def test_top_p_below_one_warns_that_the_mismatch_metric_holds_the_nucleus_renormalisation(capsys):
    _, scorer = prepare(load_config(None, ["rollout.top_p=0.9"]), None)
    scorer.close()
    err = capsys.readouterr().err
    assert "warning: rollout.top_p=0.9 < 1" in err and "logprob/mismatch" in err and err.count("\n") == 1
    _, scorer = prepare(load_config(None, []), None)
    scorer.close()
    assert capsys.readouterr().err == ""


def test_asynchronous_training_with_more_threads_than_cores_warns(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    # The demo's defaults: learner 2 + two engines of 1 + reference 2 threads = 6 on 2 cores.
    _, scorer = prepare(load_config(None, ["rollout.max_staleness=1"]), None)
    scorer.close()
    err = capsys.readouterr().err
    assert "warning: rollout.max_staleness=1" in err and "6 threads on 2 cores" in err and err.count("\n") == 1
    one_core_each = ["rollout.num_workers=1", "learner.num_threads=1", "learner.kl_coef=0"]
    for overrides in (["rollout.max_staleness=1", *one_core_each], []):  # 2 threads on 2 cores; on-policy
        _, scorer = prepare(load_config(None, overrides), None)
        scorer.close()
        assert capsys.readouterr().err == ""

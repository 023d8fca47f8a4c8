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

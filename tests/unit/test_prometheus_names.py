"""Prometheus metrics without Ray: the name rule, the gauges and counters a real server on 127.0.0.1 serves after a few
records (parsed with prometheus_client's own parser, in both of its formats), the port released at close, a taken
port or a foreign address refused before anything starts: by `check_logging`, and by `relay train` (exit code 2, one
line, nothing written); and the Grafana dashboard charts only metrics a run serves."""

from __future__ import annotations

import json
import math
import re
import socket
from pathlib import Path

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from cluster.cli.commands import main
from cluster.run.metrics import check_logging
from cluster.run.prometheus import RUN_COUNTS, STEP_COUNTS, PrometheusExporter, counter_name, metric_name
from cluster.run_sections import LoggingConfig

ROOT = Path(__file__).resolve().parents[2]
VALID_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")  # Prometheus' metric names, without the colons of rules


@pytest.mark.parametrize("key, name", [
    ("reward/mean", "relay_reward_mean"),
    ("eval/pass@1", "relay_eval_pass_at_1"),
    ("eval/mean@16", "relay_eval_mean_at_16"),
    ("verifier/my-check/latency_mean_s", "relay_verifier_my_check_latency_mean_s"),
    ("time/generate", "relay_time_generate"),
    ("reward/a.b c", "relay_reward_a_b_c"),
    ("weird//key/", "relay_weird_key"),
    ("step", "relay_step"),
])
def test_a_key_becomes_relay_and_its_characters_made_valid(key, name):
    assert metric_name(key) == name
    assert VALID_NAME.match(name)


def test_counted_keys_are_named_apart_from_their_gauges():
    assert counter_name("rollout/restarts") == "relay_rollout_restarts_cumulative_total"
    names = [metric_name(k) for k in STEP_COUNTS + RUN_COUNTS]
    assert len(set(names)) == len(names)
    assert not {counter_name(k).removesuffix("_total") for k in STEP_COUNTS + RUN_COUNTS} & set(names)


def scrape(url: str, openmetrics: bool = False) -> dict[str, tuple[str, dict, float]]:
    """sample name -> (its family's type, labels, value), parsed by prometheus_client's own parser."""
    headers = {"Accept": "application/openmetrics-text; version=1.0.0"} if openmetrics else {}
    reply = httpx.get(url, headers=headers, timeout=5)
    reply.raise_for_status()
    parse = parse_openmetrics if openmetrics else text_string_to_metric_families
    return {s.name: (family.type, s.labels, s.value) for family in parse(reply.text) for s in family.samples}


@pytest.fixture
def exporter():
    served = PrometheusExporter("127.0.0.1", 0, "try1")
    yield served
    served.close()


def test_gauges_hold_the_latest_values_and_counters_add_up(exporter):
    assert exporter.url == f"http://127.0.0.1:{exporter.port}/metrics" and exporter.port > 0
    assert scrape(exporter.url) == {}  # nothing before the first record
    exporter.update({"step": 1, "reward/mean": 0.25, "kl/mean": 0.5, "eval/pass@1": 0.75, "verifier/failures": 2.0,
                     "verifier/retries": 3.0, "rollout/restarts": 1, "train/skipped_updates": 0.0,
                     "note": "text", "rollout/completions": 64, "converged": True})
    exporter.update({"step": 2, "reward/mean": 0.5, "sync/probe_max_diff": None,
                     "verifier/failures": 1.0, "verifier/retries": 0.0, "rollout/restarts": 3,
                     "train/skipped_updates": 1.0, "rollout/completions": 32})
    for openmetrics in (False, True):
        samples = scrape(exporter.url, openmetrics)
        gauges = {name: value for name, (kind, _, value) in samples.items() if kind == "gauge"}
        assert gauges == {
            "relay_step": 2.0, "relay_reward_mean": 0.5, "relay_rollout_completions": 32.0, "relay_converged": 1.0,
            "relay_kl_mean": 0.5, "relay_eval_pass_at_1": 0.75,  # not in step 2's record: unchanged
            "relay_verifier_failures": 1.0, "relay_verifier_retries": 0.0, "relay_rollout_restarts": 3.0,
            "relay_train_skipped_updates": 1.0}  # no string, no sync/probe_max_diff (never a number)
        counters = {name: value for name, (kind, _, value) in samples.items() if kind == "counter"}
        assert counters == {"relay_verifier_failures_cumulative_total": 3.0,  # per step: 2 + 1
                            "relay_verifier_retries_cumulative_total": 3.0,
                            "relay_train_skipped_updates_cumulative_total": 1.0,
                            "relay_rollout_restarts_cumulative_total": 3.0}  # so far: 1, then up by 2
        assert {tuple(labels.items()) for _, labels, _ in samples.values()} == {(("run", "try1"),)}


def test_a_value_that_turns_non_finite_is_served_as_such_not_as_its_last_finite_one(exporter):
    # A loss that diverges must not look healthy: NaN and the infinities are served as they are (both formats carry
    # them); a key a record lacks, or holds None for, keeps its last value.
    exporter.update({"step": 1, "loss/policy": 0.5, "grad_norm": 2.0, "kl/mean": 0.1, "eval/pass@1": 0.75})
    exporter.update({"step": 2, "loss/policy": math.nan, "grad_norm": math.inf, "kl/mean": -math.inf})
    for openmetrics in (False, True):
        samples = scrape(exporter.url, openmetrics)
        assert math.isnan(samples["relay_loss_policy"][2]), samples["relay_loss_policy"]
        assert samples["relay_grad_norm"][2] == math.inf and samples["relay_kl_mean"][2] == -math.inf
        assert samples["relay_eval_pass_at_1"][2] == 0.75 and samples["relay_step"][2] == 2.0
    exporter.update({"step": 3, "loss/policy": 0.25, "grad_norm": None})
    samples = scrape(exporter.url)
    assert samples["relay_loss_policy"][2] == 0.25 and samples["relay_grad_norm"][2] == math.inf


def test_a_count_kept_so_far_that_falls_counts_as_started_again(exporter):
    for restarts in (2, 2, 5, 1):  # 1 after 5: a new count (a resumed run's), as Prometheus reads a reset
        exporter.update({"step": 1, "rollout/restarts": restarts})
    assert scrape(exporter.url)["relay_rollout_restarts_cumulative_total"][2] == 6.0


def test_two_keys_with_one_name_serve_the_first_and_warn_once(exporter, capsys):
    exporter.update({"step": 1, "reward/a-b": 1.0, "reward/a_b": 2.0})
    exporter.update({"step": 2, "reward/a-b": 3.0, "reward/a_b": 4.0})
    assert scrape(exporter.url)["relay_reward_a_b"][2] == 3.0
    assert capsys.readouterr().err.count("reward/a-b and reward/a_b both have the Prometheus name") == 1


def test_close_releases_the_port():
    served = PrometheusExporter("127.0.0.1", 0, "r")
    served.update({"step": 1, "reward/mean": 1.0})
    assert scrape(served.url)["relay_reward_mean"][2] == 1.0
    served.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(served.url, timeout=5)
    again = PrometheusExporter("127.0.0.1", served.port, "r")  # the same port at once, as the next run would
    again.close()
    served.close()  # twice: nothing happens


def test_serving_beyond_loopback_warns_once_in_one_line_and_loopback_does_not(capsys):
    for host in ("127.0.0.1", "localhost"):
        PrometheusExporter(host, 0, "r").close()
    assert "warning" not in capsys.readouterr().err
    served = PrometheusExporter("0.0.0.0", 0, "r")  # every address of this machine: the network's too
    served.update({"step": 1, "reward/mean": 1.0})
    assert scrape(f"http://127.0.0.1:{served.port}/metrics")["relay_reward_mean"][2] == 1.0
    served.close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("relay: warning: ") and "0.0.0.0" in err, err
    assert "logging.prometheus_host=127.0.0.1" in err


@pytest.fixture
def taken_port():
    """A port something listens on, as another exporter would."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_check_logging_refuses_a_taken_port_and_a_foreign_address(taken_port):
    with pytest.raises(ValueError, match=f"logging.prometheus_port={taken_port}: cannot serve metrics there "
                                         r"\(Address already in use\); .*pick another logging.prometheus_port"):
        check_logging(LoggingConfig(tensorboard=False, prometheus_port=taken_port))
    with pytest.raises(ValueError, match="192.0.2.1 .*cannot serve metrics there"):  # TEST-NET-1: no machine's own
        check_logging(LoggingConfig(tensorboard=False, prometheus_port=9464, prometheus_host="192.0.2.1"))
    check_logging(LoggingConfig(tensorboard=False, prometheus_port=0))  # any free port
    check_logging(LoggingConfig(tensorboard=False))  # not served: nothing checked


def test_relay_train_on_a_taken_port_is_one_line_exit_2_and_writes_nothing(taken_port, tmp_path, capsys):
    assert main(["train", f"run_dir={tmp_path / 'run'}", f"logging.prometheus_port={taken_port}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("relay: ") and "Traceback" not in err, err
    assert f"logging.prometheus_port={taken_port}: cannot serve metrics there (Address already in use)" in err
    assert not any(tmp_path.iterdir())


def documented_keys() -> set[str]:
    """The metric keys the table of docs/operations.md's "Metrics and what healthy looks like" names (its second
    column; placeholders such as `reward/<source>` left out, `eval/pass@k` as its first, pass@1), and `step`."""
    text = (ROOT / "docs" / "operations.md").read_text()
    table = text.split("## Metrics and what healthy looks like")[1].split("\n## ")[0]
    rows = [line.split(" | ")[1] for line in table.splitlines() if line.startswith("| ") and " | " in line]
    keys = {key.replace("@k", "@1").replace("@n", "@1") for row in rows for key in re.findall(r"`([^`]+)`", row)}
    return {key for key in keys if not re.search(r"[<>*. ]", key)} | {"step"}


def test_the_dashboard_charts_only_metrics_a_run_serves():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "relay-dashboard.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert all(t["datasource"]["uid"] == "${datasource}" for panel in dashboard["panels"] for t in panel["targets"])
    assert all('run=~"$run"' in expr for expr in exprs)
    gauges = {metric_name(key) for key in documented_keys()}
    counted = {metric_name(key)[len("relay_"):] for key in STEP_COUNTS + RUN_COUNTS}
    named = {name for expr in exprs for name in re.findall(r"\brelay_\w*[a-z0-9]\b", expr)}
    assert named and not named - gauges, sorted(named - gauges)
    alternatives = {a for expr in exprs for group in re.findall(r"relay_\(([\w|]+)\)_cumulative_total", expr)
                    for a in group.split("|")}
    assert alternatives and not alternatives - counted, sorted(alternatives - counted)
    for phase in ("generate", "train", "sync", "reference", "step"):  # what the brief of the dashboard asks for
        assert f"relay_time_{phase}" in named
    assert {"relay_reward_mean", "relay_eval_reward_mean", "relay_kl_mean", "relay_async_staleness",
            "relay_logprob_mismatch", "relay_mismatch_kl", "relay_sync_probe_max_diff",
            "relay_throughput_tokens_per_s"} <= named


def emitted_reward_names() -> set[str]:
    """The Prometheus names of the reward metrics an iterative GRPO run (configs/iterative_grpo.yaml: a verifier and a
    reward model it fine-tunes) records: `reward/*`, and `reward_model/<name>/*` with the keys its fit returns (its
    losses' own metrics and units, actors/reward_model.py)."""
    import torch

    from actors.reward_model import REWARD_MODEL_LOSSES
    from cluster.config import load_config

    sources = load_config(ROOT / "configs" / "iterative_grpo.yaml").reward.sources
    fitted = {"loss", "loss_before", "grad_norm", "updates", "skipped_updates"}
    for loss in REWARD_MODEL_LOSSES.values():
        fit = loss(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0]), 2)
        fitted |= {fit.unit, *fit.metrics, *(f"{name}_before" for name in fit.metrics)}
    keys = {"reward/mean", "reward/std", *(f"reward/{name}" for name in sources),
            *(f"reward_model/{name}/{key}" for name, source in sources.items() if getattr(source, "train", None)
              for key in fitted)}
    return {metric_name(key) for key in keys}


def selects(expr: str, name: str) -> bool:
    """Whether PromQL selector `expr`'s `__name__` matchers (`=~`, `!~`: RE2, anchored at both ends) take `name`."""
    matchers = re.findall(r'__name__\s*(=~|!~)\s*"((?:[^"\\]|\\.)*)"', expr)
    assert matchers, expr
    return all(bool(re.fullmatch(pattern.replace("\\\\", "\\"), name)) == (op == "=~") for op, pattern in matchers)


def test_the_dashboards_reward_sources_are_the_reward_sources_and_nothing_else():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "relay-dashboard.json").read_text())
    [expr] = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]
              if "relay_reward_" in t["expr"] and "__name__" in t["expr"]]
    names = emitted_reward_names()
    assert {"relay_reward_correct", "relay_reward_rm", "relay_reward_model_rm_loss",
            "relay_reward_model_rm_accuracy", "relay_reward_model_rm_pairs"} <= names  # what the check rests on
    assert {name for name in names if selects(expr, name)} == {"relay_reward_correct", "relay_reward_rm"}
    assert selects(expr, "relay_reward_model")  # a source named `model`; `model_*` ones read as a reward model's


def test_every_counted_key_is_a_documented_metric():
    assert not set(STEP_COUNTS + RUN_COUNTS) - documented_keys()

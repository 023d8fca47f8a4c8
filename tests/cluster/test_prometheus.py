"""Prometheus metrics of a real run (real Ray, real vLLM engines, the demo model): scraped over HTTP while the run
trains, every scrape shows one step's record exactly (gauges), the counters only grow and add up the records' counts,
every series carries the run's label, and the port is free again once the run ends."""

from __future__ import annotations

import math
import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import load_config
from cluster.run.launch import run_training
from cluster.run.metrics import read_records
from cluster.run.prometheus import RUN_COUNTS, STEP_COUNTS, metric_name
from tests.fleets import POOL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Scraper(threading.Thread):
    """Scrapes `url` every few milliseconds until stopped, as Prometheus would (more often); keeps every scrape as
    {sample name: (family type, labels, value)}."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.scrapes, self.stopped = url, [], threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.stopped.is_set():
                try:
                    text = client.get(self.url).text
                except httpx.TransportError:  # not serving yet (or any more)
                    time.sleep(0.02)
                    continue
                self.scrapes.append({s.name: (f.type, s.labels, s.value)
                                     for f in text_string_to_metric_families(text) for s in f.samples})
                time.sleep(0.02)


def test_a_running_run_serves_each_steps_record_and_frees_its_port(ray_local, tmp_path, demo_model_dir, capsys):
    port, run_dir = free_port(), tmp_path / "watched"
    config = load_config(None, [f"run_dir={run_dir}", f"model.path={demo_model_dir}", "max_steps=3",
                                "data.prompts_per_step=8", f"logging.prometheus_port={port}",
                                "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=1"])
    url = f"http://127.0.0.1:{port}/metrics"
    scraper = Scraper(url)
    scraper.start()
    try:
        returned = run_training(config, run_dir, display=False, pool=POOL)
    finally:
        scraper.stopped.set()
        scraper.join()
    assert f"relay: Prometheus metrics at {url}\n" in capsys.readouterr().err
    records = read_records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and records == returned

    served = [s for s in scraper.scrapes if s]  # before the first record a scrape is empty
    assert {int(s["relay_step"][2]) for s in served} == {1, 2, 3}  # scraped during the run, at every step
    previous: dict[str, float] = {}
    for scrape in served:
        step = int(scrape["relay_step"][2])
        record = records[step - 1]
        numbers = {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        assert "reward/mean" in numbers and "time/step" in numbers
        gauges = {name: value for name, (kind, _, value) in scrape.items() if kind == "gauge"}
        assert {metric_name(k): v for k, v in numbers.items()}.items() <= gauges.items()  # exactly this step's
        assert {tuple(labels.items()) for _, labels, _ in scrape.values()} == {(("run", "watched"),)}
        counters = {name: value for name, (kind, _, value) in scrape.items() if kind == "counter"}
        for key in STEP_COUNTS:  # this step's count added to the earlier steps'
            if key in record:
                assert counters[metric_name(key) + "_cumulative_total"] == sum(r[key] for r in records[:step])
        for key in RUN_COUNTS:  # kept so far by the run: the counter follows it
            if key in record:
                assert counters[metric_name(key) + "_cumulative_total"] == record[key]
        assert all(value >= previous.get(name, 0.0) for name, value in counters.items())  # monotonic
        previous = counters
    assert {"relay_verifier_failures_cumulative_total", "relay_sampling_dropped_groups_cumulative_total",
            "relay_rollout_restarts_cumulative_total"} <= previous.keys()
    assert previous["relay_sampling_dropped_groups_cumulative_total"] > 0  # groups all right or all wrong

    with pytest.raises(httpx.ConnectError):  # the server is gone ...
        httpx.get(url, timeout=5)
    with socket.socket() as again:  # ... and its port free for the next run
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
        again.listen()

"""A run's metrics for Prometheus: with `logging.prometheus_port` the driver serves `/metrics`, every key of the latest
step's record as a gauge and the run's failures, drops, retries and restarts as counters, labelled with the run.

Owns: the names (`metric_name`: a record key made a valid Prometheus name), which keys also count (`STEP_COUNTS`,
`RUN_COUNTS`), the HTTP server's life (a daemon thread, started with the recorder, shut down when the run ends, its
port released, a warning when it is bound beyond loopback) and the check, before anything starts, that its address can
be bound (`check_prometheus`).
Does not own: the records (cluster/run/metrics.py fans them out to every sink) or the dashboard
(deploy/grafana/relay-dashboard.json). prometheus_client is imported only when a run serves metrics.

A scrape reads one snapshot, replaced whole after each record, so it never mixes two steps' values; updating it is a
few dict operations on the driver's thread, and the server answers from its own threads.
"""

from __future__ import annotations

import errno
import math
import re
import socket
import sys
from collections.abc import Iterator
from typing import Any

from rewards.config import is_loopback

PREFIX = "relay_"
# Keys a record holds as this step's count: their counter grows by the value.
STEP_COUNTS = ("verifier/failures", "verifier/retries", "verifier/dropped_groups", "env/failures",
               "env/dropped_groups", "env/invalid_calls", "sampling/dropped_groups", "sampling/filler_groups",
               "eval/dropped_groups", "train/skipped_updates")
# Keys a record holds as the count so far: their counter grows by each increase.
RUN_COUNTS = ("rollout/restarts", "rollout/scale_events", "rollout/scale_failures", "data/filtered_prompts")
# A counter's family is named apart from the gauge of the same key: OpenMetrics, which Prometheus asks for first,
# refuses two families of one name.
COUNTER_SUFFIX = "_cumulative"


def metric_name(key: str) -> str:
    """The Prometheus name of record key `key`: `relay_` + the key with `@` spelled `_at_`, every other character
    that is not a letter, digit or `_` made `_`, runs of `_` made one and none at either end (`reward/mean` ->
    `relay_reward_mean`, `eval/pass@1` -> `relay_eval_pass_at_1`, `verifier/my-check/latency_mean_s` ->
    `relay_verifier_my_check_latency_mean_s`)."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", key.replace("@", "_at_"))
    return PREFIX + re.sub(r"_+", "_", name).strip("_")


def counter_name(key: str) -> str:
    """The counter of `key` (one of `STEP_COUNTS` or `RUN_COUNTS`) as scraped:
    `relay_rollout_restarts_cumulative_total`."""
    return metric_name(key) + COUNTER_SUFFIX + "_total"


def check_prometheus(host: str, port: int | None) -> None:
    """Raise ValueError (one line: what is wrong and how to fix it) if metrics are asked for and prometheus_client is
    not installed, `host` is not an address of this machine, or `port` is taken. Binds and closes a socket, with the
    server's own options, so a port that a finished run's connections still linger on counts as free."""
    if port is None:
        return
    _import_prometheus()
    where = f"logging.prometheus_host={host} logging.prometheus_port={port}"
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise ValueError(f"{where}: '{host}' is not a host name or address here ({err.strerror}); set "
                         "logging.prometheus_host to an address of this machine (127.0.0.1, or 0.0.0.0 for all)") \
            from None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's socket (http.server's)
        try:
            probe.bind(address)
        except OSError as err:
            taken = err.errno == errno.EADDRINUSE
            fix = ("another run or exporter has it: pick another logging.prometheus_port, or 0 for any free one"
                   if taken else "set logging.prometheus_host to an address of this machine (127.0.0.1, or 0.0.0.0 "
                   "for all) and the port to one you may bind (above 1023 unless root)")
            raise ValueError(f"{where}: cannot serve metrics there ({err.strerror}); {fix}") from None


class PrometheusExporter:
    """Serves the latest record at http://`host`:`port`/metrics (port 0: any free one, `url` says which) from a
    private registry, so several runs in one process do not clash. Every label set is `{run="<run>"}`.

    Gauges: every key a record has a number for, named by `metric_name`, at its latest value, NaN and the infinities
    included (a loss that diverged shows as NaN, not as its last finite value; a NaN that means "does not apply",
    such as `sync/probe_max_diff` without a probe, shows the same way): a key whose value is None, or that a record
    lacks (`eval/*` between evaluations), keeps the value it last had (`relay_step` and `relay_eval_step` say which
    step they are from); a key no record had a number for is not served.
    Counters: `counter_name(key)` for every key of `STEP_COUNTS` (grown by each record's finite value) and
    `RUN_COUNTS` (grown by each increase, the first value counting whole), from 0 when this process started serving.
    Two keys with one name: the first one seen is served, the other is left out with a warning."""

    def __init__(self, host: str, port: int, run: str):
        prometheus = _import_prometheus()
        self.run = run
        # (gauges, counters), each name -> (key, value): replaced whole, so a scrape never sees half a record
        self._snapshot: tuple[dict[str, tuple[str, float]], dict[str, tuple[str, float]]] = ({}, {})
        self._last_run_counts: dict[str, float] = {}
        self._keys: dict[str, str] = {}  # name -> the key it was first given to
        self._warned: set[tuple[str, str]] = set()
        self._metric_families = prometheus.core
        registry = prometheus.CollectorRegistry(auto_describe=False)
        registry.register(self)
        try:
            self._server, self._thread = prometheus.start_http_server(port, addr=host, registry=registry)
        except OSError as err:  # taken since `check_prometheus` looked
            raise ValueError(f"logging.prometheus_host={host} logging.prometheus_port={port}: cannot serve metrics "
                             f"there ({err.strerror}); pick another port, or 0 for any free one") from None
        self.port = self._server.server_port
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"
        if not is_loopback(host):  # as the services do (rewards/service.py); /metrics has no token to ask for
            print(f"relay: warning: serving metrics on {host}, beyond loopback, without authentication: anyone who "
                  f"can reach port {self.port} can read them; set logging.prometheus_host=127.0.0.1 unless a "
                  "firewall or network policy keeps others out", file=sys.stderr, flush=True)

    def update(self, record: dict[str, Any]) -> None:
        """Take `record` (one step's metrics) into the snapshot the next scrape reads."""
        gauges, counters = (dict(served) for served in self._snapshot)
        for key, value in record.items():
            if not isinstance(value, (int, float)) or not self._claim(metric_name(key), key):
                continue
            gauges[metric_name(key)] = (key, float(value))
            if (key in STEP_COUNTS or key in RUN_COUNTS) and math.isfinite(value):  # a NaN would stick for good
                grown = value if key in STEP_COUNTS else _increase(self._last_run_counts.get(key, 0.0), value)
                self._last_run_counts[key] = float(value)
                name = metric_name(key) + COUNTER_SUFFIX
                counters[name] = (key, counters.get(name, (key, 0.0))[1] + max(0.0, float(grown)))
        self._snapshot = (gauges, counters)

    def collect(self) -> Iterator[Any]:
        """The registry's collector: the snapshot as metric families."""
        core, labels = self._metric_families, ["run"]
        gauges, counters = self._snapshot
        for name, (key, value) in gauges.items():
            family = core.GaugeMetricFamily(name, f"relay metric {key} (docs/operations.md)", labels=labels)
            family.add_metric([self.run], value)
            yield family
        for name, (key, total) in counters.items():
            family = core.CounterMetricFamily(name, f"relay metric {key}, counted since the run's process started",
                                              labels=labels)
            family.add_metric([self.run], total)
            yield family

    def close(self) -> None:
        """Stop serving and release the port (waits for the server's loop to notice, within its poll interval)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._server = None

    def _claim(self, name: str, key: str) -> bool:
        """Whether `name` is `key`'s (the first key given it); warns once for a second key with the same name."""
        owner = self._keys.setdefault(name, key)
        if owner != key and (name, key) not in self._warned:
            self._warned.add((name, key))
            print(f"relay: warning: metrics {owner} and {key} both have the Prometheus name {name}; only {owner} is "
                  "served", file=sys.stderr, flush=True)
        return owner == key


def _increase(previous: float, value: float) -> float:
    """How much a count kept so far grew; a count that went down started again (as Prometheus reads a reset)."""
    return value - previous if value >= previous else value


def _import_prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError:
        raise ValueError("logging.prometheus_port needs the prometheus-client package: pip install prometheus-client, "
                         "or leave logging.prometheus_port unset") from None
    return prometheus_client

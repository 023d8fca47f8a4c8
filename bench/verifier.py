"""Throughput and latency of remote scoring: the RemoteVerifier client against the reference service on loopback.

Usage: python bench/verifier.py [--samples N] [--repeats R] [--workers W]
Starts `relay verifier serve --verifier exact_match` as a subprocess (its own process, so client and service do
not share a GIL), then scores N samples at each batch size x concurrency limit and prints a Markdown table of the
median over R repeats: samples/s, the whole call's time, and the mean / max latency of one request. Last, the cost
of one demo step's scoring (256 samples, the default client config), to compare with the demo's step time.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import start_service  # noqa: E402

BATCH_SIZES = [16, 64, 256]
CONCURRENCY = [1, 4, 16]


def measure(url: str, samples, repeats: int, **config) -> dict[str, float]:
    """Median over `repeats` calls (after one warm-up) of the call time and the requests' latencies."""
    from rewards.config import RemoteSource
    from rewards.remote import RemoteVerifier

    runs = []
    with RemoteVerifier("bench", RemoteSource(type="remote", urls=[url], **config)) as verifier:
        verifier.score(samples)  # warm-up: connections, first-call imports
        for _ in range(repeats):
            start = time.perf_counter()
            scores = verifier.score(samples)
            runs.append((time.perf_counter() - start, scores.metrics))
            assert scores.metrics["failures"] == 0, scores.metrics
    seconds = statistics.median(r[0] for r in runs)
    return {"seconds": seconds, "samples_per_s": len(samples) / seconds,
            "latency_mean_s": statistics.median(r[1]["latency_mean_s"] for r in runs),
            "latency_max_s": statistics.median(r[1]["latency_max_s"] for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2048, help="samples per scoring call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4, help="the service's --workers")
    args = parser.parse_args()

    from rewards.remote import VerifierSample

    def make(n: int):
        return [VerifierSample(id=str(i), prompt=f"{i}+{i}=", completion=str(2 * i + i % 2), label=str(2 * i))
                for i in range(n)]

    process, url = start_service(["verifier", "serve", "--verifier", "exact_match", "--workers", str(args.workers)])
    try:
        rows = [(b, c, measure(url, make(args.samples), args.repeats, batch_size=b, max_concurrency=c))
                for b in BATCH_SIZES for c in CONCURRENCY]
        step = measure(url, make(256), max(args.repeats, 10))  # the client's defaults: batch 64, concurrency 8
    finally:
        process.terminate()
        process.wait(timeout=30)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}; service: "
          f"exact_match, {args.workers} workers, loopback; {args.samples} samples per call, median of {args.repeats}")
    print("| batch_size | max_concurrency | samples/s | call s | request latency mean s | max s |")
    print("|---|---|---|---|---|---|")
    for batch, concurrency, m in rows:
        print(f"| {batch} | {concurrency} | {m['samples_per_s']:,.0f} | {m['seconds']:.3f} | "
              f"{m['latency_mean_s']:.4f} | {m['latency_max_s']:.4f} |")
    print(f"demo step (256 samples, default client config batch_size=64, max_concurrency=8): "
          f"{step['seconds']:.4f} s ({step['samples_per_s']:,.0f} samples/s)")


if __name__ == "__main__":
    main()

"""Run N steps of the demo and print a table of median seconds per phase and the driver's overhead.

Usage: python bench/step_breakdown.py [--steps N] [dotted.key=value ...]
Overhead = step time minus the sum of the five phases (prompt sampling, bookkeeping, Ray call latency not inside
a phase). Target: under 10% of the step time.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ["generate", "score", "reference", "train", "sync"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from cluster.config import load_config
    from cluster.demo_model import ensure_demo_model
    from cluster.driver import run_training

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(None, [f"max_steps={args.steps}", f"run_dir={tmp}/run", *args.overrides])
        model_path = config.model.path or str(ensure_demo_model())
        records = run_training(config, Path(tmp) / "run", model_path, display=False)
    records = records[1:] if len(records) > 1 else records  # step 1 pays one-off kernel builds
    median = {p: statistics.median(r[f"time/{p}"] for r in records) for p in PHASES}
    step = statistics.median(r["time/step"] for r in records)
    overhead = statistics.median(r["time/step"] - sum(r[f"time/{p}"] for p in PHASES) for r in records)
    print(f"machine: {platform.machine()}, {__import__('os').cpu_count()} cores, {platform.python_version()}; "
          f"steps measured: {len(records)} (step 1 excluded)")
    print(f"| phase | median s | share of step |\n|---|---|---|")
    for phase in PHASES:
        print(f"| {phase} | {median[phase]:.3f} | {median[phase] / step:.1%} |")
    print(f"| overhead | {overhead:.4f} | {overhead / step:.2%} |")
    print(f"| **step** | {step:.3f} | 100% |")


if __name__ == "__main__":
    main()

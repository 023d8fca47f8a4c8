"""Run N steps of the demo and print a table of median seconds per phase and the driver's overhead.

Usage: python bench/step_breakdown.py [--steps N] [dotted.key=value ...]
Phases are the step's `time/*` metrics (`time/recovery` is inside generate and sync, not a phase of its own); a
`time/*` key this script does not know stops it, so a new phase never lands in "overhead" unnoticed. The first record's
`time/startup/*` (the run's start, before its first step: bench/startup.py) are not the step's.
Overhead = step time minus the sum of the phases (prompt sampling, reward bookkeeping, metric assembly, Ray call
latency not inside a phase). Target: under 10% of the step time.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ["scale", "generate", "score", "reference", "train", "sync"]  # in the order a step runs them
NESTED = ["recovery"]  # seconds counted inside the phases above
IDLE = ["learner_wait", "rollout_idle"]  # seconds the learner, and the engines, waited: not phases of the step
OPTIONAL = ["teacher"]  # phases of some runs only (on-policy distillation's), tabled when the records have them
STARTUP = "time/startup/"  # the first record's: the run's start (cluster/run/startup.py), not a phase of a step


def check_phases(record: dict) -> None:
    """Stop if the record has a `time/*` key that is neither a phase, nor nested, nor the step."""
    known = {f"time/{name}" for name in [*PHASES, *OPTIONAL, *NESTED, *IDLE, "step"]}
    unknown = sorted(key for key in record if key.startswith("time/") and key not in known
                     and not key.startswith(STARTUP))
    if unknown:
        raise SystemExit(f"{', '.join(unknown)}: not a phase this script knows; add it to PHASES (or NESTED)")


def table(records: list[dict]) -> str:
    """The Markdown table docs/benchmarks.md shows: median seconds and share of the step, per phase."""
    for record in records:
        check_phases(record)
    phases = [p for p in PHASES + OPTIONAL if p in PHASES or any(f"time/{p}" in r for r in records)]
    median = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in records) for p in phases}
    step = statistics.median(r["time/step"] for r in records)
    overhead = statistics.median(r["time/step"] - sum(r.get(f"time/{p}", 0.0) for p in phases) for r in records)
    rows = ["| phase | median s | share of step |", "|---|---|---|"]
    rows += [f"| {phase} | {median[phase]:.4f} | {median[phase] / step:.1%} |" for phase in phases]
    rows += [f"| overhead | {overhead:.4f} | {overhead / step:.1%} |", f"| **step** | {step:.4f} | 100% |"]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from cluster.config import load_config
    from cluster.run.launch import run_training

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(None, [f"max_steps={args.steps}", f"run_dir={tmp}/run", *args.overrides])
        records = run_training(config, Path(tmp) / "run", display=False)
    records = records[1:] if len(records) > 1 else records  # step 1 pays one-off kernel builds
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"steps measured: {len(records)} (step 1 excluded)")
    print(table(records))


if __name__ == "__main__":
    main()

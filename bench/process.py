"""Process supervision against outcome-only reward on the chained-sum demo task: does a reward per step learn faster?

Usage: python bench/process.py [--steps N] [--seeds 0 1] [dotted.key=value ...]
Runs configs/grpo_process.yaml (each partial sum a step, scored by `step_match`; DeepSeekMath's process GRPO) and
the same config with the outcome reward only (the whole answer by `exact_match`, outcome GRPO), for N steps
(default 100) per seed, through the real loop. Both report the whole answer's accuracy as `reward/correct` (a
weight-0 source in the process run), and that is what is compared: the steps until its mean over 10 consecutive
steps first reaches 0.8 and 0.9 ("-" if never), its mean over the last 10 steps, and median seconds per step.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import steps_to_target  # noqa: E402

TARGETS, WINDOW, METRIC = (0.8, 0.9), 10, "reward/correct"
PRESET = ROOT / "configs" / "grpo_process.yaml"


def outcome_only(tmp: Path) -> Path:
    """The preset with its sources replaced by the whole answer's exact match (weight 1) and no steps."""
    config = yaml.safe_load(PRESET.read_text())
    config["reward"] = {"sources": {"correct": {"verifier": "exact_match", "weight": 1.0}}}
    path = tmp / "grpo_outcome.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run(name: str, config_file: Path, seed: int, steps: int, overrides: list[str], tmp: Path) -> dict:
    from cluster.config import load_config
    from cluster.run.launch import run_training

    run_dir = tmp / f"{name}-{seed}"
    config = load_config(config_file, [f"max_steps={steps}", f"seed={seed}", f"run_dir={run_dir}", *overrides])
    records = run_training(config, run_dir, None, display=False)
    accuracy = [r[METRIC] for r in records]
    return {"name": name, "seed": seed, "hits": [steps_to_target(accuracy, t) for t in TARGETS], "first": accuracy[0],
            "last10": statistics.fmean(accuracy[-WINDOW:]),
            "step": statistics.median(r["time/step"] for r in records[1:] or records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("overrides", nargs="*", help="dotted.key=value applied to both runs")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        runs = [("process (step_match per partial sum)", PRESET), ("outcome only (exact_match)", outcome_only(tmp))]
        results = [run(name, path, seed, args.steps, args.overrides, tmp) for seed in args.seeds for name, path in runs]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{args.steps} steps per run; accuracy = {METRIC} (the whole answer exactly right)")
    print("| reward | seed | accuracy at step 1 | " + " | ".join(f"steps to {t} (10-step mean)" for t in TARGETS)
          + " | last-10 accuracy | s/step |")
    print("|---" * (4 + len(TARGETS)) + "|")
    for r in results:
        print(f"| {r['name']} | {r['seed']} | {r['first']:.3f} | " + " | ".join(str(h or "-") for h in r["hits"])
              + f" | {r['last10']:.3f} | {r['step']:.3f} |")


if __name__ == "__main__":
    main()

"""PPO (value model + GAE) against GRPO and RLOO (no value model) on the demo task: what the value model costs.

Usage: python bench/algorithms.py [--steps N] [--algorithms ppo grpo rloo] [dotted.key=value ...]
Runs each preset of configs/ for N steps (default 80) through the real loop and prints, per algorithm: trained
parameters (policy + value model), the learner process's peak resident memory (and its growth over the process
before any model was loaded), median seconds per step and per phase, and the steps and training wall time until the
mean reward over 10 consecutive steps first reaches 0.9 (start-up excluded; "-" if never): for grpo_process and
iterative_grpo, whose rewards are not the verifier's alone, the verifier's accuracy (`reward/correct`) instead.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import steps_to_target as first_step_at  # noqa: E402

PHASES = ["generate", "score", "reference", "train", "sync"]
TARGET, WINDOW = 0.9, 10


# The reward each preset is measured by: the mean reward, or the verifier's accuracy `reward/correct` where the mean
# reward is something else: grpo_process's sums the step rewards (`correct` has weight 0), iterative_grpo's adds a
# reward model's scores (whose level Bradley-Terry leaves free).
METRIC = {"grpo_process": "reward/correct", "iterative_grpo": "reward/correct"}


def steps_to_target(records: list[dict], key: str = "reward/mean") -> int | None:
    """First step at which the mean of `key` over the last WINDOW steps is >= TARGET."""
    return first_step_at([r[key] for r in records], TARGET, WINDOW)


def run(name: str, steps: int, overrides: list[str], tmp: str) -> dict:
    from cluster.config import load_config
    from cluster.demo.cache import ensure_demo_model
    from cluster.run.launch import run_training
    from learner.learner import Learner

    run_dir = Path(tmp) / name
    config = load_config(ROOT / "configs" / f"{name}.yaml", [f"max_steps={steps}", f"run_dir={run_dir}", *overrides])
    model_path = config.model.path or str(ensure_demo_model(task=config.data.task))
    params = Learner(model_path, config.learner, config.model.dtype, critic=config.critic).num_trained_parameters()
    started = time.perf_counter()
    records = run_training(config, run_dir, model_path, display=False)
    wall = time.perf_counter() - started
    timed = records[1:] if len(records) > 1 else records  # step 1 pays one-off kernel builds
    key = METRIC.get(name, "reward/mean")
    hit = steps_to_target(records, key)
    return {
        "name": name, "params": params, "wall": wall,
        "peak_mb": max(r["memory/learner_peak_mb"] for r in records),
        "base_mb": records[0]["memory/learner_base_mb"],
        "step": statistics.median(r["time/step"] for r in timed),
        "phases": {p: statistics.median(r[f"time/{p}"] for r in timed) for p in PHASES},
        "hit": hit, "hit_seconds": sum(r["time/step"] for r in records[:hit]) if hit else None,
        "last10": statistics.fmean(r[key] for r in records[-WINDOW:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--algorithms", nargs="+", default=["ppo", "grpo", "rloo"])
    parser.add_argument("overrides", nargs="*", help="dotted.key=value applied to every preset")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        results = [run(name, args.steps, args.overrides, tmp) for name in args.algorithms]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{args.steps} steps each; medians exclude step 1")
    print("| algorithm | trained params (policy + value) | learner peak RSS MiB (growth) | s/step | "
          + " | ".join(f"{p} s" for p in PHASES) + f" | steps to {TARGET} | train s to {TARGET} | last-10 reward |")
    print("|---" * (7 + len(PHASES)) + "|")
    for r in results:
        p = r["params"]
        hit = str(r["hit"]) if r["hit"] else "-"
        hit_s = f"{r['hit_seconds']:.1f}" if r["hit_seconds"] else "-"
        print(f"| {r['name']} | {p['policy'] + p['critic']:,} ({p['policy']:,} + {p['critic']:,}) | "
              f"{r['peak_mb']:.0f} ({r['peak_mb'] - r['base_mb']:+.0f}) | {r['step']:.3f} | "
              + " | ".join(f"{r['phases'][ph]:.3f}" for ph in PHASES)
              + f" | {hit} | {hit_s} | {r['last10']:.3f} |")
    base = next((r for r in results if r["params"]["critic"]), None)
    for r in results:
        if base is None or r is base:
            continue
        ratio = lambda a, b: a / b if b else float("nan")  # noqa: E731
        bp, rp = base["params"], r["params"]
        print(f"{r['name']} vs {base['name']}: trained params x{ratio(sum(rp.values()), sum(bp.values())):.2f}, "
              f"learner memory growth x{ratio(r['peak_mb'] - r['base_mb'], base['peak_mb'] - base['base_mb']):.2f}, "
              f"train phase x{ratio(r['phases']['train'], base['phases']['train']):.2f}, "
              f"step x{ratio(r['step'], base['step']):.2f}")


if __name__ == "__main__":
    main()

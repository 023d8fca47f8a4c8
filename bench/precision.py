"""Precision on the demo task: float32, bfloat16 on float32 master weights, pure bfloat16, and the rollout correction.

Usage: python bench/precision.py [--steps N] [--variants NAME ...] [dotted.key=value ...]
Runs the demo config (GRPO) through the real loop for N steps (default 80) per variant and prints: median seconds per
step and of the learner's phase, steps until the mean reward of 10 consecutive steps first reaches 0.9 ("-" if
never), the last 10 steps' mean reward, the learner process's peak resident memory (and its growth over the process
before any model was loaded), the mean engine-learner mismatch (`logprob/mismatch`, `mismatch/kl`) and, with a
correction, its mean weight and the share of tokens it capped. Variants (`model.dtype` / `learner.master_dtype`):
float32; bfloat16 (float32 master, the default); bfloat16-pure (bfloat16 master: AdamW rounds most updates away);
bfloat16-tis (float32 master, `learner.rollout_correction=tis`).
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

from bench.algorithms import TARGET, WINDOW, steps_to_target  # noqa: E402

VARIANTS = {
    "float32": ["model.dtype=float32"],
    "bfloat16": ["model.dtype=bfloat16", "learner.master_dtype=float32"],
    "bfloat16-pure": ["model.dtype=bfloat16", "learner.master_dtype=bfloat16"],
    "bfloat16-tis": ["model.dtype=bfloat16", "learner.master_dtype=float32", "learner.rollout_correction=tis"],
}


def run(name: str, steps: int, overrides: list[str], tmp: str) -> dict:
    from cluster.config import load_config
    from cluster.demo_model import ensure_demo_model
    from cluster.driver import run_training

    run_dir = Path(tmp) / name
    config = load_config(None, [f"max_steps={steps}", f"run_dir={run_dir}", *VARIANTS[name], *overrides])
    model_path = config.model.path or str(ensure_demo_model())
    records = run_training(config, run_dir, model_path, display=False)
    timed = records[1:] if len(records) > 1 else records  # step 1 pays one-off kernel builds
    mean = lambda key: statistics.fmean(r[key] for r in records) if key in records[0] else float("nan")  # noqa: E731
    return {
        "name": name, "step": statistics.median(r["time/step"] for r in timed),
        "train": statistics.median(r["time/train"] for r in timed), "hit": steps_to_target(records),
        "last10": statistics.fmean(r["reward/mean"] for r in records[-WINDOW:]),
        "peak_mb": max(r["memory/learner_peak_mb"] for r in records), "base_mb": records[0]["memory/learner_base_mb"],
        "mismatch": mean("logprob/mismatch"), "kl": mean("mismatch/kl"),
        "weight": mean("rollout_correction/weight_mean"), "capped": mean("rollout_correction/capped_fraction"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("overrides", nargs="*", help="dotted.key=value applied to every variant")
    args = parser.parse_args()

    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(name, args.steps, args.overrides, tmp) for name in args.variants]
    print(f"\n{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
          f"{time.strftime('%Y-%m-%d')}; demo config, {args.steps} steps each ({time.time() - started:.0f} s); "
          "medians exclude step 1\n")
    print(f"| variant | s/step | train s | steps to {TARGET} | last-10 reward | learner peak RSS MiB (growth) | "
          "logprob/mismatch | mismatch/kl | correction weight | capped share |")
    print("|---" * 10 + "|")
    for r in results:
        print(f"| {r['name']} | {r['step']:.3f} | {r['train']:.3f} | {r['hit'] or '-'} | {r['last10']:.3f} | "
              f"{r['peak_mb']:.0f} ({r['peak_mb'] - r['base_mb']:+.0f}) | {r['mismatch']:.2e} | {r['kl']:.2e} | "
              + ("-" if r["weight"] != r["weight"] else f"{r['weight']:.4f}") + " | "
              + ("-" if r["capped"] != r["capped"] else f"{r['capped']:.2e}") + " |")


if __name__ == "__main__":
    main()

"""The off-policy correction family on the demo task: IcePop, sequence-masked TIS and CISPO against TIS, the default.

Usage: python bench/corrections.py [--steps N] [--variants NAME ...] [dotted.key=value ...]
Runs the demo config (GRPO) through the real loop for N steps (default 80) per variant, in bfloat16 and one version
stale (`rollout.max_staleness=1`, where the engine and the learner disagree most; override either to compare
elsewhere), and prints: median seconds per step, steps until the mean reward of 10 consecutive steps first reaches
0.9 ("-" if never), the last 10 steps' mean reward, the mean engine-learner mismatch (`mismatch/kl`), and the
correction's mean weight, masked and capped shares and the policy loss's clip share (means over the steps; "-"
where a variant has no such metric).
Variants: tis (the asynchronous default), icepop (band [0.5, 5]), seq_mask_tis (band [0.9, 1.1], cap 2: a band of a
few thousandths masks most sequences in bfloat16, stale or not), cispo
(its weights in [0, 4], two minibatches a step so that the ratio leaves 1; beside tis), cispo-icepop (the two
together).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.algorithms import TARGET, WINDOW, steps_to_target  # noqa: E402  (after the sys.path line)

REGIME = ["model.dtype=bfloat16", "rollout.max_staleness=1"]
CISPO = ["learner.policy_loss=cispo", "learner.num_minibatches=2"]
VARIANTS = {
    "tis": ["learner.rollout_correction=tis"],
    "icepop": ["learner.rollout_correction=icepop"],
    "seq_mask_tis": ["learner.rollout_correction=seq_mask_tis", "learner.rollout_correction_low=0.9",
                     "learner.rollout_correction_high=1.1"],
    "cispo": [*CISPO, "learner.rollout_correction=tis"],
    "cispo-icepop": [*CISPO, "learner.rollout_correction=icepop"],
}
COLUMNS = {"weight": "rollout_correction/weight_mean", "masked": "rollout_correction/masked_fraction",
           "capped": "rollout_correction/capped_fraction", "clip": "clip_fraction", "kl": "mismatch/kl"}


def run(name: str, steps: int, overrides: list[str], tmp: str) -> dict:
    from cluster.config import load_config
    from cluster.demo.cache import ensure_demo_model
    from cluster.run.launch import run_training

    run_dir = Path(tmp) / name
    config = load_config(None, [f"max_steps={steps}", f"run_dir={run_dir}", *REGIME, *VARIANTS[name], *overrides])
    model_path = config.model.path or str(ensure_demo_model())
    records = run_training(config, run_dir, model_path, display=False)
    timed = records[1:] if len(records) > 1 else records  # step 1 pays one-off kernel builds

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in records) if key in records[0] else math.nan

    return {"name": name, "step": statistics.median(r["time/step"] for r in timed), "hit": steps_to_target(records),
            "last10": statistics.fmean(r["reward/mean"] for r in records[-WINDOW:]),
            **{column: mean(key) for column, key in COLUMNS.items()}}


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
          f"{time.strftime('%Y-%m-%d')}; demo config, {' '.join(REGIME + args.overrides)}, {args.steps} steps each "
          f"({time.time() - started:.0f} s); medians exclude step 1\n")
    print(f"| variant | s/step | steps to {TARGET} | last-10 reward | mismatch/kl | weight mean | masked share | "
          "capped share | clip share |")
    print("|---" * 9 + "|")

    def show(value: float, spec: str) -> str:
        return "-" if math.isnan(value) else format(value, spec)

    for r in results:
        print(f"| {r['name']} | {r['step']:.3f} | {r['hit'] or '-'} | {r['last10']:.3f} | {show(r['kl'], '.2e')} | "
              f"{show(r['weight'], '.4f')} | {show(r['masked'], '.2e')} | {show(r['capped'], '.2e')} | "
              f"{show(r['clip'], '.2e')} |")


if __name__ == "__main__":
    main()

"""Precision on the demo task: float32, bfloat16 on float32 master weights, pure bfloat16, and the rollout correction.

Usage: python bench/precision.py [--steps N] [--variants NAME ...] [dotted.key=value ...]
Runs the demo config (GRPO) through the real loop for N steps (default 80) per variant and prints: median seconds per
step and of the learner's phase, steps until the mean reward of 10 consecutive steps first reaches 0.9 ("-" if
never), the last 10 steps' mean reward, the learner process's peak resident memory (and its growth over the process
before any model was loaded), the mean engine-learner mismatch (`logprob/mismatch`, `mismatch/kl`) and, with a
correction, its mean weight and the share of tokens it capped. Variants (`model.dtype` / `learner.master_dtype`):
float32; bfloat16 (float32 master, the default); bfloat16-pure (bfloat16 master: AdamW rounds most updates away);
bfloat16-tis (float32 master, `learner.rollout_correction=tis`).
At the demo's learning rate (5e-5) even pure bfloat16 learns; a second table shows where the master weights matter:
each precision's learner takes `--progress-steps` (30) GRPO steps at lr 1e-6 on one fixed batch of the demo model's
completions, and the table gives how far the rewarded completions' log-probability rose (and the others' fell),
measured by the learner's own forward, as a multiple of float32's.
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
    from cluster.demo.cache import ensure_demo_model
    from cluster.run.launch import run_training

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


PROGRESS_PRECISIONS = {"float32": ("float32", "float32"), "bfloat16": ("bfloat16", "float32"),
                       "bfloat16-pure": ("bfloat16", "bfloat16")}


def progress(steps: int, lr: float) -> dict[str, float]:
    """How far each precision's learner moves a fixed batch's rewarded completions in `steps` on-policy steps."""
    from transformers import AutoTokenizer

    from cluster.demo.cache import ensure_demo_model
    from learner.batch import TrainBatch
    from learner.config import LearnerConfig
    from learner.learner import Learner

    model_path = str(ensure_demo_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pairs = [("37+45=", "82"), ("37+45=", "81"), ("1+2=", "3"), ("1+2=", "4"), ("60+39=", "99"), ("60+39=", "98")]
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p, _ in pairs]
    responses = [tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id] for _, r in pairs]
    rewards = [1.0, 0.0] * 3
    moved = {}
    for name, (dtype, master) in PROGRESS_PRECISIONS.items():
        config = LearnerConfig(lr=lr, warmup_steps=0, kl_coef=0.0, num_threads=2, master_dtype=master)
        learner = Learner(model_path, config, dtype=dtype, seed=0)
        before = [sum(lp) for lp in learner.compute_logprobs(prompts, responses)]
        for _ in range(steps):
            behavior = learner.compute_logprobs(prompts, responses)
            learner.train_step(TrainBatch(prompts, responses, behavior, rewards, 2))
        after = [sum(lp) for lp in learner.compute_logprobs(prompts, responses)]
        moved[name] = sum((a - b) * (1 if r else -1) for a, b, r in zip(after, before, rewards))
    return moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--progress-steps", type=int, default=30)
    parser.add_argument("--progress-lr", type=float, default=1e-6)
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
    moved = progress(args.progress_steps, args.progress_lr)
    print(f"\nlr {args.progress_lr:g}, {args.progress_steps} steps on one fixed batch of 3 demo groups (demo model)\n")
    print("| precision (model.dtype, master) | log-probability moved | x float32 |")
    print("|---|---|---|")
    for name, value in moved.items():
        dtype, master = PROGRESS_PRECISIONS[name]
        print(f"| {name} ({dtype}, {master}) | {value:.3e} | {value / moved['float32']:.2f} |")


if __name__ == "__main__":
    main()

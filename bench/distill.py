"""On-policy distillation against GRPO on the demo, from the same start (the shipped demo model): `configs/grpo.yaml`
and `configs/distill.yaml` (GRPO plus the demo teacher's per-token advantage), each at several learning rates, through
the real loop (real Ray, real vLLM engines), plus distillation alone (`learner.advantage=distill`) at the preset's.

Usage: python bench/distill.py [--steps N] [--lrs 5e-5 1e-4 ...] [dotted.key=value ...]
Per run: the steps until the 10-step mean reward first reaches 0.9 ("-" if never), the mean reward of the last 10
steps, `distill/reverse_kl` at the first and the last step, median s/step and `time/teacher` (step 1 excluded). Also
the teacher's own last-10 reward in its GRPO run (its `relay_demo_report.json`). Overrides go to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import steps_to_target  # noqa: E402

TARGET, WINDOW = 0.9, 10


def run(preset: str, lr: float, steps: int, overrides: list[str], tmp: str) -> dict:
    from cluster.config import load_config
    from cluster.run.launch import run_training

    run_dir = Path(tmp) / f"{preset}-{lr:g}-{len(overrides)}"
    config = load_config(ROOT / "configs" / f"{preset}.yaml",
                         [f"max_steps={steps}", f"learner.lr={lr}", f"run_dir={run_dir}", *overrides])
    records = run_training(config, run_dir, display=False)
    rewards = [r["reward/mean"] for r in records]
    timed = records[1:] if len(records) > 1 else records
    return {"preset": preset if config.learner.advantage != "distill" else "distill (alone)", "lr": lr,
            "hit": steps_to_target(rewards, TARGET, WINDOW), "last10": statistics.fmean(rewards[-WINDOW:]),
            "rkl": (records[0].get("distill/reverse_kl"), records[-1].get("distill/reverse_kl")),
            "step": statistics.median(r["time/step"] for r in timed),
            "teacher": statistics.median(r.get("time/teacher", 0.0) for r in timed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lrs", type=float, nargs="+", default=[5e-5, 1e-4, 1.5e-4, 2e-4])
    args, overrides = parser.parse_known_args()
    from cluster.config import load_config
    from cluster.demo.cache import demo_teacher_dir

    preset_lr = load_config(ROOT / "configs" / "distill.yaml", []).learner.lr
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for lr in args.lrs:
            for preset in ("grpo", "distill"):
                rows.append(run(preset, lr, args.steps, overrides, tmp))
        rows.append(run("distill", preset_lr, args.steps, ["learner.advantage=distill", *overrides], tmp))
    teacher = json.loads((demo_teacher_dir() / "relay_demo_report.json").read_text())
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; {args.steps} steps; "
          f"teacher: {teacher['recipe']} x {teacher['steps']} steps, "
          f"last-10 reward {teacher['reward_mean_last_10']:.3f}")
    print("| run | lr | steps to 0.9 | last-10 reward | reverse KL, first -> last | s/step | teacher s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        first, last = r["rkl"]
        rkl = "-" if first is None else f"{first:.3f} -> {last:.3f}"
        print(f"| {r['preset']} | {r['lr']:g} | {r['hit'] or '-'} | {r['last10']:.3f} | {rkl} | {r['step']:.3f} | "
              f"{r['teacher']:.3f} |")


if __name__ == "__main__":
    main()

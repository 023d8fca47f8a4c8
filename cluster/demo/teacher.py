"""The demo teacher of on-policy distillation (`teacher.path=demo`): the arithmetic demo model after a GRPO run of
`configs/grpo.yaml`, so a stronger model of the student's size and tokenizer.

Owns its recipe: `python -m cluster.demo.teacher --out DIR` trains it with relay itself (a real run, Ray and vLLM
started here) and exports the last checkpoint's policy with a report of the run (`relay_demo_report.json`). relay
ships the result (`cluster/demo/models/demo-teacher-v1`, `cluster.demo.cache.demo_teacher_dir`): the run's float
rounding differs between CPUs, and the distillation numbers in docs/benchmarks.md start from the shipped one.
Does not own the run (cluster/run/launch.py) or the export (cluster/run/export.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from cluster.demo.catalog import DEMO_TEACHER_NAME

RECIPE = "configs/grpo.yaml"  # the preset the teacher is trained with, from the shipped demo model
STEPS = 150  # the run's length: its reward has settled above 0.9 (docs/benchmarks.md, distillation)


def make_demo_teacher(out: Path, steps: int = STEPS, seed: int = 0) -> dict:
    """Train the demo model with `RECIPE` for `steps` steps and write its final policy to `out` (a new directory),
    with `relay_demo_report.json`; returns the report."""
    from cluster.config import load_config
    from cluster.run.export import export_checkpoint
    from cluster.run.launch import run_training

    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="relay-teacher-") as tmp:
        run_dir = Path(tmp) / "run"
        config = load_config(root / RECIPE, [f"max_steps={steps}", f"seed={seed}", f"run_dir={run_dir}",
                                             f"checkpoint.every={steps}"])
        records = run_training(config, run_dir, display=False)
        export_checkpoint(run_dir / "checkpoints" / f"step_{steps}", out, merge=False)
    rewards = [r["reward/mean"] for r in records]
    report = {"name": DEMO_TEACHER_NAME, "recipe": RECIPE, "steps": steps, "seed": seed,
              "reward_first_step": rewards[0], "reward_mean_last_10": statistics.fmean(rewards[-10:])}
    (out / "relay_demo_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description="Make relay's demo teacher for on-policy distillation.")
    parser.add_argument("--out", type=Path, required=True, help="a new directory for the teacher model")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"GRPO steps (default {STEPS})")
    args = parser.parse_args()
    print(json.dumps(make_demo_teacher(args.out, args.steps), indent=2))


if __name__ == "__main__":
    main()

"""The tool-using agent demo (configs/agent_calc.yaml): how fast it learns to call the calculator, with the
environment in the rollout workers and behind `relay env serve`.

Usage: python bench/agent.py [--steps N] [--seeds 0 1] [--no-remote] [dotted.key=value ...]
Runs configs/agent_calc.yaml for N steps (default 40) per seed through the real loop, in-process
(`env.spec`), then, unless --no-remote, the same run with the environment served over HTTP on this machine
(`relay env serve --env rewards.environments.examples:Calculator --param max_calls=2`, `env.urls`). Accuracy is
`reward/env` (the environment's reward: 1 for a right final answer). Printed per run: accuracy at step 1, the steps
until its mean over 10 consecutive steps first reaches 0.8 and 0.9 ("-" if never), the last-10 mean, the last-10
mean of model turns per episode (2: call, then answer), median seconds per step and of `time/env`, the run's wall
clock (the engines' start included, not the model's build), and for a remote run whether every step's reward equals
the in-process run's.
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

from bench.common import start_service, steps_to_target  # noqa: E402

TARGETS, WINDOW, METRIC = (0.8, 0.9), 10, "reward/env"
PRESET = ROOT / "configs" / "agent_calc.yaml"


def run(mode: str, seed: int, steps: int, overrides: list[str], tmp: Path, url: str | None = None) -> dict:
    from cluster.config import load_config
    from cluster.run.launch import run_training
    from rewards.config import EnvironmentConfig

    run_dir = tmp / f"{mode}-{seed}"
    config = load_config(PRESET, [f"max_steps={steps}", f"seed={seed}", f"run_dir={run_dir}", *overrides])
    if url is not None:
        config = config.model_copy(update={"env": EnvironmentConfig(urls=[url])})
    started = time.perf_counter()
    records = run_training(config, run_dir, None, display=False)
    wall = time.perf_counter() - started
    accuracy = [r[METRIC] for r in records]
    return {"mode": mode, "seed": seed, "accuracy": accuracy, "first": accuracy[0],
            "hits": [steps_to_target(accuracy, t) for t in TARGETS],
            "last10": statistics.fmean(accuracy[-WINDOW:]),
            "turns": statistics.fmean(r["env/turns/mean"] for r in records[-WINDOW:]),
            "step": statistics.median(r["time/step"] for r in records[1:] or records),
            "env": statistics.median(r["time/env"] for r in records), "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--no-remote", action="store_true")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value applied to every run")
    args = parser.parse_args()

    from cluster.demo.cache import ensure_demo_model

    ensure_demo_model(task="calc")  # built once, outside the runs' wall clock
    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for seed in args.seeds:
            local = run("in-process", seed, args.steps, args.overrides, tmp)
            results.append(local)
            if not args.no_remote:
                process, url = start_service(["env", "serve", "--env", "rewards.environments.examples:Calculator",
                                              "--param", "max_calls=2"])
                try:
                    remote = run("remote (HTTP)", seed, args.steps, args.overrides, tmp, url)
                finally:
                    process.terminate()
                    process.wait(timeout=30)
                remote["same"] = "yes" if remote["accuracy"] == local["accuracy"] else "NO"
                results.append(remote)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{args.steps} steps per run; accuracy = {METRIC} (the final answer right)")
    print("| environment | seed | accuracy at step 1 | " + " | ".join(f"steps to {t} (10-step mean)" for t in TARGETS)
          + " | last-10 accuracy | last-10 turns/episode | s/step | time/env s | wall s | every step = in-process |")
    print("|---" * (9 + len(TARGETS)) + "|")
    for r in results:
        print(f"| {r['mode']} | {r['seed']} | {r['first']:.3f} | " + " | ".join(str(h or "-") for h in r["hits"])
              + f" | {r['last10']:.3f} | {r['turns']:.2f} | {r['step']:.3f} | {r['env']:.4f} | {r['wall']:.1f} | "
              + f"{r.get('same', '(reference)')} |")


if __name__ == "__main__":
    main()

"""Kill a rollout worker at a random step of the demo, N times, and report what the run lost.

Usage: python bench/faults.py [--runs 10] [--steps 30] [--seed 0] [dotted.key=value ...]
Each run is the demo config for --steps steps; one rollout worker's process kills itself with SIGKILL in the middle
of a generate call at a step drawn at random (2 .. steps-1). Prints, per run: whether it finished, the step of the
kill, prompts lost (completions missing from the steps, / G: must be 0), rewards identical to a run without the
fault (same seeds), restarts and recovery time (killing, starting a new engine, loading and probing the weights).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.rollout import RolloutWorker  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker class below travels by value


def _first(marker: str) -> bool:
    """True for exactly one caller over all processes: workers reach their faulty call at the same moment."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


class KilledOnceWorker(RolloutWorker):
    """SIGKILLs its own process at its `kill_on`-th generate call, once per run (a marker file records it)."""

    marker = ""
    kill_on = 2

    def generate(self, prompts, seeds, sampling, *load, **probe):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == self.kill_on and _first(self.marker):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().generate(prompts, seeds, sampling, *load, **probe)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill steps (not of the runs)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from cluster.config import load_config
    from cluster.demo.cache import ensure_demo_model
    from cluster.run.launch import run_training
    from sync.calls import RunError

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        def config(name):
            return load_config(None, [f"max_steps={args.steps}", f"run_dir={tmp}/{name}", "ray.dashboard=false",
                                      *args.overrides])

        clean = config("clean")
        model_path = clean.model.path or str(ensure_demo_model())
        expected = [r["reward/mean"] for r in run_training(clean, Path(tmp) / "clean", model_path, display=False)]
        per_step = clean.data.prompts_per_step * clean.rollout.group_size
        rows = []
        for n in range(args.runs):
            kill_step = rng.randint(2, args.steps - 1)
            # Every worker generates once per step: its kill_step-th call is in step kill_step.
            worker = type("KilledOnce", (KilledOnceWorker,), {"marker": f"{tmp}/killed-{n}", "kill_on": kill_step})
            started = time.perf_counter()
            try:
                records = run_training(config(f"run{n}"), Path(tmp) / f"run{n}", model_path, display=False,
                                       rollout_cls=worker)
                error = ""
            except RunError as err:
                records, error = [], str(err)
            wall = time.perf_counter() - started
            lost = sum(per_step - r["rollout/completions"] for r in records) / clean.rollout.group_size
            rows.append({"run": n, "kill_step": kill_step, "finished": len(records) == args.steps and not error,
                         "lost": lost + (args.steps - len(records)) * clean.data.prompts_per_step,
                         "same": [r["reward/mean"] for r in records] == expected,
                         "restarts": records[-1]["rollout/restarts"] if records else 0,
                         "recovery": records[-1]["time/recovery"] if records else float("nan"),
                         "wall": wall, "error": error})
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; demo config, "
          f"{args.steps} steps per run, one rollout worker SIGKILLed mid-generation per run")
    print("| run | kill at step | finished | prompts lost | rewards = fault-free run | restarts | recovery s | "
          "run wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['kill_step']} | {'yes' if r['finished'] else 'NO: ' + r['error'][:80]} | "
              f"{r['lost']:.0f} | {'yes' if r['same'] else 'no'} | {r['restarts']} | {r['recovery']:.2f} | "
              f"{r['wall']:.1f} |")
    recoveries = [r["recovery"] for r in rows if r["finished"]]
    print(f"finished {sum(r['finished'] for r in rows)}/{len(rows)}, prompts lost {sum(r['lost'] for r in rows):.0f}, "
          f"identical rewards {sum(r['same'] for r in rows)}/{len(rows)}, recovery median "
          f"{statistics.median(recoveries) if recoveries else float('nan'):.2f} s, max "
          f"{max(recoveries, default=float('nan')):.2f} s")


if __name__ == "__main__":
    main()

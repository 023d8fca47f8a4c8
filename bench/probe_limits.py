"""The sync probe's limits: how far one training step moves the probe's logprobs, against the probe's tolerance.

Usage: python bench/probe_limits.py [--precisions float32 bfloat16 bfloat16/bfloat16] [--lrs 1e-6 5e-6 5e-5 1e-3]
       [--steps 3]
The probe (`sync.probe`) passes when every engine's logprobs of a seeded sample from `sync.probe_prompt` are within
the probe's tolerance of the learner's. It catches an engine that kept the previous weights only if one step moves
those logprobs by more than the tolerance, and it never fails a correct load only if engine and learner agree to
within it. For each precision (`model.dtype`, the engine's and the learner's compute dtype, and
`learner.master_dtype`, the learner's parameters) and learning rate, on the demo model: a learner (`warmup_steps=0`, so
each step uses the full lr; the default 10-step warm-up makes a run's first step lr/10) and a real vLLM engine in this
process take `--steps` GRPO steps on groups the engine samples from the demo's prompts (rewards drawn at random: any
batch with non-zero advantages moves the policy). Before each load, the probe compares the engine, still on the
previous weights, with the updated learner ("stale gap"); after it, the engine on the new weights ("fresh gap").
Columns: the noise floor (the gap before any update), the largest fresh gap, the smallest stale gap, the tolerance
derived from the noise floor as a run derives it (`cluster.rollout_pool.probe_tolerance_from`: 5x, at least 1e-4),
and whether every stale engine was caught with no correct load refused.
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

PRECISIONS = {"float32": ("float32", "float32"), "bfloat16": ("bfloat16", "float32"),
              "bfloat16/bfloat16": ("bfloat16", "bfloat16")}  # name: (model.dtype, learner.master_dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS),
                        help="model.dtype, or model.dtype/learner.master_dtype")
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-6, 5e-6, 5e-5, 1e-3])
    parser.add_argument("--steps", type=int, default=3, help="training steps (so loads) per learning rate")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout, where the table goes

    from actors.engine import EngineSettings
    from actors.rollout import RolloutWorker, SamplingSettings
    from cluster.config import LearnerConfig, SyncConfig
    from cluster.demo_model import ensure_demo_model
    from cluster.rollout_pool import probe_tolerance_from
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
    for precision in args.precisions:
        dtype, master = PRECISIONS[precision]
        worker = RolloutWorker(EngineSettings(model_path=model_path, dtype=dtype))
        try:
            for lr in args.lrs:
                config = LearnerConfig(lr=lr, warmup_steps=0, kl_coef=0.0, num_threads=1, master_dtype=master)
                learner = Learner(model_path, config, dtype=dtype)
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
                tolerance = probe_tolerance_from(fresh[0], ["the engine"])
                caught = min(stale) > tolerance >= max(fresh)
                rows.append((dtype, master, lr, fresh[0], max(fresh), min(stale), tolerance,
                             "yes" if caught else "NO"))
                print(f"  {precision} lr={lr:g}: fresh {max(fresh):.2e}, stale {min(stale):.2e}", file=sys.stderr)
        finally:
            worker.shutdown()

    print(f"\n{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
          f"{time.strftime('%Y-%m-%d')}; demo model, probe of {sync.probe_tokens} tokens, {args.steps} steps per lr\n")
    print("| dtype | master | lr | noise floor | fresh gap (max) | stale gap (min) | tolerance | "
          "stale engine caught, no false alarm |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, master, lr, noise, fresh_gap, stale_gap, tolerance, caught in rows:
        print(f"| {dtype} | {master} | {lr:g} | {noise:.2e} | {fresh_gap:.2e} | {stale_gap:.2e} | {tolerance:.2g} | "
              f"{caught} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The sync probe's limits: how far one training step moves the probe's logprobs, against the probe's tolerance.

Usage: python bench/probe_limits.py [--precisions float32 bfloat16 bfloat16/bfloat16] [--lrs 1e-6 5e-6 5e-5 1e-3]
       [--steps 5]
The probe (`sync.probe`) checks every engine two ways after a load. The gap (`sync.verify.probe_gap`, the root mean
square over its tokens of |engine - learner| logprob) of a seeded sample from `sync.probe_prompt` must be within the
probe's tolerance; that catches an engine that kept the previous weights only if one step moves those logprobs by more
than the tolerance, and refuses no correct load only if engine and learner agree to within it. The repeat rule
(`sync.verify.stale_probe`): an engine that gives bit for bit the probe it gave at an earlier version, while the
learner's logprobs of it moved by more than the noise floor, did not apply the load. For each precision
(`model.dtype`, the engine's and the learner's compute dtype, and `learner.master_dtype`, the learner's parameters) and
learning rate, on the demo model: a learner (`warmup_steps=0`, so each step uses the full lr; the default 10-step
warm-up makes a run's first step lr/10) and a real vLLM engine in this process take `--steps` GRPO steps on groups the
engine samples from the demo's prompts (rewards drawn at random: any batch with non-zero advantages moves the policy).
Before any update the engine samples the probe with each of `PROBE_NOISE_SEEDS` and the learner scores it, as a run's
first (on-policy) probe does: the noise floor is their largest gap (`sync.verify.probe_noise`). Before each load the
probe (`PROBE_SEED`'s, as every later probe of a run) compares the engine, still on the previous weights, with the
updated learner ("stale"); after it, the engine on the new weights ("fresh"). The learner scores each probe alone, as a
run does.
Columns: the noise floor, the largest fresh gap (`PROBE_SEED`'s probe before any update included), the smallest stale
gap, the tolerance derived from the noise floor as a run derives it (`sync.verify.probe_tolerance_from`: 3x, at least
1e-4 in float32 and 2^-3 in bfloat16), whether the gap caught every stale engine with no correct load refused, how many
one-step-stale engines the repeat rule caught, the step at which it caught an engine that never loaded (its probe is
the one of step 0, as a stale engine repeats its probe exactly), and the repeat rule's false alarms on fresh engines.
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
    parser.add_argument("--steps", type=int, default=5, help="training steps (so loads) per learning rate")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout, where the table goes

    from actors.engine import EngineSettings
    from actors.rollout import RolloutWorker, SamplingSettings
    from cluster.demo.cache import ensure_demo_model
    from learner.batch import TrainBatch
    from learner.config import LearnerConfig
    from learner.learner import Learner
    from sync.config import SyncConfig
    from sync.verify import (
        PROBE_NOISE_SEEDS,
        PROBE_SEED,
        ProbeRecord,
        digest,
        next_probe_record,
        probe_gap,
        probe_noise,
        probe_tolerance_from,
        stale_probe,
    )

    model_path = str(ensure_demo_model())
    sync = SyncConfig()
    sampling = SamplingSettings(group_size=4, max_new_tokens=8)
    prompts = [f"{a}+{b}=" for a, b in [(37, 45), (1, 2), (60, 39), (8, 8), (12, 71), (99, 1), (5, 40), (23, 23)]]

    def probe(worker, learner, version: int, weights: str, seed: int = PROBE_SEED) -> tuple[float, ProbeRecord]:
        """(the gap, the probe as a run records it; `weights`: the digest of the learner's weights)."""
        prompt_ids, response_ids, engine_lps, *_ = worker.probe(sync.probe_prompt, sync.probe_tokens, 1.0, seed)
        [ours] = learner.compute_logprobs([prompt_ids], [response_ids])
        return probe_gap(engine_lps, ours), ProbeRecord(version, weights, tuple(response_ids), tuple(engine_lps),
                                                        tuple(ours))

    def rescored(record: ProbeRecord, prompt_ids: list[int], learner, version: int, weights: str) -> ProbeRecord:
        """`record`'s probe as an engine that never loaded repeats it, with the learner's logprobs now."""
        [ours] = learner.compute_logprobs([prompt_ids], [list(record.response_ids)])
        return record._replace(version=version, weights=weights, learner=tuple(ours))

    rows = []
    for precision in args.precisions:
        dtype, master = PRECISIONS[precision]
        worker = RolloutWorker(EngineSettings(model_path=model_path, dtype=dtype))
        probe_prompt = worker.tokenizer.encode(sync.probe_prompt, add_special_tokens=False)
        try:
            for lr in args.lrs:
                config = LearnerConfig(lr=lr, warmup_steps=0, kl_coef=0.0, num_threads=1, master_dtype=master)
                learner = Learner(model_path, config, dtype=dtype)
                worker.load_weights(0, *learner.export_weights(int(sync.bucket_mb * 2**20)))
                weights = digest(learner.weights_fingerprint())
                # The noise floor's draws, PROBE_SEED's first (as a run takes them): the probe every later one repeats.
                draws = [probe(worker, learner, 0, weights, seed)[1] for seed in PROBE_NOISE_SEEDS]
                noise = probe_noise([(draw.engine, draw.learner) for draw in draws])
                first = draws[PROBE_NOISE_SEEDS.index(PROBE_SEED)]
                fresh, stale = [probe_gap(first.engine, first.learner)], []
                repeats_caught, false_alarms, never_caught = 0, 0, None
                last = first  # the record a run keeps for this engine
                rng = random.Random(0)  # the same rewards for every row
                for step in range(1, args.steps + 1):
                    groups = worker.generate(prompts, list(range(step * 100, step * 100 + len(prompts))), sampling)
                    flat = [r for group in groups for r in group]
                    rewards = [rng.choice([0.0, 1.0]) for _ in flat]
                    learner.train_step(TrainBatch([r.prompt_ids for r in flat], [r.response_ids for r in flat],
                                                  [r.behavior_logprobs for r in flat], rewards, sampling.group_size))
                    weights = digest(learner.weights_fingerprint())
                    gap, record = probe(worker, learner, step, weights)
                    stale.append(gap)
                    repeats_caught += stale_probe(last, record, noise) is not None
                    never = rescored(first, probe_prompt, learner, step, weights)
                    if never_caught is None and stale_probe(first, never, noise) is not None:
                        never_caught = step
                    worker.load_weights(step, *learner.export_weights(int(sync.bucket_mb * 2**20)))
                    gap, record = probe(worker, learner, step, weights)
                    fresh.append(gap)
                    false_alarms += stale_probe(last, record, noise) is not None
                    last = next_probe_record(last, record)
                tolerance = probe_tolerance_from(noise, ["the engine"], dtype)
                caught = min(stale) > tolerance >= max(fresh)
                rows.append((dtype, master, lr, noise, max(fresh), min(stale), tolerance, "yes" if caught else "NO",
                             f"{repeats_caught}/{args.steps}", never_caught, false_alarms))
                print(f"  {precision} lr={lr:g}: fresh {max(fresh):.2e}, stale {min(stale):.2e}, repeat rule "
                      f"{repeats_caught}/{args.steps}", file=sys.stderr)
        finally:
            worker.shutdown()

    print(f"\n{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
          f"{time.strftime('%Y-%m-%d')}; demo model, probe of {sync.probe_tokens} tokens, {args.steps} steps per lr\n")
    print("| dtype | master | lr | noise floor | fresh gap (max) | stale gap (min) | tolerance | gap caught every "
          "stale engine, no false alarm | repeat rule: one-step-stale engines caught | repeat rule: never-loading "
          "engine caught at step | repeat rule: false alarms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype, master, lr, noise, fresh_gap, stale_gap, tolerance, caught, repeats, never, alarms in rows:
        print(f"| {dtype} | {master} | {lr:g} | {noise:.2e} | {fresh_gap:.2e} | {stale_gap:.2e} | {tolerance:.2g} | "
              f"{caught} | {repeats} | {never if never is not None else 'not within ' + str(args.steps)} | {alarms} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

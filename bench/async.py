"""Asynchronous training against on-policy: `rollout.max_staleness` k = 0, 1, 2, and k = 1 with in-flight weight
updates, on the same work.

Usage: .venv/bin/python bench/async.py [--configs demo long] [--ks 0,1,2,1i,2i] [--steps N] [dotted.key=value ...]
(a k ending in `i` runs with `rollout.in_flight_updates=true`)

Every run gets the engines and the learner one core each on a 2-core machine, so that the overlap is real: one
rollout worker with one engine thread, the learner and the reference with one torch thread each
(`rollout.num_workers=1 rollout.num_threads=1 learner.num_threads=1 reference.num_threads=1`). Configurations:
- `demo` (80 steps): the built-in demo (its ~300K-parameter model, `a+b=` prompts, G = 8, up to 8 new tokens);
  generate and train take similar time on this machine.
- `long` (12 steps): generation-heavy: a random-init 5M-parameter Qwen2 (hidden 256, 6 layers, 4 heads; built
  once into `.cache/async/model-5M`) on the same prompts with up to 48 new tokens; a random model rarely stops, so
  completions are ~48 tokens. It does not learn the task: its reward columns are left empty.
Columns: median s/step (steps 3 onwards: the first steps build kernels and fill the pipeline), steps/s relative to
k = 0, the first step whose 10-step running mean reward reaches 0.9 (`-`: never), the last 10 steps' mean reward,
and the learner's and the engines' idle fractions: the sums of `time/learner_wait` and of `time/rollout_idle` over
the measured steps, over their wall time; `mean token staleness` is the mean over steps of `async/token_staleness`
with in-flight updates (versions behind per token), else of `async/staleness`. Runs go one after the other;
nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CACHE = ROOT / ".cache" / "async"
ONE_CORE_EACH = ["rollout.num_workers=1", "rollout.num_threads=1", "learner.num_threads=1",
                 "reference.num_threads=1", "ray.dashboard=false"]
SHAPE_5M = {"hidden_size": 256, "num_layers": 6, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 768}
DEFAULT_STEPS = {"demo": 80, "long": 12}
SKIP = 2  # steps left out of the timings


def set_cache_env() -> None:
    """Relay's model cache and vLLM's compile cache inside the checkout (git ignores `.cache/`), unless set."""
    os.environ.setdefault("RELAY_CACHE_DIR", str(ROOT / ".cache" / "relay"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))


def model_5m_dir() -> Path:
    from cluster.demo.model import make_random_model_dir

    path = CACHE / "model-5M"
    if not (path / "config.json").exists():
        make_random_model_dir(path, seed=0, max_position_embeddings=64, **SHAPE_5M)
    return path


def overrides(work: str) -> list[str]:
    if work == "demo":
        return []
    return [f"model.path={model_5m_dir()}", "rollout.max_new_tokens=48", "rollout.max_model_len=64",
            "data.prompts_per_step=16"]


def run(work: str, k: str, steps: int, extra: list[str]) -> list[dict]:
    from cluster.config import load_config
    from cluster.run.launch import run_training

    in_flight = ["rollout.in_flight_updates=true"] if k.endswith("i") else []
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(None, [f"run_dir={tmp}/run", f"max_steps={steps}",
                                    f"rollout.max_staleness={k.removesuffix('i')}", *in_flight, *ONE_CORE_EACH,
                                    *overrides(work), *extra])
        return run_training(config, Path(tmp) / "run", display=False)


def first_reaching(records: list[dict], level: float = 0.9, window: int = 10) -> str:
    rewards = [r["reward/mean"] for r in records]
    for i in range(window, len(rewards) + 1):
        if statistics.fmean(rewards[i - window:i]) >= level:
            return str(records[i - 1]["step"])
    return "-"


def row(work: str, k: str, records: list[dict], base: float | None) -> tuple[str, float]:
    measured = records[SKIP:]
    step = statistics.median(r["time/step"] for r in measured)
    wall = sum(r["time/step"] for r in measured)
    learner_idle = sum(r["time/learner_wait"] for r in measured) / wall
    engine_idle = sum(r["time/rollout_idle"] for r in measured) / wall
    ratio = f"{base / step:.2f}x" if base else "1.00x"
    learns = work == "demo"
    reach = first_reaching(records) if learns else ""
    last = f"{statistics.fmean(r['reward/mean'] for r in records[-10:]):.3f}" if learns else ""
    staleness = max(r["async/staleness"] for r in records)
    tokens = statistics.fmean(r.get("async/token_staleness", r["async/staleness"]) for r in records)
    label = f"{k.removesuffix('i')} + in-flight" if k.endswith("i") else k
    return (f"| {work} | {label} | {staleness} | {tokens:.2f} | {step:.3f} | {ratio} | {reach} | {last} | "
            f"{learner_idle:.0%} | {engine_idle:.0%} |", step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["demo", "long"], choices=["demo", "long"])
    parser.add_argument("--ks", default="0,1,2,1i,2i")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: 80 demo, 12 long)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    set_cache_env()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; one core "
          f"each: {' '.join(ONE_CORE_EACH[:4])}")
    print("\n| config | k | max staleness | mean token staleness | median s/step | steps/s vs k=0 | "
          "step to 10-step mean 0.9 | last 10 reward | learner idle | engines idle |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for work in args.configs:
        base = None
        for k in args.ks.split(","):
            records = run(work, k, args.steps or DEFAULT_STEPS[work], args.overrides)
            line, step = row(work, k, records, base)
            base = base or step
            print(line, flush=True)


if __name__ == "__main__":
    main()

"""What one relay learner step spends its time on: the profiler's top operators of a step of each variant asked for.

Usage: python bench/gpu_profile.py [--size 0.5b|tiny|demo|25m] [--variants plain,all] [--dtype bfloat16] [--out DIR]
The model, batches and variants are bench/gpu_learner.py's (`--size`; `--variants` of its VARIANTS: `plain`, today's
paths, one per technique a-f, `all` for them together), full fine-tuning on float32 master weights. Per variant: one
warm-up step (where c compiles; a bucket it has not seen compiles in the profiled step), then one step under
torch.profiler: its top operators by device time and by CPU time, its kernels and the share of the step the device ran
none (gpu_learner's `launch_profile` counts them the same way), printed and written to `--out` (profile-VARIANT.txt,
trace-VARIANT.json.gz) when given. gpu_learner.py times the same variants against the plain transformers loop. Imports
what bench/gpu_learner.py imports.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_learner import (  # noqa: E402
    SIZES,
    VARIANTS,
    WARMUP_STEPS,
    build_model_dir,
    busy_seconds,
    draw_batch,
    learner_config,
    plain_loop,
    plan_budget,
    release,
    synchronize,
)
from learner.learner import Learner, TrainBatch  # noqa: E402
from learner.passes.device import pick_device  # noqa: E402


def plain_seconds(model_dir: Path, size, batches: list[TrainBatch]) -> float:
    """The plain transformers loop's seconds per step (bench/gpu_learner.py's `plain_loop`)."""
    return plain_loop(model_dir, size, batches)["seconds_per_step"]


def profile_step(model_dir: Path, size, batches: list[TrainBatch], out: Path | None, key: str = "all",
                 dtype: str = "bfloat16") -> str:
    """One step of variant `key` under the profiler after a warm-up step: the top operators' tables, the kernels and
    the device's idle share (written to `out` with the trace, when given)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    variant, device = VARIANTS[key], pick_device()
    release(device)
    budget = plan_budget(size, model_dir, device, variant, dtype) if variant.plan_budget else size.budget
    learner = Learner(str(model_dir), learner_config(size, variant.packed, variant.lora, variant, budget), dtype=dtype,
                      seed=0)
    learner.train_step(batches[0])
    synchronize(learner.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if learner.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        learner.train_step(batches[min(1, len(batches) - 1)])
        synchronize(learner.device)
        wall = time.perf_counter() - start
    kernels = [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in prof.events()
               if e.device_type == DeviceType.CUDA]
    idle = f"{max(0.0, 1 - busy_seconds(kernels) / wall):.0%}" if kernels else "n/a"
    averages = prof.key_averages()
    device_key = "device_time_total" if learner.device.type == "cuda" else "cpu_time_total"
    text = (f"variant {variant.name} (passes of {budget} tokens): {wall:.3f} s profiled, {len(kernels)} kernels, "
            f"device idle {idle}\n"
            f"by {device_key}:\n{averages.table(sort_by=device_key, row_limit=30, max_name_column_width=60)}\n"
            f"by self_cpu_time_total:\n"
            f"{averages.table(sort_by='self_cpu_time_total', row_limit=30, max_name_column_width=60)}\n")
    if out is not None:
        (out / f"profile-{key}.txt").write_text(text)
        trace = out / f"trace-{key}.json"
        prof.export_chrome_trace(str(trace))
        with trace.open("rb") as raw, gzip.open(str(trace) + ".gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        trace.unlink()
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="0.5b")
    parser.add_argument("--variants", default="plain,all", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    keys = args.variants.split(",")
    if any(key not in VARIANTS for key in keys):
        parser.error(f"--variants: choose from {list(VARIANTS)}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    size = SIZES[args.size]
    batches = [draw_batch(size, seed) for seed in range(WARMUP_STEPS + 1)]
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="relay-gpu-profile-") as tmp:
        build_model_dir(size, Path(tmp), pick_device())
        for key in keys:
            print(profile_step(Path(tmp), size, batches, args.out, key, args.dtype), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

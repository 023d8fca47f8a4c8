"""Where the learner's GPU step goes: ablations of `learner.share_prompts` and `learner.pack_sequences`, a plain
transformers loop over the same tokens as a floor, and torch.profiler's top operators of one relay step.

Usage: python bench/gpu_profile.py [--size 0.5b|tiny] [--steps N] [--out DIR] [--no-ablations]
The model and batches are bench/gpu_learner.py's (`--size`), full fine-tuning in bfloat16 on float32 master weights.
Rows: relay's `train_step` with prompts shared or not, packed or padded passes (one warm-up step, then `--steps`);
"plain loop": per pass of at most the learner's token budget (rows sorted by length, padded to the pass's longest),
`model(input_ids, attention_mask)` under autocast, log-softmax of the response tokens, their mean, backward, then one
AdamW step: no relay code, what a hand-written trainer would take for the same tokens. Then one relay step (the
default: shared and packed) under torch.profiler: its top operators by device time and by CPU time, written to
`--out` (profile.txt, trace.json.gz) when given. Imports what bench/gpu_learner.py imports.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_learner import (  # noqa: E402
    SIZES,
    WARMUP_STEPS,
    build_model_dir,
    draw_batch,
    learner_config,
    release,
    synchronize,
    time_steps,
)
from learner.learner import Learner, TrainBatch  # noqa: E402
from learner.passes.device import compute_in, pick_device  # noqa: E402


def relay_seconds(model_dir: Path, size, batches: list[TrainBatch], share: bool, pack: bool) -> float:
    release(pick_device())
    config = learner_config(size, pack, False).model_copy(update={"share_prompts": share})
    learner = Learner(str(model_dir), config, dtype="bfloat16", seed=0)
    seconds, _ = time_steps(learner, batches)
    del learner
    return sum(seconds) / len(seconds)


def plain_seconds(model_dir: Path, size, batches: list[TrainBatch]) -> float:
    """A hand-written step over the same rows: padded passes of at most `size.budget` tokens, no relay code (its own
    cut too, not `MicroBatching`: shortest rows first, so a pass's longest row is the one joining it)."""
    from transformers import AutoModelForCausalLM

    device = pick_device()
    release(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    seconds = []
    for i, batch in enumerate(batches):
        rows = sorted(zip(batch.prompt_ids, batch.response_ids), key=lambda r: len(r[0]) + len(r[1]))
        passes, current = [], []
        for row in rows:
            longest = len(row[0]) + len(row[1])
            if current and longest * (len(current) + 1) > size.budget:
                passes.append(current)
                current = []
            current.append(row)
        passes.append(current)
        synchronize(device)
        start = time.perf_counter()
        tokens = sum(len(r) for _, r in rows)
        for part in passes:
            length = max(len(p) + len(r) for p, r in part)
            ids = torch.zeros(len(part), length, dtype=torch.long)
            mask = torch.zeros(len(part), length, dtype=torch.long)
            response = torch.zeros(len(part), length - 1)
            for j, (p, r) in enumerate(part):
                ids[j, :len(p) + len(r)] = torch.tensor(p + r)
                mask[j, :len(p) + len(r)] = 1
                response[j, len(p) - 1:len(p) + len(r) - 1] = 1
            ids, mask, response = ids.to(device), mask.to(device), response.to(device)
            with compute_in(device, torch.bfloat16, torch.float32):
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            (-(logprobs * response).sum() / tokens).backward()
            del logits, logprobs
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if i >= WARMUP_STEPS:
            seconds.append(time.perf_counter() - start)
    del model, optimizer
    return sum(seconds) / len(seconds)


def profile_step(model_dir: Path, size, batches: list[TrainBatch], out: Path | None) -> str:
    from torch.profiler import ProfilerActivity, profile

    release(pick_device())
    learner = Learner(str(model_dir), learner_config(size, True, False), dtype="bfloat16", seed=0)
    learner.train_step(batches[0])
    synchronize(learner.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if learner.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        learner.train_step(batches[1])
        synchronize(learner.device)
    averages = prof.key_averages()
    device_key = "device_time_total" if learner.device.type == "cuda" else "cpu_time_total"
    text = (f"by {device_key}:\n{averages.table(sort_by=device_key, row_limit=30, max_name_column_width=60)}\n"
            f"by self_cpu_time_total:\n"
            f"{averages.table(sort_by='self_cpu_time_total', row_limit=30, max_name_column_width=60)}\n")
    if out is not None:
        (out / "profile.txt").write_text(text)
        trace = out / "trace.json"
        prof.export_chrome_trace(str(trace))
        with trace.open("rb") as raw, gzip.open(str(trace) + ".gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        trace.unlink()
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="0.5b")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--ablations", action=argparse.BooleanOptionalAction, default=True,
                        help="time the four relay variants and the plain loop before profiling (default: yes)")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    size = SIZES[args.size]
    batches = [draw_batch(size, seed) for seed in range(WARMUP_STEPS + args.steps)]
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="relay-gpu-profile-") as tmp:
        build_model_dir(size, Path(tmp), pick_device())
        if args.ablations:
            print("| step | s/step |\n|---|---|", flush=True)
            for share in (True, False):
                for pack in (True, False):
                    seconds = relay_seconds(Path(tmp), size, batches, share, pack)
                    print(f"| relay, prompts {'shared' if share else 'not shared'}, {'packed' if pack else 'padded'}"
                          f" | {seconds:.3f} |", flush=True)
            print(f"| plain loop (padded passes, no relay code) | {plain_seconds(Path(tmp), size, batches):.3f} |",
                  flush=True)
        print(profile_step(Path(tmp), size, batches, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

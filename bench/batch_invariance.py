"""Batch invariance of a CPU engine with torch's linear (`rollout.cpu_linear` torch, the demo's kernel): whether a
row's, and a prompt's, bits depend on what else its batch held, with torch's linear as it is, with its rows padded to
whole 4-row blocks (relay's construction until 2026-12: it held on the AVX2 EPYC, not on an AVX-512 Xeon), and in
matmuls of a fixed row count (`torch_linear`, now).

Usage: python bench/batch_invariance.py [--trials 12] [--repeats 30] [--threads 1,2,8,16,32]
Three tables, each printed as Markdown:
1. Each kernel alone, random float32 and bfloat16 matrices of the demo's width (128 -> 256) and a 0.5B model's
   (896 -> 4864): the batch sizes (1-299 rows) whose rows differ from the same rows in a batch of 300, at 1, 2, 8, 16
   and 32 threads; the row block `torch_linear` chose and how long choosing it took; and how long the engine's start
   check (`rows_invariant`) takes at the demo's width.
2. The demo model's engine in float32 (one, in-process, as a rollout worker holds it), 16 demo prompts x 8 (up to 8
   new tokens): the step whole, then `--trials` random splits of it into 2-5 requests in random order; how many of
   the 128 completions got other tokens or other logprobs than the whole step's, with each kernel.
3. The same request whole, `--repeats` alternated rounds of the three kernels: median milliseconds.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import actors.vllm_extension as extension  # noqa: E402

SHAPES = ((128, 256), (896, 4864))  # (in, out): the demo's MLP, a 0.5B model's
THREADS = (1, 2, 8, 16, 32)


def padded_to_4(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Torch's linear over rows padded with zeros to a multiple of 4, in one matmul: the construction before."""
    rows = x.numel() // x.shape[-1]
    padded = torch.nn.functional.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, -rows % 4))
    return torch.nn.functional.linear(padded, weight, bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])


KERNELS = {"torch's linear": torch.nn.functional.linear, "padded to 4 rows": padded_to_4,
           "fixed row blocks (`torch_linear`)": extension.torch_linear}


def differing_sizes(width: int, out: int, dtype: torch.dtype, kernel) -> list[int]:
    """Batch sizes whose rows are not the bits of the same rows in a batch of 300."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(300, width, generator=generator).to(dtype)
    weight = torch.randn(out, width, generator=generator).to(dtype)
    everything = kernel(x, weight, None)
    return [m for m in range(1, 300) if not torch.equal(kernel(x[:m], weight, None), everything[:m])]


def sample_splits(worker, prompts: list, seeds: list[int], sampling, splits: list[list[int]]) -> dict[int, list]:
    """{prompt index: its completions' (token ids, logprobs)}, the prompts sampled by `worker` one request per part
    of `splits` (lists of indices), in that order."""
    out = {}
    for part in splits:
        groups = worker.generate([prompts[i] for i in part], [seeds[i] for i in part], sampling)
        out.update({i: [(tuple(r.response_ids), tuple(r.behavior_logprobs)) for r in g] for i, g in zip(part, groups)})
    return out


def kernel_table(thread_counts: tuple[int, ...] = THREADS) -> None:
    before = torch.get_num_threads()
    names = list(KERNELS)
    print(f"| dtype | threads | shape (in -> out) | batch sizes that differ: {names[0]} | {names[1]} | {names[2]} "
          "| block chosen (ms to choose) |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for width, out in SHAPES:
                cells = []
                for kernel in KERNELS.values():
                    sizes = differing_sizes(width, out, dtype, kernel)
                    cells.append(f"{len(sizes)}, up to {max(sizes)}" if sizes else "none")
                extension._blocks.clear()
                started = time.perf_counter()
                block = extension.row_block(width, out, dtype, False)
                chose = (time.perf_counter() - started) * 1000
                print(f"| {str(dtype)[6:]} | {threads} | {width} -> {out} | {' | '.join(cells)} | "
                      f"{block} ({chose:.1f}) |")
    print()
    print("| start check (`rows_invariant` of `torch_linear`, width 128) | threads | ms (median of 5) | invariant |")
    print("|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            times = []
            for _ in range(5):
                started = time.perf_counter()
                ok = extension.rows_invariant(extension.torch_linear, 128, dtype)
                times.append(time.perf_counter() - started)
            print(f"| {str(dtype)[6:]} | {threads} | {statistics.median(times) * 1000:.1f} | {ok} |")
    torch.set_num_threads(before)
    print()


def _set_kernels(kernel):
    """A function the engine's worker runs: every linear layer of its model takes `kernel`."""

    def apply(vllm_worker) -> None:
        for layer in vllm_worker.model_runner.get_model().modules():
            if getattr(layer, "cpu_linear", None) is not None:
                layer.cpu_linear = kernel

    return apply


def engine_tables(trials: int, repeats: int) -> None:
    from actors.engine import EngineSettings
    from actors.rollout import RolloutWorker
    from actors.rollout_types import SamplingSettings
    from cluster.demo.cache import ensure_demo_model
    from cluster.demo.task import make_problems

    worker = RolloutWorker(EngineSettings(model_path=str(ensure_demo_model(log=lambda _: None)), cpu_linear="torch"))
    prompts = [p.prompt for p in make_problems(random.Random(0), 16)]
    seeds = list(range(100, 116))
    sampling = SamplingSettings(group_size=8, max_new_tokens=8)
    try:
        print("| kernel | split (prompts per request) | completions with other tokens | other logprobs |")
        print("|---|---|---|---|")
        for name, kernel in KERNELS.items():
            worker.engine.llm.collective_rpc(_set_kernels(kernel))
            whole = sample_splits(worker, prompts, seeds, sampling, [list(range(16))])
            rng = random.Random(1)
            for _ in range(trials):
                order = rng.sample(range(16), 16)
                cuts = sorted(rng.sample(range(1, 16), rng.randint(1, 4)))
                splits = [order[a:b] for a, b in zip([0, *cuts], [*cuts, 16])]
                got = sample_splits(worker, prompts, seeds, sampling, splits)
                pairs = [(got[i][j], whole[i][j]) for i in range(16) for j in range(8)]
                tokens = sum(a[0] != b[0] for a, b in pairs)
                logprobs = sum(a[1] != b[1] for a, b in pairs)
                print(f"| {name} | {[len(s) for s in splits]} | {tokens} | {logprobs} |")
        print()
        times: dict[str, list[float]] = {name: [] for name in KERNELS}
        for _ in range(repeats):
            for name, kernel in KERNELS.items():
                worker.engine.llm.collective_rpc(_set_kernels(kernel))
                started = time.perf_counter()
                worker.generate(prompts, seeds, sampling)
                times[name].append(time.perf_counter() - started)
        print("| one request of 16 prompts x 8, kernel | ms (median) |")
        print("|---|---|")
        for name, values in times.items():
            print(f"| {name} | {statistics.median(values) * 1000:.1f} |")
    finally:
        worker.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12, help="random splits of the step per kernel")
    parser.add_argument("--repeats", type=int, default=30, help="alternated timing rounds")
    parser.add_argument("--threads", default=",".join(map(str, THREADS)), help="thread counts of table 1")
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}\n")
    kernel_table(tuple(int(t) for t in args.threads.split(",")))
    engine_tables(args.trials, args.repeats)


if __name__ == "__main__":
    main()

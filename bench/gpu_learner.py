"""The learner's training step on a GPU: tokens/s, MFU and peak memory of relay's `Learner.train_step`, and two
checks that need the device.

Usage: python bench/gpu_learner.py [--device cuda|cpu] [--size 0.5b|tiny] [--steps N] [--out PATH]
`--size 0.5b` (the default: 97 s for the four variants on one H200, docs/benchmarks.md): a Qwen2 of Qwen2.5-0.5B's
shape (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151936, tied embeddings: 494M parameters)
with random weights, saved to a temporary directory that `Learner` loads; each step 8 prompts of 256 tokens x 8
completions whose lengths are drawn (seeded, uniform) from 128-2048 tokens, the learner's passes cut at 8192 tokens
(configs/gpu_gsm8k_single.yaml's then; 4096 since `relay plan` sized it for 80 GB GPUs at 1.5B).
`--size tiny`: 2 layers of hidden 128 (4 heads of 32), vocabulary 1024, 4 prompts of 32 tokens x 4 completions of
16-128, passes of 1024 tokens: seconds on a CPU, for the tests.
Four variants, each a fresh `Learner` on the same batches: bfloat16 on float32 master weights (`model.dtype=bfloat16`,
`learner.master_dtype=float32`: the learner's autocast), packed (`learner.pack_sequences`) or padded passes, full
fine-tuning or LoRA (rank 32 at 0.5b, every linear projection of every layer: relay's `learner.lora`). GRPO,
one minibatch (one forward and backward per token, no separate old-logprobs pass), the KL in the loss, prompts shared
(`learner.share_prompts`), as a run has them. One untimed warm-up step, then `--steps` timed ones (the GPU
synchronised around each).

Columns: tokens/s counts every row's prompt and response tokens (what the batch holds). Model FLOPs per step count
the tokens relay must compute: each distinct prompt once (prompts shared) and every response token, never padding, so
padded passes' waste shows as lower MFU. Per token: 6 N for a full update (forward 2 N, backward 4 N; the usual
count, without attention's score and value products, a few per cent at these lengths), N every parameter once (the
tied head is one matrix used once per token; the embedding lookup computes nothing); with LoRA 4 N_base + 6
N_adapter (the frozen base still runs its forward and carries gradients back through its activations, 2 N + 2 N, but
computes no weight gradients). MFU: those FLOPs per second over the device's dense bfloat16 peak (`PEAK_TFLOPS`; n/a
for devices not in it, the CPU among them). Peak memory: `torch.cuda.max_memory_allocated` over the variant on a
GPU; on the CPU the process's peak resident memory so far (the learner's `memory/learner_peak_mb`), which only grows
from one variant to the next.

Checks (after the first variant's steps, on its trained weights; a failure exits 1 with one line saying which):
- fingerprints: `sync.fingerprint` of every weight on the device equals that of its host copy, for the float32
  master weights and for their bfloat16 casts the engines get (`Learner.weights_fingerprint`, the publisher's path);
  on the CPU both are host sums, so it holds trivially there;
- packing: one packed and one padded pass over the first `check_prompts` groups (`batched_logprobs`, whole rows)
  give the same logprobs of every response token, within `TOLERANCES`, in bfloat16 (the learner's autocast) and in
  float32.
Imports only torch, numpy, transformers, peft and the standard library, with relay's `learner/` and `sync/`, which
import nothing more (pydantic for the config): the GPU machines have neither Ray nor vLLM
(tests/unit/test_gpu_learner_bench.py checks it).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from learner.config import LearnerConfig, LoraConfig  # noqa: E402
from learner.learner import Learner, TrainBatch  # noqa: E402
from learner.passes.device import compute_in, pick_device  # noqa: E402
from learner.passes.sequences import MicroBatching, batched_logprobs, pad_sequences, sharing  # noqa: E402
from sync.fingerprint import fingerprint, tensor_fingerprint  # noqa: E402
from sync.publisher import per_tensor, to_engine  # noqa: E402


@dataclass(frozen=True)
class Size:
    """A model shape and the batch each step trains on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    prompts: int  # distinct prompts per step
    group: int  # completions per prompt (G)
    prompt_tokens: int
    response_tokens: tuple[int, int]  # each response's length drawn uniformly from [low, high]
    budget: int  # learner.max_tokens_per_micro_batch
    lora_rank: int
    check_prompts: int  # groups in the packed-against-padded check


SIZES = {
    "0.5b": Size(896, 24, 14, 2, 4864, 151936, prompts=8, group=8, prompt_tokens=256, response_tokens=(128, 2048),
                 budget=8192, lora_rank=32, check_prompts=2),
    "tiny": Size(128, 2, 4, 2, 256, 1024, prompts=4, group=4, prompt_tokens=32, response_tokens=(16, 128),
                 budget=1024, lora_rank=8, check_prompts=2),
}
# (name, packed passes, LoRA); the first is the one the checks run on.
VARIANTS = [("full, packed", True, False), ("full, padded", False, False),
            ("LoRA, packed", True, True), ("LoRA, padded", False, True)]
WARMUP_STEPS = 1
# Dense bfloat16 peaks in TFLOP/s, by a substring of torch.cuda.get_device_name() (case ignored), first match wins.
# NVL parts (other clocks and power) and anything else unlisted get no MFU.
PEAK_TFLOPS: list[tuple[str, float | None]] = [
    ("NVL", None), ("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0)]
# Largest |packed - padded| logprob allowed. float32: the two differ only in summation order. bfloat16: its 8-bit
# mantissa, as the sync probe's bfloat16 minimum (2^-3, sync/verify.py). Tokens that saw what they should not differ
# by far more (docs/benchmarks.md, "GPU learner").
TOLERANCES = {"bfloat16": 2.0**-3, "float32": 1e-3}


def build_model_dir(size: Size, directory: Path, device: torch.device, seed: int = 0) -> None:
    """A random-weight Qwen2 of `size`'s shape, saved (float32 safetensors) to `directory` for `Learner` to load."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
                         num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
                         intermediate_size=size.intermediate, max_position_embeddings=32768, rms_norm_eps=1e-6,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it will run: seconds for 0.5B on a GPU
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    del model


def draw_batch(size: Size, seed: int) -> TrainBatch:
    """One step's completions: `size.prompts` random prompts x `size.group` random responses of drawn lengths,
    random 0/1 rewards, behaviour and reference logprobs those of a uniform model (a random model's are near it)."""
    rng = np.random.default_rng(seed)
    prompts, responses = [], []
    for _ in range(size.prompts):
        prompt = rng.integers(1, size.vocab, size.prompt_tokens).tolist()
        for _ in range(size.group):
            length = int(rng.integers(size.response_tokens[0], size.response_tokens[1] + 1))
            prompts.append(prompt)
            responses.append(rng.integers(1, size.vocab, length).tolist())
    uniform = [[-math.log(size.vocab)] * len(response) for response in responses]
    rewards = rng.integers(0, 2, len(responses)).astype(float).tolist()
    return TrainBatch(prompts, responses, uniform, rewards, size.group, ref_logprobs=uniform)


def learner_config(size: Size, packed: bool, lora: bool) -> LearnerConfig:
    """Near configs/gpu_gsm8k_single.yaml's learner (lr 1e-6, token-mean loss, clip-higher, the KL in the loss), but
    one minibatch (one forward and backward per token, no old-logprobs pass), no rollout correction, no warm-up. With
    `lora`, relay's `learner.lora`: rank `size.lora_rank`, alpha 2 x rank, every linear layer of the blocks."""
    return LearnerConfig(lr=1e-6, warmup_steps=0, master_dtype="float32", max_tokens_per_micro_batch=size.budget,
                         pack_sequences=packed, loss_agg="token-mean", clip_high=0.28, kl_coef=0.001,
                         lora=LoraConfig(rank=size.lora_rank if lora else 0))


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """{"base": frozen parameters (all, for a full update), "adapter": trained parameters with LoRA (else 0),
    "trained": parameters the update changes}; a tied head counted once."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lora = trained < total
    return {"base": total - trained if lora else total, "adapter": trained if lora else 0, "trained": trained}


def model_tokens(learner: Learner, batch: TrainBatch) -> int:
    """Tokens relay must compute for `batch`: every response token, and every prompt's tokens once per distinct
    prompt when the learner shares prompts (`sharing`), else once per row."""
    padded = pad_sequences(batch.prompt_ids, batch.response_ids, learner.pad_id, "cpu")
    prompts = batch.prompt_ids
    if sharing(learner.model, padded, learner.batching):
        prompts = list({tuple(prompt): prompt for prompt in prompts}.values())
    return sum(map(len, prompts)) + sum(map(len, batch.response_ids))


def step_flops(counts: dict[str, int], tokens: int) -> float:
    """Model FLOPs of one update over `tokens` (the module's docstring): 6 N per token for a full update, 4 N_base +
    6 N_adapter with LoRA."""
    return (4 * counts["base"] + 6 * counts["adapter"] if counts["adapter"] else 6 * counts["base"]) * tokens


def peak_tflops(device_name: str) -> float | None:
    """The dense bfloat16 peak of the GPU called `device_name` (`PEAK_TFLOPS`), None when it is not listed."""
    return next((peak for key, peak in PEAK_TFLOPS if key.lower() in device_name.lower()), None)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Free what the previous variant left, so each variant's peak memory is its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def time_steps(learner: Learner, batches: list[TrainBatch]) -> tuple[list[float], dict[str, float]]:
    """`train_step` over every batch; the seconds of each after the warm-up ones, and the last step's metrics."""
    seconds, metrics = [], {}
    for i, batch in enumerate(batches):
        synchronize(learner.device)
        start = time.perf_counter()
        metrics = learner.train_step(batch)
        synchronize(learner.device)
        if i >= WARMUP_STEPS:
            seconds.append(time.perf_counter() - start)
    return seconds, metrics


def run_variant(name: str, packed: bool, lora: bool, model_dir: Path, size: Size, batches: list[TrainBatch],
                peak: float | None) -> tuple[dict, Learner]:
    """One variant's timed steps: its row of the table, and its learner (for the checks)."""
    release(pick_device())
    learner = Learner(str(model_dir), learner_config(size, packed, lora), dtype="bfloat16", seed=0)
    seconds, metrics = time_steps(learner, batches)
    timed = batches[WARMUP_STEPS:]
    tokens = sum(len(p) + len(r) for batch in timed for p, r in zip(batch.prompt_ids, batch.response_ids))
    counts = parameter_counts(learner.model)
    flops = sum(step_flops(counts, model_tokens(learner, batch)) for batch in timed)
    tflops = flops / sum(seconds) / 1e12
    if learner.device.type == "cuda":
        memory = torch.cuda.max_memory_allocated(learner.device) / 2**30
    else:
        memory = metrics["memory/learner_peak_mb"] / 1024
    row = {"variant": name, "packed": packed, "lora": lora, "lora_rank": size.lora_rank if lora else None,
           "trained_parameters": counts["trained"], "base_parameters": counts["base"],
           "adapter_parameters": counts["adapter"], "steps": len(seconds), "tokens_per_step": tokens / len(timed),
           "seconds_per_step": sum(seconds) / len(seconds), "step_seconds": seconds,
           "tokens_per_s": tokens / sum(seconds), "model_tflops_per_step": flops / len(timed) / 1e12,
           "tflops_per_s": tflops, "mfu": tflops / peak if peak else None, "peak_memory_gib": memory,
           "loss": metrics["loss/policy"], "grad_norm": metrics["grad_norm"]}
    return row, learner


def check_fingerprints(learner: Learner) -> dict:
    """The policy's fingerprints computed where its weights live against those of host copies: the master weights,
    and their casts to the engines' dtype (`weights_fingerprint`, cast and summed on the device)."""
    state = learner.policy_state_dict()
    on_host = {name: tensor.cpu() for name, tensor in state.items()}
    master = (fingerprint(state.items()), fingerprint(on_host.items()))
    engine = (learner.weights_fingerprint(),
              per_tensor(on_host, lambda t: tensor_fingerprint(to_engine(t, learner.compute_dtype))))
    differing = sorted({name for device, host in (master, engine) for name in device if device[name] != host[name]})
    return {"name": "fingerprints", "tensors": len(state), "device": str(learner.device), "differing": differing,
            "passed": not differing and master[0].keys() == master[1].keys() and engine[0].keys() == engine[1].keys()}


def check_packing(learner: Learner, batch: TrainBatch, size: Size) -> dict:
    """One packed and one padded pass (whole rows, the learner's token budget) over the first `size.check_prompts`
    groups of `batch`: the largest |difference| of a response token's logprob, in bfloat16 and in float32."""
    rows = size.check_prompts * size.group
    padded = pad_sequences(batch.prompt_ids[:rows], batch.response_ids[:rows], learner.pad_id, learner.device)
    result = {"name": "packing", "rows": rows, "tokens": int(padded.attention_mask.sum()), "passed": True}
    for dtype, tolerance in TOLERANCES.items():
        logprobs = []
        for pack in (True, False):
            with compute_in(learner.device, getattr(torch, dtype), learner.master_dtype):
                logprobs.append(batched_logprobs(learner.model, padded, MicroBatching(None, size.budget, False, pack)))
        gap = float(((logprobs[0] - logprobs[1]).abs() * padded.response_mask).max())
        result[dtype] = {"max_abs_diff": gap, "tolerance": tolerance, "passed": gap <= tolerance}
        result["passed"] = result["passed"] and gap <= tolerance
    return result


def failures(checks: list[dict]) -> list[str]:
    """One line per failed check, saying what differed."""
    lines = []
    for check in checks:
        if check["passed"]:
            continue
        if check["name"] == "fingerprints":
            lines.append(f"fingerprints on {check['device']} differ from the host's for {len(check['differing'])} "
                         f"of {check['tensors']} tensors (first: {check['differing'][:3]})")
        else:
            gaps = ", ".join(f"{d} {check[d]['max_abs_diff']:.3g} (tolerance {check[d]['tolerance']:g})"
                             for d in TOLERANCES if not check[d]["passed"])
            lines.append(f"packed and padded passes' logprobs differ on {check['rows']} rows: {gaps}")
    return lines


def choose_device(asked: str | None) -> torch.device:
    """The device every `Learner` here will pick (`pick_device`): the GPU unless the CPU is asked for, which
    hides the GPUs from this process (before CUDA starts)."""
    if asked == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    device = pick_device()
    if asked is not None and device.type != asked:
        raise SystemExit(f"--device {asked}: the learner would run on {device} "
                         + ("(no CUDA GPU visible; drop --device cuda)" if asked == "cuda"
                            else "(CUDA started before the GPUs could be hidden; set CUDA_VISIBLE_DEVICES=)"))
    return device


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what `platform` knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def describe(device: torch.device, size_name: str, size: Size, args: argparse.Namespace) -> dict:
    """What the table was measured on: device, versions, model, batch."""
    import peft
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {"device": str(device), "device_name": name, "cpus": os.cpu_count(), "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__, "date": time.strftime("%Y-%m-%d"),
            "size": size_name, "shape": asdict(size), "steps": args.steps, "warmup_steps": WARMUP_STEPS,
            "peak_tflops": peak_tflops(name) if device.type == "cuda" else None}


def print_table(setup: dict, rows: list[dict], checks: list[dict]) -> None:
    shape = setup["shape"]
    print(f"\n{setup['device_name']} ({setup['device']}), {setup['cpus']} CPUs, torch {setup['torch']}, transformers "
          f"{setup['transformers']}, peft {setup['peft']}, {setup['date']}; --size {setup['size']}: "
          f"{rows[0]['base_parameters'] / 1e6:.1f}M parameters, {shape['prompts']} prompts of "
          f"{shape['prompt_tokens']} x {shape['group']} responses of {shape['response_tokens'][0]}-"
          f"{shape['response_tokens'][1]} tokens, passes of {shape['budget']} tokens; bfloat16 on float32 master "
          f"weights; {setup['steps']} steps after {setup['warmup_steps']} warm-up\n")
    memory = "peak memory GiB" if setup["device"].startswith("cuda") else "peak RSS GiB (process)"
    print(f"| variant | trained params | tokens/step | s/step | tokens/s | model TFLOP/s | MFU | {memory} |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        print(f"| {r['variant']} | {r['trained_parameters'] / 1e6:.2f}M | {r['tokens_per_step']:.0f} | "
              f"{r['seconds_per_step']:.3f} | {r['tokens_per_s']:.0f} | {r['tflops_per_s']:.3g} | {mfu} | "
              f"{r['peak_memory_gib']:.2f} |")
    for check in checks:
        if check["name"] == "fingerprints":
            print(f"\nfingerprints, {check['tensors']} tensors, float32 and bfloat16, {check['device']} against "
                  f"host: {'PASS' if check['passed'] else 'FAIL'}")
        else:
            gaps = "; ".join(f"{d} {check[d]['max_abs_diff']:.2e} (tolerance {check[d]['tolerance']:g})"
                             for d in TOLERANCES)
            print(f"packed against padded logprobs, {check['rows']} rows, {check['tokens']} tokens, max |diff|: "
                  f"{gaps}: {'PASS' if check['passed'] else 'FAIL'}")


def write_results(path: Path, setup: dict, rows: list[dict], checks: list[dict]) -> None:
    path.write_text(json.dumps({"setup": setup, "variants": rows, "checks": checks}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="default: cuda if a GPU is visible, else cpu")
    parser.add_argument("--size", choices=list(SIZES), default="0.5b")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant, after one warm-up step")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    device = choose_device(args.device)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the loads' and saves' bars would bury the table
    size = SIZES[args.size]
    setup = describe(device, args.size, size, args)
    batches = [draw_batch(size, seed) for seed in range(WARMUP_STEPS + args.steps)]
    rows, checks = [], []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="relay-gpu-learner-") as tmp:
        build_model_dir(size, Path(tmp), device)
        for number, (name, packed, lora) in enumerate(VARIANTS):
            row, learner = run_variant(name, packed, lora, Path(tmp), size, batches, setup["peak_tflops"])
            rows.append(row)
            if number == 0:
                checks = [check_fingerprints(learner), check_packing(learner, batches[0], size)]
            del learner
            # A run cut short by a machine's time limit still leaves the variants it finished.
            print(f"gpu_learner: {name}: {row['seconds_per_step']:.3f} s/step, {row['tokens_per_s']:.0f} tokens/s, "
                  f"{row['peak_memory_gib']:.2f} GiB ({time.perf_counter() - started:.0f} s so far)",
                  file=sys.stderr, flush=True)
            if args.out is not None:
                write_results(args.out, setup, rows, checks)
    setup["wall_seconds"] = time.perf_counter() - started
    print_table(setup, rows, checks)
    print(f"\n{setup['wall_seconds']:.0f} s in all")
    if args.out is not None:
        write_results(args.out, setup, rows, checks)
    failed = failures(checks)
    for line in failed:
        print(f"gpu_learner: CHECK FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The learner's training step on a GPU: s/step, tokens/s, MFU, peak memory, kernels and the device's idle share of
relay's `Learner.train_step`, one variant per faster path (`learner.fast_paths`, the token budget) and all of them,
each against a plain transformers loop; and two checks that need the device.

Usage: python bench/gpu_learner.py [--device cuda|cpu] [--size 0.5b|tiny|demo|25m] [--steps N] [--variants a,b,..]
                                   [--dtype bfloat16|float32] [--no-plain-loop] [--out PATH]
`--size 0.5b` (the default): a Qwen2 of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864,
vocabulary 151936, tied embeddings: 494M parameters) with random weights, saved to a temporary directory that
`Learner` loads; each step 8 prompts of 256 tokens x 8 completions whose lengths are drawn (seeded, uniform) from
128-2048 tokens, passes cut at 8192 tokens unless a variant asks `relay plan` (cluster/plan.py) for the largest budget
the device holds. `--size tiny`: 2 layers of hidden 128, vocabulary 1024, 4 prompts of 32 tokens x 4 completions of
16-128, passes of 1024 tokens: seconds on a CPU, for the tests. `demo`, `25m`: the CPU's learner steps (the demo's
model and bench/vs_trl.py's 25M shape, character vocabulary, 32 prompts x 8 short completions).
Variants (`VARIANTS`), each a fresh `Learner` on the same batches, `--dtype` (bfloat16: the learner's autocast) on
float32 master weights, GRPO, one minibatch (one forward and backward per token, no separate old-logprobs pass), the
KL in the loss, prompts shared and passes packed as a run has them: `plain` (today's paths), one per technique (`a`
the budget of relay plan, `b` the head in chunks, `c` each decoder layer compiled on bucketed pass lengths (inductor
on a GPU; on a CPU aot_eager, as inductor compiles there for minutes), `d` metrics on the device, `e` varlen attention,
`f` fused AdamW), `all` (together), `padded`, `lora`, `lora-all`. The plain loop (`plain_step`): padded passes of
the same budget, `model(...)` under autocast, log-softmax, backward, fused AdamW: no relay code. One untimed warm-up
step, then `--steps` timed ones (the GPU synchronised around each), then one under torch.profiler for the kernels and
the idle share.

Columns: tokens/s counts every row's prompt and response tokens (what the batch holds). Model FLOPs per step count
the tokens relay must compute: each distinct prompt once (prompts shared) and every response token, never padding, so
padded passes' waste shows as lower MFU. Per token: 6 N for a full update (forward 2 N, backward 4 N; the usual
count, without attention's score and value products, a few per cent at these lengths), N every parameter once (the
tied head is one matrix used once per token; the embedding lookup computes nothing); with LoRA 4 N_base + 6
N_adapter (the frozen base still runs its forward and carries gradients back through its activations, 2 N + 2 N, but
computes no weight gradients). MFU: those FLOPs per second over the device's dense bfloat16 peak (`PEAK_TFLOPS`; n/a
for devices not in it, the CPU among them). Peak memory: `torch.cuda.max_memory_allocated` over the variant on a
GPU; on the CPU the process's peak resident memory so far (the learner's `memory/learner_peak_mb`), which only grows
from one variant to the next. Kernels/step: the device's kernels in the profiled step; GPU idle: 1 - the union of
their intervals / the step's wall time (`launch_profile`; n/a on a CPU).

Checks (after the first variant's steps, on its trained weights; a failure exits 1 with one line saying which):
- fingerprints: `sync.fingerprint` of every weight on the device equals that of its host copy, for the float32
  master weights and for their bfloat16 casts the engines get (`Learner.weights_fingerprint`, the publisher's path);
  on the CPU both are host sums, so it holds trivially there;
- packing: one packed and one padded pass over the first `check_prompts` groups (`batched_logprobs`, whole rows)
  give the same logprobs of every response token, within `TOLERANCES`, in bfloat16 (the learner's autocast) and in
  float32.
Imports only torch, numpy, transformers, peft and the standard library, with relay's `learner/` and `sync/`, and
cluster/plan.py for technique a, which import nothing more (pydantic and yaml for the config): the GPU machines have
neither Ray nor vLLM (tests/unit/test_gpu_learner_bench.py checks it).
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

from learner.config import FastPathsConfig, LearnerConfig, LoraConfig  # noqa: E402
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
    head_chunk: int = 4096  # learner.fast_paths.head_chunk_tokens in the variants that chunk the head
    compile_bucket: int = 2048  # learner.fast_paths.compile_bucket_tokens in the variants that compile the layers


SIZES = {
    "0.5b": Size(896, 24, 14, 2, 4864, 151936, prompts=8, group=8, prompt_tokens=256, response_tokens=(128, 2048),
                 budget=8192, lora_rank=32, check_prompts=2),
    "tiny": Size(128, 2, 4, 2, 256, 1024, prompts=4, group=4, prompt_tokens=32, response_tokens=(16, 128),
                 budget=1024, lora_rank=8, check_prompts=2, head_chunk=64, compile_bucket=256),
    # The CPU's learner steps: the demo's model and bench/vs_trl.py's 25M one (the character vocabulary), a step of
    # 32 prompts x 8 short completions as the demo samples them.
    "demo": Size(128, 2, 4, 2, 256, 17, prompts=32, group=8, prompt_tokens=6, response_tokens=(2, 30), budget=1024,
                 lora_rank=8, check_prompts=2, head_chunk=1024, compile_bucket=256),
    "25m": Size(512, 8, 8, 4, 1536, 17, prompts=32, group=8, prompt_tokens=6, response_tokens=(2, 64), budget=1024,
                lora_rank=8, check_prompts=2, head_chunk=1024, compile_bucket=256),
}


@dataclass(frozen=True)
class Variant:
    """One row of the table: relay's learner with these settings (`learner.fast_paths` and the token budget)."""

    name: str
    packed: bool = True
    lora: bool = False
    fast: tuple[tuple[str, object], ...] = ()  # learner.fast_paths overrides
    plan_budget: bool = False  # passes of the largest budget `relay plan` fits in the device's memory (technique a)


ALL_FAST = (("head_chunk_tokens", "size"), ("compile_bucket_tokens", "size"), ("metrics_on_device", True),
            ("varlen_attention", True), ("fused_adamw", True))
# `learner.fast_paths` keys whose value "size" means the size's own (`Size`'s field).
SIZE_FIELDS = {"head_chunk_tokens": "head_chunk", "compile_bucket_tokens": "compile_bucket"}
# The first is the one the checks run on; every other row is it with one technique, then all of them together.
VARIANTS = {
    "plain": Variant("full, packed: plain paths"),
    "a": Variant("a. passes of relay plan's budget", plan_budget=True),
    "b": Variant("b. head in chunks", fast=(("head_chunk_tokens", "size"),)),
    "c": Variant("c. compiled layers, bucketed lengths", fast=(("compile_bucket_tokens", "size"),)),
    "d": Variant("d. metrics on the device", fast=(("metrics_on_device", True),)),
    "e": Variant("e. varlen attention", fast=(("varlen_attention", True),)),
    "f": Variant("f. fused AdamW", fast=(("fused_adamw", True),)),
    "all": Variant("a+b+c+d+e+f", fast=ALL_FAST, plan_budget=True),
    "padded": Variant("full, padded: plain paths", packed=False),
    "lora": Variant("LoRA, packed: plain paths", lora=True),
    "lora-all": Variant("LoRA, packed: a+b+c+d+e+f", lora=True, fast=ALL_FAST, plan_budget=True),
}
# What a CPU's learner may take when a variant asks relay plan for a budget (no GPU to read): the demo's step fits
# whole, as on a large GPU.
PLAN_CPU_BYTES = 8 * 2**30
# (name, packed passes, LoRA); the first is the one the checks run on.
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


def learner_config(size: Size, packed: bool, lora: bool, variant: Variant | None = None,
                   budget: int | None = None) -> LearnerConfig:
    """Near configs/gpu_gsm8k_single.yaml's learner (lr 1e-6, token-mean loss, clip-higher, the KL in the loss), but
    one minibatch (one forward and backward per token, no old-logprobs pass), no rollout correction, no warm-up. With
    `lora`, relay's `learner.lora`: rank `size.lora_rank`, alpha 2 x rank, every linear layer of the blocks. With a
    `variant`, its `learner.fast_paths` (the head's chunk `size.head_chunk`, the compiled layers' bucket
    `size.compile_bucket`), and passes of `budget` tokens when given (else `size.budget`)."""
    fast = {key: getattr(size, SIZE_FIELDS[key]) if value == "size" else value
            for key, value in (variant.fast if variant else ())}
    if "compile_bucket_tokens" in fast:  # the module's docstring: inductor on a GPU, aot_eager on a CPU
        fast["compile_backend"] = "inductor" if pick_device().type == "cuda" else "aot_eager"
    return LearnerConfig(lr=1e-6, warmup_steps=0, master_dtype="float32",
                         max_tokens_per_micro_batch=budget or size.budget, pack_sequences=packed,
                         loss_agg="token-mean", clip_high=0.28, kl_coef=0.001,
                         lora=LoraConfig(rank=size.lora_rank if lora else 0), fast_paths=FastPathsConfig(**fast))


def plan_budget(size: Size, model_dir: Path, device: torch.device, variant: Variant, dtype: str) -> int:
    """Technique a: the largest token budget `relay plan` (cluster/plan.py, `fitting_token_budget`) fits in this
    device's memory for the bench's step (`PLAN_CPU_BYTES` on a CPU), with the variant's fast paths."""
    from cluster.config import load_config
    from cluster.plan import ModelShape, fitting_token_budget

    head = size.head_chunk if ("head_chunk_tokens", "size") in variant.fast else None
    config = load_config(None, [f"model.dtype={dtype}", f"data.prompts_per_step={size.prompts}",
                                f"rollout.group_size={size.group}", f"data.max_prompt_tokens={size.prompt_tokens}",
                                f"rollout.max_new_tokens={size.response_tokens[1]}",
                                f"rollout.max_model_len={size.prompt_tokens + size.response_tokens[1]}",
                                "learner.num_minibatches=1", "learner.lr=1e-6", "learner.num_gpus=1",
                                f"learner.lora.rank={size.lora_rank if variant.lora else 0}"]
                         + ([f"learner.fast_paths.head_chunk_tokens={head}"] if head else []))
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else PLAN_CPU_BYTES
    step = 1024 if size.budget >= 1024 else 128
    return fitting_token_budget(config, ModelShape.read(model_dir), memory, step=step) or size.budget


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


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end] intervals (the device's kernels, which may overlap on streams)."""
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def launch_profile(step, device: torch.device) -> dict:
    """One call of `step()` under torch.profiler: the kernels the device ran and the share of the step's wall time
    it ran none (1 - the union of the kernels' intervals / the wall time). On a CPU: None for both (no kernels)."""
    if device.type != "cuda":
        return {"kernels": None, "idle_share": None}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        wall = time.perf_counter() - start
    kernels = [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in prof.events()
               if e.device_type == DeviceType.CUDA]
    return {"kernels": len(kernels), "idle_share": max(0.0, 1 - busy_seconds(kernels) / wall)}


def run_variant(variant: Variant, model_dir: Path, size: Size, batches: list[TrainBatch], peak: float | None,
                dtype: str, plain_loop: float | None) -> tuple[dict, Learner]:
    """One variant's timed steps and one profiled step: its row of the table, and its learner (for the checks)."""
    device = pick_device()
    release(device)
    budget = plan_budget(size, model_dir, device, variant, dtype) if variant.plan_budget else size.budget
    learner = Learner(str(model_dir), learner_config(size, variant.packed, variant.lora, variant, budget), dtype=dtype,
                      seed=0)
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
    launches = launch_profile(lambda: learner.train_step(timed[-1]), learner.device)
    per_step = sum(seconds) / len(seconds)
    row = {"variant": variant.name, "packed": variant.packed, "lora": variant.lora,
           "lora_rank": size.lora_rank if variant.lora else None, "fast_paths": dict(variant.fast),
           "budget": budget, "trained_parameters": counts["trained"], "base_parameters": counts["base"],
           "adapter_parameters": counts["adapter"], "steps": len(seconds), "tokens_per_step": tokens / len(timed),
           "seconds_per_step": per_step, "step_seconds": seconds, "vs_plain_loop": plain_loop / per_step
           if plain_loop else None, "tokens_per_s": tokens / sum(seconds),
           "model_tflops_per_step": flops / len(timed) / 1e12, "tflops_per_s": tflops,
           "mfu": tflops / peak if peak else None, "peak_memory_gib": memory, **launches,
           "loss": metrics["loss/policy"], "grad_norm": metrics["grad_norm"]}
    return row, learner


def plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: TrainBatch, budget: int,
               device: torch.device) -> None:
    """A hand-written step over `batch`'s rows: padded passes of at most `budget` tokens (shortest rows first, so a
    pass's longest row is the one joining it), `model(input_ids, attention_mask)` under autocast, log-softmax of the
    response tokens, their mean, backward, then one fused AdamW step: no relay code."""
    rows = sorted(zip(batch.prompt_ids, batch.response_ids), key=lambda r: len(r[0]) + len(r[1]))
    passes, current = [], []
    for row in rows:
        longest = len(row[0]) + len(row[1])
        if current and longest * (len(current) + 1) > budget:
            passes.append(current)
            current = []
        current.append(row)
    passes.append(current)
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


def plain_loop(model_dir: Path, size: Size, batches: list[TrainBatch]) -> dict:
    """The plain loop's row: `plain_step` over the same batches (one warm-up step), and one profiled step."""
    from transformers import AutoModelForCausalLM

    device = pick_device()
    release(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    seconds = []
    for i, batch in enumerate(batches):
        synchronize(device)
        start = time.perf_counter()
        plain_step(model, optimizer, batch, size.budget, device)
        synchronize(device)
        if i >= WARMUP_STEPS:
            seconds.append(time.perf_counter() - start)
    timed = batches[WARMUP_STEPS:]
    tokens = sum(len(p) + len(r) for batch in timed for p, r in zip(batch.prompt_ids, batch.response_ids))
    launches = launch_profile(lambda: plain_step(model, optimizer, timed[-1], size.budget, device), device)
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"variant": "plain loop (transformers, padded, no relay code)",
            "seconds_per_step": sum(seconds) / len(seconds), "step_seconds": seconds,
            "tokens_per_step": tokens / len(timed), "tokens_per_s": tokens / sum(seconds), "peak_memory_gib": memory,
            **launches}  # the model and optimizer are freed on return


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
            "dtype": args.dtype, "peak_tflops": peak_tflops(name) if device.type == "cuda" else None}


def _cell(value, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def print_table(setup: dict, rows: list[dict], checks: list[dict], plain: dict | None) -> None:
    shape = setup["shape"]
    print(f"\n{setup['device_name']} ({setup['device']}), {setup['cpus']} CPUs, torch {setup['torch']}, transformers "
          f"{setup['transformers']}, peft {setup['peft']}, {setup['date']}; --size {setup['size']}: "
          f"{rows[0]['base_parameters'] / 1e6:.1f}M parameters, {shape['prompts']} prompts of "
          f"{shape['prompt_tokens']} x {shape['group']} responses of {shape['response_tokens'][0]}-"
          f"{shape['response_tokens'][1]} tokens; {setup['dtype']} on float32 master weights; {setup['steps']} steps "
          f"after {setup['warmup_steps']} warm-up\n")
    memory = "peak memory GiB" if setup["device"].startswith("cuda") else "peak RSS GiB (process)"
    print(f"| variant | passes of | s/step | plain loop's s / this | tokens/s | model TFLOP/s | MFU | {memory} | "
          f"kernels/step | GPU idle |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    if plain is not None:
        print(f"| {plain['variant']} | {shape['budget']} | {plain['seconds_per_step']:.3f} | 1.00 | "
              f"{plain['tokens_per_s']:.0f} | | | {_cell(plain['peak_memory_gib'], '.2f')} | "
              f"{_cell(plain['kernels'], 'd')} | {_cell(plain['idle_share'], '.0%')} |")
    for r in rows:
        print(f"| {r['variant']} | {r['budget']} | {r['seconds_per_step']:.3f} | {_cell(r['vs_plain_loop'], '.2f')} | "
              f"{r['tokens_per_s']:.0f} | {r['tflops_per_s']:.3g} | {_cell(r['mfu'], '.1%')} | "
              f"{r['peak_memory_gib']:.2f} | {_cell(r['kernels'], 'd')} | {_cell(r['idle_share'], '.0%')} |")
    for check in checks:
        if check["name"] == "fingerprints":
            print(f"\nfingerprints, {check['tensors']} tensors, float32 and bfloat16, {check['device']} against "
                  f"host: {'PASS' if check['passed'] else 'FAIL'}")
        else:
            gaps = "; ".join(f"{d} {check[d]['max_abs_diff']:.2e} (tolerance {check[d]['tolerance']:g})"
                             for d in TOLERANCES)
            print(f"packed against padded logprobs, {check['rows']} rows, {check['tokens']} tokens, max |diff|: "
                  f"{gaps}: {'PASS' if check['passed'] else 'FAIL'}")


def write_results(path: Path, setup: dict, rows: list[dict], checks: list[dict], plain: dict | None = None) -> None:
    path.write_text(json.dumps({"setup": setup, "plain_loop": plain, "variants": rows, "checks": checks}, indent=2)
                    + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="default: cuda if a GPU is visible, else cpu")
    parser.add_argument("--size", choices=list(SIZES), default="0.5b")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant, after one warm-up step")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}; the first is the one checked")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="model.dtype (the master weights are float32)")
    parser.add_argument("--plain-loop", action=argparse.BooleanOptionalAction, default=True,
                        help="time the plain transformers loop first, the rows' reference (default: yes)")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    unknown = [name for name in args.variants.split(",") if name not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    device = choose_device(args.device)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the loads' and saves' bars would bury the table
    size = SIZES[args.size]
    setup = describe(device, args.size, size, args)
    batches = [draw_batch(size, seed) for seed in range(WARMUP_STEPS + args.steps)]
    rows, checks, plain = [], [], None
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="relay-gpu-learner-") as tmp:
        build_model_dir(size, Path(tmp), device)
        if args.plain_loop:
            plain = plain_loop(Path(tmp), size, batches)
            progress("plain loop", plain, started)
        for number, key in enumerate(args.variants.split(",")):
            row, learner = run_variant(VARIANTS[key], Path(tmp), size, batches, setup["peak_tflops"], args.dtype,
                                       plain["seconds_per_step"] if plain else None)
            rows.append(row)
            if number == 0:
                checks = [check_fingerprints(learner), check_packing(learner, batches[0], size)]
            del learner
            progress(row["variant"], row, started)
            if args.out is not None:  # a run cut short by a machine's time limit still leaves the variants it finished
                write_results(args.out, setup, rows, checks, plain)
    setup["wall_seconds"] = time.perf_counter() - started
    print_table(setup, rows, checks, plain)
    print(f"\n{setup['wall_seconds']:.0f} s in all")
    if args.out is not None:
        write_results(args.out, setup, rows, checks, plain)
    failed = failures(checks)
    for line in failed:
        print(f"gpu_learner: CHECK FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


def progress(name: str, row: dict, started: float) -> None:
    memory = "" if row["peak_memory_gib"] is None else f", {row['peak_memory_gib']:.2f} GiB"
    print(f"gpu_learner: {name}: {row['seconds_per_step']:.3f} s/step, {row['tokens_per_s']:.0f} tokens/s{memory} "
          f"({time.perf_counter() - started:.0f} s so far)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())

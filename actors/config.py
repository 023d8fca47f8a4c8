"""The rollout fleet's, the reference worker's and the teacher's settings: engines, sampling, placement knobs of the
workers.

Owned here, beside the workers they configure; `cluster/config.py` composes them into the run config, and takes the
engine's sizes a model's own config.json sets (`sizes_for_model`). Imports only pydantic (and json to read that file),
so validating a config needs neither torch nor vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


MAX_CONTEXT = 4096  # a longer context is not taken as max_model_len: every engine's KV cache scales with it
KV_SEQUENCES = 8  # full-length sequences the KV cache a model sets holds (the demo's group of 8 at once)
DEMO_KV_CACHE_BYTES = 64 * 2**20


def sizes_for_model(model_dir: str | None, max_model_len: int | None = None) -> dict[str, int]:
    """The rollout sizes that the model in `model_dir` sets where the user did not: `max_model_len` is its config's
    context (`max_position_embeddings`) up to MAX_CONTEXT tokens; `max_new_tokens` an eighth of max_model_len (the
    user's, if given; the prompt gets the rest: the demo's 8 of 64, 512 of 4096); `kv_cache_bytes` room for
    KV_SEQUENCES sequences of max_model_len tokens at 4 bytes a value (twice as many in bfloat16), and at least the
    demo's 64 MiB. Empty when `model_dir` holds no readable config.json with a context (the run's start reports a
    missing model)."""
    try:
        model = json.loads((Path(model_dir) / "config.json").read_text()) if model_dir else {}
    except (OSError, ValueError):
        return {}
    model = model.get("text_config") or model if isinstance(model, dict) else {}
    context = model.get("max_position_embeddings")
    if not isinstance(context, int) or context < 16:
        return {}
    length = max_model_len if isinstance(max_model_len, int) and max_model_len >= 16 else min(context, MAX_CONTEXT)
    sizes = {"max_model_len": length, "max_new_tokens": length // 8}
    layers, heads = model.get("num_hidden_layers"), model.get("num_attention_heads")
    if isinstance(layers, int) and isinstance(heads, int) and isinstance(model.get("hidden_size"), int):
        head_dim = model.get("head_dim") or model["hidden_size"] // heads
        per_token = 2 * layers * (model.get("num_key_value_heads") or heads) * head_dim * 4  # keys and values, float32
        sizes["kv_cache_bytes"] = max(DEMO_KV_CACHE_BYTES, -(-KV_SEQUENCES * length * per_token // 2**20) * 2**20)
    return sizes


class RolloutConfig(_Section):
    num_workers: int = Field(2, ge=1, le=4096)
    """Rollout workers, each one Ray actor owning one vLLM engine; scaled independently of the learner."""
    num_cpus: float = Field(0.5, gt=0, le=1024)
    """CPUs Ray reserves for each rollout worker (scheduling only)."""
    num_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves for each rollout worker (0 on CPU machines)."""
    num_threads: int = Field(1, ge=1, le=1024)
    """Compute threads each engine uses; keep the sum over workers at or below the cores of a node."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """GPUs each engine shards its model over (vLLM tensor parallelism); each worker reserves this many bundles of
    `num_cpus`/`num_gpus`, packed on one node."""
    resources: dict[str, float] = {}
    """Custom Ray resources each rollout worker needs, e.g. `{rollout_node: 1}` to run only on nodes started with
    `--resources='{"rollout_node": 8}'`."""
    node_labels: dict[str, str] = {}
    """Node labels each rollout worker's node must carry (Ray label selector), e.g.
    `{ray.io/accelerator-type: H100}`."""
    placement: Literal["pack", "spread"] = "pack"
    """Where rollout workers go among the nodes that fit them: `pack` leaves it to Ray (which fills nodes already
    in use first), `spread` puts each new worker on the fitting node with the fewest rollout workers."""
    balance: Literal["speed", "even"] = "speed"
    """How each step's prompts are split over the workers (one request, one engine batch, per worker): `speed` in
    proportion to the prompts per second each worker managed in recent steps, so a slow worker gets fewer and the
    fleet finishes together; `even` in equal shares."""
    group_size: int = Field(8, ge=1, le=1024)
    """Completions sampled per prompt (G)."""
    max_new_tokens: int = Field(8, ge=1, le=1_000_000)
    """Maximum response tokens per completion; of a multi-turn episode (`env`), its model and environment tokens
    together. Below `max_model_len`. Unset with `model.path`: an eighth of `max_model_len` (`sizes_for_model`)."""
    max_turns: int = Field(4, ge=1, le=10_000)
    """Multi-turn episodes (`env`): model turns per episode at most; after the last one the episode ends."""
    stop: list[str] = []
    """Multi-turn episodes (`env`): strings that end a model turn besides EOS (e.g. a tool call's closing tag `]` or
    `</tool_call>`); the text that completes one is the model's, and goes to the environment with its turn."""
    temperature: float = Field(1.0, gt=0, le=10)
    """Sampling temperature; the learner scores with the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass. 1 keeps the full distribution, which the learner's logprobs assume; below 1 the
    engines' logprobs are renormalised over the nucleus and the learner's are not, so `logprob/mismatch` also holds
    that renormalisation (the run warns at start). With `learner.rollout_correction` (which asynchronous training and
    replay set by default) it is refused: the importance weights would be biased below 1."""
    max_model_len: int = Field(64, ge=8, le=1_048_576)
    """Longest prompt+response the engine accepts. Unset with `model.path`: the model's context
    (`max_position_embeddings` in its config.json), at most 4096 (`sizes_for_model`)."""
    kv_cache_bytes: int = Field(64 * 2**20, ge=2**20)
    """KV-cache memory per engine, in bytes (needed on CPU, where vLLM cannot measure free memory). Unset with
    `model.path`: room for 8 sequences of `max_model_len` tokens in float32, at least 64 MiB (`sizes_for_model`)."""
    enforce_eager: bool = True
    """Skip torch.compile and graph capture, which dominate an engine's start-up on CPU (docs/vllm-cpu.md)."""
    cpu_linear: Literal["auto", "torch", "onednn"] = "auto"
    """CPU engines only: the linear layers' kernel. `onednn` (vLLM's): matmuls on a pre-packed copy of each weight,
    so every load re-packs every layer through vLLM's reload; `torch`: torch's linear on the weights as loaded, so a
    load copies them in place (the demo's model: 2.5 ms against 24 ms), with slower matmuls on larger models (a 25M one
    samples in 1.3x the time); `auto`: torch for a policy under 1M parameters (one-shard engines), else onednn."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of GPU memory the engine may take (GPU only)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (no learning signal) and sample more prompts
    until `data.prompts_per_step` groups are kept."""
    max_restarts: int = Field(5, ge=0, le=10_000)
    """Rollout workers the run may replace (after a death or a missed deadline) before it stops."""
    max_staleness: int = Field(0, ge=0, le=64)
    """Asynchronous training: the batch step t trains on is sampled with weights version exactly max(c, t - 1 - k)
    (k this value; c the latest checkpoint step before t, where the pipeline drains), so the next k batches are
    generated, scored and reference-scored while the learner trains. 0: on-policy, generation waits for each step's
    weights. With k >= 1 the loss is decoupled PPO (`learner.rollout_correction` defaults to `tis`);
    docs/operations.md, asynchronous training."""
    in_flight_updates: bool = False
    """Asynchronous training (`max_staleness` >= 1): every engine also takes each new weights version between two
    steps of the request it is running (PipelineRL-style): requests in progress are preempted and go on with the new
    weights, and each token carries the version that sampled it. Fresher tokens, but not deterministic: when a load
    lands depends on timing. docs/operations.md, in-flight updates."""
    max_sampling_rounds: int = Field(4, ge=1, le=1000)
    """Generation rounds per step with dynamic sampling; if the batch is still short after them, it is topped up
    with dropped groups (counted in `sampling/filler_groups`)."""


class ReferenceConfig(_Section):
    enabled: bool = True
    """Allow a frozen reference policy for the KL penalty; it is started only when `learner.kl_coef` or
    `learner.kl_reward_coef` is > 0 (which then require it)."""
    num_cpus: float = Field(0.5, gt=0, le=1024)
    """CPUs Ray reserves for the reference worker."""
    num_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves for the reference worker."""
    num_threads: int | None = Field(None, ge=1, le=1024)
    """Torch threads of the reference worker, set as `learner.num_threads` when unset (2, or 1 for a policy under 1M
    parameters; 1 in an asynchronous run)."""
    resources: dict[str, float] = {}
    """Custom Ray resources the reference worker needs (e.g. `{learner_node: 1}`)."""
    micro_batch_size: int | None = Field(None, ge=1, le=1_000_000)
    """Sequences per reference forward pass at most; empty: only `max_tokens_per_micro_batch` limits a pass."""
    max_tokens_per_micro_batch: int | None = Field(1024, ge=1, le=1_000_000_000)
    """Tokens per reference forward pass at most, as `learner.max_tokens_per_micro_batch` (sequences sorted by
    length; packed passes count their real tokens, padded ones sequences x the pass's longest); empty: no token
    limit."""
    share_prompts: bool = True
    """Compute each prompt once for the rows that share it, as `learner.share_prompts`."""
    pack_sequences: bool = True
    """Run each pass's rows as one packed sequence of their real tokens, as `learner.pack_sequences`."""
    refresh_every: int = Field(0, ge=0, le=10_000_000)
    """Iterative GRPO: at every step that is a multiple of this, before its reference pass, the reference takes the
    policy's current weights (the ones that sampled the step's batch), checked by fingerprints and a probe, so the
    KL penalty measures the drift from a recent policy rather than the initial one (`kl/mean` ~0 at that step).
    0: the reference stays the initial policy. docs/algorithms.md, iterative GRPO."""


class TeacherConfig(_Section):
    path: str | None = None
    """On-policy distillation's teacher (`learner.distill_coef` > 0): a Hugging Face causal LM directory with the
    policy's tokenizer (checked at the start), of any size; `demo`: relay's demo teacher, the arithmetic demo model
    after a GRPO run (shipped). Empty: no teacher."""
    num_cpus: float = Field(0.5, gt=0, le=1024)
    """CPUs Ray reserves for the teacher worker."""
    num_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves for the teacher worker."""
    num_threads: int | None = Field(None, ge=1, le=1024)
    """Torch threads of the teacher worker, set as `reference.num_threads` when unset."""
    resources: dict[str, float] = {}
    """Custom Ray resources the teacher worker needs (e.g. `{teacher_node: 1}`)."""
    micro_batch_size: int | None = Field(None, ge=1, le=1_000_000)
    """Sequences per teacher forward pass at most; empty: only `max_tokens_per_micro_batch` limits a pass."""
    max_tokens_per_micro_batch: int | None = Field(1024, ge=1, le=1_000_000_000)
    """Tokens per teacher forward pass at most, as `reference.max_tokens_per_micro_batch`; empty: no token limit."""
    share_prompts: bool = True
    """Compute each prompt once for the rows that share it, as `reference.share_prompts`."""
    pack_sequences: bool = True
    """Run each pass's rows as one packed sequence of their real tokens, as `reference.pack_sequences`."""

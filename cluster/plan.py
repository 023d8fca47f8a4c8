"""A run's plan before it runs: where its actors go, the GPU memory each needs, and whether the GPUs can hold them,
from the run config and the model's config.json alone (no Ray, no GPU, no weights).

Owns: the actors' Ray bundles (`core_bundles`, `rollout_bundles`; cluster/fleet/placement.py reserves exactly
these), the model's shape read from config.json (`ModelShape`), the memory estimates (`plan_run`: a learner rank, the
reference, teacher and reward models, each engine; what each counts: docs/gpu.md, "Memory: relay plan"),
`fit_problems` (what `relay plan` and `relay train` refuse), the largest token budget a learner's GPU holds
(`fitting_token_budget`, `resolve_token_budget` for `=auto`), and the GPU memory of this machine (`gpu_memory`).
Does not own: reserving or starting anything (cluster/fleet/placement.py), printing a plan (cluster/cli/plan.py), or
the measurement the estimate is checked against (docs/benchmarks.md, "GPU learner"; tests/unit/test_plan.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from cluster.config import ConfigError, RunConfig
from rewards.config import ModelSource

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2}
# What a CUDA process holds besides its tensors (the context, cuBLAS/cuDNN workspaces, the caching allocator's
# rounding): an allowance, not a measurement (torch.cuda.max_memory_allocated, which the bench reports, excludes it).
CUDA_OVERHEAD_BYTES = GIB
# vLLM's working memory inside its gpu_memory_utilization (activations it profiles at start, the sampler, CUDA
# graphs): an allowance, not a measurement; the rest of its share is KV cache.
ENGINE_WORKING_BYTES = 2 * GIB
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape, as its Hugging Face config.json gives it (Qwen2 and Llama alike)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool  # the output head is the embedding
    attention_bias: bool  # q, k and v projections have biases (Qwen2)
    max_positions: int

    @classmethod
    def read(cls, directory: str | Path) -> ModelShape:
        """The shape in `directory`/config.json; ValueError (one line) when it is missing or lacks a field."""
        path = Path(directory) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read the model's shape from {path} ({err.__class__.__name__}); pass a model "
                             "directory with its config.json (model.path=DIR)") from None
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(hidden, int(config["num_hidden_layers"]), heads,
                       int(config.get("num_key_value_heads") or heads), int(config.get("head_dim") or hidden // heads),
                       int(config["intermediate_size"]), int(config["vocab_size"]),
                       bool(config.get("tie_word_embeddings", False)),
                       bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
                       int(config.get("max_position_embeddings") or 0))
        except KeyError as err:
            raise ValueError(f"{path} has no {err.args[0]}: relay plan reads decoder-only transformers' shapes "
                             "(hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size)") \
                from None

    def linear_sizes(self) -> dict[str, tuple[int, int]]:
        """Each block's linear layers: name -> (inputs, outputs)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                "o_proj": (q, self.hidden), "gate_proj": (self.hidden, self.intermediate),
                "up_proj": (self.hidden, self.intermediate), "down_proj": (self.intermediate, self.hidden)}

    @property
    def parameters(self) -> int:
        """Every parameter: embedding, blocks (linears, q/k/v biases, two norms), final norm, an untied head."""
        block = sum(i * o for i, o in self.linear_sizes().values()) + 2 * self.hidden
        if self.attention_bias:
            block += (self.heads + 2 * self.kv_heads) * self.head_dim
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * block + self.hidden

    def adapter_parameters(self, rank: int, targets: str | list[str]) -> int:
        """LoRA's trained parameters: rank x (inputs + outputs) per adapted linear of every block."""
        names = LINEARS if targets == "all-linear" else [n for n in LINEARS if n in targets]
        return self.layers * sum(rank * sum(self.linear_sizes()[n]) for n in names)


def layer_bytes(shape: ModelShape, compute: int, autocast: bool) -> int:
    """Bytes one block saves for its backward per token, in a pass whose matmuls run in `compute`-byte floats
    (`autocast`: on float32 master weights): the MLP's four [I] tensors, the two norms' float32 inputs and outputs,
    the linear layers' inputs (autocast casts one per linear, else the three share two), attention's query, keys and
    values (repeated to every head) and output, its log-sum-exp and the norms' scales."""
    attention = shape.heads * shape.head_dim
    return (4 * shape.intermediate * compute + 16 * shape.hidden + (6 if autocast else 3) * shape.hidden * compute
            + 4 * attention * compute + 4 * shape.heads + 8)


def pass_saved_bytes(shape: ModelShape, tokens: int, longest: int, compute: int, autocast: bool) -> int:
    """Bytes a training pass of `tokens` tokens in rows of up to `longest` saves for its backward: every block's
    (`layer_bytes`), the attention masks (one per block, [rows, longest, longest] in the compute dtype), the final
    norm and the head's input, and the float32 logits the log-softmax keeps."""
    per_token = shape.layers * layer_bytes(shape, compute, autocast) + 8 * shape.hidden + shape.hidden * compute
    return tokens * (per_token + 4 * shape.vocab) + shape.layers * tokens * longest * compute


@dataclass
class ActorPlan:
    """One kind of actor: how many, what each asks Ray for, and the memory each needs (bytes by what holds it)."""

    name: str
    key: str  # its config section, as fixes name it: learner, reference, teacher, reward.sources.NAME, rollout
    count: int
    cpus: float
    gpus: float  # per actor; a rollout worker's per tensor-parallel shard (its memory is per shard too)
    memory: dict[str, int] = field(default_factory=dict)  # on its device: a GPU's if it has one, else host memory
    notes: list[str] = field(default_factory=list)
    engine_share: float | None = None  # an engine on a GPU: gpu_memory_utilization

    @property
    def total(self) -> int:
        return sum(self.memory.values())


def core_bundles(config: RunConfig) -> list[tuple[str, dict[str, float]]]:
    """The shared placement group's bundles (Ray's PACK), in order, each with the actor it holds: the learner's ranks,
    the reference (when a KL reads it), the teacher (distillation), each reward model."""
    lc, rc, tc = config.learner, config.reference, config.teacher
    bundles = [(f"learner rank {rank}", bundle(lc.num_cpus, lc.num_gpus, lc.resources)) for rank in range(lc.num_ranks)]
    if config.uses_reference:
        bundles.append(("reference", bundle(rc.num_cpus, rc.num_gpus, rc.resources)))
    if config.uses_teacher:
        bundles.append(("teacher", bundle(tc.num_cpus, tc.num_gpus, tc.resources)))
    bundles += [(f"reward model '{name}'", bundle(s.num_cpus, s.num_gpus)) for name, s in config.reward.sources.items()
                if isinstance(s, ModelSource)]
    return bundles


def rollout_bundles(config: RunConfig) -> list[dict[str, float]]:
    """One rollout worker's placement group (Ray's STRICT_PACK: one node): a bundle per tensor-parallel shard."""
    ro = config.rollout
    return [bundle(ro.num_cpus, ro.num_gpus, ro.resources) for _ in range(ro.tensor_parallel_size)]


def cpus_asked(config: RunConfig) -> dict[str, float]:
    """The CPUs the run's actors book in Ray at the start (placement groups), by the config keys that set them."""
    lc, rc, ro = config.learner, config.reference, config.rollout
    engines = ro.num_cpus * ro.num_workers * ro.tensor_parallel_size
    return {"learner.num_cpus x num_ranks": lc.num_cpus * lc.num_ranks,
            "reference.num_cpus": rc.num_cpus if config.uses_reference else 0.0,
            "teacher.num_cpus": config.teacher.num_cpus if config.uses_teacher else 0.0,
            "rollout.num_cpus x num_workers x tensor_parallel_size": engines,
            **{f"reward.sources.{name}.num_cpus": s.num_cpus for name, s in config.reward.sources.items()
               if isinstance(s, ModelSource)}}


def bundle(num_cpus: float, num_gpus: float, resources: dict[str, float] | None = None) -> dict[str, float]:
    """One actor's Ray bundle: its CPUs, its GPUs when it asks for any, and custom resources."""
    out = {"CPU": num_cpus, **(resources or {})}
    if num_gpus:
        out["GPU"] = num_gpus
    return out


def _longest(config: RunConfig, shared: bool) -> int:
    """The longest row a pass runs: a prompt's last token and the response with shared prompts, else a whole row."""
    return config.rollout.max_new_tokens + 1 if shared else config.rollout.max_model_len


def _pass_tokens(budget: int | None, rows: int | None, longest: int, rows_in_batch: int) -> int:
    """Tokens in a pass: the token budget (a longer row runs alone), capped by the rows' budget; without either,
    the whole batch's rows."""
    if budget is None:
        return (rows or rows_in_batch) * longest
    return max(longest, min(budget, rows * longest if rows else budget))


def logits_bytes(shape: ModelShape, tokens: int, compute: int, grad: bool, entropy_grad: bool = False,
                 gpu: bool = True) -> int:
    """A pass's logits at their peak: [T, V] in the compute dtype, and the float32 log-softmax's chunks (a GPU's or a
    CPU's size): all of them saved for the backward (`grad`), else two at a time; with `grad` the entropy's three
    chunk-sized temporaries come first (freed before the log-softmax's), and with `entropy_grad` its float32 copies
    are saved too."""
    from learner.algo.logprobs import FLOAT32_CHUNK_ELEMENTS, GPU_FLOAT32_CHUNK_ELEMENTS

    wide = 4 * shape.vocab * tokens
    chunk = min(4 * (GPU_FLOAT32_CHUNK_ELEMENTS if gpu else FLOAT32_CHUNK_ELEMENTS), wide)
    held = (0 if compute == 4 else compute * shape.vocab * tokens)
    if not grad:
        return held + 2 * chunk
    return held + max(wide, 3 * chunk) + (2 * wide if entropy_grad else 0)


def learner_memory(config: RunConfig, shape: ModelShape) -> tuple[dict[str, int], list[str]]:
    """A learner rank's memory at its peak by what holds it, and how its passes are cut. The peak is the end of a
    training pass's forward (learner/learner.py, learner/passes/): master weights in `learner.master_dtype`, their
    gradients and AdamW's two moments (of the trained parameters), divided by the ranks under fsdp2; the compute-dtype
    copies autocast makes of every weight (two sets with shared prompts); the tensors a pass saves for its backward
    (`layer_bytes`, measured by tests/unit/test_plan.py), a packed pass's attention masks and the shared prompts'
    pass; and the logits with the log-softmax's float32 copies and the entropy's temporaries. A pass holds
    `max_tokens_per_micro_batch` tokens (a longer row runs alone), its rows as long as the config allows."""
    lc, ro, data = config.learner, config.rollout, config.data
    master, compute = BYTES[lc.master_dtype], BYTES[config.model.dtype]
    sharded = lc.num_ranks > 1 and lc.strategy == "fsdp2"
    split = lc.num_ranks if sharded else 1
    params = shape.parameters
    trained = shape.adapter_parameters(lc.lora.rank, lc.lora.target_modules) if lc.lora.enabled else params
    shared = lc.share_prompts and not sharded  # the learner shares prompts except under fsdp2 with several ranks
    rows = math.ceil(data.prompts_per_step * ro.group_size / lc.num_minibatches / lc.num_ranks)
    longest = _longest(config, shared)
    tokens = _pass_tokens(lc.max_tokens_per_micro_batch, lc.micro_batch_size, longest, rows)
    autocast = master != compute
    memory = {"master weights": (params if not lc.lora.enabled else params + trained) * master // split,
              "gradients": trained * master // split, "AdamW moments": 2 * trained * master // split}
    if autocast:
        memory["compute-dtype weight copies"] = params * compute * (2 if shared else 1)
    if sharded:  # fsdp2 gathers a block (and prefetches the next) and keeps the root's embedding and head whole
        block = (params - shape.vocab * shape.hidden * (1 if shape.tied else 2)) // shape.layers
        memory["fsdp2 unsharded blocks and root"] = (2 * block + shape.vocab * shape.hidden
                                                     * (1 if shape.tied else 2)) * master
    saved = pass_saved_bytes(shape, tokens, longest, compute, autocast) - 4 * shape.vocab * tokens
    memory[f"activations ({tokens}-token pass)"] = saved
    notes = [f"passes of {tokens} tokens (learner.max_tokens_per_micro_batch), rows of up to {longest}"]
    if shared:
        prompt = (data.max_prompt_tokens or max(1, ro.max_model_len - ro.max_new_tokens)) - 1
        prefix = min(min(data.prompts_per_step, rows) * prompt, max(lc.max_tokens_per_micro_batch or 0, prompt))
        per_token = shape.layers * layer_bytes(shape, compute, autocast)
        cached = shape.layers * 2 * shape.heads * shape.head_dim * compute * prompt * math.ceil(tokens / longest)
        memory["prompts' pass (shared prompts)"] = prefix * per_token + cached
        notes.append(f"shared prompts: {prefix} prompt tokens in one pass, kept until their rows' passes end")
    # The head in chunks (`learner.fast_paths.head_chunk_tokens`) holds one chunk's logits at a time.
    logit_tokens = min(tokens, lc.fast_paths.head_chunk_tokens or tokens)
    memory["logits"] = logits_bytes(shape, logit_tokens, compute, True, lc.entropy_coef > 0, lc.num_gpus > 0)
    if config.critic.enabled:
        critic = shape.parameters - shape.vocab * shape.hidden * (0 if shape.tied else 1)
        memory["value model (weights, gradients, AdamW)"] = 4 * critic * master // split
    return memory, notes


def fitting_token_budget(config: RunConfig, shape: ModelShape, gpu_bytes: int, step: int = 1024,
                         margin: float = 0.9) -> int | None:
    """The largest `learner.max_tokens_per_micro_batch`, a multiple of `step`, whose learner rank `learner_memory`
    estimates within `margin` of its GPU share with CUDA's overhead (the estimate was within 5% of the one
    measurement: docs/gpu.md), and no larger than a rank's whole minibatch; None when not even `step` fits."""
    lc, ro, data = config.learner, config.rollout, config.data
    share = margin * min(lc.num_gpus or 1.0, 1.0) * gpu_bytes - CUDA_OVERHEAD_BYTES
    rows = math.ceil(data.prompts_per_step * ro.group_size / lc.num_minibatches / lc.num_ranks)
    most = max(step, rows * ro.max_model_len // step * step)

    def fits(budget: int) -> bool:
        trial = config.model_copy(update={"learner": lc.model_copy(update={"max_tokens_per_micro_batch": budget})})
        return sum(learner_memory(trial, shape)[0].values()) <= share

    if not fits(step):
        return None
    low, high = 1, most // step  # fits(low * step); the answer is a multiple of step in [low, high]
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle * step) else (low, middle - 1)
    return low * step


def resolve_token_budget(config: RunConfig, gpu_bytes: int | None = None, shape: ModelShape | None = None
                         ) -> tuple[RunConfig, str | None]:
    """`config` with `learner.max_tokens_per_micro_batch=auto` made a number, and the line that says which (None when
    it is not `auto`): on a GPU learner, `fitting_token_budget` for a GPU of `gpu_bytes` (None: this machine's
    smallest, `gpu_memory`) and the policy's `shape` (None: read from `model.path`, else the shipped demo model's); on a
    CPU learner, 1024. ConfigError (one line) when a GPU learner's GPU is unknown or not even 1024 tokens fit."""
    lc = config.learner
    if lc.max_tokens_per_micro_batch != "auto":
        return config, None
    if not lc.num_gpus:
        budget, why = 1024, "a CPU learner's (on CPUs 512-1024 were fastest: docs/benchmarks.md)"
    else:
        gpu_bytes = gpu_bytes if gpu_bytes is not None else gpu_memory()
        if gpu_bytes is None:
            raise ConfigError("learner.max_tokens_per_micro_batch=auto sizes passes to the learner's GPU, and this "
                              "machine has none: run `relay plan --gpu-memory SIZE` and set the number it prints")
        if shape is None:
            from cluster.demo.cache import shipped_demo_model

            try:
                shape = ModelShape.read(config.model.path or shipped_demo_model(config.data.task))
            except ValueError as err:
                raise ConfigError(str(err)) from None
        budget = fitting_token_budget(config, shape, gpu_bytes)
        if budget is None:
            raise ConfigError("learner.max_tokens_per_micro_batch=auto: not even 1024-token passes fit the learner's "
                              "GPU by relay plan's estimate; add learner ranks, use LoRA (learner.lora.rank) or "
                              "learner.fast_paths.head_chunk_tokens, or set a number")
        why = f"the largest that fits in 90% of the learner's {gpu_bytes / GIB:.1f} GiB GPU share (relay plan)"
    resolved = config.model_copy(update={"learner": lc.model_copy(update={"max_tokens_per_micro_batch": budget})})
    return resolved, f"learner.max_tokens_per_micro_batch=auto: {budget}, {why}"


def frozen_memory(config: RunConfig, shape: ModelShape, budget: int | None, rows: int | None, scores: bool,
                  shared: bool, gpu: bool) -> tuple[dict[str, int], list[str]]:
    """A frozen model's memory (the reference, the teacher, a reward model), loaded in `model.dtype`, at the peak of
    a pass without gradients: one block's temporaries and, when it `scores` tokens, the logits."""
    compute = BYTES[config.model.dtype]
    longest = _longest(config, shared)
    tokens = _pass_tokens(budget, rows, longest, config.data.prompts_per_step * config.rollout.group_size)
    memory = {"weights": shape.parameters * compute,
              f"a block's temporaries ({tokens}-token pass)": tokens * layer_bytes(shape, compute, False)}
    if scores:
        memory["logits"] = logits_bytes(shape, tokens, compute, False, gpu=gpu)
    return memory, [f"passes of {tokens} tokens, rows of up to {longest}"]


def engine_memory(config: RunConfig, shape: ModelShape, gpu_bytes: int | None) -> tuple[dict[str, int], list[str]]:
    """One engine's memory per GPU: its weights (sharded over tensor parallelism), its working memory, and the KV cache
    it gets (`rollout.kv_cache_bytes` on a CPU; on a GPU the rest of `gpu_memory_utilization` x the GPU), with how many
    of the step's sequences that holds at `rollout.max_model_len` tokens each."""
    ro = config.rollout
    compute, tp = BYTES[config.model.dtype], ro.tensor_parallel_size
    weights = shape.parameters * compute // tp
    per_token = 2 * shape.layers * math.ceil(shape.kv_heads / tp) * shape.head_dim * compute
    if ro.num_gpus and gpu_bytes:
        reserved = int(ro.gpu_memory_utilization * gpu_bytes)
        memory = {"weights": weights, "working memory (allowance)": ENGINE_WORKING_BYTES,
                  "KV cache": max(0, reserved - weights - ENGINE_WORKING_BYTES)}
    elif ro.num_gpus:
        return {"weights": weights}, ["KV cache: the rest of gpu_memory_utilization x the GPU (give --gpu-memory)"]
    else:
        memory = {"weights": weights, "KV cache (rollout.kv_cache_bytes)": ro.kv_cache_bytes}
    kv = memory.get("KV cache", memory.get("KV cache (rollout.kv_cache_bytes)", 0))
    sequences = math.ceil(config.data.prompts_per_step * ro.group_size / ro.num_workers)
    fits = kv // (per_token * ro.max_model_len)
    return memory, [f"KV cache: {per_token / 2**10:.0f} KiB per token, {fits} sequences of {ro.max_model_len} tokens "
                    f"at once; the step gives each engine {sequences}"]


def plan_run(config: RunConfig, shape: ModelShape, gpu_bytes: int | None = None,
             shapes: dict[str, ModelShape] | None = None) -> list[ActorPlan]:
    """Every actor of a run of `config` on a policy of `shape`: the learner's ranks, the frozen models, the engines.
    `shapes`: other models by path (the teacher's, reward models'); missing ones are taken to be the policy's."""
    lc, rc, tc, ro = config.learner, config.reference, config.teacher, config.rollout
    shapes = shapes or {}
    memory, notes = learner_memory(config, shape)
    actors = [ActorPlan("learner rank", "learner", lc.num_ranks, lc.num_cpus, lc.num_gpus, memory, notes)]
    if config.uses_reference:
        actors.append(ActorPlan("reference", "reference", 1, rc.num_cpus, rc.num_gpus,
                                *frozen_memory(config, shape, rc.max_tokens_per_micro_batch, rc.micro_batch_size,
                                               True, rc.share_prompts, rc.num_gpus > 0)))
    if config.uses_teacher:
        actors.append(ActorPlan("teacher", "teacher", 1, tc.num_cpus, tc.num_gpus,
                                *frozen_memory(config, shapes.get(str(tc.path), shape), tc.max_tokens_per_micro_batch,
                                               tc.micro_batch_size, True, tc.share_prompts, tc.num_gpus > 0)))
    for name, s in config.reward.sources.items():
        if isinstance(s, ModelSource):
            actors.append(ActorPlan(f"reward model '{name}'", f"reward.sources.{name}", 1, s.num_cpus, s.num_gpus,
                                    *frozen_memory(config, shapes.get(str(s.path), shape), s.max_tokens_per_micro_batch,
                                                   s.micro_batch_size, False, False, s.num_gpus > 0)))
    memory, notes = engine_memory(config, shape, gpu_bytes)
    actors.append(ActorPlan("rollout worker", "rollout", ro.num_workers, ro.num_cpus * ro.tensor_parallel_size,
                            ro.num_gpus, memory, notes, ro.gpu_memory_utilization if ro.num_gpus else None))
    return actors


def fit_problems(actors: list[ActorPlan], gpu_bytes: int) -> list[str]:
    """One line per actor its GPU share cannot hold: a torch actor's estimate plus CUDA's overhead above its
    `num_gpus` (up to one GPU: it computes on one), an engine whose `gpu_memory_utilization` is above its `num_gpus`
    or leaves no KV cache for one sequence."""
    problems = []
    for actor in actors:
        if not actor.gpus:
            continue
        share = min(actor.gpus, 1.0) * gpu_bytes
        if actor.engine_share is not None:
            if actor.gpus < 1 and actor.engine_share > actor.gpus + 1e-9:
                problems.append(f"rollout.gpu_memory_utilization={actor.engine_share:g} takes more than the "
                                f"rollout.num_gpus={actor.gpus:g} share of a GPU; set it to at most {actor.gpus:g}")
            elif actor.memory.get("KV cache", 1) <= 0:
                problems.append(f"a rollout worker's weights ({actor.memory['weights'] / GIB:.1f} GiB) and working "
                                f"memory fill rollout.gpu_memory_utilization x {gpu_bytes / GIB:.1f} GiB with no room "
                                "for KV cache; raise gpu_memory_utilization or rollout.tensor_parallel_size")
            continue
        need = actor.total + CUDA_OVERHEAD_BYTES
        if need > share:
            more = ", shard it over more ranks (learner.num_ranks, strategy fsdp2)" if actor.key == "learner" else ""
            problems.append(f"a {actor.name} needs about {need / GIB:.1f} GiB of GPU memory and {actor.key}.num_gpus="
                            f"{actor.gpus:g} of a {gpu_bytes / GIB:.1f} GiB GPU gives it {share / GIB:.1f} GiB; "
                            f"lower {actor.key}.max_tokens_per_micro_batch{more} or use larger GPUs (relay plan "
                            "shows what takes the memory)")
    return problems


def gpu_memory() -> int | None:
    """The memory of the smallest GPU on this machine, in bytes; None without one. Read through NVML (pynvml, which
    vLLM's CUDA build installs) where it is installed, so the driver makes no CUDA context (one would hold GPU memory
    for the whole run); else through torch.cuda."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:  # no NVIDIA driver: no GPU
            return None
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            return min((pynvml.nvmlDeviceGetMemoryInfo(h).total for h in handles), default=None)
        finally:
            pynvml.nvmlShutdown()
    import torch

    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))


def check_gpu_fit(config: RunConfig, model_path: str | None) -> None:
    """`relay train`'s check before anything starts: ConfigError (one line) when the GPUs on this machine cannot hold
    the run on `model_path` (None: the demo model); nothing when the run asks Ray for no GPU or this machine has none
    (a cluster's driver on a CPU head: the plan is then `relay plan --gpu-memory`'s to show)."""
    if not uses_gpus(config):
        return
    gpu_bytes = gpu_memory()
    if gpu_bytes is None:
        return
    if model_path is None:
        from cluster.demo.cache import shipped_demo_model

        model_path = str(shipped_demo_model(config.data.task))
    try:
        shape = ModelShape.read(model_path)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    problems = fit_problems(plan_run(config, shape, gpu_bytes), gpu_bytes)
    if problems:
        raise ConfigError(problems[0])


def uses_gpus(config: RunConfig) -> bool:
    """Some actor of the run asks Ray for GPUs."""
    return bool(config.rollout.num_gpus) or any(b.get("GPU") for _, b in core_bundles(config))

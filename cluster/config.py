"""The one configuration tree of a relay run, its loading from YAML and dotted overrides, and its errors.

Owns: every user-settable knob (pydantic models that forbid unknown keys, with bounds and a docstring per field),
`load_config(path, overrides)`, and `ConfigError` whose message is one line naming the key and the fix.
Does not own: what the knobs do. This module imports nothing heavier than pydantic and yaml, so `relay --help`
and config validation are instant and need neither torch nor vLLM.
"""

from __future__ import annotations

from pathlib import Path
import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator


class ConfigError(ValueError):
    """A user's configuration is invalid; the message is one line naming the key and how to fix it."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ModelConfig(_Section):
    path: str | None = None
    """Hugging Face model directory of the initial policy; empty means the built-in demo model (built on first use)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype: the engines' and the reference's weights, the learner's forward and backward (autocast when its
    parameters are float32: `learner.master_dtype`), and the saved policy's."""


class DataConfig(_Section):
    task: Literal["arithmetic", "dataset"] = "arithmetic"
    """Prompt source: `arithmetic` draws `a+b=` prompts whose label is the sum; `dataset` reads `data.path`."""
    path: str | None = None
    """Prompt file for `task=dataset`: JSONL (`.jsonl`), Parquet (`.parquet`) or a Hugging Face `datasets`
    directory (written by `save_to_disk`)."""
    split: str = Field("train", min_length=1)
    """Split to read when `data.path` is a `datasets` directory holding several splits."""
    prompt_field: str = Field("prompt", min_length=1)
    """Row field holding the prompt: a string, or chat messages (a list of {role, content})."""
    label_field: str | None = "label"
    """Row field holding the label the verifiers compare with (any JSON value); empty: no label."""
    chat_template: bool = False
    """Wrap string prompts as one user message and apply the tokenizer's chat template (message prompts always
    get it)."""
    system_prompt: str | None = None
    """System message put before every prompt when the chat template is applied."""
    max_prompt_tokens: int | None = Field(None, ge=1, le=1_048_576)
    """Longer prompts are skipped and counted (`data/filtered_prompts`); empty: `rollout.max_model_len -
    rollout.max_new_tokens`."""
    shuffle: bool = True
    """Shuffle the dataset with `seed`, a new order each epoch."""
    min_operand: int = Field(0, ge=0, le=10**6)
    """Smallest operand of the arithmetic task."""
    max_operand: int = Field(99, ge=0, le=10**6)
    """Largest operand of the arithmetic task."""
    prompts_per_step: int = Field(32, ge=1, le=1_000_000)
    """Prompts drawn per step (B); each gets `rollout.group_size` completions."""

    @model_validator(mode="after")
    def _operands_ordered(self) -> DataConfig:
        if self.min_operand > self.max_operand:
            raise ValueError(
                f"min_operand ({self.min_operand}) must not exceed max_operand ({self.max_operand}); swap them"
            )
        return self


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
    """Node labels each rollout worker's node must carry (Ray label selector), e.g. `{ray.io/accelerator-type: H100}`."""
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
    """Maximum response tokens per completion."""
    temperature: float = Field(1.0, gt=0, le=10)
    """Sampling temperature; the learner scores with the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass. 1 keeps the full distribution, which the learner's logprobs assume; below 1 the
    engines' logprobs are renormalised over the nucleus and the learner's are not, so `logprob/mismatch` also holds
    that renormalisation (the run warns at start)."""
    max_model_len: int = Field(64, ge=8, le=1_048_576)
    """Longest prompt+response the engine accepts."""
    kv_cache_bytes: int = Field(64 * 2**20, ge=2**20)
    """KV-cache memory per engine, in bytes (needed on CPU, where vLLM cannot measure free memory)."""
    enforce_eager: bool = True
    """Skip torch.compile and graph capture (saves ~1 minute of start-up on CPU)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of GPU memory the engine may take (GPU only)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (no learning signal) and sample more prompts
    until `data.prompts_per_step` groups are kept."""
    max_restarts: int = Field(5, ge=0, le=10_000)
    """Rollout workers the run may replace (after a death or a missed deadline) before it stops."""
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
    num_threads: int = Field(2, ge=1, le=1024)
    """Torch threads of the reference worker (phases run in turn, so it may use every core)."""
    resources: dict[str, float] = {}
    """Custom Ray resources the reference worker needs (e.g. `{learner_node: 1}`)."""
    micro_batch_size: int = Field(64, ge=1, le=1_000_000)
    """Sequences per reference forward pass."""


class LearnerConfig(_Section):
    num_cpus: float = Field(0.5, gt=0, le=1024)
    """CPUs Ray reserves for the learner."""
    num_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves for the learner."""
    num_threads: int = Field(2, ge=1, le=1024)
    """Torch threads of the learner (phases run in turn, so it may use every core)."""
    resources: dict[str, float] = {}
    """Custom Ray resources each learner rank needs, e.g. `{learner_node: 1}`."""
    num_ranks: int = Field(1, ge=1, le=4096)
    """Data-parallel learner ranks (one actor each, joined by torch.distributed; rank 0 exports weights)."""
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the parameters AdamW updates, its state and the checkpoint's master weights. With
    `model.dtype=bfloat16`, `float32` keeps every update (the forward and backward run in bfloat16 under autocast;
    engines get the weights cast once per sync); `bfloat16` halves that memory but is lossy: an update below half a
    bfloat16 ulp of its weight rounds away, most of them at learning rates near 1e-6 (docs/algorithms.md)."""
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """How ranks share the model when `num_ranks` > 1: `ddp` replicates it and sums each rank's share of the gradient
    (the update equals one rank's), `fsdp2` shards parameters, gradients and optimizer state (`fully_shard`) for
    models that do not fit one device."""
    advantage: Literal["grpo", "rloo", "reinforce_pp", "gae"] = "grpo"
    """Advantage estimator: `grpo` ((r - group mean) / (group std + 1e-6)), `rloo` (leave-one-out baseline),
    `reinforce_pp` (REINFORCE++: group mean subtracted, then whitened over the batch) or `gae` (PPO: GAE from the
    value model's per-token values, whitened over the batch; needs `critic.enabled=true`)."""
    group_scale: Literal["std", "none"] = "std"
    """How `grpo` scales the centred reward: `std` divides by the group's std, `none` does not (Dr.GRPO)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """GAE discount per token (`advantage=gae` only)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda (`advantage=gae` only)."""
    policy_loss: Literal["ppo", "gspo"] = "ppo"
    """Policy objective: `ppo` (per-token clipped ratio) or `gspo` (one length-normalised ratio per sequence)."""
    lr: float = Field(5e-5, gt=0, le=1)
    """AdamW learning rate."""
    warmup_steps: int = Field(10, ge=0, le=10_000_000)
    """Optimizer steps over which the learning rate rises linearly to `lr` (step n uses lr x n / warmup_steps):
    lets Adam's moment estimates settle before full-size steps, as its first steps are sign-like."""
    weight_decay: float = Field(0.0, ge=0, le=1)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping threshold (global L2 norm)."""
    ppo_epochs: int = Field(1, ge=1, le=100)
    """Passes over each step's batch."""
    num_minibatches: int = Field(1, ge=1, le=100_000)
    """Optimizer steps per epoch; the batch is shuffled and split into this many minibatches."""
    micro_batch_size: int = Field(64, ge=1, le=1_000_000)
    """Sequences per forward/backward pass; gradients accumulate over a minibatch's micro-batches."""
    clip_low: float = Field(0.2, ge=0, le=1)
    """PPO ratio clip below 1: ratios under 1 - clip_low stop contributing gradient."""
    clip_high: float = Field(0.2, ge=0, le=10)
    """PPO ratio clip above 1 (DAPO's clip-higher when larger than clip_low)."""
    clip_c: float | None = Field(None, gt=1, le=100)
    """Dual-clip constant for negative advantages (loss at most -A * clip_c); empty turns dual clip off (`ppo`)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean")
    """How per-token losses become one number: every token weighs the same (`token-mean`, DAPO), every sequence
    weighs the same (`seq-mean-token-mean`, GRPO/GSPO), sums per sequence (`seq-mean-token-sum`), or sums over a
    fixed length (`seq-mean-token-sum-norm`, Dr.GRPO)."""
    loss_norm_length: int | None = Field(None, ge=1, le=1_000_000)
    """The fixed length of `seq-mean-token-sum-norm`; empty means `rollout.max_new_tokens`."""
    entropy_coef: float = Field(0.0, ge=0, le=10)
    """Weight of the entropy bonus subtracted from the loss; 0 turns it off."""
    kl_coef: float = Field(0.01, ge=0, le=100)
    """Coefficient of the KL penalty to the reference policy added to the loss (GRPO style); 0 turns it off."""
    kl_reward_coef: float = Field(0.0, ge=0, le=100)
    """Coefficient of the per-token KL penalty subtracted from the reward (PPO style); 0 turns it off. Use either
    this or `kl_coef`, not both."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator, wherever the KL goes (loss or reward)."""
    rollout_correction: Literal["none", "tis", "mis"] = "none"
    """Correct the policy gradient for the gap between the engine's logprobs of the sampled tokens (behaviour) and
    the learner's (pi_old), rho = pi_old / pi_behavior: `tis` weighs each token's term by min(rho, cap) (truncated
    importance sampling), `mis` drops tokens whose rho is outside [1/cap, cap] (masked); `none` uses neither. The gap
    is numerics in a synchronous run (larger in bfloat16; `mismatch/kl` shows it); docs/algorithms.md."""
    rollout_correction_cap: float = Field(2.0, gt=1, le=1000)
    """The cap C of `rollout_correction`."""
    rollout_correction_level: Literal["token", "sequence"] = "token"
    """`token`: one ratio per token; `sequence`: one per sequence, the product of its tokens' (each of its tokens
    gets the sequence's weight)."""
    max_nonfinite_steps: int = Field(3, ge=1, le=1000)
    """Consecutive updates skipped for a non-finite loss or gradient before the run stops."""


class CriticConfig(_Section):
    enabled: bool = False
    """Train a value model (PPO); required by and only used with `learner.advantage=gae`."""
    path: str | None = None
    """Hugging Face directory the value model starts from (a scalar head is added); empty: the policy's checkpoint."""
    lr: float = Field(1e-4, gt=0, le=1)
    """AdamW learning rate of the value model (its own optimizer, stepped with the policy's)."""
    warmup_steps: int = Field(0, ge=0, le=10_000_000)
    """Optimizer steps over which the value model's learning rate rises linearly to `lr` (as `learner`'s)."""
    weight_decay: float = Field(0.0, ge=0, le=1)
    """AdamW weight decay of the value model."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping threshold of the value model (global L2 norm)."""
    value_clip: float = Field(0.2, gt=0, le=1e6)
    """PPO value clipping: how far a value may move from its rollout-time prediction before the clipped loss
    term takes over."""


class SyncConfig(_Section):
    transport: Literal["object_store", "collective"] = "object_store"
    """How weights reach the engines: `object_store` puts them once (numpy, zero-copy) for every worker to read, or
    into a shared-memory buffer for workers on the learner's node (`shared_memory`); `collective` broadcasts them over
    a torch.distributed group of the learner's rank 0 and every engine (NCCL on GPUs, gloo on CPU)."""
    bucket_mb: float = Field(256.0, gt=0, le=65536)
    """Size of each weight bucket (one object-store object, or one broadcast of the collective transport), in MB."""
    shared_memory: bool = True
    """`object_store` only: workers on the learner's node read its weights from one shared-memory buffer that the
    learner rewrites in place at every sync (no new object-store object per sync, ~1 copy of the model's bytes);
    workers on other nodes get them through the object store either way. The buffer costs one host copy of the
    model in the learner's memory. Off: every worker reads through the object store (e.g. when workers cannot open
    the learner's `/proc/<pid>/fd`, as in another PID namespace)."""
    fingerprint: bool = True
    """After every load, each worker reports a fingerprint of every tensor it handed its engine (exact integer sums
    over the bits: learner/fingerprint.py) and the run stops if one differs from the learner's or is missing: exact in
    every dtype. Costs one pass over the weights per worker and load (docs/benchmarks.md, weight sync)."""
    probe: bool = True
    """After every sync, compare each engine's logprobs on a fixed probe sequence with the learner's. Off, an
    `object_store` sync only exports the weights and each worker loads them at the start of its next generate request
    (one call per worker per step instead of two: for large fleets); rollouts' weights versions are checked either
    way."""
    probe_tolerance: float | None = Field(None, gt=0)
    """Largest allowed max |engine - learner| logprob on the probe. Empty: derived from the noise floor the first
    probe measures, before any update (engines and learner on the same weights): 5x it, at least 1e-4 (float32: 1e-4;
    bfloat16: ~5e-2, where one step's change at small learning rates is below it and the probe's repeat rule and the
    fingerprints carry the check: docs/operations.md). A first gap above 0.25 stops the run: that is not numerics."""
    probe_tokens: int = Field(8, ge=1, le=1024)
    """Tokens the probe samples from its fixed prompt."""
    probe_prompt: str = Field("1+1=2 2+2=4 3+3=6 4+4=8 5+5=10 6+6=12 7+7=14 ", min_length=1)
    """Fixed probe prompt; longer than one KV block (32 tokens) so a missed prefix-cache reset shows up."""


class RuleSource(_Section):
    type: Literal["rule"] = "rule"
    """A rule verifier run in the driver: a pure function (completion, label) -> reward."""
    verifier: str = Field("exact_match", min_length=1)
    """A name from `rewards/registry.py` (`exact_match`, `numeric_match`, `math_verify`, `format`) or your own
    function as `package.module:function`."""
    params: dict[str, Any] = {}
    """Keyword arguments passed to the verifier (e.g. `pattern` for `format`)."""
    weight: float = Field(1.0, ge=-1000, le=1000)
    """Weight of this source in the combined reward."""


class RemoteSource(_Section):
    type: Literal["remote"]
    """A verifier service over HTTP (`POST /verify`, docs/verifiers.md)."""
    urls: list[str] = Field(min_length=1)
    """Base URLs of the service's replicas (`http(s)://host:port`); batches are spread over them."""
    weight: float = Field(1.0, ge=-1000, le=1000)
    """Weight of this source in the combined reward."""
    batch_size: int = Field(64, ge=1, le=100_000)
    """Samples per request."""
    max_concurrency: int = Field(8, ge=1, le=4096)
    """Requests in flight at once, over all URLs."""
    timeout: float = Field(30.0, gt=0, le=86_400)
    """Deadline of one request, in seconds (connect + send + reply)."""
    max_retries: int = Field(3, ge=0, le=100)
    """Retries of a request that was refused, timed out or got a 5xx reply (never on 4xx)."""
    backoff: float = Field(0.25, gt=0, le=600)
    """First retry delay in seconds; doubles each retry, with full jitter, up to `backoff_max`."""
    backoff_max: float = Field(8.0, gt=0, le=3600)
    """Longest retry delay in seconds."""
    on_failure: Literal["fail", "drop", "default"] = "fail"
    """What happens to samples still unscored after the retries: `fail` stops the run naming the service and the
    error, `drop` removes their groups from the step, `default` gives them `default_reward`. Always counted."""
    default_reward: float | None = None
    """Reward of an unscored sample with `on_failure=default`."""
    token_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of the environment variable holding a bearer token (the token itself is never in the config)."""
    verify_tls: bool = True
    """Verify the service's TLS certificate (https URLs)."""

    @model_validator(mode="after")
    def _valid(self) -> RemoteSource:
        for url in self.urls:
            if not re.fullmatch(r"https?://[^\s/:]+(:\d{1,5})?/?", url):
                raise ValueError(f"url {url!r} is not of the form http(s)://host[:port]")
        if self.on_failure == "default" and self.default_reward is None:
            raise ValueError("on_failure=default needs default_reward (e.g. 0.0); or choose fail or drop")
        if self.backoff > self.backoff_max:
            raise ValueError(f"backoff ({self.backoff}) must not exceed backoff_max ({self.backoff_max})")
        return self


class ModelSource(_Section):
    type: Literal["model"]
    """A frozen reward model (`AutoModelForSequenceClassification`) in its own Ray actor."""
    path: str = Field(min_length=1)
    """Hugging Face directory of the reward model (one output: the score)."""
    weight: float = Field(1.0, ge=-1000, le=1000)
    """Weight of this source in the combined reward."""
    normalize: Literal["none", "batch"] = "none"
    """`batch` whitens the scores over the step's completions (mean 0, std 1) before weighting."""
    num_cpus: float = Field(0.5, gt=0, le=1024)
    """CPUs Ray reserves for the reward-model worker."""
    num_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves for the reward-model worker."""
    num_threads: int = Field(1, ge=1, le=1024)
    """Torch threads of the reward-model worker."""
    micro_batch_size: int = Field(32, ge=1, le=1_000_000)
    """Sequences per forward pass."""


def _source_type(value: Any) -> str:
    """A source without `type` is a rule verifier (the common case: `reward.sources.fmt.verifier=format`)."""
    return value.get("type", "rule") if isinstance(value, dict) else getattr(value, "type", "rule")


RewardSource = Annotated[Annotated[RuleSource, Tag("rule")] | Annotated[RemoteSource, Tag("remote")]
                         | Annotated[ModelSource, Tag("model")], Discriminator(_source_type)]


SOURCE_TYPES: dict[str, type[BaseModel]] = {"rule": RuleSource, "remote": RemoteSource, "model": ModelSource}


class RewardConfig(_Section):
    sources: dict[str, RewardSource] = Field(default_factory=lambda: {"correct": RuleSource()}, min_length=1)
    """Named reward sources, each of `type` rule, remote or model, with a `weight`; the reward is the weighted sum.
    Giving `sources` (in YAML or as overrides) replaces the default `{correct: {type: rule, verifier:
    exact_match}}`. Each source's mean goes in the metrics as `reward/<name>`."""
    overlong_buffer: int = Field(0, ge=0, le=1_000_000)
    """DAPO soft overlong punishment: responses longer than `rollout.max_new_tokens - overlong_buffer` tokens lose
    reward linearly, up to `overlong_penalty` at the maximum; 0 turns it off."""
    overlong_penalty: float = Field(1.0, ge=0, le=1000)
    """Reward lost by a response of the maximum length when `overlong_buffer` > 0."""

    @model_validator(mode="after")
    def _names(self) -> RewardConfig:
        for name in self.sources:
            if not re.fullmatch(r"[a-z][a-z0-9_]{0,63}", name):
                raise ValueError(f"source name {name!r} must be lower-case letters, digits and _ (it names metrics)")
            if name in ("mean", "std"):
                raise ValueError(f"source name {name!r} would hide the metric reward/{name}; choose another name")
        return self


class CheckpointConfig(_Section):
    every: int = Field(20, ge=0, le=10_000_000)
    """Write a checkpoint every this many steps (and always after the last step); 0: only after the last step."""
    keep: int = Field(2, ge=1, le=1000)
    """Checkpoints kept in `run_dir/checkpoints/`; older ones are deleted once a newer one is complete."""


class LoggingConfig(_Section):
    tensorboard: bool = True
    """Write TensorBoard event files to `run_dir/tensorboard/`."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb` and a login or WANDB_API_KEY)."""
    wandb_project: str = Field("relay", min_length=1)
    """Weights & Biases project."""
    wandb_run_name: str | None = None
    """Weights & Biases run name; empty: the run directory's name."""


class TimeoutConfig(_Section):
    start: float = Field(600.0, gt=0)
    """Seconds for every actor to start (engines load their model here)."""
    generate: float = Field(300.0, gt=0)
    """Seconds for one worker's generate call."""
    reference: float = Field(300.0, gt=0)
    """Seconds for the reference worker's logprobs call."""
    reward: float = Field(300.0, gt=0)
    """Seconds for a reward-model worker's scoring call (remote verifiers have their own `timeout`)."""
    train: float = Field(1800.0, gt=0)
    """Seconds for the learner's train step."""
    sync: float = Field(300.0, gt=0)
    """Seconds for exporting and loading weights on every worker, probe included."""


class RayConfig(_Section):
    address: str | None = None
    """Ray cluster address (`auto`, `ray://host:10001`); empty starts a local Ray instance for this run."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs a local Ray instance advertises (default: every core)."""
    dashboard: bool = True
    """Start the Ray dashboard with a local instance, bound to 127.0.0.1; its address is printed at start."""
    log_to_driver: bool = False
    """Echo every actor's log (vLLM's included) on the console; otherwise they stay in Ray's session logs."""


class RunConfig(_Section):
    """A whole training run. `relay train CONFIG.yaml key.sub=value ...` builds one of these."""

    run_dir: str | None = None
    """Directory for config.yaml, metrics.jsonl and checkpoints; must not already hold a run. Empty: runs/<time>."""
    max_steps: int = Field(80, ge=1, le=10_000_000)
    """Training steps to run."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed for prompts, sampling and shuffling."""
    resume: str | None = None
    """`auto`: continue the run in `run_dir` from its latest complete checkpoint (or start it if it has none);
    a path: continue from that checkpoint directory. Empty: a new run (`run_dir` must not hold one)."""
    model: ModelConfig = ModelConfig()
    """The initial policy (also the reference)."""
    data: DataConfig = DataConfig()
    """Where prompts come from and how many per step."""
    rollout: RolloutConfig = RolloutConfig()
    """The rollout fleet (vLLM engines) and sampling."""
    reference: ReferenceConfig = ReferenceConfig()
    """The frozen reference policy for the KL penalty."""
    reward: RewardConfig = RewardConfig()
    """How completions are scored."""
    learner: LearnerConfig = LearnerConfig()
    """The trained policy, its optimizer and the objective."""
    critic: CriticConfig = CriticConfig()
    """The value model of PPO, trained in the learner actor."""
    sync: SyncConfig = SyncConfig()
    """Weight sync to the engines after every step, and its verification."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Periodic checkpoints for resuming."""
    logging: LoggingConfig = LoggingConfig()
    """Where metrics go besides `metrics.jsonl`."""
    timeouts: TimeoutConfig = TimeoutConfig()
    """A deadline for every remote call."""
    ray: RayConfig = RayConfig()
    """The Ray cluster to run on."""

    @property
    def uses_reference(self) -> bool:
        """Whether the run starts a reference worker: only when some KL penalty reads its logprobs."""
        return self.reference.enabled and (self.learner.kl_coef > 0 or self.learner.kl_reward_coef > 0)

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        for problem in _inconsistencies(self):
            raise ValueError(problem)  # the first one; fixing it shows the next
        return self


def _inconsistencies(config: RunConfig):
    """Yield one message per invalid combination of keys, each saying how to fix it."""
    learner, rollout = config.learner, config.rollout
    if learner.master_dtype == "bfloat16" and config.model.dtype != "bfloat16":
        yield ("learner.master_dtype=bfloat16 needs model.dtype=bfloat16 (master weights are never coarser than the "
               "compute dtype); set learner.master_dtype=float32")
    if learner.kl_coef > 0 and learner.kl_reward_coef > 0:
        yield ("KL is in the loss (learner.kl_coef) and in the reward (learner.kl_reward_coef) at once; "
               "set one of them to 0")
    if (learner.kl_coef > 0 or learner.kl_reward_coef > 0) and not config.reference.enabled:
        yield ("a KL penalty (learner.kl_coef or learner.kl_reward_coef > 0) needs a reference policy: set "
               "reference.enabled=true or both coefficients to 0")
    batch = config.data.prompts_per_step * rollout.group_size
    if batch % learner.num_minibatches:
        yield (f"learner.num_minibatches ({learner.num_minibatches}) must divide the batch of "
               f"data.prompts_per_step x rollout.group_size = {batch} completions")
    if learner.advantage == "rloo" and rollout.group_size < 2:
        yield "learner.advantage=rloo needs rollout.group_size >= 2"
    if learner.advantage == "gae" and not config.critic.enabled:
        yield "learner.advantage=gae needs a value model: set critic.enabled=true (or pick grpo, rloo, reinforce_pp)"
    if config.critic.enabled and learner.advantage != "gae":
        yield (f"critic.enabled=true but learner.advantage={learner.advantage} does not use a value model; "
               "set learner.advantage=gae or critic.enabled=false")
    if learner.group_scale != "std" and learner.advantage != "grpo":
        yield "learner.group_scale applies to advantage=grpo only; remove it or set learner.advantage=grpo"
    if learner.clip_c is not None and learner.policy_loss == "gspo":
        yield "learner.clip_c (dual clip) is not defined for policy_loss=gspo; remove clip_c"
    if config.reward.overlong_buffer >= rollout.max_new_tokens:
        yield (f"reward.overlong_buffer ({config.reward.overlong_buffer}) must be below rollout.max_new_tokens "
               f"({rollout.max_new_tokens}); the penalty ramps over the last overlong_buffer tokens")
    if config.data.task == "dataset" and not config.data.path:
        yield "data.task=dataset needs data.path (a .jsonl or .parquet file, or a datasets directory)"
    if rollout.dynamic_sampling and rollout.group_size < 2:
        yield "rollout.dynamic_sampling needs rollout.group_size >= 2 (it drops groups whose rewards are all equal)"


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    # A reward source's location holds its union tag (`reward.sources.judge.remote.urls`): drop it.
    loc = [p for i, p in enumerate(first["loc"]) if not (i >= 2 and first["loc"][i - 2] == "sources")]
    key = ".".join(str(p) for p in loc)
    if first["type"] == "extra_forbidden":
        allowed = _allowed_keys(tuple(first["loc"][:-1]))
        return f"unknown config key '{key}'; allowed here: {', '.join(allowed)}"
    if first["type"] == "union_tag_invalid":
        return f"{key}.type: must be one of {', '.join(SOURCE_TYPES)} (got {first['ctx']['tag']!r})"
    value = first.get("input")
    shown = "" if isinstance(value, dict) else f" (got {value!r})"
    msg = first["msg"].removeprefix("Value error, ")
    return f"{key}: {msg}{shown}" if key else msg


def _allowed_keys(loc: tuple) -> list[str]:
    if loc[:2] == ("reward", "sources") and len(loc) == 4 and loc[3] in SOURCE_TYPES:
        return list(SOURCE_TYPES[loc[3]].model_fields)  # (reward, sources, <name>, <tag>)
    model: type[BaseModel] = RunConfig
    for part in loc:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn `["a.b=1", "c=x"]` into a nested dict; values are parsed as YAML scalars (`1` -> int, `true` -> bool)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override '{item}' is not of the form dotted.key=value (e.g. learner.lr=1e-4)")
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError:
            value = raw
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{item}' conflicts with an earlier override of '{part}'")
            node = child
        node[leaf] = value
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Build the run config from an optional YAML file plus dotted overrides; raise ConfigError on bad input."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ConfigError(f"cannot read config file '{path}': {err.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"config file '{path}'{where} is not valid YAML") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of keys, not {type(data).__name__}")
    data = _merge(data, parse_overrides(list(overrides)))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML, loadable again by `load_config`."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def config_reference() -> str:
    """Every key with its default and docstring, as Markdown (docs/configuration.md is this text)."""
    lines = ["# Configuration reference", "",
             "Generated from `cluster/config.py` by `python -m cluster.config > docs/configuration.md`; a test keeps",
             "the two equal. Set keys in a YAML file or as `dotted.key=value` overrides on the command line.", ""]

    def walk(model: type[BaseModel], prefix: str, title: str | None = None) -> None:
        rows = []
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.")
                continue
            default = field.default_factory() if field.default_factory else field.default
            if isinstance(default, BaseModel):
                default = default.model_dump()
            elif isinstance(default, dict):
                default = {k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in default.items()}
            meaning = " ".join((field.description or "").split()).replace("|", "\\|")
            shown = "required" if field.is_required() else f"`{default!r}`"
            rows.append(f"| `{prefix}{name}` | {shown} | {meaning} |")
        if rows:
            title = title or prefix.rstrip(".") or "top level"
            lines.extend([f"## {title}", "", "| key | default | meaning |", "|---|---|---|", *rows, ""])

    walk(RunConfig, "")
    for tag, source in SOURCE_TYPES.items():
        walk(source, "reward.sources.<name>.", f"reward.sources.<name> with `type: {tag}`")
    return "\n".join(lines)


if __name__ == "__main__":
    print(config_reference(), end="")

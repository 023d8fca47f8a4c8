"""The learner's settings: the objective, the optimizer, the ranks, and the value model of PPO.

Owned here, beside the learner; `cluster/config.py` composes them into the run config. Imports only pydantic.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class LoraConfig(_Section):
    rank: int = Field(0, ge=0, le=512)
    """LoRA rank r (`peft`): the policy's base weights stay frozen and only rank-r adapters on `target_modules` train
    (AdamW state for them alone); weight syncs move only the adapters, which the engines serve on the base model they
    loaded once (vLLM's LoRA). 0: full fine-tuning. docs/algorithms.md, LoRA."""
    alpha: float | None = Field(None, gt=0, le=100_000)
    """LoRA alpha: the adapter's update is scaled by alpha / rank. Empty: 2 x rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input, in the training forward passes only: old logprobs, the reference and the
    engines never drop (their logprobs are those of the policy without dropout)."""
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """Modules that get adapters: `all-linear` (every linear layer of the decoder blocks, not the output head) or
    module names (`[q_proj, v_proj]`; a name matches a module whose path ends with it). Each must match a linear
    layer of the policy's decoder blocks that vLLM serves LoRA on."""
    modules_to_save: list[str] = Field([], max_length=16)
    """Modules outside the decoder blocks trained whole beside the adapters, as peft's `modules_to_save` does, by their
    path in the policy: `[lm_head, model.norm]` (the output layer and the final norm of Qwen2 and Llama). They sync
    with the adapters (in `sync/bytes`), the engines load them into the base they serve, the reference is the base
    without them, checkpoints hold them in peft's format and `relay export --merge` writes them. Not with tied
    embeddings."""
    modules_lr: float | None = Field(None, gt=0, le=1)
    """AdamW learning rate of `modules_to_save` (as unsloth's `embedding_learning_rate`). Empty: `learner.lr`. Adam
    moves every weight of a whole layer by about the rate each step, the adapters' product far less: the adapters'
    rate overshoots a whole layer."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale_alpha(self) -> float:
        """alpha, 2 x rank when unset."""
        return self.alpha if self.alpha is not None else 2.0 * self.rank


class FastPathsConfig(_Section):
    head_chunk_tokens: int | None = Field(None, ge=1, le=1_000_000)
    """Run the output head and the log-softmax over this many of a pass's tokens at a time, each chunk's logits
    recomputed in the backward (`learner.passes.head`): a pass never holds its whole [tokens x vocabulary] logits.
    The same logprobs, entropies and gradients up to the head's summation order (bit for bit when one chunk holds
    the pass; bounds: tests/unit/test_fast_paths.py). Qwen2, Qwen3, Llama and Mistral heads; others run the whole
    logits. Empty: the whole pass's logits at once (the CPU's vocabularies are small: docs/benchmarks.md)."""
    fused_adamw: bool = False
    """torch's fused AdamW kernel (`fused=True`: one kernel per step for all parameters, on CPUs and GPUs), where
    torch has it for the device and dtype. The same update up to rounding (within 2 ulps of each weight plus 2^-20
    x lr: tests/unit/test_fast_paths.py)."""
    metrics_on_device: bool = False
    """Keep each pass's metrics where they are computed and read them once per minibatch, and weigh passes by token
    counts taken from host memory: no `.item()` per pass. The same metrics and update bit for bit (the same float64
    sums in the same order)."""
    varlen_attention: bool = False
    """Packed passes' attention over the pack's tokens as they lie (`learner.passes.varlen`), no row gathered into a
    padded row of its own: torch's `varlen_attn` (flash attention over cu_seqlens) on CUDA in bfloat16 and float16,
    else, and for rows on shared prompts' cached states, compiled FlexAttention with a block mask (on a CPU, its mask
    over every query and key of the pack through sdpa: for tests). The same logprobs, entropies and gradients up to
    the softmax's summation order (bounds: tests/unit/test_packed_fast_paths.py). Packed passes only."""
    compile_bucket_tokens: int | None = Field(None, ge=1, le=1_000_000)
    """torch.compile each decoder layer, not the whole model (`learner.passes.compiled`), and pad each packed pass's
    tokens up to a multiple of this many, so that the compiled shapes stay one per bucket (verl's pad_to_length): no
    real token sees the padding, whose outputs are dropped. Old logprobs and the update bucket alike. Packed passes
    only; padded ones and shared prompts' prefixes run uncompiled. Empty: nothing compiled."""
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    """torch.compile's backend with `compile_bucket_tokens`: `inductor` (fused kernels, for GPUs; compiles for minutes
    on a CPU) or `aot_eager` (the traced graphs run by eager kernels: what the CPU's tests run)."""


class LearnerConfig(_Section):
    num_cpus: float = Field(0.5, gt=0, le=1024)
    """CPUs Ray reserves for the learner."""
    num_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves for the learner."""
    num_threads: int | None = Field(None, ge=1, le=1024)
    """Torch threads of the learner. Unset: 2 (phases run in turn, so it may use every core), or 1 for a policy under
    1M parameters (too small for a second thread to pay); in an asynchronous run (`rollout.max_staleness` >= 1) 1:
    the engines generate meanwhile."""
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
    advantage: Literal["grpo", "rloo", "reinforce_pp", "gae", "reinforce", "distill"] = "grpo"
    """Advantage estimator: `grpo` ((r - group mean) / (group std + 1e-6)), `rloo` (leave-one-out baseline),
    `reinforce_pp` (REINFORCE++: group mean subtracted, then whitened over the batch), `gae` (PPO: GAE from the
    value model's per-token values, whitened over the batch; needs `critic.enabled=true`), `reinforce` (each
    token's discounted return G_t minus `baseline`) or `distill` (on-policy distillation alone: the teacher's
    per-token advantage, `distill_coef`, and no reward's; the rewards are still scored and logged)."""
    baseline: Literal["none", "batch_mean", "group_mean", "value"] = "none"
    """`advantage=reinforce`'s baseline: `none`, `batch_mean` / `group_mean` (the mean total discounted reward of the
    batch's / the prompt's sequences) or `value` (the value model's V(s_t), trained on the returns: needs
    `critic.enabled=true`)."""
    group_scale: Literal["std", "none"] = "std"
    """How `grpo` scales the centred reward: `std` divides by the group's std, `none` does not (Dr.GRPO)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per token (`advantage=gae` and `reinforce`)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda (`advantage=gae` only)."""
    policy_loss: Literal["ppo", "gspo", "vanilla", "cispo"] = "ppo"
    """Policy objective: `ppo` (per-token clipped ratio), `gspo` (one length-normalised ratio per sequence),
    `vanilla` (REINFORCE's -A log pi: no ratio, no clipping) or `cispo` (MiniMax-M1: -sg(clip(r)) A log pi, the
    clipped ratio a detached weight, so no token loses its gradient; unset `clip_low` and `clip_high` become 1 and 3,
    the weight in [0, 4]: no lower bound as in the paper, Tinker's upper one)."""
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
    micro_batch_size: int | None = Field(None, ge=1, le=1_000_000)
    """Sequences per forward/backward pass at most; empty: only `max_tokens_per_micro_batch` limits a pass.
    Gradients accumulate over a minibatch's micro-batches (the loss is the same however they are cut)."""
    max_tokens_per_micro_batch: Annotated[int, Field(ge=1, le=1_000_000_000)] | Literal["auto"] | None = 1024
    """Tokens per forward/backward pass at most (a longer sequence is a pass alone): each rank's rows are sorted by
    length and cut into passes under this budget, so compute follows the real tokens. Packed passes
    (`pack_sequences`) count the rows' own tokens; padded ones sequences x the pass's longest, each pass padded only
    to its own longest sequence. Larger uses more memory (activations, logits); on CPU 512-1024 were fastest
    (docs/benchmarks.md), GPUs want more (e.g. 16384). `auto`: on a GPU learner, the largest multiple of 1024 that
    `relay plan`'s memory estimate fits in 90% of the learner's GPU share (this machine's GPU, or `relay plan
    --gpu-memory`), on a CPU learner 1024; `relay train`, `relay serve` and `relay plan` print the number. Empty: no
    token limit."""
    share_prompts: bool = True
    """Compute each prompt once for the rows that share it (a group's G completions): the prompt's tokens run in
    one forward whose key/value states every row's pass attends to, gradients carried back through them once; the
    token budget then counts each row's own tokens. The same logprobs, losses and gradients (up to float summation
    order); saves the prompt's compute G-1 times. Off under `strategy=fsdp2` with several ranks, and for models
    whose cache is not one plain key/value layer per layer (sliding windows, recurrent state)."""
    pack_sequences: bool = True
    """Run each pass's rows as one packed sequence of their real tokens: every layer but attention computes no
    padding; attention gathers each row's tokens into a padded row of its own (the CPU equivalent of a GPU's
    variable-length attention; `learner.passes.packing`). The same logprobs, losses and gradients (up to float
    summation order), in less time than padded passes (docs/benchmarks.md, "Packed passes"); a value model
    (`critic.enabled`) runs the policy's passes, packed too. Only for models whose attention is sdpa and keeps no
    sliding window (others run padded passes)."""
    overlap_reference: Literal["auto"] | bool = "auto"
    """On-policy steps: send the update before the reference's logprobs have arrived, so that the learner's first
    training forward (a round's prompts and its first pass) runs while the reference computes; it waits for them
    before its first loss, and the update is the same bit for bit. `auto`: true unless the learner and the reference
    both compute on the CPU and either runs more than one torch thread, where they would compete for the same cores
    (on 2 cores the demo's step took 0.83-0.86x the time, both on one thread; the 25M benchmark's 1.07x, both on two:
    docs/benchmarks.md, "The learner's forward beside the reference")."""
    clip_low: float = Field(0.2, ge=0, le=1)
    """PPO ratio clip below 1: ratios under 1 - clip_low stop contributing gradient (`cispo`: the weight's lower
    bound; unset, 1: none)."""
    clip_high: float = Field(0.2, ge=0, le=10)
    """PPO ratio clip above 1 (DAPO's clip-higher when larger than clip_low; `cispo`: the weight's upper bound,
    unset 3)."""
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
    distill_coef: float = Field(0.0, ge=0, le=100)
    """On-policy distillation: weight of the teacher's per-token advantage log pi_teacher(x_t) - log pi(x_t) (minus
    the per-token reverse KL to the teacher, on the policy's own samples; discounted by `distill_discount`), added
    to the advantage of `advantage` (or alone with `advantage=distill`); needs `teacher.path`. 0 turns it off."""
    distill_discount: float = Field(0.0, ge=0, le=1)
    """Discount of the distillation advantage: token t gets sum over s >= t of discount^(s - t) times token s's
    log-ratio. 0: each token its own (Thinking Machines' on-policy distillation); 1: the rest of the sequence's."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator, wherever the KL goes (loss or reward)."""
    rollout_correction: Literal["none", "tis", "mis", "icepop", "seq_mask_tis"] = "none"
    """Correct the policy gradient for the gap between the engine's logprobs of the sampled tokens (behaviour) and
    the learner's (pi_old), rho = pi_old / pi_behavior: `tis` weighs each token's term by min(rho, cap) (truncated
    importance sampling), `mis` drops tokens whose rho is outside [1/cap, cap] (masked), `icepop` weighs a token by
    rho inside [`rollout_correction_low`, `rollout_correction_high`] and drops it outside (IcePop), `seq_mask_tis`
    drops whole sequences whose geometric-mean rho is outside that band and weighs the others' tokens by
    min(rho, cap); `none` uses none. The gap is numerics in a synchronous run (larger in bfloat16; `mismatch/kl`
    shows it); docs/algorithms.md."""
    rollout_correction_cap: float = Field(2.0, gt=1, le=1000)
    """The cap C of `rollout_correction` (`tis`, `mis`, `seq_mask_tis`)."""
    rollout_correction_level: Literal["token", "sequence"] = "token"
    """`token`: one ratio per token; `sequence`: one per sequence, the product of its tokens' (each of its tokens
    gets the sequence's weight). `tis` and `mis` only: `icepop` and `seq_mask_tis` define their own."""
    rollout_correction_low: float = Field(0.5, ge=0, le=1000)
    """Lower end of the band of `icepop` (on each token's rho) and `seq_mask_tis` (on each sequence's geometric-mean
    rho); 0: none. Below `rollout_correction_high`, and the band must hold 1."""
    rollout_correction_high: float = Field(5.0, gt=0, le=1000)
    """Upper end of that band. IcePop's is [0.5, 5]; a geometric mean over many tokens stays near 1, so
    `seq_mask_tis` wants a narrower one: a few thousandths on-policy in float32 (e.g. [0.999, 1.002]), wider in
    bfloat16 or for stale batches, which such a band would mask nearly whole (docs/algorithms.md)."""
    max_nonfinite_steps: int = Field(3, ge=1, le=1000)
    """Consecutive updates skipped for a non-finite loss or gradient before the run stops."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters instead of full fine-tuning (`lora.rank` > 0)."""
    fast_paths: FastPathsConfig = FastPathsConfig()
    """Faster ways to run the same passes and update (docs/benchmarks.md, "GPU learner", measures each)."""

    @model_validator(mode="before")
    @classmethod
    def _cispo_clip_by_default(cls, data: Any) -> Any:
        """`policy_loss=cispo` clips a weight, not the objective: unset clip_low and clip_high become CISPO's one-sided
        range [0, 4] (no lower bound: MiniMax-M1; upper bound 4: Tinker's default), not PPO's [0.8, 1.2]."""
        if isinstance(data, dict) and data.get("policy_loss") == "cispo":
            data = {"clip_low": 1.0, "clip_high": 3.0, **data}
        return data

    @property
    def uses_value_model(self) -> bool:
        """Whether the advantage reads a value model: `gae`, and `reinforce` with the `value` baseline."""
        return self.advantage == "gae" or (self.advantage == "reinforce" and self.baseline == "value")


class CriticConfig(_Section):
    enabled: bool = False
    """Train a value model; required by and only used with an advantage that reads one: `learner.advantage=gae` (PPO),
    or `reinforce` with `learner.baseline=value`."""
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

"""Learner: the trained policy (and, for PPO, the value model), their optimizers, and one update per step.

Owns: the policy (a transformers causal LM, or with `learner.lora` adapters on its frozen base, which is then the
reference: its logprobs come from here with the adapters off) and AdamW in `learner.master_dtype` (forward and backward
in `model.dtype`); the `Critic` when a value model is used; `old_logprobs` (the training forward's own, detached, when
the batch gets exactly one update: `single_update`); epochs x minibatches x micro-batches of the loss
(`learner.objective`), passes cut by a token budget with shared prompts (`learner.passes`); skipping non-finite
updates; its whole state in checkpoints; the weights version (`train_step` and `load_checkpoint` return it). With
`learner.num_ranks` > 1 one rank of a data-parallel group (`learner.distributed`); tensors on the actor's GPU if any.
Does not own: sampling, rewards, the loss's math (`learner.objective`, `learner.algo`), how weights travel
(`sync.publisher.WeightPublisher`, mixed in), checkpoint atomicity and retention (cluster/run/checkpoint.py). A plain
class: Ray wraps its ranks in cluster/fleet/learner_group.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from learner.algo.advantages import AdvantageInputs, distill_log_ratios
from learner.algo.losses import aggregate
from learner.batch import StepTensors, TrainBatch, per_token_rewards
from learner.critic import Critic, check_weights, read_model_weights, save_model_dir
from learner.distributed import DataParallel, clip_grad_norm
from learner.lora import adapter_dropout, adapter_weights, add_adapters, load_adapters, read_adapters, save_adapters
from learner.objective import correct_rollouts, micro_batch_loss, step_advantages
from learner.passes.device import (
    compute_in,
    count_parameters,
    default_threads,
    fused_adamw,
    matmuls_in,
    peak_rss_mb,
    pick_device,
    to_cpu,
    warmup_schedule,
)
from learner.passes.head import pass_scorer
from learner.passes.metric_sums import MetricSums, denominators, pass_weights
from learner.passes.micro_batches import MicroBatching
from learner.passes.rounds import in_update_passes, update_rounds
from learner.passes.sequences import (
    SequenceBatch,
    SharedPrompts,
    pad_per_token,
    pad_sequences,
    shared_prompts,
    tail_lengths,
    unpad_per_token,
)
from sync.adapters import ADAPTER_CONFIG_FILE
from sync.publisher import WeightPublisher, cast_to_engine
from sync.startup import mark

if TYPE_CHECKING:
    from learner.config import CriticConfig, LearnerConfig


# The learner's part of a checkpoint directory (cluster/run/checkpoint.py names the same files; a test keeps them
# equal).
POLICY_DIR = "policy"  # Hugging Face causal LM directory: transformers and vLLM load it as it is
CRITIC_DIR = "critic"  # Hugging Face token-classification directory, with a critic only
LEARNER_STATE_FILE = "learner_state.pt"  # optimizers, schedulers, RNG states, counters: tensors and numbers only
LEARNER_STATE_FORMAT = 1


class NonFiniteError(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


class Learner(WeightPublisher):
    """Holds the policy (+ critic) and optimizers; `train_step` updates them, the `WeightPublisher` methods hand them
    out.

    With `config.num_ranks` > 1 this is rank `rank` of the group: call `join_process_group` on every rank first, then
    call `train_step`, `compute_logprobs`, `save_checkpoint` and `load_checkpoint` on every rank, in the same order
    (they run collectives); the `WeightPublisher` methods (export, share, fingerprint, weight group) are rank 0's
    alone."""

    def __init__(self, model_path: str, config: LearnerConfig, dtype: str = "float32", temperature: float = 1.0,
                 seed: int = 0, critic: CriticConfig | None = None, norm_length: int | None = None, rank: int = 0):
        from transformers import AutoModelForCausalLM

        mark("loading")  # start-up marks (sync/startup.py)
        torch.set_num_threads(config.num_threads or default_threads(count_parameters(model_path)))
        torch.manual_seed(seed)
        self.base_rss_mb = peak_rss_mb()  # the process before any model: interpreter, torch, transformers
        self.model_path = model_path  # where a saved policy's tokenizer and generation files come from
        self.config = config
        self.temperature = temperature
        self.norm_length = config.loss_norm_length or norm_length  # seq-mean-token-sum-norm's fixed length
        self.device = pick_device()
        self.compute_dtype = getattr(torch, dtype)  # forward/backward, the engines' weights, the saved policy's
        self.master_dtype = getattr(torch, config.master_dtype)  # parameters, gradients, AdamW state
        if self.master_dtype.itemsize < self.compute_dtype.itemsize:
            raise ValueError(f"learner.master_dtype={config.master_dtype} is coarser than model.dtype={dtype}; "
                             "set learner.master_dtype=float32")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.master_dtype).to(self.device)
        self.lora = config.lora.enabled  # the policy = the frozen base + adapters, which alone train and sync
        if self.lora:
            self.model = add_adapters(self.model, config.lora)
        # eval(): no dropout, ever. Old and new logprobs (and the engines') must come from one deterministic function,
        # or ratios and the sync check measure dropout noise. Gradients do not depend on the mode.
        self.model.eval()
        self.pad_id = self.model.config.pad_token_id or 0
        self.dp = DataParallel(rank, config.num_ranks, config.strategy)
        self._gathered: dict[str, torch.Tensor] | None = None  # fsdp2: rank 0's copy of the whole policy weights
        self._make_optimizer()
        self.critic = (Critic(model_path, critic, dtype, config.master_dtype, config.pack_sequences)
                       if critic is not None and critic.enabled else None)
        if (self.critic is None) == config.uses_value_model:
            raise ValueError(f"advantage={config.advantage!r} (baseline {config.baseline!r}) and a critic go together: "
                             "gae needs one, as does reinforce with baseline 'value'; the others don't")
        # Prompts shared by a group's rows are computed once (`SharedPrompts`). Not under fsdp2 with several ranks:
        # its per-backward gradient reduction would run once more, for the prompts' own backward (not measured).
        # Passes are packed (`learner.passes.packing`), the value model's too (it runs whole rows in the same passes).
        self.batching = MicroBatching(config.micro_batch_size, config.max_tokens_per_micro_batch,
                                      config.share_prompts and not self.dp.sharded, config.pack_sequences)
        # Each batch gets exactly one update and nothing needs the pre-update logprobs before it (no KL in the reward):
        # old_logprobs then equal the training forward's own, detached (ratio 1), so the separate no-grad pass over
        # the batch is skipped; its metrics and the rollout correction's weights (per token, or per sequence: a row
        # is never split across passes) come from the training forward.
        # (Distillation's advantage needs them before the update too.) Not with LoRA dropout: the training forward
        # drops, and pi_old must be the policy the engines serve, without dropout (a no-gradient pass then).
        self.single_update = (config.ppo_epochs == 1 and config.num_minibatches == 1 and config.kl_reward_coef == 0
                              and config.distill_coef == 0 and not (config.lora.enabled and config.lora.dropout > 0))
        # With LoRA the reference (the initial policy) is the base: the learner computes its logprobs itself with the
        # adapters disabled, and no reference actor holds a second copy of the base (the driver starts none).
        self.base_reference = self.lora and (config.kl_coef > 0 or config.kl_reward_coef > 0)
        self.scorer = pass_scorer(self.model, config.fast_paths, config.max_tokens_per_micro_batch)  # fast paths
        self.shuffle = torch.Generator().manual_seed(seed)
        self.weights_version = 0
        self.nonfinite_in_row = 0
        mark("ready")

    def _make_optimizer(self) -> None:
        cfg = self.config
        # Only what trains gets AdamW state: every parameter, or with LoRA the adapters (the base is frozen) and the
        # whole modules trained beside them, at their own rate (`learner.lora.modules_lr`).
        named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        whole = [p for name, p in named if ".modules_to_save." in name]
        groups = [{"params": [p for name, p in named if ".modules_to_save." not in name]}]
        if whole:
            groups.append({"params": whole, "lr": cfg.lora.modules_lr or cfg.lr})
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                           fused=fused_adamw(cfg.fast_paths.fused_adamw, named))
        self.scheduler = warmup_schedule(self.optimizer, cfg.warmup_steps)

    def open_process_group(self, host: str, timeout_s: float) -> int:
        """Rank 0, before every rank's `join_process_group`: start listening for the group on `host`; the port."""
        return self.dp.listen(host, timeout_s)

    def join_process_group(self, host: str, port: int, timeout_s: float) -> None:
        """Join the data-parallel group whose rank 0 listens on `host:port` (every rank, before any other call).
        `timeout_s` bounds the rendezvous and every later collective. fsdp2 shards the policy and the value model
        here (their optimizers are rebuilt); ddp starts every rank from rank 0's weights."""
        self.dp.join(host, port, timeout_s, self.device)  # gloo on CPU, NCCL on a GPU
        self.dp.distribute(self.model)
        self._make_optimizer()
        if self.critic:
            self.critic.distribute(self.dp)
        self._gathered = self.dp.gather_weights(self.model)

    def compute_logprobs(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                         temperature: float | None = None) -> list[list[float]]:
        """log pi of every response token under the current weights: [B][T_resp_i] (every rank computes its share
        of the rows and gets all of them). `temperature`: the logits' divisor, the sampling temperature unless given
        (the asynchronous sync probe scores at 1, as vLLM's prompt logprobs are)."""
        batch = pad_sequences(prompt_ids, response_ids, self.pad_id, self.device)
        return unpad_per_token(self._policy_rows(batch, temperature), batch)

    def probe_sample(self, prompt_ids: list[int], max_tokens: int, temperature: float,
                     seed: int) -> tuple[list[int], list[int], list[float], int]:
        """A seeded sample of up to `max_tokens` tokens continuing `prompt_ids` from the current weights, with its
        tokens' logprobs at temperature 1: `RolloutWorker.score_probe`'s arguments (asynchronous training's sync
        probe, asked for when the weights are exported). Every rank draws the same tokens (same seed and logits);
        the learner's own random state is left as it was."""
        ids = torch.tensor([prompt_ids], device=self.device)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad(), self._compute():
            torch.manual_seed(seed)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                      temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_tokens,
                                      pad_token_id=self.pad_id)
        response = out[0, len(prompt_ids):].tolist()
        [logprobs] = self.compute_logprobs([prompt_ids], [response], temperature=1.0)
        return list(prompt_ids), response, logprobs, seed

    def _policy_rows(self, batch: SequenceBatch, temperature: float | None = None) -> torch.Tensor:
        """`sequence_logprobs` of the whole batch without gradients, [B, L-1], each rank computing its share of the
        rows, pass by pass."""
        temperature = self.temperature if temperature is None else temperature

        with torch.no_grad(), self._compute():
            prompts = shared_prompts(self.model, batch, self.batching)

        @torch.no_grad()
        def compute(part: SequenceBatch) -> torch.Tensor:
            with self._compute():
                return self.scorer.logprobs(self.model, part, temperature, prompts, self.batching.pack)

        return self.dp.compute_rows(batch, compute, self.batching,
                                    tail_lengths(batch) if prompts is not None else None)

    def _base_rows(self, batch: SequenceBatch) -> torch.Tensor:
        """The reference's logprobs of the response tokens when the reference is the base under LoRA adapters: the
        policy's own pass with the adapters disabled, laid out as `pad_per_token` lays out a reference's."""
        with self.model.disable_adapter():
            rows = self._policy_rows(batch)
        return torch.where(batch.response_mask.bool(), rows.float(), 0.0)

    def _compute(self):
        """The context of every policy forward pass (`learner.passes.device.compute_in`)."""
        return compute_in(self.device, self.compute_dtype, self.master_dtype)

    def num_trained_parameters(self) -> dict[str, int]:
        """Trainable parameters of the policy and of the value model (0 without one)."""
        policy = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return {"policy": policy, "critic": self.critic.num_parameters() if self.critic else 0}

    def train_step(self, data: TrainBatch, ref_logprobs: np.ndarray | Callable[[], np.ndarray] | None = None,
                   teacher_logprobs: np.ndarray | None = None) -> dict[str, float]:
        """One update on a step's completions; returns the step's learner metrics, `weights/version` among them:
        the version this update produced (the learner owns it; the driver and the engines read it from here).
        `ref_logprobs`, when given, replaces `data.ref_logprobs`: every response token's reference logprob in one flat
        array (`ReferenceWorker.compute_flat_logprobs`; Ray resolves a ref passed here in the learner's process), or a
        callable returning it (`sync.calls.Later`: the reference still computing them), called where they are first
        needed: after the first training forward with the KL in the loss (before anything is updated), so that the
        forward runs meanwhile; at once with the KL in the reward. A step that raises before its update (they never
        came) leaves the learner as it was: its shuffling generator is put back too. `teacher_logprobs`, likewise,
        replaces `data.teacher_logprobs` (`learner.distill_coef`), as one flat array."""
        shuffle = self.shuffle.get_state()
        try:
            return self._train_step(data, ref_logprobs, teacher_logprobs)
        except Exception:
            self.shuffle.set_state(shuffle)
            raise

    def _train_step(self, data: TrainBatch, ref_logprobs: np.ndarray | Callable[[], np.ndarray] | None,
                    teacher_logprobs: np.ndarray | None) -> dict[str, float]:
        cfg = self.config
        batch = pad_sequences(data.prompt_ids, data.response_ids, self.pad_id, self.device, data.model_masks)
        mask = batch.loss_mask  # the tokens trained on: the model's (the response's, without environment tokens)
        old_logprobs = None if self.single_update else self._old_rows(batch)
        ref = self._reference_rows(batch, data.ref_logprobs if ref_logprobs is None else ref_logprobs)
        metrics: dict[str, float] = {}
        token_rewards, step_ends = per_token_rewards(data, batch, old_logprobs, ref, cfg, self.device, metrics)
        old_values = self.dp.compute_rows(batch, self.critic.compute_values, self.batching) if self.critic else None
        distill = None
        if cfg.distill_coef > 0:  # on-policy distillation: the teacher's view of every token the model sampled
            teacher_logprobs = data.teacher_logprobs if teacher_logprobs is None else teacher_logprobs
            if teacher_logprobs is None:
                raise ValueError("learner.distill_coef > 0 needs the teacher's logprobs of every response token")
            distill = distill_log_ratios(pad_per_token(teacher_logprobs, batch), old_logprobs, mask)
            metrics["distill/reverse_kl"] = float(aggregate(-distill, mask, "token-mean"))
        inputs = AdvantageInputs(token_rewards=token_rewards, mask=mask, group_size=data.group_size, values=old_values,
                                 gamma=cfg.gamma, lam=cfg.lam, scale=cfg.group_scale, baseline=cfg.baseline,
                                 step_ends=step_ends, distill=distill, distill_discount=cfg.distill_discount)
        estimate = step_advantages(cfg, inputs, batch.has_env_tokens)
        behavior = pad_per_token(data.behavior_logprobs, batch)
        correction = None
        if old_logprobs is not None:  # else the training forward measures the mismatch (`micro_batch_loss`)
            correction, corrected, mismatch = correct_rollouts(cfg, old_logprobs, behavior, mask)
            metrics.update({name: float(value) for name, value in corrected.items()})
            metrics["logprob/mismatch"] = float(mismatch)
        tensors = StepTensors(batch, old_logprobs, estimate.advantages, behavior, ref if cfg.kl_coef > 0 else None,
                              old_values, estimate.returns, correction)
        metrics.update(self._update(tensors))
        metrics["advantage/mean_abs"] = float(aggregate(estimate.advantages.abs(), mask, "token-mean"))
        if estimate.returns is not None:
            metrics["returns/mean"] = float(aggregate(estimate.returns, mask, "token-mean"))
        metrics["memory/learner_peak_mb"] = peak_rss_mb()
        metrics["memory/learner_base_mb"] = self.base_rss_mb
        self.weights_version += 1
        metrics["weights/version"] = self.weights_version
        self._gathered = self.dp.gather_weights(self.model)
        metrics["sync/bytes"] = float(self.weights_bytes()) if self.dp.is_writer else 0.0
        return metrics

    def _reference_rows(self, batch: SequenceBatch, ref_logprobs: np.ndarray | Callable[[], np.ndarray] | None
                        ) -> torch.Tensor | Callable[[], torch.Tensor] | None:
        """The reference's logprobs [B, L-1]: the base's under LoRA when none came, or a callable that waits for them
        where first needed when they are still on their way (at once with the KL in the reward, which needs them)."""
        if ref_logprobs is None and self.base_reference:
            return self._base_rows(batch)
        if callable(ref_logprobs):
            ref = lambda: pad_per_token(ref_logprobs(), batch)  # noqa: E731
            return ref() if self.config.kl_reward_coef > 0 else ref
        return pad_per_token(ref_logprobs, batch) if ref_logprobs is not None else None

    def _update(self, tensors: StepTensors) -> dict[str, float]:
        """`ppo_epochs` x `num_minibatches` updates on a shuffled order of the rows; the means of their metrics (of
        `train/skipped_updates`, the count)."""
        sums: dict[str, float] = {}
        updates = 0
        for _ in range(self.config.ppo_epochs):
            # Drawn on the host from the checkpointed generator (the same order on any device), used on the model's.
            order = torch.randperm(len(tensors.batch), generator=self.shuffle, device="cpu").to(self.device)
            # Fewer than num_minibatches chunks when groups were dropped (on_failure=drop) and the batch shrank.
            for b_idx in order.chunk(self.config.num_minibatches):
                updates += 1
                for key, value in self._minibatch_update(tensors, b_idx).items():
                    sums[key] = sums.get(key, 0.0) + value
        means = {key: value / updates for key, value in sums.items()}
        means["train/skipped_updates"] = sums["train/skipped_updates"]
        return means

    def _rounds(self, batch: SequenceBatch, rows: torch.Tensor, grad: bool = True
                ) -> Iterator[tuple[SharedPrompts | None, list[tuple[torch.Tensor, bool]]]]:
        """This rank's passes over `rows` in rounds that share prompts (`update_rounds`; whole rows with a critic)."""
        return update_rounds(self.model, batch, rows, self.batching, self.dp, self.critic is not None, self._compute,
                             grad)

    def _old_rows(self, batch: SequenceBatch) -> torch.Tensor:
        """The old logprobs [B, L-1] before the update, computed in the passes of the first epoch's minibatches (its
        order drawn ahead from the shuffling generator, which is put back): each row in a pass of the same rows,
        order and shapes as its first training forward, so that in bfloat16 no pass shape makes a ratio that is not 1
        (`learner.passes.rounds`)."""
        state = self.shuffle.get_state()
        order = torch.randperm(len(batch), generator=self.shuffle, device="cpu").to(self.device)
        self.shuffle.set_state(state)

        def score(part: SequenceBatch, prompts: SharedPrompts | None) -> torch.Tensor:
            with self._compute():
                return self.scorer.logprobs(self.model, part, self.temperature, prompts, self.batching.pack)

        with torch.no_grad():
            rounds = lambda b_idx: self._rounds(batch, b_idx, grad=False)  # noqa: E731
            return in_update_passes(batch, order.chunk(self.config.num_minibatches), rounds, score, self.dp.all_reduce)

    def _minibatch_update(self, step: StepTensors, b_idx: torch.Tensor) -> dict[str, float]:
        """Accumulate gradients over micro-batches, then one optimizer step (skipped if anything is non-finite).

        With several ranks, this rank runs its share of the minibatch `b_idx`, weighted against the whole minibatch;
        gradients and metrics are summed over ranks before the norm and the skip decision, so all ranks agree."""
        b_mask = step.batch.loss_mask[b_idx]  # the trained tokens: every share and denominator counts these
        on_device = self.config.fast_paths.metrics_on_device
        whole = denominators(b_mask) if on_device else b_mask
        sums = MetricSums(on_device)
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic:
            self.critic.zero_grad()
        with adapter_dropout(self.model, True) if self.lora and self.config.lora.dropout > 0 else nullcontext():
            for prompts, passes in self._rounds(step.batch, b_idx):  # prompts shared by a round's rows, or None
                for mb_idx, live in passes:
                    self._micro_batch_backward(step, mb_idx, live, whole, prompts, sums)
                if prompts is not None:  # the prompts' own backward, once
                    with matmuls_in(self.device, self.compute_dtype):
                        prompts.backward()
        self.dp.reduce_gradients([self.model, self.critic.model] if self.critic else [self.model])
        return self._optimizer_step(self.dp.sum_metrics(sums.totals()))

    def _micro_batch_backward(self, step: StepTensors, mb_idx: torch.Tensor, live: bool, whole: Any, prompts: Any,
                              sums: MetricSums) -> None:
        """One pass: the micro-batch's loss, weighted into the minibatch's (`whole`: its mask, or its denominators
        on the device), backward; its metrics go to `sums`."""
        cfg = self.config
        mb = step.batch.select(mb_idx)
        width = mb.response_mask.shape[1]
        # The minibatch's loss is the sum over micro-batches (of every rank) of weight x micro-batch loss, for every
        # mode; token-mean metrics weigh by the tokens' share, per-sequence ones by the sequences'. A dead pass
        # (ranks run equally many) weighs 0.
        weight, token_share, seq_share = pass_weights(mb.loss_mask, whole, cfg.loss_agg, live, sums.on_device)
        with self._compute():
            logprobs, entropy = self.scorer.logprobs_and_entropy(self.model, mb, self.temperature,
                                                                 cfg.entropy_coef > 0, prompts, self.batching.pack)
        loss, metrics = micro_batch_loss(cfg, step, mb_idx, mb, logprobs, entropy, self.norm_length)
        with matmuls_in(self.device, self.compute_dtype):
            (loss * (weight.float() if isinstance(weight, torch.Tensor) else weight)).backward()
        for name, value in metrics.items():
            sums.add(name, value,
                     weight if name == "loss/policy" else seq_share if name.startswith("seq_") else token_share)
        if self.critic:
            for name, value in self.critic.accumulate(mb, step.old_values[mb_idx, :width],
                                                      step.returns[mb_idx, :width], float(token_share)).items():
                sums.add(name, value, 1.0)

    def _optimizer_step(self, totals: dict[str, float]) -> dict[str, float]:
        """Clip the gradients and step the optimizers, or skip the update when a metric or a norm is not finite
        (`learner.max_nonfinite_steps` in a row stop the run); the minibatch's metrics."""
        cfg = self.config
        norms = {"grad_norm": clip_grad_norm(self.model.parameters(), cfg.max_grad_norm)}
        if self.critic:
            norms["critic/grad_norm"] = self.critic.clip_gradients()
        finite = all(np.isfinite(v) for v in [*norms.values(), *totals.values()])
        if finite:
            self.optimizer.step()
            self.scheduler.step()
            if self.critic:
                self.critic.step()
            self.nonfinite_in_row = 0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            if self.critic:
                self.critic.zero_grad()
            self.nonfinite_in_row += 1
            if self.nonfinite_in_row >= cfg.max_nonfinite_steps:
                raise NonFiniteError(f"{self.nonfinite_in_row} updates in a row had a non-finite loss or gradient; "
                                     "lower learner.lr or check the rewards")
            norms = {name: 0.0 for name in norms}
        return {**totals, **norms, "train/skipped_updates": float(not finite)}

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """What the engines need of the policy, by checkpoint name: its whole weights (the live tensors, or under
        fsdp2 rank 0's CPU copy gathered after the last update or load; other fsdp2 ranks: empty), or with LoRA the
        adapters and `learner.lora.modules_to_save` (peft's names; the engines keep the rest of the base they
        loaded). No collective: rank 0 alone may call it."""
        if self.lora:
            return adapter_weights(self.model)
        return self._gathered if self._gathered is not None else self.model.state_dict()

    def save_checkpoint(self, directory: str) -> None:
        """Write the learner's whole state into `directory` (existing and empty; the caller makes it atomic):
        `policy/` (in `model.dtype`, for vLLM and transformers; with LoRA the adapters alone, in peft's format and
        the master dtype) and, with a critic, `critic/` (in
        `learner.master_dtype`) as Hugging Face directories (safetensors), and `learner_state.pt` with the optimizers,
        schedulers, RNG states and counters as plain tensors and numbers, so that it loads with
        `torch.load(weights_only=True)`, and the policy's master weights when they are wider than `model.dtype`.
        With `load_checkpoint` the next `train_step` is bitwise the same.
        With several ranks every rank calls it and rank 0 writes the same files, with whole tensors, that one rank
        would: a checkpoint resumes with any number of ranks and either strategy."""
        root = Path(directory)
        if self.critic:
            self.critic.save_model(root / CRITIC_DIR)
        state = self._training_state()  # under fsdp2 every rank joins the gathers, rank 0 keeps the result
        if self.dp.is_writer and self.lora:  # peft's format, in the master dtype: what the update continues from
            save_adapters(self.model, root / POLICY_DIR, self.policy_state_dict())
            torch.save(state, root / LEARNER_STATE_FILE)
        elif self.dp.is_writer:
            weights = self.policy_state_dict()
            if self.mixed_precision:
                state["master_weights"] = to_cpu(weights)  # what the update continues from, exactly
                weights = cast_to_engine(weights, self.compute_dtype)
            save_model_dir(self.model, self.model_path, root / POLICY_DIR, weights, self.compute_dtype)
            torch.save(state, root / LEARNER_STATE_FILE)

    def load_checkpoint(self, directory: str) -> int:
        """Restore what `save_checkpoint` wrote into this learner (built with the same model and config); returns
        the weights version the restored policy has."""
        root = Path(directory)
        # No arbitrary unpickling. Into host memory: the RNG states must be CPU tensors, and loading the optimizers'
        # state moves each tensor to its parameter's device.
        state = torch.load(root / LEARNER_STATE_FILE, map_location="cpu", weights_only=True)
        if state.get("format") != LEARNER_STATE_FORMAT:
            raise ValueError(f"{root / LEARNER_STATE_FILE}: format {state.get('format')!r}, this relay reads "
                             f"{LEARNER_STATE_FORMAT}; resume with the relay version that wrote it")
        if (state["critic"] is None) != (self.critic is None):
            raise ValueError(f"{root}: the checkpoint {'has' if state['critic'] is not None else 'has no'} value "
                             f"model but this run {'has' if self.critic else 'has none'}; resume with the "
                             "checkpoint's learner.advantage and critic settings")
        if (root / POLICY_DIR / ADAPTER_CONFIG_FILE).is_file() != self.lora:
            raise ValueError(f"{root}: the checkpoint {'has' if not self.lora else 'has no'} LoRA adapters but this "
                             f"run {'has none' if not self.lora else 'has'}; resume with the checkpoint's "
                             "learner.lora settings")
        master = state.get("master_weights")  # absent when the policy directory holds the master weights
        if self.lora:
            load_adapters(self.model, read_adapters(self.model, root / POLICY_DIR))
        elif master is not None:  # cast on load when this run's master weights are narrower
            self.dp.load_weights(self.model, check_weights(self.model, master, root / LEARNER_STATE_FILE))
        else:
            self.dp.load_weights(self.model, read_model_weights(self.model, root / POLICY_DIR))
        self.dp.load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic:
            self.critic.load_model(root / CRITIC_DIR)
            self.critic.load_training_state(state["critic"])
        self.shuffle.set_state(state["rng"]["shuffle"])
        torch.set_rng_state(state["rng"]["torch"])  # the update does not draw from it (no dropout); restored anyway
        self.weights_version = int(state["weights_version"])
        self.nonfinite_in_row = int(state["nonfinite_in_row"])
        self._gathered = self.dp.gather_weights(self.model)
        return self.weights_version

    @property
    def mixed_precision(self) -> bool:
        """The master weights are wider than the compute dtype (float32 kept for bfloat16 compute)."""
        return self.master_dtype != self.compute_dtype

    def _training_state(self) -> dict[str, Any]:
        """Everything but the weights that the next update depends on. The learner draws no numpy or Python
        random numbers; its only generators are `self.shuffle` and torch's global one. In host memory (`to_cpu`): a
        checkpoint written on a GPU resumes on any device."""
        return to_cpu({
            "format": LEARNER_STATE_FORMAT,
            "optimizer": self.dp.full_optimizer_state(self.optimizer),  # whole tensors, whatever the ranks
            "scheduler": self.scheduler.state_dict(),  # LambdaLR leaves the lambda out: rebuilt from the config
            "critic": self.critic.training_state() if self.critic else None,
            "rng": {"shuffle": self.shuffle.get_state(), "torch": torch.get_rng_state()},
            "weights_version": self.weights_version,
            "nonfinite_in_row": self.nonfinite_in_row,
        })


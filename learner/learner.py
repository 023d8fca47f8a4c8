"""Learner: the trained policy, its optimizer, and one PPO-style update per step.

Owns: the policy (a transformers causal LM) and AdamW; recomputing `old_logprobs`; advantages (looked up by the
config's name); epochs x minibatches x micro-batches of the clipped objective with the KL penalty in the loss;
skipping non-finite updates; exporting weights in buckets for the engines. Does not own: sampling, rewards, or how
weights travel (cluster/). A plain class: Ray wraps it in `cluster/`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from learner.algo.advantages import ADVANTAGE_ESTIMATORS, broadcast_to_tokens
from learner.algo.losses import aggregate, clipped_policy_loss, kl
from learner.algo.sequences import (SequenceBatch, batched_logprobs, pad_per_token, pad_sequences, sequence_logprobs,
                                     unpad_per_token)

if TYPE_CHECKING:
    from cluster.config import LearnerConfig


@dataclass
class TrainBatch:
    """One step's completions, B = prompts x G, grouped: completions of one prompt are consecutive."""

    prompt_ids: list[list[int]]  # [B][T_prompt_i]
    response_ids: list[list[int]]  # [B][T_resp_i]
    behavior_logprobs: list[list[float]]  # [B][T_resp_i] from the engine that sampled
    rewards: list[float]  # [B]
    group_size: int  # G
    ref_logprobs: list[list[float]] | None = None  # [B][T_resp_i] from the frozen reference, when KL is on


class NonFiniteError(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


class Learner:
    """Holds the policy and optimizer; `train_step` updates them, `export_weights` hands them out."""

    def __init__(self, model_path: str, config: LearnerConfig, dtype: str = "float32", temperature: float = 1.0,
                 seed: int = 0):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(config.num_threads)
        torch.manual_seed(seed)
        self.config = config
        self.temperature = temperature
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.train()
        self.pad_id = self.model.config.pad_token_id or 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay)
        warmup = config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda n: min(1.0, (n + 1) / warmup) if warmup else 1.0)
        self.shuffle = torch.Generator().manual_seed(seed)
        self.weights_version = 0
        self.nonfinite_in_row = 0

    def compute_logprobs(self, prompt_ids: Sequence[Sequence[int]],
                         response_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """log pi of every response token under the current weights: [B][T_resp_i]."""
        batch = pad_sequences(prompt_ids, response_ids, self.pad_id)
        return unpad_per_token(batched_logprobs(self.model, batch, self.config.micro_batch_size, self.temperature),
                               batch)

    def train_step(self, data: TrainBatch) -> dict[str, float]:
        """One update on a step's completions; returns the step's learner metrics."""
        cfg = self.config
        batch = pad_sequences(data.prompt_ids, data.response_ids, self.pad_id)
        mask = batch.response_mask
        old_logprobs = batched_logprobs(self.model, batch, cfg.micro_batch_size, self.temperature)
        behavior = pad_per_token(data.behavior_logprobs, batch)
        ref = pad_per_token(data.ref_logprobs, batch) if data.ref_logprobs is not None else None
        rewards = torch.tensor(data.rewards, dtype=torch.float32)
        advantages = broadcast_to_tokens(ADVANTAGE_ESTIMATORS[cfg.advantage](rewards, data.group_size), mask)

        sums: dict[str, float] = {}
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(batch), generator=self.shuffle)
            for b_idx in order.chunk(cfg.num_minibatches):
                for key, value in self._minibatch_update(batch, b_idx, old_logprobs, advantages, ref).items():
                    sums[key] = sums.get(key, 0.0) + value
        updates = cfg.ppo_epochs * cfg.num_minibatches
        metrics = {key: value / updates for key, value in sums.items()}
        metrics["logprob/mismatch"] = float(aggregate((behavior - old_logprobs).abs(), mask, "token-mean"))
        metrics["advantage/mean_abs"] = float(aggregate(advantages.abs(), mask, "token-mean"))
        self.weights_version += 1
        return metrics

    def _minibatch_update(self, batch: SequenceBatch, b_idx: torch.Tensor, old_logprobs: torch.Tensor,
                          advantages: torch.Tensor, ref: torch.Tensor | None) -> dict[str, float]:
        """Accumulate gradients over micro-batches, then one optimizer step (skipped if anything is non-finite)."""
        cfg = self.config
        b_tokens = float(batch.response_mask[b_idx].sum().clamp(min=1))
        totals = {"loss/policy": 0.0, "kl/mean": 0.0, "clip_fraction": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        for mb_idx in b_idx.split(cfg.micro_batch_size):
            mb = batch.select(mb_idx)
            width = mb.response_mask.shape[1]
            mb_mask = mb.response_mask
            # token-mean over the minibatch = sum over micro-batches of (micro-batch token-mean x token share)
            share = float(mb_mask.sum()) / b_tokens
            logprobs = sequence_logprobs(self.model, mb, self.temperature)
            policy_loss, pg = clipped_policy_loss(logprobs, old_logprobs[mb_idx, :width], advantages[mb_idx, :width],
                                                  mb_mask, cfg.clip_low, cfg.clip_high, mode="token-mean")
            loss = policy_loss
            if ref is not None and cfg.kl_coef > 0:
                kl_mean = aggregate(kl(logprobs, ref[mb_idx, :width], cfg.kl_estimator, mb_mask), mb_mask,
                                    "token-mean")
                loss = loss + cfg.kl_coef * kl_mean
                totals["kl/mean"] += float(kl_mean.detach()) * share
            (loss * share).backward()
            totals["loss/policy"] += float(policy_loss.detach()) * share
            totals["clip_fraction"] += float(pg["clip_fraction"]) * share
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm))
        finite = np.isfinite(grad_norm) and np.isfinite(totals["loss/policy"]) and np.isfinite(totals["kl/mean"])
        if finite:
            self.optimizer.step()
            self.scheduler.step()
            self.nonfinite_in_row = 0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_in_row += 1
            if self.nonfinite_in_row >= cfg.max_nonfinite_steps:
                raise NonFiniteError(f"{self.nonfinite_in_row} updates in a row had a non-finite loss or gradient; "
                                     "lower learner.lr or check the rewards")
        return {**totals, "grad_norm": grad_norm if finite else 0.0, "train/skipped_updates": float(not finite)}

    def export_weights(self, bucket_bytes: int) -> list[list[tuple[str, np.ndarray | torch.Tensor]]]:
        """The policy's weights as buckets of (name, array) of about `bucket_bytes` each, in checkpoint names.

        numpy arrays travel through Ray's object store zero-copy; dtypes numpy lacks (bfloat16) stay tensors.
        The arrays are views of the live parameters: load or copy them before the next `train_step`."""
        buckets: list[list[tuple[str, np.ndarray | torch.Tensor]]] = [[]]
        size = 0
        for name, tensor in self.model.state_dict().items():
            tensor = tensor.detach().contiguous().cpu()
            if size and size + tensor.nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((name, tensor.numpy() if tensor.dtype != torch.bfloat16 else tensor))
            size += tensor.nbytes
        return buckets

    def export_weight_buckets(self, bucket_bytes: int):
        """`export_weights` shaped for a Ray call with `num_returns=count_buckets(...)`: one object per bucket
        (Ray stores a method's whole return value as one object when num_returns is 1, so one bucket goes bare)."""
        buckets = self.export_weights(bucket_bytes)
        return buckets[0] if len(buckets) == 1 else buckets

    def count_buckets(self, bucket_bytes: int) -> int:
        return len(self.export_weights(bucket_bytes))

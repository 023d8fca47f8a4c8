"""What one step trains on: `TrainBatch`, a step's completions as the driver sends them to the learner; `StepTensors`,
the same padded to the step's [B, L-1] token layout with what the learner computes from them before its update
(old logprobs, advantages, returns, rollout-correction weights), which every minibatch reads; and the per-token
rewards (`per_token_rewards`: the outcome reward on each row's last model token, the step rewards of process
supervision, minus the KL penalty when it goes in the reward).
Does not own: the token layout and padding (`learner.passes.sequences`), the advantage estimators and the KL
(`learner.algo`), or the update that reads these (`learner.learner`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from learner.algo.advantages import carry_to_model_tokens, last_token_rewards
from learner.algo.losses import aggregate, kl
from learner.passes.sequences import SequenceBatch, pad_per_token

if TYPE_CHECKING:
    from learner.config import LearnerConfig


@dataclass
class TrainBatch:
    """One step's completions, B = prompts x G, grouped: completions of one prompt are consecutive."""

    prompt_ids: list[list[int]]  # [B][T_prompt_i]
    response_ids: list[list[int]]  # [B][T_resp_i]
    behavior_logprobs: list[list[float]]  # [B][T_resp_i] from the engine that sampled
    rewards: list[float]  # [B] outcome reward of each completion
    group_size: int  # G
    # [B][T_resp_i] from the frozen reference, when KL is on (or `train_step`'s `ref_logprobs`: one flat array)
    ref_logprobs: list[list[float]] | None = None
    # Process supervision: [B][T_resp_i] each step's reward at the step's last token (0 elsewhere), and 1 at the
    # tokens that end a step (the last response token always does), 0 elsewhere.
    step_rewards: list[list[float]] | None = None
    step_ends: list[list[float]] | None = None
    # Multi-turn episodes: [B][T_resp_i] 1 (any value > 0) at the response tokens the model sampled, 0 at those the
    # environment added (trained on by nothing: no loss, KL, entropy, mismatch or correction, no value target, no
    # token counted); `Rows` of any numeric dtype travel packed. None: every response token is the model's. Every
    # other per-token array still covers every response token (behaviour logprobs 0 at the environment's).
    model_masks: list[list[float]] | None = None
    # On-policy distillation (`learner.distill_coef`): [B][T_resp_i] the teacher's logprobs of the response tokens (or
    # `train_step`'s `teacher_logprobs`: one flat array).
    teacher_logprobs: list[list[float]] | None = None


@dataclass
class StepTensors:
    """What every minibatch of one step reads, padded to the step's [B, L-1] token layout."""

    batch: SequenceBatch
    old_logprobs: torch.Tensor | None  # [B, L-1] learner, before this step's update; None: the training forward's
    advantages: torch.Tensor  # [B, L-1]
    behavior: torch.Tensor  # [B, L-1] the engines' logprobs of the sampled tokens
    ref_logprobs: torch.Tensor | Callable[[], torch.Tensor] | None  # [B, L-1] when the KL is in the loss: `reference`
    old_values: torch.Tensor | None = None  # [B, L-1] critic, before this step's update (gae)
    returns: torch.Tensor | None = None  # [B, L-1] value targets (gae)
    correction: torch.Tensor | None = None  # [B, L-1] rollout-correction weights (learner.rollout_correction)

    def reference(self) -> torch.Tensor:
        """`ref_logprobs`, waited for at the first call when they were still on their way (a callable)."""
        if callable(self.ref_logprobs):
            self.ref_logprobs = self.ref_logprobs()
        return self.ref_logprobs


def per_token_rewards(data: TrainBatch, batch: SequenceBatch, old_logprobs: torch.Tensor | None,
                      ref: torch.Tensor | None, cfg: LearnerConfig, device: torch.device,
                      metrics: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token rewards [B, L-1], on the model's tokens only: the outcome reward on each row's last one, plus
    the step rewards (process supervision), minus the KL penalty when it goes in the reward (its mean into
    `metrics`); and the step ends ([B, L-1] bool, or None)."""
    mask = batch.loss_mask
    rewards = torch.tensor(data.rewards, dtype=torch.float32, device=device)  # [B]
    token_rewards = last_token_rewards(rewards, mask)
    step_ends = None
    if data.step_rewards is not None:  # process supervision: step rewards at their steps' last tokens
        step_rewards, step_ends = pad_per_token(data.step_rewards, batch), pad_per_token(data.step_ends, batch)
        if batch.has_env_tokens:  # steps ending on environment tokens end at the model token before them
            step_rewards = carry_to_model_tokens(step_rewards, batch.response_mask, mask)
            step_ends = carry_to_model_tokens(step_ends, batch.response_mask, mask)
        token_rewards = token_rewards + step_rewards
        step_ends = step_ends > 0
    if cfg.kl_reward_coef > 0:  # PPO style: a per-token penalty on the reward, from the pre-update policy
        token_kl = kl(old_logprobs, ref, cfg.kl_estimator, mask)
        token_rewards = token_rewards - cfg.kl_reward_coef * token_kl
        metrics["kl/mean"] = float(aggregate(token_kl, mask, "token-mean"))
    return token_rewards, step_ends

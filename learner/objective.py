"""What the learner optimises, as functions over a step's tensors (no model, no optimizer): the step's advantages
(the config's estimator on the model's tokens, plus on-policy distillation's), the rollout correction's weights with
the logprob mismatch, and one micro-batch's loss (policy loss, KL in the loss, entropy bonus) with its metrics.
Does not own: the math itself (`learner.algo`), the per-token rewards (`learner.batch`), or the passes, gradients
and optimizer steps that use these (`learner.learner`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import Tensor

from learner.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    Advantages,
    distill_advantages,
    on_model_tokens,
)
from learner.algo.correction import rollout_correction
from learner.algo.losses import POLICY_LOSSES, aggregate, entropy_bonus, kl

if TYPE_CHECKING:
    from learner.batch import StepTensors
    from learner.config import LearnerConfig
    from learner.passes.sequences import SequenceBatch


def step_advantages(cfg: LearnerConfig, inputs: AdvantageInputs, has_env_tokens: bool) -> Advantages:
    """The step's advantages and returns [B, L-1]: `cfg.advantage`'s estimator, with the teacher's advantage
    (`inputs.distill` given) weighted by `cfg.distill_coef`: alone, or added to the rewards' (docs/algorithms.md,
    distillation)."""

    def estimate_with(estimator: Callable[[AdvantageInputs], Advantages]) -> Advantages:
        # Environment tokens between turns: the estimators see each row's model tokens as one contiguous sequence.
        return on_model_tokens(estimator, inputs) if has_env_tokens else estimator(inputs)

    estimate = estimate_with(ADVANTAGE_ESTIMATORS[cfg.advantage])
    if cfg.advantage == "distill":
        return Advantages(cfg.distill_coef * estimate.advantages, None)
    if inputs.distill is not None:
        return Advantages(estimate.advantages + cfg.distill_coef * estimate_with(distill_advantages).advantages,
                          estimate.returns)
    return estimate


def correct_rollouts(cfg: LearnerConfig, old: Tensor, behavior: Tensor,
                     mask: Tensor) -> tuple[Tensor | None, dict[str, Tensor], Tensor]:
    """The rollout correction's weights [B, T] (None when `cfg.rollout_correction` is none), its metrics, and the
    mean absolute gap between the learner's logprobs `old` and the engines' `behavior` (`logprob/mismatch`)."""
    correction, metrics = rollout_correction(
        old, behavior, mask, cfg.rollout_correction, cfg.rollout_correction_cap,
        cfg.rollout_correction_level, cfg.rollout_correction_low, cfg.rollout_correction_high)
    mismatch = aggregate((behavior - old).abs(), mask, "token-mean")
    return (None if cfg.rollout_correction == "none" else correction), metrics, mismatch


def micro_batch_loss(cfg: LearnerConfig, step: StepTensors, mb_idx: Tensor, mb: SequenceBatch, logprobs: Tensor,
                     entropy: Tensor, norm_length: int | None) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of micro-batch `mb` (rows `mb_idx` of `step`) from its training forward's `logprobs` and `entropy`
    [b, T], and its metrics: `loss/policy` (the policy loss alone), the policy loss's own (gspo's `seq_*` are means
    over sequences), the others means over the micro-batch's trained tokens. With one update per batch
    (`step.old_logprobs` None) pi_old is this forward's own policy, detached, and the correction is measured here."""
    width = mb.response_mask.shape[1]
    mask = mb.loss_mask
    metrics: dict[str, Tensor] = {}
    if step.old_logprobs is None:
        old = logprobs.detach()
        correction, corrected, mismatch = correct_rollouts(cfg, old, step.behavior[mb_idx, :width], mask)
        metrics["logprob/mismatch"] = mismatch
        metrics.update(corrected)
    else:
        old = step.old_logprobs[mb_idx, :width]
        correction = None if step.correction is None else step.correction[mb_idx, :width]
    policy_loss, pg = POLICY_LOSSES[cfg.policy_loss](
        logprobs, old, step.advantages[mb_idx, :width], mask, cfg.clip_low,
        cfg.clip_high, cfg.clip_c, cfg.loss_agg, norm_length, correction)
    loss = policy_loss
    if step.ref_logprobs is not None:  # GRPO style: the KL penalty in the loss
        token_kl = kl(logprobs, step.reference()[mb_idx, :width], cfg.kl_estimator, mask)
        loss = loss + cfg.kl_coef * aggregate(token_kl, mask, cfg.loss_agg, norm_length)
        metrics["kl/mean"] = aggregate(token_kl.detach(), mask, "token-mean")
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * entropy_bonus(entropy, mask, cfg.loss_agg, norm_length)
    metrics["loss/policy"] = policy_loss.detach()
    metrics["entropy/mean"] = aggregate(entropy.detach(), mask, "token-mean")
    metrics.update(pg)
    return loss, metrics

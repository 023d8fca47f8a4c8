"""Rollout-training mismatch correction: per-token weights for the policy-gradient term from the gap between the
engine that sampled (the behaviour policy) and the learner's own log-probabilities of the same tokens.

Owns the truncated (TIS) and masked (MIS) importance weights, token- or sequence-level, and the mismatch metrics.
Does not own where the weights are applied (`losses.py`'s policy losses take them) nor the config (`learner.*`).

The learner recomputes log pi_old for every sampled token; the engine's log pi_behavior of the same tokens differs
by numerics (bfloat16 kernels, other attention code) or, asynchronously, by a weights version. The PPO ratio is
taken against pi_old, so tokens are weighted by how much likelier pi_old makes them than pi_behavior did
(Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"; verl's rollout
correction). With rho_t = pi_old(x_t) / pi_behavior(x_t) and cap C > 1:
    tis, token:     w_t = min(rho_t, C)
    tis, sequence:  w_t = min(prod_t' rho_t', C) for every token of the sequence
    mis, token:     w_t = 1 if 1/C <= rho_t <= C else 0
    mis, sequence:  w_t = 1 if 1/C <= prod_t' rho_t' <= C else 0, for every token of the sequence
The weights carry no gradient. Notation: B: sequences, T: tokens; mask [B, T] is 1 at response tokens.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

MODES = ("none", "tis", "mis")
LEVELS = ("token", "sequence")


def rollout_correction(old_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, mode: str, cap: float,
                       level: str = "token") -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights for the policy-gradient term of every response token, and the mismatch metrics.

    Args:
        old_logprobs: [B, T] log pi_old(x_t), the learner's, before this step's update.
        behavior_logprobs: [B, T] log pi_behavior(x_t), the engine's when it sampled x_t.
        mask: [B, T] 1 (or True) at response tokens, 0 at padding (which gets weight 1 and counts nowhere).
        mode: "none" (all weights 1), "tis" (truncated) or "mis" (masked), see the module docstring.
        cap: C > 1.
        level: "token" (one ratio per token) or "sequence" (one ratio per sequence, the product of its tokens').

    Returns:
        weights: [B, T], detached.
        metrics: detached [] tensors, means over response tokens:
            rollout_correction/weight_mean (tis, mis): mean of w_t,
            rollout_correction/capped_fraction (tis): share of tokens whose ratio was above C,
            rollout_correction/masked_fraction (mis): share of tokens given weight 0,
            mismatch/kl: k3 estimate of KL(pi_behavior || pi_old) from tokens sampled by pi_behavior,
                (rho_t - 1) - log rho_t (computed whatever the mode).
    """
    if mode not in MODES:
        raise ValueError(f"unknown rollout correction {mode!r}; choose one of {list(MODES)}")
    if level not in LEVELS:
        raise ValueError(f"unknown rollout correction level {level!r}; choose one of {list(LEVELS)}")
    if not cap > 1:
        raise ValueError(f"rollout correction cap must be > 1, got {cap}")
    if not (old_logprobs.shape == behavior_logprobs.shape == mask.shape) or mask.dim() != 2:
        shapes = [tuple(t.shape) for t in (old_logprobs, behavior_logprobs, mask)]
        raise ValueError(f"old_logprobs, behavior_logprobs and mask must share one [B, T] shape, got {shapes}")
    with torch.no_grad():
        keep = mask.bool()
        log_rho = torch.where(keep, old_logprobs - behavior_logprobs, 0.0)  # [B, T] log rho_t; 0 at padding
        if level == "sequence":
            log_rho_used = log_rho.sum(dim=1, keepdim=True).expand_as(log_rho)  # log prod_t rho_t on every token
        else:
            log_rho_used = log_rho
        log_cap = math.log(cap)
        if mode == "tis":
            weights = torch.exp(log_rho_used.clamp(max=log_cap))  # min(rho, C), without overflow for long sequences
            flagged = log_rho_used > log_cap
        elif mode == "mis":
            flagged = (log_rho_used > log_cap) | (log_rho_used < -log_cap)  # outside [1/C, C]
            weights = (~flagged).to(old_logprobs.dtype)
        else:
            weights = torch.ones_like(old_logprobs)
            flagged = torch.zeros_like(keep)
        weights = torch.where(keep, weights, 1.0)
        tokens = keep.sum().clamp(min=1)
        x = log_rho.double()  # k3 = (rho - 1) - log rho = expm1(x) - x ~ x^2/2: float32 would round it below 0
        metrics = {"mismatch/kl": (torch.where(keep, torch.expm1(x) - x, 0.0).sum() / tokens).float()}
        if mode != "none":
            name = "capped_fraction" if mode == "tis" else "masked_fraction"
            metrics["rollout_correction/weight_mean"] = torch.where(keep, weights, 0.0).sum() / tokens
            metrics[f"rollout_correction/{name}"] = (flagged & keep).sum() / tokens
    return weights, metrics

"""Rollout-training mismatch correction: per-token weights for the policy-gradient term from the gap between the
engine that sampled (the behaviour policy) and the learner's own log-probabilities of the same tokens.

Owns the truncated (TIS) and masked (MIS) importance weights, token- or sequence-level, IcePop's two-sided token
mask, the sequence-masked TIS (their equations: `_mode_weights`), and the mismatch metrics. Does not own where the
weights are applied (`losses.py`'s policy losses take them) nor the config (`learner.*`).

The learner recomputes log pi_old for every sampled token; the engine's log pi_behavior of the same tokens differs
by numerics (bfloat16 kernels, other attention code) or, asynchronously, by a weights version. The PPO ratio is
taken against pi_old, so tokens are weighted by how much likelier pi_old makes them than pi_behavior did (Yao et al.
2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"; verl's rollout correction).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

MODES = ("none", "tis", "mis", "icepop", "seq_mask_tis")
LEVELS = ("token", "sequence")
BANDED = ("icepop", "seq_mask_tis")  # the modes that read the band [low, high] and define their own level


def rollout_correction(old_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, mode: str, cap: float,
                       level: str = "token", low: float = 0.5, high: float = 5.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights for the policy-gradient term of every response token, and the mismatch metrics.

    Args:
        old_logprobs: [B, T] log pi_old(x_t), the learner's, before this step's update.
        behavior_logprobs: [B, T] log pi_behavior(x_t), the engine's when it sampled x_t.
        mask: [B, T] 1 (or True) at response tokens, 0 at padding (which gets weight 1 and counts nowhere).
        mode: one of MODES, see `_mode_weights`.
        cap: C > 1 (tis, mis, seq_mask_tis).
        level: "token" (one ratio per token) or "sequence" (one per sequence, the product of its tokens'): tis and
            mis only; icepop and seq_mask_tis take "token" (each defines its own unit).
        low, high: the band [lo, hi] of icepop (on rho_t) and seq_mask_tis (on the geometric mean), 0 <= lo < hi.

    Returns:
        weights: [B, T], detached.
        metrics: detached [] tensors, means over response tokens:
            rollout_correction/weight_mean (every mode but none): mean of w_t,
            rollout_correction/capped_fraction (tis, seq_mask_tis): share of tokens whose ratio was above C (and,
                for seq_mask_tis, whose sequence was kept),
            rollout_correction/masked_fraction (mis, icepop, seq_mask_tis): share of tokens given weight 0 by the
                mask (for seq_mask_tis: the tokens of the masked sequences),
            mismatch/kl: k3 estimate of KL(pi_behavior || pi_old) from tokens sampled by pi_behavior,
                (rho_t - 1) - log rho_t (computed whatever the mode).
    """
    _check_arguments(old_logprobs, behavior_logprobs, mask, mode, cap, level, low, high)
    with torch.no_grad():
        keep = mask.bool()
        log_rho = torch.where(keep, old_logprobs - behavior_logprobs, 0.0)  # [B, T] log rho_t; 0 at padding
        if level == "sequence":
            log_rho_used = log_rho.sum(dim=1, keepdim=True).expand_as(log_rho)  # log prod_t rho_t on every token
        else:
            log_rho_used = log_rho
        weights, capped, masked = _mode_weights(mode, log_rho, log_rho_used, keep, cap, low, high,
                                                old_logprobs.dtype)
        weights = torch.where(keep, weights, 1.0)
        tokens = keep.sum().clamp(min=1)
        x = log_rho.double()  # k3 = (rho - 1) - log rho = expm1(x) - x ~ x^2/2: float32 would round it below 0
        metrics = {"mismatch/kl": (torch.where(keep, torch.expm1(x) - x, 0.0).sum() / tokens).float()}
        if mode != "none":
            metrics["rollout_correction/weight_mean"] = torch.where(keep, weights, 0.0).sum() / tokens
        if mode in ("tis", "seq_mask_tis"):
            metrics["rollout_correction/capped_fraction"] = (capped & keep).sum() / tokens
        if mode in ("mis", "icepop", "seq_mask_tis"):
            metrics["rollout_correction/masked_fraction"] = (masked & keep).sum() / tokens
    return weights, metrics


def _check_arguments(old_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, mode: str, cap: float, level: str,
                     low: float, high: float) -> None:
    """`rollout_correction`'s arguments, each checked with a message that says how to fix it."""
    if mode not in MODES:
        raise ValueError(f"unknown rollout correction {mode!r}; choose one of {list(MODES)}")
    if level not in LEVELS:
        raise ValueError(f"unknown rollout correction level {level!r}; choose one of {list(LEVELS)}")
    if mode in BANDED and level != "token":
        raise ValueError(f"rollout correction {mode} has its own level; level must be 'token', got {level!r}")
    if mode in BANDED and not 0 <= low < high:
        raise ValueError(f"rollout correction {mode} needs a band 0 <= low < high, got low={low}, high={high}")
    if not cap > 1:
        raise ValueError(f"rollout correction cap must be > 1, got {cap}")
    if not (old_logprobs.shape == behavior_logprobs.shape == mask.shape) or mask.dim() != 2:
        shapes = [tuple(t.shape) for t in (old_logprobs, behavior_logprobs, mask)]
        raise ValueError(f"old_logprobs, behavior_logprobs and mask must share one [B, T] shape, got {shapes}")


def _mode_weights(mode: str, log_rho: Tensor, log_rho_used: Tensor, keep: Tensor, cap: float, low: float,
                  high: float, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The weights w_t [B, T] of `mode` (padding left to the caller; mis and none in `dtype`), and where the ratio was
    capped and where masked ([B, T] bool). With rho_t = pi_old(x_t) / pi_behavior(x_t) (`log_rho`; `log_rho_used`:
    log prod_t' rho_t' on every token at the sequence level), cap C > 1 and a band [lo, hi]:
        tis, token:     w_t = min(rho_t, C)
        tis, sequence:  w_t = min(prod_t' rho_t', C) for every token of the sequence
        mis, token:     w_t = 1 if 1/C <= rho_t <= C else 0
        mis, sequence:  w_t = 1 if 1/C <= prod_t' rho_t' <= C else 0, for every token of the sequence
        icepop:         w_t = rho_t if lo <= rho_t <= hi else 0
                        (Ling Team 2025, "Every Step Evolves: Scaling RL for Trillion-Scale Thinking Model", IcePop)
        seq_mask_tis:   g = exp(mean_t' log rho_t') over the sequence's tokens (the geometric-mean ratio);
                        w_t = min(rho_t, C) if lo <= g <= hi else 0                    (NeMo-RL, OpenRLHF)"""
    log_cap = math.log(cap)
    capped = torch.zeros_like(keep)
    masked = torch.zeros_like(keep)
    if mode == "tis":
        weights = torch.exp(log_rho_used.clamp(max=log_cap))  # min(rho, C), without overflow for long sequences
        capped = log_rho_used > log_cap
    elif mode == "mis":
        masked = (log_rho_used > log_cap) | (log_rho_used < -log_cap)  # outside [1/C, C]
        weights = (~masked).to(dtype)
    elif mode == "icepop":
        masked = _outside(log_rho, low, high)
        # rho_t inside the band; the clamp only keeps exp() finite at the masked tokens it replaces
        weights = torch.where(masked, 0.0, torch.exp(log_rho.clamp(max=math.log(high))))
    elif mode == "seq_mask_tis":
        lengths = keep.sum(dim=1, keepdim=True).clamp(min=1)
        log_geo = log_rho.sum(dim=1, keepdim=True) / lengths  # [B, 1] log g = mean_t log rho_t
        masked = _outside(log_geo, low, high).expand_as(keep)  # the whole sequence, or none of it
        capped = (log_rho > log_cap) & ~masked
        weights = torch.where(masked, 0.0, torch.exp(log_rho.clamp(max=log_cap)))  # min(rho_t, C) on the rest
    else:
        weights = torch.ones_like(log_rho, dtype=dtype)
    return weights, capped, masked


def _outside(log_ratio: Tensor, low: float, high: float) -> Tensor:
    """Where exp(log_ratio) lies outside [low, high], compared in log space (low = 0: no lower bound)."""
    below = log_ratio < math.log(low) if low > 0 else torch.zeros_like(log_ratio, dtype=torch.bool)
    return below | (log_ratio > math.log(high))

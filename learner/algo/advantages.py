"""Advantage estimators: outcome rewards for groups of samples drawn from the same prompt, and PPO's GAE.

Owns turning one scalar reward per sequence into one advantage per sequence (GRPO, Dr.GRPO, RLOO, REINFORCE++),
spreading it over the sequence's tokens, and Generalized Advantage Estimation from per-token rewards and values.
Does not own the rewards themselves (`rewards/`), the policy and value losses (`losses.py`), or the layout of the
batch: callers pass rewards with each prompt's G samples consecutive.

Notation: B: sequences in the batch, T: tokens per sequence, G: samples per prompt (group size), B = N * G.
"""

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """View rewards [B] as [B / G, G]: row n holds the G consecutive samples of prompt n."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}; pass one reward per sequence")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"batch of {rewards.numel()} rewards is not divisible by group_size {group_size}; "
            f"pass whole groups of {group_size} samples per prompt"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    return rewards.view(-1, group_size)


def group_relative(rewards: Tensor, group_size: int, scale: str = "std", eps: float = 1e-6) -> Tensor:
    """Group-relative advantages: each reward minus its group's mean, optionally over the group's std.

    GRPO, Shao et al. 2024 ("DeepSeekMath", sec. 4.1.2, outcome supervision): A_i = (r_i - mean(r)) / std(r).
    scale="none" drops the division (Dr.GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training"), which
    removes the bias towards groups whose rewards barely differ.

    Args:
        rewards: [B] one reward per sequence; samples [n*G, (n+1)*G) form the group of prompt n.
        group_size: G, samples per prompt; B must be divisible by G.
        scale: "std" divides by the unbiased (Bessel-corrected) group std plus eps; "none" does not.
        eps: added to the std so groups whose rewards are all equal get advantage 0; must be > 0 for "std".

    Returns:
        [B] advantages, same order as rewards. A group of one sample gets 0 (its std is undefined; taken as 0).

    Notation: B: sequences, G: group size.
    """
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    if scale == "std" and eps <= 0:
        raise ValueError(f"eps must be > 0 with scale='std' (it keeps equal-reward groups at 0), got {eps}")
    grouped = _grouped(rewards, group_size)  # [B/G, G]
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # r_i - mean(r)
    if scale == "none":
        return centered.view(-1)
    if group_size == 1:
        std = torch.zeros_like(centered)  # torch.std of one sample is NaN; GRPO has no baseline to compare to
    else:
        std = grouped.std(dim=1, keepdim=True, correction=1)  # sqrt(sum (r_i - mean)^2 / (G - 1))
    return (centered / (std + eps)).view(-1)  # A_i = (r_i - mean(r)) / (std(r) + eps)


def rloo(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out advantages: each reward minus the mean of the other G-1 rewards of its group.

    Ahmadian et al. 2024 ("Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
    Feedback in LLMs", sec. 3; Kool et al. 2019): A_i = r_i - 1/(G-1) * sum_{j != i} r_j.

    Args:
        rewards: [B] one reward per sequence; samples [n*G, (n+1)*G) form the group of prompt n.
        group_size: G >= 2, samples per prompt; B must be divisible by G.

    Returns:
        [B] advantages, same order as rewards.

    Notation: B: sequences, G: group size.
    """
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2 (the baseline is the other samples' mean), got {group_size}")
    grouped = _grouped(rewards, group_size)  # [B/G, G]
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # 1/(G-1) sum_{j != i} r_j
    return (grouped - others_mean).view(-1)  # A_i = r_i - baseline_i


def reinforce_pp(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ with baseline: subtract the group mean, then whiten over the whole batch.

    Hu et al. 2025 ("REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both Prompt and Reward Models"):
        A'_i = r_i - mean_group(r),  A_i = (A'_i - mean_batch(A')) / (std_batch(A') + eps).
    The batch-level std (rather than GRPO's per-group std) keeps groups with nearly equal rewards from being
    blown up.

    Args:
        rewards: [B] one reward per sequence; samples [n*G, (n+1)*G) form the group of prompt n.
        group_size: G, samples per prompt; B must be divisible by G.
        eps: added to the batch std so a batch whose centered rewards are all equal gets 0; must be > 0.

    Returns:
        [B] advantages, same order as rewards. A batch of one sequence gets 0 (its std is undefined; taken as 0).

    Notation: B: sequences, G: group size.
    """
    if eps <= 0:
        raise ValueError(f"eps must be > 0 (it keeps a constant batch at 0), got {eps}")
    grouped = _grouped(rewards, group_size)  # [B/G, G]
    centered = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)  # A'_i = r_i - mean_group(r)
    if centered.numel() < 2:
        return torch.zeros_like(centered)  # torch.std of one sample is NaN
    std = centered.std(correction=1)  # unbiased batch std of A'
    return (centered - centered.mean()) / (std + eps)  # A_i = (A'_i - mean(A')) / (std(A') + eps)


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation over each sequence's response tokens.

    Schulman et al. 2016 ("High-Dimensional Continuous Control Using Generalized Advantage Estimation", eq. 16):
        delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1},  R_t = A_t + V_t,
    with V and A after the last response token taken as 0 (the episode ends there).

    Args:
        token_rewards: [B, T] reward of each response token (e.g. the outcome reward on the last one, minus KL).
        values: [B, T] critic's V(s_t) at each response token.
        mask: [B, T] 1 (or True) at response tokens, 0 at padding; each row's response tokens are contiguous
            (right-padded). Padding may hold any finite or non-finite value in rewards and values.
        gamma: discount factor in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        advantages: [B, T] A_t at response tokens, 0 at padding.
        returns: [B, T] R_t = A_t + V_t at response tokens (the value target), 0 at padding.

    Notation: B: sequences, T: tokens.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or values.dim() != 2:
        shapes = [tuple(x.shape) for x in (token_rewards, values, mask)]
        raise ValueError(f"token_rewards, values and mask must share one [B, T] shape, got {shapes}")
    if not (0 <= gamma <= 1 and 0 <= lam <= 1):
        raise ValueError(f"need gamma and lam in [0, 1], got gamma={gamma}, lam={lam}")
    keep = mask.bool()
    # Select padding out first so its garbage cannot leak into a response token through gamma * V_{t+1}.
    rewards = torch.where(keep, token_rewards, 0.0)
    values = torch.where(keep, values, 0.0)
    if values.shape[1] == 0:
        return torch.zeros_like(values), torch.zeros_like(values)
    lastgaelam = values.new_zeros(values.shape[0])  # [B] A_{t+1}
    nextvalues = values.new_zeros(values.shape[0])  # [B] V_{t+1}
    advantages_reversed = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]  # delta_t = r_t + gamma V_{t+1} - V_t
        lastgaelam = delta + gamma * lam * lastgaelam  # A_t = delta_t + gamma lam A_{t+1}
        # Padding after the last response token resets both to 0: the episode ends there.
        lastgaelam = torch.where(keep[:, t], lastgaelam, 0.0)
        nextvalues = values[:, t]  # already 0 at padding
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)  # [B, T]
    returns = torch.where(keep, advantages + values, 0.0)  # R_t = A_t + V_t
    return advantages, returns


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Give every response token its sequence's advantage, and padding 0.

    Args:
        advantages: [B] one advantage per sequence.
        mask: [B, T] 1 (or True) for response tokens, 0 for padding.

    Returns:
        [B, T] advantages[b] at response tokens of sequence b, 0 at padding.

    Notation: B: sequences, T: tokens.
    """
    if advantages.dim() != 1 or mask.dim() != 2 or mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"need advantages [B] and mask [B, T], got {tuple(advantages.shape)} and {tuple(mask.shape)}"
        )
    return advantages.unsqueeze(1) * mask.to(advantages.dtype)  # A_{b,t} = A_b * m_{b,t}


# The config's names for the estimators; one signature: (rewards [B], group_size) -> advantages [B].
ADVANTAGE_ESTIMATORS: dict[str, Callable[[Tensor, int], Tensor]] = {
    "grpo": partial(group_relative, scale="std"),
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
}

"""Advantage estimators: outcome rewards for groups of samples drawn from the same prompt, and PPO's GAE.

Owns turning one scalar reward per sequence into one advantage per sequence (GRPO, Dr.GRPO, RLOO, REINFORCE++),
spreading it over the sequence's tokens, Generalized Advantage Estimation from per-token rewards and values,
REINFORCE's Monte-Carlo returns with its baselines, on-policy distillation's per-token advantage from a teacher's
logprobs, masked whitening, and the registry that runs every estimator (GAE included) through one signature:
AdvantageInputs -> Advantages; running any of them on the model's tokens of multi-turn episodes (`on_model_tokens`:
the environment's tokens taken out of each row, `compact`, and the results put back, `uncompact`). Does not own the
rewards themselves (`rewards/`), the KL penalty's estimate (`losses.kl`), the policy and value losses (`losses.py`),
or the layout of the batch: callers pass rewards with each prompt's G samples consecutive.

Notation: B: sequences in the batch, T: tokens per sequence, G: samples per prompt (group size), B = N * G.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

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


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Shift and scale values to mean 0 and std 1 over the response tokens of the whole batch.

    As PPO implementations whiten GAE advantages (openai/baselines ppo2; verl and OpenRLHF `masked_whiten`):
        A'_t = (A_t - mean(A)) / (std(A) + eps),  mean and Bessel-corrected std over the tokens where mask is 1.

    Args:
        values: [B, T] per-token values; padding may hold anything, inf and NaN included (selected out with
            torch.where, so it changes neither the statistics nor the result, and gets no gradient).
        mask: [B, T] 1 (or True) at response tokens, 0 at padding.
        eps: added to the std so constant values give 0 rather than NaN; must be > 0.

    Returns:
        [B, T] whitened values at response tokens, 0 at padding. With fewer than 2 response tokens the std is
        undefined and the result is all 0.

    Notation: B: sequences, T: tokens.
    """
    if values.shape != mask.shape:
        raise ValueError(f"values and mask must share one shape, got {tuple(values.shape)} and {tuple(mask.shape)}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0 (it keeps constant values at 0), got {eps}")
    if not values.is_floating_point():
        values = values.to(torch.get_default_dtype())
    keep = mask.bool()
    count = keep.sum()  # n, response tokens in the batch
    mean = torch.where(keep, values, 0.0).sum() / count.clamp(min=1)  # 1/n sum_t m_t v_t
    centered = torch.where(keep, values - mean, 0.0)  # v_t - mean at response tokens, 0 (not inf - mean) elsewhere
    var = centered.square().sum() / (count - 1).clamp(min=1)  # sum (v_t - mean)^2 / (n - 1)
    # sqrt's gradient at 0 is inf (and 0 * inf = NaN): take the root of 1 there instead, then put 0 back.
    std = torch.where(var > 0, torch.where(var > 0, var, 1.0).sqrt(), 0.0)  # std = sqrt(var)
    whitened = centered / (std + eps)  # (v_t - mean) / (std + eps)
    return torch.where(keep & (count >= 2), whitened, 0.0)  # n < 2: std undefined, all 0


def last_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence's outcome reward on its last response token, for estimators that read per-token rewards.

    Args:
        rewards: [B] one reward per sequence.
        mask: [B, T] 1 (or True) at response tokens, 0 at padding; the last 1 of a row is where the sequence ends
            (a multi-turn episode's loss mask, with holes at the environment's tokens: its last model token).

    Returns:
        [B, T] rewards[b] at the last response token of row b, 0 elsewhere. A row with no response token is all 0:
        there is no token to carry its reward, so that reward is dropped.

    Notation: B: sequences, T: tokens.
    """
    if rewards.dim() != 1 or mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"need rewards [B] and mask [B, T], got {tuple(rewards.shape)} and {tuple(mask.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    keep = mask.bool()
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)  # no token to carry any reward
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(keep)  # [B, T] column index t
    last = torch.where(keep, positions, -1).amax(dim=1, keepdim=True)  # [B, 1] last response token, -1 if none
    is_last = keep & (positions == last)  # [B, T]; an empty row has last = -1 and no True
    return torch.where(is_last, rewards.unsqueeze(1), 0.0)  # r_{b,t} = r_b at t = last response token of b


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Monte-Carlo returns of each response token: the discounted sum of the rewards from it to the sequence's end.

    REINFORCE (Williams 1992; Sutton & Barto, 2nd ed., sec. 13.3): G_t = sum_{s >= t} gamma^(s - t) r_s, computed
    backwards as G_t = r_t + gamma G_{t+1}, with G after the last response token taken as 0 (the episode ends there).

    Args:
        token_rewards: [B, T] reward of each response token (the outcome reward on the last one, minus any per-token
            penalty, plus any step rewards); padding may hold anything.
        mask: [B, T] 1 (or True) at response tokens, 0 at padding; each row's response tokens are contiguous
            (right-padded).
        gamma: discount factor in [0, 1].

    Returns:
        [B, T] G_t at response tokens, 0 at padding.

    Notation: B: sequences, T: tokens.
    """
    if token_rewards.shape != mask.shape or mask.dim() != 2:
        shapes = [tuple(x.shape) for x in (token_rewards, mask)]
        raise ValueError(f"token_rewards and mask must share one [B, T] shape, got {shapes}")
    if not 0 <= gamma <= 1:
        raise ValueError(f"need gamma in [0, 1], got {gamma}")
    if not token_rewards.is_floating_point():
        token_rewards = token_rewards.to(torch.get_default_dtype())
    keep = mask.bool()
    rewards = torch.where(keep, token_rewards, 0.0)  # padding's garbage cannot reach a response token
    following = rewards.new_zeros(rewards.shape[0])  # [B] G_{t+1}
    returns = []
    for t in reversed(range(rewards.shape[1])):
        following = torch.where(keep[:, t], rewards[:, t] + gamma * following, 0.0)  # G_t = r_t + gamma G_{t+1}
        returns.append(following)
    return torch.stack(returns[::-1], dim=1) if returns else rewards.clone()


def first_token_values(values: Tensor, mask: Tensor) -> Tensor:
    """[B] each row's value at its first response token (0 for a row without one)."""
    keep = mask.bool()
    first = keep.int().argmax(dim=1, keepdim=True)  # [B, 1] the first 1 of each row (0 when there is none)
    return torch.where(keep.any(dim=1), values.gather(1, first)[:, 0], 0.0)


def reinforce(returns: Tensor, mask: Tensor, group_size: int, baseline: str,
              values: Tensor | None = None) -> Tensor:
    """REINFORCE advantages: each token's return minus a baseline.

    A_t = G_t - b, with b (any b that does not depend on the sampled tokens keeps the gradient unbiased):
        none: 0;
        batch_mean: the mean over the batch's sequences of their return at the first response token (G_0: the
            sequence's discounted total reward, its "average reward" when gamma = 1);
        group_mean: the same mean over the G sequences of the row's prompt;
        value: the value model's V(s_t) at each token (trained on G_t, as PPO's critic on its returns).

    Args:
        returns: [B, T] G_t at response tokens (see discounted_returns).
        mask: [B, T] 1 (or True) at response tokens, 0 at padding.
        group_size: G; each prompt's G samples are consecutive rows.
        baseline: "none" | "batch_mean" | "group_mean" | "value".
        values: [B, T] V(s_t), needed by "value" only.

    Returns:
        [B, T] A_t at response tokens, 0 at padding.

    Notation: B: sequences, T: tokens, G: group size.
    """
    keep = mask.bool()
    if baseline == "none":
        b = torch.zeros_like(returns)
    elif baseline in ("batch_mean", "group_mean"):
        starts = first_token_values(returns, mask)  # [B] G_0 of each sequence
        if baseline == "batch_mean":
            b = starts.mean().expand(returns.shape[0])  # [B] one baseline for the batch
        else:
            b = _grouped(starts, group_size).mean(dim=1, keepdim=True).expand(-1, group_size).reshape(-1)  # [B]
        b = b.unsqueeze(1).expand_as(returns)
    elif baseline == "value":
        if values is None or values.shape != returns.shape:
            raise ValueError("baseline 'value' needs values: the critic's [B, T] V(s_t), the shape of returns")
        b = values
    else:
        raise ValueError(f"baseline must be 'none', 'batch_mean', 'group_mean' or 'value', got {baseline!r}")
    return torch.where(keep, returns - b, 0.0)  # A_t = G_t - b


def process_group_relative(step_rewards: Tensor, step_ends: Tensor, mask: Tensor, group_size: int,
                           scale: str = "std", eps: float = 1e-6) -> Tensor:
    """GRPO with process supervision: per-step rewards, normalised over the group, summed from each token onwards.

    Shao et al. 2024 ("DeepSeekMath", sec. 4.1.3): every step j of every output of a group has a reward r_j, taken
    at the step's last token index(j); each is normalised with the mean and std of all the group's step rewards,
    r~_j = (r_j - mean(R)) / std(R), and a token's advantage is the sum of the normalised rewards of the steps that
    end at or after it: A_t = sum_{index(j) >= t} r~_j.

    Args:
        step_rewards: [B, T] step j's reward at the token that ends it; anything elsewhere (selected out).
        step_ends: [B, T] 1 (or True) at the tokens that end a step (each a response token), 0 elsewhere.
        mask: [B, T] 1 (or True) at response tokens, 0 at padding; right-padded.
        group_size: G; each prompt's G samples are consecutive rows.
        scale: "std" divides by the std as above; "none" only centres, r~_j = r_j - mean(R) (Dr.GRPO's choice).
        eps: added to the std (Bessel-corrected over the group's steps) so a group whose step rewards are all equal
            gets 0; must be > 0.

    Returns:
        [B, T] A_t at response tokens (0 after a row's last step end, and at padding). With scale "std" a group with
        fewer than two steps in all gets 0 (its std is undefined).

    Notation: B: sequences, T: tokens, G: group size.
    """
    if not (step_rewards.shape == step_ends.shape == mask.shape) or mask.dim() != 2:
        shapes = [tuple(x.shape) for x in (step_rewards, step_ends, mask)]
        raise ValueError(f"step_rewards, step_ends and mask must share one [B, T] shape, got {shapes}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0 (it keeps equal step rewards at 0), got {eps}")
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    ends = step_ends.bool()
    if (ends & ~mask.bool()).any():
        raise ValueError("a step ends at a token that is not a response token (step_ends outside mask)")
    if not step_rewards.is_floating_point():
        step_rewards = step_rewards.to(torch.get_default_dtype())
    rewards = torch.where(ends, step_rewards, 0.0)
    grouped_rewards = _grouped_rows(rewards, group_size)  # [B/G, G*T]
    grouped_ends = _grouped_rows(ends, group_size)
    count = grouped_ends.sum(dim=1, keepdim=True)  # [B/G, 1] steps in the group
    mean = grouped_rewards.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = torch.where(grouped_ends, grouped_rewards - mean, 0.0)
    if scale == "std":
        std = (centered.square().sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        normalised = torch.where(grouped_ends & (count >= 2), centered / (std + eps), 0.0)  # r~_j
    else:
        normalised = centered  # r_j - mean(R)
    normalised = normalised.view_as(rewards)
    # A_t = sum over steps ending at t' >= t: a reverse cumulative sum along the row.
    advantages = normalised.flip(1).cumsum(1).flip(1)
    return torch.where(mask.bool(), advantages, 0.0)


def _grouped_rows(values: Tensor, group_size: int) -> Tensor:
    """View [B, T] as [B / G, G * T]: row n holds the G consecutive rows of prompt n."""
    if group_size < 1 or values.shape[0] % group_size:
        raise ValueError(f"batch of {values.shape[0]} rows is not divisible by group_size {group_size}; pass whole "
                         f"groups of {group_size} samples per prompt")
    return values.reshape(values.shape[0] // group_size, -1)


def compact(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Gather each row's masked entries to the left, in order, and right-pad: a multi-turn episode's model tokens as
    one contiguous sequence, the environment's tokens between them taken out.

    Args:
        values: [B, T] of any dtype.
        mask: [B, T] 1 (or True) at the entries to keep, anywhere in the row (holes allowed).

    Returns:
        compacted: [B, K] row b's kept entries in their order, then 0 (False); K: the most entries kept in one row.
        index: [B, K] long, the column of `values` each compacted entry came from, T at padding (no column): the
            compacted mask is index < T, and uncompact(compacted, index, T) puts every entry back.

    Notation: B: rows, T: columns, K: kept entries of the fullest row.
    """
    if values.shape != mask.shape or mask.dim() != 2:
        raise ValueError(f"need values and mask of one [B, T] shape, got {tuple(values.shape)}, {tuple(mask.shape)}")
    keep = mask.bool()
    width = int(keep.sum(dim=1).max()) if keep.numel() else 0
    # A stable sort on "not kept" lists each row's kept columns first, in their order, then the others.
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]  # [B, K]
    kept = keep.gather(1, order)  # [B, K] False past the row's own count
    return values.gather(1, order).masked_fill(~kept, 0), torch.where(kept, order, mask.shape[1])


def uncompact(compacted: Tensor, index: Tensor, length: int) -> Tensor:
    """The inverse of `compact`: each compacted entry back at its column `index`, 0 in every other column.

    Args:
        compacted: [B, K] values in the compacted layout (what lies at padding, index == length, is dropped).
        index: [B, K] long, `compact`'s index: a column in [0, length), or length at padding.
        length: T, the columns of the result.

    Returns:
        [B, T] out[b, index[b, k]] = compacted[b, k], 0 elsewhere.

    Notation: B: rows, T: columns, K: compacted columns.
    """
    if compacted.shape != index.shape or index.dim() != 2:
        raise ValueError(f"need compacted and index of one [B, K] shape, got {tuple(compacted.shape)}, "
                         f"{tuple(index.shape)}")
    out = compacted.new_zeros(compacted.shape[0], length + 1)  # column T takes the padding, then is cut off
    return out.scatter(1, index, compacted)[:, :length]


def carry_to_model_tokens(values: Tensor, response_mask: Tensor, loss_mask: Tensor) -> Tensor:
    """Move what lies on the environment's tokens of an episode to the model token before them (adding it there).

    Per-token rewards and step ends belong on tokens the model sampled: a step that ends inside the environment's
    output (or the episode's last token, when the environment spoke last) ends, for training, at the last model
    token before it; two step ends landing on one token make one step, their rewards summed.

    Args:
        values: [B, T] float, per response token (step rewards, or 1 at step ends).
        response_mask: [B, T] 1 (or True) at response tokens, 0 elsewhere (what lies there is dropped).
        loss_mask: [B, T] 1 (or True) at the response tokens the model sampled.

    Returns:
        [B, T] at each model token t: values[t] plus the values of the non-model response tokens after t up to the
        next model token; 0 elsewhere. Response tokens before a row's first model token have no model token to carry
        them to: dropped.

    Notation: B: sequences, T: tokens.
    """
    if not (values.shape == response_mask.shape == loss_mask.shape) or values.dim() != 2:
        shapes = [tuple(x.shape) for x in (values, response_mask, loss_mask)]
        raise ValueError(f"values, response_mask and loss_mask must share one [B, T] shape, got {shapes}")
    keep = loss_mask.bool()
    columns = torch.arange(values.shape[1], device=values.device).expand_as(keep)
    latest = torch.where(keep, columns, -1).cummax(dim=1).values  # [B, T] the last model token at or before t
    carried = torch.where(response_mask.bool() & (latest >= 0), values, 0.0)
    return torch.zeros_like(carried).scatter_add(1, latest.clamp(min=0), carried)  # v'_s = sum_{latest(t) = s} v_t


@dataclass(frozen=True)
class AdvantageInputs:
    """What every advantage estimator reads; fields an estimator does not use are ignored by it.

    Notation: B: sequences, T: tokens, G: group size.
    """

    # [B, T] the sequence's outcome reward on its last response token (see last_token_rewards), minus any per-token
    # penalty (e.g. KL in reward). Critic-free estimators use its sum over each sequence's tokens as the reward.
    token_rewards: Tensor
    mask: Tensor  # [B, T] 1 at response tokens
    group_size: int  # G; each prompt's G samples are consecutive rows
    values: Tensor | None = None  # [B, T] critic values (gae, and reinforce with the value baseline)
    gamma: float = 1.0  # gae and reinforce
    lam: float = 1.0  # gae only
    scale: str = "std"  # grpo only: "std" | "none" (Dr.GRPO)
    baseline: str = "none"  # reinforce only: "none" | "batch_mean" | "group_mean" | "value"
    # [B, T] True at the tokens that end a step (process supervision; each row's last response token among them), or
    # None. grpo then normalises the rewards at step ends over the group (process_group_relative); gae and reinforce
    # read token_rewards as they are (step rewards on step ends); rloo and reinforce_pp do not take steps.
    step_ends: Tensor | None = None
    # [B, T] on-policy distillation's per-token log-ratio log pi_teacher(x_t) - log pi(x_t) (`distill_log_ratios`), or
    # None; read by `distill` alone, whatever `distill_discount` discounts it by.
    distill: Tensor | None = None
    distill_discount: float = 0.0


class Advantages(NamedTuple):
    """What every advantage estimator returns. Notation: B: sequences, T: tokens."""

    advantages: Tensor  # [B, T], 0 at padding
    returns: Tensor | None  # [B, T] value targets (gae), G_t (reinforce), None for the sequence-level estimators


def sequence_rewards(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """Each sequence's reward: the sum of its token rewards over response tokens (padding selected out).

    With token_rewards = last_token_rewards(r) - beta * kl_t this is R_b = r_b - beta * sum_t kl_{b,t}: the
    per-token KL penalty of "KL in reward" (Ouyang et al. 2022, eq. 2) summed over the sequence.

    Args:
        token_rewards: [B, T] per-token rewards; padding may hold anything.
        mask: [B, T] 1 (or True) at response tokens, 0 at padding.

    Returns:
        [B] R_b = sum_t m_{b,t} r_{b,t}.

    Notation: B: sequences, T: tokens.
    """
    if token_rewards.shape != mask.shape or mask.dim() != 2:
        shapes = [tuple(x.shape) for x in (token_rewards, mask)]
        raise ValueError(f"token_rewards and mask must share one [B, T] shape, got {shapes}")
    if not token_rewards.is_floating_point():
        token_rewards = token_rewards.to(torch.get_default_dtype())
    return torch.where(mask.bool(), token_rewards, 0.0).sum(dim=1)  # R_b = sum_t m_t r_t


def grpo_advantages(inputs: AdvantageInputs) -> Advantages:
    """GRPO (scale "std") or Dr.GRPO (scale "none") on the sequence rewards, spread over each sequence's tokens; with
    step ends, process supervision: the rewards at step ends (the outcome reward counts as the last step's) normalised
    over the group's steps and summed from each token on (process_group_relative)."""
    if inputs.step_ends is not None:
        return Advantages(process_group_relative(inputs.token_rewards, inputs.step_ends, inputs.mask,
                                                 inputs.group_size, scale=inputs.scale), None)
    rewards = sequence_rewards(inputs.token_rewards, inputs.mask)
    advantages = group_relative(rewards, inputs.group_size, scale=inputs.scale)
    return Advantages(broadcast_to_tokens(advantages, inputs.mask), None)


def rloo_advantages(inputs: AdvantageInputs) -> Advantages:
    """RLOO on the sequence rewards, spread over each sequence's tokens."""
    rewards = sequence_rewards(inputs.token_rewards, inputs.mask)
    return Advantages(broadcast_to_tokens(rloo(rewards, inputs.group_size), inputs.mask), None)


def reinforce_pp_advantages(inputs: AdvantageInputs) -> Advantages:
    """REINFORCE++ on the sequence rewards, spread over each sequence's tokens."""
    rewards = sequence_rewards(inputs.token_rewards, inputs.mask)
    return Advantages(broadcast_to_tokens(reinforce_pp(rewards, inputs.group_size), inputs.mask), None)


def gae_advantages(inputs: AdvantageInputs) -> Advantages:
    """GAE from token_rewards and the critic's values; advantages whitened over the batch, returns not.

    PPO as in verl and OpenRLHF: A = masked_whiten(gae(...).advantages) for the policy loss, while the critic
    regresses on the unwhitened R_t = A_t + V_t (whitening them would change the value target's scale).
    """
    if inputs.values is None:
        raise ValueError(
            "advantage estimator 'gae' needs values (the critic's [B, T] V(s_t)); pass them in AdvantageInputs.values"
        )
    advantages, returns = gae(inputs.token_rewards, inputs.values, inputs.mask, inputs.gamma, inputs.lam)
    return Advantages(masked_whiten(advantages, inputs.mask), returns)


def reinforce_advantages(inputs: AdvantageInputs) -> Advantages:
    """REINFORCE: per-token discounted returns minus the baseline (not whitened); the returns come back too (the
    critic's targets with the value baseline, and the `returns/mean` metric)."""
    returns = discounted_returns(inputs.token_rewards, inputs.mask, inputs.gamma)
    advantages = reinforce(returns, inputs.mask, inputs.group_size, inputs.baseline, inputs.values)
    return Advantages(advantages, returns)


def distill_log_ratios(teacher_logprobs: Tensor, logprobs: Tensor, mask: Tensor) -> Tensor:
    """On-policy distillation's per-token signal: how much likelier the teacher finds each sampled token than the
    policy does.

    Agarwal et al. 2024 ("On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes", GKD with
    the reverse KL); Thinking Machines 2025 ("On-Policy Distillation"): on the policy's own samples x ~ pi,
    d_t = log pi_T(x_t | x_<t) - log pi(x_t | x_<t), minus the single-sample (k1) estimate of the per-token reverse
    KL(pi || pi_T). Used as an advantage, its policy gradient is that of -KL(pi || pi_T) summed over the tokens.

    Args:
        teacher_logprobs: [B, T] log pi_T of the sampled tokens; padding may hold anything.
        logprobs: [B, T] log pi of the same tokens (the policy before the update); padding may hold anything.
        mask: [B, T] 1 (or True) at the tokens trained on, 0 elsewhere.

    Returns:
        [B, T] d_t at masked tokens, 0 elsewhere.

    Notation: B: sequences, T: tokens.
    """
    if teacher_logprobs.shape != logprobs.shape or logprobs.shape != mask.shape or mask.dim() != 2:
        shapes = [tuple(x.shape) for x in (teacher_logprobs, logprobs, mask)]
        raise ValueError(f"teacher_logprobs, logprobs and mask must share one [B, T] shape, got {shapes}")
    return torch.where(mask.bool(), teacher_logprobs.float() - logprobs.float(), 0.0)  # d_t = log pi_T - log pi


def distill_advantages(inputs: AdvantageInputs) -> Advantages:
    """On-policy distillation: each token's advantage is the discounted sum of the log-ratios from it on,
    A_t = sum_{s >= t} gamma_d^(s - t) d_s (`distill_discount` = gamma_d; 0: A_t = d_t, each token credited with its
    own, as Thinking Machines do; 1: with everything the teacher thinks of the rest of the sequence). Not centred
    or scaled: d_t already compares two models on one token, and a constant shift would reward length."""
    if inputs.distill is None:
        raise ValueError("advantage estimator 'distill' needs the teacher's per-token log-ratios (AdvantageInputs."
                         "distill, from distill_log_ratios); set teacher.path and learner.distill_coef > 0")
    if inputs.distill_discount == 0:  # the recursion's result without its loop over T
        return Advantages(torch.where(inputs.mask.bool(), inputs.distill, 0.0), None)
    return Advantages(discounted_returns(inputs.distill, inputs.mask, inputs.distill_discount), None)


def on_model_tokens(estimator: Callable[[AdvantageInputs], Advantages], inputs: AdvantageInputs) -> Advantages:
    """Run `estimator` on each row's model tokens gathered to the left (`compact` by inputs.mask, which may have
    holes), and put its advantages and returns back at their tokens (`uncompact`; 0 at every other position).

    Multi-turn episodes interleave the model's tokens with the environment's. The estimators take a row's masked
    tokens as one contiguous sequence (GAE's and the returns' recursions stop at the first 0, the outcome goes on the
    last 1); compacted, turn k's last model token is followed by turn k+1's first, as verl's multi-turn GAE skips
    observation tokens: gamma and lambda discount per model token, and V at a model token is the critic's value of
    the state with every earlier token, the environment's included, in context. token_rewards, values, step_ends
    and distill are read at model tokens only (`carry_to_model_tokens` moves what lies elsewhere first).

    Args:
        estimator: an ADVANTAGE_ESTIMATORS entry.
        inputs: its inputs, `mask` [B, T] 1 at the model's tokens.

    Returns:
        The estimator's Advantages, [B, T], 0 wherever inputs.mask is 0.

    Notation: B: sequences, T: tokens.
    """
    length = inputs.mask.shape[1]
    token_rewards, index = compact(inputs.token_rewards, inputs.mask)
    mask = (index < length).to(inputs.mask.dtype)  # [B, K] each row's model tokens, right-padded

    def compacted(values: Tensor | None) -> Tensor | None:
        return None if values is None else compact(values, inputs.mask)[0]

    estimate = estimator(replace(inputs, token_rewards=token_rewards, mask=mask, values=compacted(inputs.values),
                                 step_ends=compacted(inputs.step_ends), distill=compacted(inputs.distill)))
    returns = None if estimate.returns is None else uncompact(estimate.returns, index, length)
    return Advantages(uncompact(estimate.advantages, index, length), returns)


# The config's names for the estimators; one signature: AdvantageInputs -> Advantages ([B, T], 0 at padding).
ADVANTAGE_ESTIMATORS: dict[str, Callable[[AdvantageInputs], Advantages]] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "gae": gae_advantages,
    "reinforce": reinforce_advantages,
    "distill": distill_advantages,
}


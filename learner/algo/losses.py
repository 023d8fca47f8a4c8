"""Per-token policy losses, KL estimators, and the reduction of [B, T] token values to one scalar loss.

Owns the PPO clipped surrogate (with DAPO's asymmetric clip range and the optional dual clip), GSPO's
sequence-level surrogate, the plain policy-gradient (REINFORCE) loss and CISPO's clipped-weight policy gradient (the
four share one signature in POLICY_LOSSES), PPO's clipped value loss, the entropy
bonus, the k1/k2/k3 KL estimators, the aggregation modes the config names, and the weights that make micro-batch
losses sum to the whole batch's. Does not own advantages (`advantages.py`), computing log-probabilities from
logits (`logprobs.py`), nor the optimiser step or micro-batch loop (`learner/`).

Notation: B: sequences, T: tokens (response positions). mask [B, T] is 1 (or True) at response tokens, 0 at
padding; padding may hold any finite value and never changes a result or receives gradient.
"""

from collections.abc import Callable

import torch
from torch import Tensor


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log pi(x) - log pi_ref(x): unbiased for KL(pi || pi_ref) with x ~ pi, high variance, can be < 0."""
    return logprobs - ref_logprobs  # k1 = -log r, r = pi_ref / pi


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = 1/2 (log pi(x) - log pi_ref(x))^2: biased, low variance, >= 0."""
    return 0.5 * (logprobs - ref_logprobs).square()  # k2 = 1/2 (log r)^2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = pi_ref/pi - log(pi_ref/pi) - 1: unbiased for KL(pi || pi_ref) with x ~ pi, low variance, >= 0."""
    log_r = ref_logprobs - logprobs  # log r, r = pi_ref / pi
    return torch.exp(log_r) - log_r - 1  # k3 = (r - 1) - log r


def kl(logprobs: Tensor, ref_logprobs: Tensor, estimator: str, mask: Tensor | None = None) -> Tensor:
    """Elementwise estimate of KL(pi || pi_ref) from the log-probabilities of tokens sampled from pi.

    Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html), with r = pi_ref / pi:
    k1 = -log r, k2 = 1/2 (log r)^2, k3 = (r - 1) - log r.

    Args:
        logprobs: [B, T] log pi(x_t) under the policy the samples are scored against (the first argument).
        ref_logprobs: [B, T] log pi_ref(x_t) under the reference policy.
        estimator: "k1", "k2" or "k3" (a key of KL_ESTIMATORS).
        mask: optional [B, T]; where 0 the result is 0 and no gradient flows, whatever the inputs hold there
            (without it, a large garbage log-ratio in padding gives exp(...) = inf and a NaN gradient).

    Returns:
        [B, T] per-token KL estimates (any shape works: the estimators are elementwise).

    Notation: B: sequences, T: tokens.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {sorted(KL_ESTIMATORS)}")
    if mask is not None:
        # Zero both inputs at padding before the exp, so padding gives log r = 0, k = 0 and a zero gradient.
        keep = mask.bool()
        logprobs = torch.where(keep, logprobs, 0.0)
        ref_logprobs = torch.where(keep, ref_logprobs, 0.0)
    return KL_ESTIMATORS[estimator](logprobs, ref_logprobs)


def aggregate(values: Tensor, mask: Tensor, mode: str, norm_length: int | None = None) -> Tensor:
    """Reduce per-token values (losses, KL) to one scalar, counting only response tokens.

    Modes (m: mask, v: values, L: norm_length, B: all sequences, S: sequences with >= 1 token):
        token-mean:              sum_bt v*m / sum_bt m           (each token weighs the same; DAPO, Yu et al. 2025)
        seq-mean-token-mean:     1/|S| sum_{b in S} (sum_t v*m / sum_t m)   (each sequence weighs the same; GRPO)
        seq-mean-token-sum:      1/B sum_b sum_t v*m             (long sequences weigh more)
        seq-mean-token-sum-norm: sum_bt v*m / (B * L)            (constant normaliser; Dr.GRPO, Liu et al. 2025)

    Args:
        values: [B, T] per-token values; padding may hold any value (selected out by torch.where, not multiplied).
        mask: [B, T] 1 (or True) at response tokens, 0 at padding.
        mode: one of AGGREGATION_MODES.
        norm_length: L, required (and > 0) for seq-mean-token-sum-norm, typically the max response length.

    Returns:
        [] scalar. With no response tokens at all it is 0, still attached to values' graph (zero gradient).

    Notation: B: sequences, T: tokens.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {list(AGGREGATION_MODES)}")
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(f"need values and mask of one shape [B, T], got {tuple(values.shape)}, {tuple(mask.shape)}")
    keep = mask.bool()
    masked = torch.where(keep, values, 0.0)  # v*m, but padding's inf/NaN cannot leak through 0 * inf
    num_sequences = max(values.shape[0], 1)  # clamps only the empty batch, whose sums are 0 anyway
    if mode == "token-mean":
        return masked.sum() / keep.sum().clamp(min=1)  # sum_bt v*m / sum_bt m
    if mode == "seq-mean-token-mean":
        tokens_per_seq = keep.sum(dim=1)  # [B]
        seq_means = masked.sum(dim=1) / tokens_per_seq.clamp(min=1)  # [B] sum_t v*m / sum_t m; 0 for empty rows
        return seq_means.sum() / (tokens_per_seq > 0).sum().clamp(min=1)  # mean over sequences in S
    if mode == "seq-mean-token-sum":
        return masked.sum() / num_sequences  # 1/B sum_b sum_t v*m
    if norm_length is None or norm_length <= 0:
        raise ValueError(
            f"mode 'seq-mean-token-sum-norm' needs norm_length > 0 (the max response length), got {norm_length}"
        )
    return masked.sum() / (num_sequences * norm_length)  # sum_bt v*m / (B * L)


def _check_policy_inputs(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
                         clip_high: float, need_2d: bool = False) -> None:
    """The checks both policy losses make: one [B, T] shape for the four tensors, a valid clip range."""
    if not (logprobs.shape == old_logprobs.shape == advantages.shape == mask.shape) or (need_2d and mask.dim() != 2):
        shapes = [tuple(t.shape) for t in (logprobs, old_logprobs, advantages, mask)]
        raise ValueError(f"logprobs, old_logprobs, advantages and mask must share one [B, T] shape, got {shapes}")
    if not (0 <= clip_low <= 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float | None = None,
    mode: str = "token-mean",
    norm_length: int | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss with an asymmetric clip range and optional dual clip.

    Schulman et al. 2017 ("Proximal Policy Optimization Algorithms", eq. 7), as a loss to minimise:
        r_t = exp(log pi(x_t) - log pi_old(x_t)),  l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high)).
    Asymmetric range (clip_high > clip_low lets unlikely tokens grow): DAPO "clip-higher", Yu et al. 2025.
    Dual clip, Ye et al. 2020 ("Mastering Complex Control in MOBA Games with Deep RL"), for A_t < 0 only:
        l_t = min(l_t, -A_t c), which bounds the loss when r_t is far above 1 on a bad token.

    Args:
        logprobs: [B, T] log pi(x_t) under the current policy (carries the gradient).
        old_logprobs: [B, T] log pi_old(x_t) under the policy before this update (no gradient needed).
        advantages: [B, T] per-token advantages (see advantages.broadcast_to_tokens).
        mask: [B, T] 1 (or True) at response tokens, 0 at padding.
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high]; 0 <= clip_low <= 1, clip_high >= 0.
        clip_c: dual-clip constant c > 1, or None for no dual clip.
        mode, norm_length: how l_t is reduced to a scalar, see aggregate().
        weights: optional [B, T] per-token factors w_t (no gradient) on l_t before the reduction: the rollout
            correction's importance weights (correction.rollout_correction); None: all 1.

    Returns:
        loss: [] scalar to minimise.
        metrics: detached [] tensors, each a mean over response tokens (whatever mode is):
            clip_fraction: share of tokens where the clipped term was the larger one (its gradient is 0),
            dual_clip_fraction: share of tokens where the dual clip bound was taken (0 when clip_c is None),
            ratio_mean: mean of r_t,
            approx_kl: k3 estimate of KL(pi_old || pi) on tokens sampled from pi_old: (r_t - 1) - log r_t.

    Notation: B: sequences, T: tokens.
    Long because the docstring gives the paper's equations and every argument's shape beside a computation of some
    thirty lines that reads as those equations; split, neither would read alone.
    """
    _check_policy_inputs(logprobs, old_logprobs, advantages, mask, clip_low, clip_high)
    if clip_c is not None and clip_c <= 1:
        raise ValueError(f"dual-clip constant clip_c must be > 1 (or None to disable it), got {clip_c}")

    keep = mask.bool()
    # Select padding out before exp(): its log-ratio becomes 0 (r = 1) and gets no gradient, whatever it held.
    log_ratio = torch.where(keep, logprobs - old_logprobs, 0.0)
    advantages = torch.where(keep, advantages, 0.0)
    ratio = torch.exp(log_ratio)  # r_t = pi(x_t) / pi_old(x_t)
    loss_unclipped = -advantages * ratio  # -A_t r_t
    loss_clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)  # -A_t clip(r_t, 1 - eps_low, 1 + eps_high)
    token_losses = torch.maximum(loss_unclipped, loss_clipped)  # l_t = -min(A_t r_t, A_t clip(r_t))
    clipped = loss_clipped > loss_unclipped
    dual_clipped = torch.zeros_like(clipped)
    if clip_c is not None:
        loss_dual = -advantages * clip_c  # -A_t c
        dual_clipped = (advantages < 0) & (loss_dual < token_losses)
        token_losses = torch.where(dual_clipped, loss_dual, token_losses)  # A_t < 0: l_t = min(l_t, -A_t c)
    if weights is not None:
        token_losses = token_losses * weights.detach()  # w_t l_t

    loss = aggregate(token_losses, mask, mode, norm_length)
    with torch.no_grad():
        metrics = {
            "clip_fraction": aggregate(clipped.to(ratio.dtype), mask, "token-mean"),
            "dual_clip_fraction": aggregate(dual_clipped.to(ratio.dtype), mask, "token-mean"),
            "ratio_mean": aggregate(ratio, mask, "token-mean"),
            "approx_kl": aggregate(ratio - 1 - log_ratio, mask, "token-mean"),  # k3 = (r - 1) - log r, x ~ pi_old
        }
    return loss, {name: value.detach() for name, value in metrics.items()}


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float | None = None,
    mode: str = "seq-mean-token-mean",
    norm_length: int | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: the clipped surrogate with one length-normalised importance ratio per sequence.

    Zheng et al. 2025 ("Group Sequence Policy Optimization", eq. 5-7), as a loss to minimise:
        s_i = exp(1/|y_i| sum_t (log pi(y_i,t) - log pi_old(y_i,t))),
        l_i = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high)).
    l_i is put on each of sequence i's response tokens and reduced like any token loss; the default mode,
    seq-mean-token-mean, gives the paper's mean of l_i over sequences, token-mean weighs l_i by |y_i|.
    Same signature as clipped_policy_loss, so both sit in POLICY_LOSSES.

    Args:
        logprobs: [B, T] log pi(y_t) under the current policy (carries the gradient).
        old_logprobs: [B, T] log pi_old(y_t) under the policy before this update.
        advantages: [B, T] the sequence's advantage A_i at each of its response tokens (see
            advantages.broadcast_to_tokens); the mean over the row's response tokens is taken as A_i.
        mask: [B, T] 1 (or True) at response tokens, 0 at padding.
        clip_low, clip_high: s_i is clipped to [1 - clip_low, 1 + clip_high]; 0 <= clip_low <= 1, clip_high >= 0.
        clip_c: must be None: the dual clip is a per-token bound of PPO, not defined for GSPO.
        mode, norm_length: how the token losses l_i are reduced to a scalar, see aggregate().
        weights: optional [B, T] per-token factors (no gradient) on the token losses before the reduction, as in
            clipped_policy_loss; None: all 1.

    Returns:
        loss: [] scalar to minimise (0 if no row has a response token).
        metrics: detached [] tensors: clipped_policy_loss's keys, meaning the same (means over response tokens),
        and two of the sequences (those with >= 1 token), which only GSPO has:
            clip_fraction: share of tokens whose sequence's clipped term was the larger one,
            dual_clip_fraction: 0 (no dual clip),
            ratio_mean: mean of the per-token ratios r_t = pi(y_t) / pi_old(y_t),
            approx_kl: mean of k3 = (r_t - 1) - log r_t,
            seq_clip_fraction: share of sequences whose clipped term was the larger one,
            seq_ratio_mean: mean of s_i.

    Notation: B: sequences, T: tokens.
    Long because the docstring gives the paper's equations and every argument's shape beside a computation of some
    thirty lines that reads as those equations; split, neither would read alone.
    """
    if clip_c is not None:
        raise ValueError(f"dual clip is not defined for gspo; unset clip_c (got {clip_c})")
    _check_policy_inputs(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, need_2d=True)

    keep = mask.bool()
    lengths = keep.sum(dim=1, keepdim=True)  # [B, 1] |y_i|
    # Select padding out before the sum and exp(), so its garbage neither changes s_i nor receives gradient.
    token_log_ratio = torch.where(keep, logprobs - old_logprobs, 0.0)  # [B, T] log r_t
    log_ratio = token_log_ratio.sum(dim=1, keepdim=True) / lengths.clamp(min=1)  # [B, 1] 1/|y_i| sum_t log r_t
    seq_advantages = torch.where(keep, advantages, 0.0).sum(dim=1, keepdim=True) / lengths.clamp(min=1)  # A_i
    ratio = torch.exp(log_ratio)  # [B, 1] s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|)
    loss_unclipped = -seq_advantages * ratio  # -A_i s_i
    loss_clipped = -seq_advantages * ratio.clamp(1 - clip_low, 1 + clip_high)  # -A_i clip(s_i)
    seq_losses = torch.maximum(loss_unclipped, loss_clipped)  # [B, 1] l_i = -min(A_i s_i, A_i clip(s_i))

    token_losses = seq_losses.expand_as(token_log_ratio)  # [B, T] l_i on every token of sequence i
    if weights is not None:
        token_losses = token_losses * weights.detach()
    loss = aggregate(token_losses, mask, mode, norm_length)
    has_tokens = lengths > 0  # [B, 1] sequences the sequence-level metrics average over
    with torch.no_grad():
        clipped = (loss_clipped > loss_unclipped).to(ratio.dtype)  # [B, 1]
        token_ratio = torch.exp(token_log_ratio)  # [B, T] r_t
        metrics = {
            "clip_fraction": aggregate(clipped.expand_as(token_log_ratio), mask, "token-mean"),
            "dual_clip_fraction": torch.zeros((), dtype=ratio.dtype, device=ratio.device),
            "ratio_mean": aggregate(token_ratio, mask, "token-mean"),
            # k3 = (r_t - 1) - log r_t per token, x ~ pi_old, as in clipped_policy_loss
            "approx_kl": aggregate(token_ratio - 1 - token_log_ratio, mask, "token-mean"),
            "seq_clip_fraction": aggregate(clipped, has_tokens, "token-mean"),
            "seq_ratio_mean": aggregate(ratio, has_tokens, "token-mean"),
        }
    return loss, {name: value.detach() for name, value in metrics.items()}


def vanilla_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float | None = None,
    mode: str = "token-mean",
    norm_length: int | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The plain policy-gradient (REINFORCE) loss: no ratio, no clipping.

    Williams 1992, as a loss to minimise: l_t = -A_t log pi(y_t), whose gradient -A_t grad log pi(y_t) is the
    REINFORCE estimator (equal to PPO's at r_t = 1, i.e. with one update per batch). Same signature as
    clipped_policy_loss (clip_low and clip_high are unused), so it sits in POLICY_LOSSES.

    Args:
        logprobs: [B, T] log pi(y_t) under the current policy (carries the gradient).
        old_logprobs: [B, T] log pi_old(y_t), for the metrics only.
        advantages: [B, T] per-token advantages (e.g. returns minus a baseline).
        mask: [B, T] 1 (or True) at response tokens, 0 at padding.
        clip_c: must be None (nothing is clipped).
        mode, norm_length: how l_t is reduced to a scalar, see aggregate().
        weights: optional [B, T] per-token factors w_t (no gradient) on l_t, as in clipped_policy_loss.

    Returns:
        loss: [] scalar to minimise.
        metrics: clipped_policy_loss's keys: clip_fraction and dual_clip_fraction 0, ratio_mean and approx_kl of
            r_t = pi(y_t) / pi_old(y_t) (how far the policy moved from pi_old, which the loss does not bound).

    Notation: B: sequences, T: tokens.
    """
    if clip_c is not None:
        raise ValueError(f"dual clip is not defined for the vanilla loss; unset clip_c (got {clip_c})")
    _check_policy_inputs(logprobs, old_logprobs, advantages, mask, clip_low, clip_high)
    keep = mask.bool()
    token_losses = -torch.where(keep, advantages, 0.0) * torch.where(keep, logprobs, 0.0)  # -A_t log pi(y_t)
    if weights is not None:
        token_losses = token_losses * weights.detach()  # w_t l_t
    loss = aggregate(token_losses, mask, mode, norm_length)
    with torch.no_grad():
        log_ratio = torch.where(keep, logprobs - old_logprobs, 0.0)
        ratio = torch.exp(log_ratio)
        zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
        metrics = {"clip_fraction": zero, "dual_clip_fraction": zero,
                   "ratio_mean": aggregate(ratio, mask, "token-mean"),
                   "approx_kl": aggregate(ratio - 1 - log_ratio, mask, "token-mean")}
    return loss, {name: value.detach() for name, value in metrics.items()}


def cispo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float | None = None,
    mode: str = "token-mean",
    norm_length: int | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: the policy gradient weighed by the clipped, detached importance ratio; no token loses its gradient.

    MiniMax 2025 ("MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", CISPO), as a loss
    to minimise:
        r_t = exp(log pi(x_t) - log pi_old(x_t)),  l_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t log pi(x_t).
    PPO's clip zeroes the gradient of a token whose ratio left the range; here the clip bounds only the token's
    weight, so rare tokens whose probability grows (reflection tokens, in the paper) keep contributing. At r_t = 1
    (one update per batch) the gradient is REINFORCE's and PPO's. Same signature as clipped_policy_loss.

    Args:
        logprobs: [B, T] log pi(x_t) under the current policy (carries the gradient).
        old_logprobs: [B, T] log pi_old(x_t) under the policy before this update (no gradient).
        advantages: [B, T] per-token advantages.
        mask: [B, T] 1 (or True) at response tokens, 0 at padding.
        clip_low, clip_high: the weight is r_t clipped to [1 - clip_low, 1 + clip_high]; 0 <= clip_low <= 1 (1: no
            lower bound, the paper's choice), clip_high >= 0.
        clip_c: must be None (no dual clip).
        mode, norm_length: how l_t is reduced to a scalar, see aggregate().
        weights: optional [B, T] per-token factors w_t (no gradient) on l_t, as in clipped_policy_loss.

    Returns:
        loss: [] scalar to minimise.
        metrics: clipped_policy_loss's keys, means over response tokens: clip_fraction the share of tokens whose
            weight was clipped (r_t outside the range; they keep a gradient), dual_clip_fraction 0, ratio_mean and
            approx_kl of r_t.

    Notation: B: sequences, T: tokens.
    """
    if clip_c is not None:
        raise ValueError(f"dual clip is not defined for cispo; unset clip_c (got {clip_c})")
    _check_policy_inputs(logprobs, old_logprobs, advantages, mask, clip_low, clip_high)
    keep = mask.bool()
    # Select padding out before exp(): its log-ratio becomes 0 (r = 1) and nothing there gets gradient.
    log_ratio = torch.where(keep, logprobs - old_logprobs, 0.0).detach()
    ratio = torch.exp(log_ratio)  # r_t = pi(x_t) / pi_old(x_t)
    clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)  # sg(clip(r_t, 1 - eps_low, 1 + eps_high))
    token_losses = -clipped_ratio * torch.where(keep, advantages, 0.0) * torch.where(keep, logprobs, 0.0)
    if weights is not None:
        token_losses = token_losses * weights.detach()  # w_t l_t
    loss = aggregate(token_losses, mask, mode, norm_length)
    with torch.no_grad():
        zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
        metrics = {"clip_fraction": aggregate((clipped_ratio != ratio).to(ratio.dtype), mask, "token-mean"),
                   "dual_clip_fraction": zero,
                   "ratio_mean": aggregate(ratio, mask, "token-mean"),
                   "approx_kl": aggregate(ratio - 1 - log_ratio, mask, "token-mean")}
    return loss, {name: value.detach() for name, value in metrics.items()}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float,
    mode: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss: the critic may not move further than clip from its old prediction for free.

    Schulman et al. 2017 (PPO; the value clipping of the reference implementation, openai/baselines ppo2):
        l_t = 1/2 max((V_t - R_t)^2, (clip(V_t, V_old_t - clip, V_old_t + clip) - R_t)^2).

    Args:
        values: [B, T] V(s_t) under the current critic (carries the gradient).
        old_values: [B, T] V_old(s_t) under the critic before this update (from the rollout).
        returns: [B, T] value targets R_t (see advantages.gae).
        mask: [B, T] 1 (or True) at response tokens, 0 at padding.
        clip: > 0, how far V may move from V_old before the clipped term takes over.
        mode, norm_length: how l_t is reduced to a scalar, see aggregate().

    Returns:
        loss: [] scalar to minimise.
        metrics: detached [] tensors, means over response tokens (whatever mode is):
            clip_fraction: share of tokens where the clipped term was the larger one.

    Notation: B: sequences, T: tokens.
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        shapes = [tuple(x.shape) for x in (values, old_values, returns, mask)]
        raise ValueError(f"values, old_values, returns and mask must share one [B, T] shape, got {shapes}")
    if clip <= 0:
        raise ValueError(f"value clip must be > 0, got {clip}")
    keep = mask.bool()
    # Select padding out so its garbage cannot give inf/NaN squares (and NaN gradients through 0 * inf).
    values = torch.where(keep, values, 0.0)
    old_values = torch.where(keep, old_values, 0.0)
    returns = torch.where(keep, returns, 0.0)
    values_clipped = old_values + (values - old_values).clamp(-clip, clip)  # clip(V, V_old - c, V_old + c)
    loss_unclipped = (values - returns).square()  # (V - R)^2
    loss_clipped = (values_clipped - returns).square()  # (clip(V) - R)^2
    token_losses = 0.5 * torch.maximum(loss_unclipped, loss_clipped)  # l_t = 1/2 max(., .)

    loss = aggregate(token_losses, mask, mode, norm_length)
    with torch.no_grad():
        clip_fraction = aggregate((loss_clipped > loss_unclipped).to(token_losses.dtype), mask, "token-mean")
    return loss, {"clip_fraction": clip_fraction.detach()}


def micro_batch_weight(part_mask: Tensor, whole_mask: Tensor, mode: str) -> float:
    """The factor that makes a micro-batch's aggregated loss its share of the whole batch's.

    For rows split into parts P_k of a whole W, sum_k w_k * aggregate(v[P_k], m[P_k], mode, L) equals
    aggregate(v, m, mode, L): each part's own denominator is swapped for the whole's (D: aggregate's denominator):
        w_k = D(P_k) / D(W),  D = response tokens (token-mean), sequences with >= 1 response token
        (seq-mean-token-mean), rows (seq-mean-token-sum, seq-mean-token-sum-norm; L is the same in both).
    Only the row partition matters: a part may be trimmed to fewer columns than the whole.

    Args:
        part_mask: [B_k, T_k] the micro-batch's response mask, 1 (or True) at response tokens.
        whole_mask: [B, T] the whole batch's response mask.
        mode: one of AGGREGATION_MODES.

    Returns:
        w_k as a Python float; 0 when the whole's denominator is 0 (then every aggregate is 0 too).

    Notation: B: sequences, T: tokens; B_k, T_k those of micro-batch k.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {list(AGGREGATION_MODES)}")
    if part_mask.dim() != 2 or whole_mask.dim() != 2:
        shapes = (tuple(part_mask.shape), tuple(whole_mask.shape))
        raise ValueError(f"need part_mask [B_k, T_k] and whole_mask [B, T], got {shapes}")
    if mode == "token-mean":
        part, whole = int(part_mask.bool().sum()), int(whole_mask.bool().sum())  # sum_bt m
    elif mode == "seq-mean-token-mean":
        part, whole = int(part_mask.bool().any(dim=1).sum()), int(whole_mask.bool().any(dim=1).sum())  # |S|
    else:
        part, whole = part_mask.shape[0], whole_mask.shape[0]  # B (L cancels for the -norm mode)
    return part / whole if whole else 0.0  # w_k = D(P_k) / D(W)


def entropy_bonus(entropy: Tensor, mask: Tensor, mode: str = "token-mean", norm_length: int | None = None) -> Tensor:
    """Mean policy entropy over response tokens, reduced like the policy loss; callers subtract coef * bonus.

    Entropy regularisation as in Mnih et al. 2016 ("Asynchronous Methods for Deep RL"), and PPO's c2 S[pi] term
    (Schulman et al. 2017, eq. 9): bonus = aggregate(H_t), H_t = -sum_v pi(v | s_t) log pi(v | s_t).

    Args:
        entropy: [B, T] per-token entropy H_t of the current policy's next-token distribution.
        mask: [B, T] 1 (or True) at response tokens, 0 at padding.
        mode, norm_length: see aggregate().

    Returns:
        [] scalar bonus (to be maximised).

    Notation: B: sequences, T: tokens.
    """
    return aggregate(entropy, mask, mode, norm_length)


# The config's names for the KL estimators; one signature: (logprobs, ref_logprobs) -> per-token KL, same shape.
KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}

# The config's names for aggregate()'s modes.
AGGREGATION_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)

# The config's names for the policy losses; one signature: (logprobs, old_logprobs, advantages, mask, clip_low,
# clip_high, clip_c=None, mode=..., norm_length=None, weights=None) -> (loss [], metrics with the same keys).
POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "ppo": clipped_policy_loss,
    "gspo": gspo_policy_loss,
    "vanilla": vanilla_policy_loss,
    "cispo": cispo_policy_loss,
}

"""A minibatch's metrics summed over its passes, and each pass's weight in the minibatch's loss
(`learner.fast_paths.metrics_on_device`).

Owns `MetricSums` (weighted float64 sums, read as Python floats pass by pass, or kept where the pass computed them
and read once per minibatch) and `pass_weights` (`micro_batch_weight`'s three factors as Python floats, or as
tensors on the device, with no `.item()`). Both ways do the same float64 arithmetic in the same order, so they give
the same sums bit for bit; the device's saves the host a synchronisation per metric and per weight each pass.
Does not own: the metrics themselves (`learner.objective`), the loss aggregation (`learner.algo.losses`).
"""

from __future__ import annotations

import torch

from learner.algo.losses import micro_batch_weight

# The factors a pass is weighed by: its loss's (the config's aggregation), token means' and per-sequence means'.
SHARES = ("token-mean", "seq-mean-token-mean")


class MetricSums:
    """Sum over passes of weight x metric, per name, in float64: `float(value) * weight` added on the host (the plain
    path), or with `on_device` `value.double() * weight` added where `value` is, read by `totals` once."""

    def __init__(self, on_device: bool):
        self.on_device = on_device
        self.sums: dict[str, float | torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float) -> None:
        if self.on_device and isinstance(value, torch.Tensor):
            term = value.detach().double() * weight
        else:
            term = float(value) * float(weight)
        self.sums[name] = self.sums.get(name, 0.0) + term

    def totals(self) -> dict[str, float]:
        """Every sum as a Python float (one read of the device for all of them)."""
        names = [name for name, value in self.sums.items() if isinstance(value, torch.Tensor)]
        read = torch.stack([self.sums[name] for name in names]).tolist() if names else []
        return {**{name: float(value) for name, value in self.sums.items()}, **dict(zip(names, read))}


def pass_weights(part_mask: torch.Tensor, whole: dict[str, torch.Tensor] | torch.Tensor, loss_agg: str, live: bool,
                 on_device: bool) -> tuple[torch.Tensor | float, ...]:
    """The pass's weights (loss, token-mean, seq-mean) of `micro_batch_weight`: Python floats from `whole` (the
    minibatch's mask [B, T]), or with `on_device` float64 tensors from `whole_denominators(whole_mask)` (the
    same quotient of the same integers, computed on the device). A dead pass weighs 0."""
    modes = (loss_agg, *SHARES)
    if not on_device:
        return tuple(micro_batch_weight(part_mask, whole, mode) if live else 0.0 for mode in modes)
    part = denominators(part_mask)
    zero = torch.zeros((), dtype=torch.float64, device=part_mask.device)
    return tuple(torch.where(whole[mode] > 0, part[mode] / whole[mode].clamp(min=1), zero) if live else zero
                 for mode in modes)


def denominators(mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """`micro_batch_weight`'s denominator D of `mask` [B, T] for each aggregation mode, as float64 tensors (integers,
    exact below 2^53) on the mask's device."""
    tokens = mask.bool().sum().double()
    sequences = mask.bool().any(dim=1).sum().double()
    rows = torch.tensor(float(mask.shape[0]), dtype=torch.float64, device=mask.device)
    return {"token-mean": tokens, "seq-mean-token-mean": sequences, "seq-mean-token-sum": rows,
            "seq-mean-token-sum-norm": rows}

"""Training on datums, as the Tinker API defines them: a user's own loop sends token rows with per-token targets and
weights (or advantages and the sampler's logprobs); gradients accumulate over `forward_backward` calls until
`optim_step` applies them with the Adam parameters the user gives.

Owns: `Datum` (one row), the datum losses (`DATUM_LOSSES`, looked up by the API's loss names), and `DatumLearner`,
which has a `Learner` (its policy, LoRA adapters and AdamW) and runs these passes on it.
Does not own: the wire formats, sessions and futures (cluster/tinker/), relay's own `Learner.train_step`.
A plain class: Ray wraps it in cluster/tinker/models.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from learner.algo.losses import cispo_policy_loss, clipped_policy_loss
from learner.distributed import clip_grad_norm
from learner.learner import Learner
from learner.passes.device import matmuls_in
from learner.passes.sequences import pad_sequences

if TYPE_CHECKING:
    from learner.config import CriticConfig, LearnerConfig


@dataclass
class Datum:
    """One row. N: the row's tokens; position i predicts `target_ids[i]` from `input_ids[:i+1]`."""

    input_ids: list[int]  # [N] the model's input
    target_ids: list[int]  # [N] the token each position is scored on
    weights: list[float] | None = None  # [N] cross_entropy's per-token weight (None: 1 everywhere)
    advantages: list[float] | None = None  # [N] importance_sampling's per-token advantage
    behavior_logprobs: list[float] | None = None  # [N] log pi of the targets under the sampler's weights


def cross_entropy_loss(logprobs: torch.Tensor, datum: Datum, config: Mapping[str, float]) -> torch.Tensor:
    """Weighted negative log-likelihood, summed over tokens: L = -sum_t w_t log pi(y_t). logprobs: [N]."""
    weights = torch.ones_like(logprobs) if datum.weights is None else _row(datum.weights, logprobs)
    return -(weights * logprobs).sum()


def importance_sampling_loss(logprobs: torch.Tensor, datum: Datum, config: Mapping[str, float]) -> torch.Tensor:
    """REINFORCE with an importance weight for samples from other weights, summed over tokens:
    L = -sum_t (pi(y_t) / q(y_t)) A_t, q the sampler's policy. logprobs: [N]."""
    ratio = torch.exp(logprobs - _row(datum.behavior_logprobs, logprobs))  # pi / q
    return -(ratio * _row(datum.advantages, logprobs)).sum()


def _clipped(policy_loss: Callable[..., tuple[torch.Tensor, dict]]) -> Callable[..., torch.Tensor]:
    """The API's `ppo` or `cispo` from relay's own (learner/algo/losses.py), summed over the datum's tokens: the ratio
    pi / q clipped to [clip_low_threshold, clip_high_threshold] (`loss_fn_config`, 0.8 and 1.2 unless given), i.e.
    relay's clip_low = 1 - low, clip_high = high - 1."""

    def loss(logprobs: torch.Tensor, datum: Datum, config: Mapping[str, float]) -> torch.Tensor:
        low, high = clip_thresholds(config)
        row = logprobs[None]  # [1, N]
        value, _ = policy_loss(row, _row(datum.behavior_logprobs, logprobs)[None],
                               _row(datum.advantages, logprobs)[None], torch.ones_like(row), 1 - low, high - 1,
                               None, "seq-mean-token-sum")  # one sequence: the sum over its tokens
        return value

    return loss


def clip_thresholds(config: Mapping[str, float]) -> tuple[float, float]:
    """`ppo`'s and `cispo`'s (clip_low_threshold, clip_high_threshold): the `loss_fn_config`'s, 0.8 and 1.2 unless
    given."""
    return config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)


def check_loss(loss_fn: str, config: Mapping[str, float]) -> None:
    """A one-line `ValueError` for a loss this learner does not have, a `loss_fn_config` key `loss_fn` does not read,
    or clip thresholds out of order. The service asks it before queueing a request, the learner before its passes."""
    if loss_fn not in DATUM_LOSSES:
        raise ValueError(f"loss_fn {loss_fn!r} is not supported; use one of {sorted(DATUM_LOSSES)}")
    if unknown := sorted(set(config) - LOSS_CONFIG_KEYS[loss_fn]):
        raise ValueError(f"loss_fn_config {unknown} is not read by {loss_fn}; give only "
                         f"{sorted(LOSS_CONFIG_KEYS[loss_fn]) or 'nothing'}")
    low, high = clip_thresholds(config)
    if not 0 <= low <= 1 <= high:
        raise ValueError(f"clip thresholds ({low}, {high}) must satisfy 0 <= clip_low_threshold <= 1 <= "
                         "clip_high_threshold")


def check_datum(datum: Datum, loss_fn: str) -> None:
    """A one-line `ValueError` for a datum `loss_fn` cannot take: targets or per-token inputs of another length than
    the input, a policy loss without advantages and the sampler's logprobs. The losses (`DATUM_LOSSES`) take only
    datums checked here, with a loss and config `check_loss` passed."""
    n = len(datum.input_ids)
    if len(datum.target_ids) != n:
        raise ValueError(f"target_tokens has {len(datum.target_ids)} tokens for a model_input of {n}; give one "
                         "target per input token")
    for name, values in (("weights", datum.weights), ("advantages", datum.advantages),
                         ("logprobs", datum.behavior_logprobs)):
        if values is not None and len(values) != n:
            raise ValueError(f"a per-token input ({name}) has {len(values)} values for {n} tokens; give one per "
                             "token")
    if loss_fn != "cross_entropy" and (datum.advantages is None or datum.behavior_logprobs is None):
        raise ValueError(f"{loss_fn} needs loss_fn_inputs 'advantages' and 'logprobs' (the sampler's)")


def _row(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)


DATUM_LOSSES: dict[str, Callable[[torch.Tensor, Datum, Mapping[str, float]], torch.Tensor]] = {
    "cross_entropy": cross_entropy_loss,
    "importance_sampling": importance_sampling_loss,
    "ppo": _clipped(clipped_policy_loss),
    "cispo": _clipped(cispo_policy_loss),
}
# The `loss_fn_config` keys each loss reads; others are refused.
LOSS_CONFIG_KEYS = {"cross_entropy": set(), "importance_sampling": set(),
                    "ppo": {"clip_low_threshold", "clip_high_threshold"},
                    "cispo": {"clip_low_threshold", "clip_high_threshold"}}


class DatumLearner:
    """A `Learner` driven datum by datum: `forward_backward` adds to the gradients, `optim_step` applies them."""

    def __init__(self, model_path: str, config: LearnerConfig, dtype: str = "float32", temperature: float = 1.0,
                 seed: int = 0, critic: CriticConfig | None = None, norm_length: int | None = None, rank: int = 0):
        # `Learner`'s arguments, so that cluster/fleet/learner_group.py starts it as it starts a Learner; the datum
        # losses score at temperature 1 and have no critic, whatever they say.
        if critic is not None and critic.enabled:
            raise ValueError("the Tinker API trains a policy alone; set critic.enabled=false")
        self.learner = Learner(model_path, config, dtype=dtype, temperature=1.0, seed=seed, rank=rank)
        self.learner.optimizer.zero_grad(set_to_none=True)

    def vocab_size(self) -> int:
        return int(self.learner.model.config.vocab_size)

    def forward_backward(self, datums: Sequence[Datum], loss_fn: str, forward_only: bool = False,
                         config: Mapping[str, float] | None = None) -> tuple[list[list[float]], dict[str, float]]:
        """Every datum's target logprobs ([B][N]) and the summed loss (`loss:sum`); with `forward_only` False the
        loss's gradient is added to the parameters' (nothing steps). A one-line `ValueError` for an unknown loss or
        a malformed datum, before any gradient changes."""
        check_loss(loss_fn, config or {})
        for datum in datums:
            check_datum(datum, loss_fn)
        rows, total = [], 0.0
        # Passes of several datums (right-padded: a row's real tokens see nothing after them), within the learner's
        # micro-batch limits, each pass's gradient added before the next: every datum was checked above, so a
        # malformed one fails before any gradient changes.
        for chunk in self._passes(datums):
            with torch.set_grad_enabled(not forward_only):
                logprobs = self._target_logprobs(chunk)
                loss = torch.stack([DATUM_LOSSES[loss_fn](lp, d, config or {}) for lp, d in zip(logprobs, chunk)]).sum()
                if not forward_only:
                    with matmuls_in(self.learner.device, self.learner.compute_dtype):
                        loss.backward()
            rows += [lp.detach().cpu().tolist() for lp in logprobs]
            total += float(loss.detach())
        return rows, {"loss:sum": total}

    def _passes(self, datums: Sequence[Datum]) -> list[list[Datum]]:
        """`datums` in order, cut into passes of at most `learner.micro_batch_size` rows and (but for a longer datum
        alone) `learner.max_tokens_per_micro_batch` padded tokens."""
        cfg = self.learner.config
        rows_max, tokens_max = cfg.micro_batch_size or len(datums), cfg.max_tokens_per_micro_batch or 2**62
        passes: list[list[Datum]] = []
        for datum in datums:
            last = passes[-1] if passes else None
            width = max([len(d.input_ids) for d in last or []] + [len(datum.input_ids)])
            if last and len(last) < rows_max and (len(last) + 1) * width <= tokens_max:
                last.append(datum)
            else:
                passes.append([datum])
        return passes

    def _target_logprobs(self, datums: Sequence[Datum]) -> list[torch.Tensor]:
        """log pi(target_t | input_<=t) at temperature 1, in float32, one pass for every datum: [B][N_i]."""
        device, none = self.learner.device, [[]] * len(datums)
        batch = pad_sequences([d.input_ids for d in datums], none, self.learner.pad_id, device)
        targets = pad_sequences([d.target_ids for d in datums], none, 0, device).input_ids  # as long: checked
        with self.learner._compute():
            logits = self.learner.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]
        return [logprobs[i, :len(d.input_ids)] for i, d in enumerate(datums)]

    def optim_step(self, learning_rate: float, beta1: float, beta2: float, eps: float, weight_decay: float = 0.0,
                   grad_clip_norm: float = 0.0) -> dict[str, float]:
        """One AdamW step on the accumulated gradients with these parameters (`grad_clip_norm` 0: no clipping), then
        zero them; the weights version goes up by one. Metrics: the gradient's norm before clipping. Whole modules
        trained beside the adapters (`learner.lora.modules_to_save`) keep their rate's ratio to the adapters'
        (`modules_lr` / `lr` of the served config): `learning_rate` x that ratio."""
        learner = self.learner
        for group in learner.optimizer.param_groups:
            ratio = group.get("initial_lr", learner.config.lr) / learner.config.lr
            group.update(lr=learning_rate * ratio, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        params = [p for p in learner.model.parameters() if p.requires_grad]
        norm = clip_grad_norm(params, grad_clip_norm if grad_clip_norm > 0 else float("inf"))
        learner.optimizer.step()
        learner.optimizer.zero_grad(set_to_none=True)
        learner.weights_version += 1
        return {"grad_norm": float(norm)}

    def weights_version(self) -> int:
        return self.learner.weights_version

    def export_weights(self, bucket_bytes: int) -> list[list[tuple[str, Any]]]:
        """The adapters (and whole modules trained beside them) in the engines' dtype, as the `Learner`'s sync
        exports them (`sync.publisher.WeightPublisher.export_weights`)."""
        return self.learner.export_weights(bucket_bytes)

    def weights_fingerprint(self) -> dict[str, str]:
        """{name: fingerprint} of what an engine must receive (`WeightPublisher.weights_fingerprint`)."""
        return self.learner.weights_fingerprint()

    def save_state(self, directory: str) -> None:
        """The learner's whole state (adapters, AdamW, counters: `Learner.save_checkpoint`) into a new `directory`;
        gradients accumulated since the last `optim_step` are not part of it."""
        Path(directory).mkdir(parents=True)
        self.learner.save_checkpoint(directory)

    def load_state(self, directory: str, optimizer: bool) -> int:
        """Restore what `save_state` wrote (`Learner.load_checkpoint`: the next step is bitwise the same); without
        `optimizer` the AdamW state starts afresh. Accumulated gradients are dropped. The weights version."""
        version = self.learner.load_checkpoint(directory)
        if not optimizer:
            self.learner._make_optimizer()
        self.learner.optimizer.zero_grad(set_to_none=True)
        return version

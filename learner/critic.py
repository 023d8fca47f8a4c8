"""Critic: PPO's value model, a transformer with a scalar head, trained beside the policy in the learner actor.

Owns: the value model (a transformers `AutoModelForTokenClassification` with one label, so it saves and loads as a
plain Hugging Face checkpoint), its own AdamW and warm-up schedule, computing values in the token layout of
`learner.algo.sequences`, and accumulating the clipped value loss micro-batch by micro-batch. Does not own: GAE
(`learner.algo.advantages`), the loss math (`learner.algo.losses`), or when to step (the `Learner`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from learner.algo.losses import value_loss
from learner.algo.sequences import SequenceBatch

if TYPE_CHECKING:
    from cluster.config import CriticConfig


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear learning-rate warm-up from 0 to the optimizer's lr over `warmup_steps` steps, then constant."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda n: min(1.0, (n + 1) / warmup_steps) if warmup_steps else 1.0)


class Critic:
    """V(s_t) for every position of a batch; `accumulate` adds the value loss's gradient, `step` applies it."""

    def __init__(self, model_path: str, config: CriticConfig, dtype: str = "float32"):
        from transformers import AutoModelForTokenClassification
        from transformers.utils import logging as hf_logging

        self.config = config
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report calls the new head "MISSING": expected, and handled below
        try:
            self.model, info = AutoModelForTokenClassification.from_pretrained(
                config.path or model_path, num_labels=1, dtype=getattr(torch, dtype), output_loading_info=True)
        finally:
            hf_logging.set_verbosity(verbosity)
        # A new head on a policy checkpoint (whatever the architecture calls it): start at V = 0 (rewards are O(1)),
        # not at random values scaled by the backbone's hidden-state norm.
        parameters = dict(self.model.named_parameters())
        with torch.no_grad():
            for name in info["missing_keys"]:
                if name in parameters:
                    parameters[name].zero_()
        self.model.eval()  # no dropout: the value clip compares V with V_old from the same function
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = warmup_schedule(self.optimizer, config.warmup_steps)

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        """V of the state before each next token: [B, L-1], position j is V(tokens 0..j) (scores token j+1's state),
        the layout of `sequence_logprobs`. Gradients flow if enabled by the caller."""
        out = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return out[:, :-1, 0].float()

    @torch.no_grad()
    def compute_values(self, batch: SequenceBatch, micro_batch_size: int) -> torch.Tensor:
        """`values` without gradients, micro-batch by micro-batch: [B, L-1] (zeros past each sequence)."""
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        for start in range(0, len(batch), micro_batch_size):
            part = batch.select(slice(start, start + micro_batch_size))
            out[start : start + micro_batch_size, : part.response_mask.shape[1]] = self.values(part)
        return out

    def accumulate(self, mb: SequenceBatch, old_values: torch.Tensor, returns: torch.Tensor,
                   weight: float) -> dict[str, float]:
        """Backpropagate `weight` x the token-mean clipped value loss of one micro-batch; returns weighted metrics.

        The value loss is always a token mean: it is a regression, and every token's return is one target."""
        values = self.values(mb)
        loss, metrics = value_loss(values, old_values, returns, mb.response_mask, self.config.value_clip, "token-mean")
        (loss * weight).backward()
        with torch.no_grad():
            mask = mb.response_mask.bool()
            mean_value = float(values[mask].mean()) if mask.any() else 0.0
        return {"loss/value": float(loss.detach()) * weight, "value/clip_fraction": float(metrics["clip_fraction"])
                * weight, "value/mean": mean_value * weight}

    def clip_gradients(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))

    def step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

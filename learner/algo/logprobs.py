"""Token log-probabilities and entropies from a language model's logits.

Owns the softmax arithmetic on logits: in float32 whatever the model's dtype (bf16 log-probabilities are too coarse
for importance ratios), a few sequences at a time so the float32 copy stays under `FLOAT32_CHUNK_ELEMENTS` on a
CPU, `GPU_FLOAT32_CHUNK_ELEMENTS` on a GPU (one sequence, [T, V], when a single one is larger), never a whole
[B, T, V] of a large vocabulary; small models get one chunk, not a Python loop per sequence. Does not own running
the model, shifting logits against labels (callers pass logits already aligned with the tokens they score), or
masking padding (`losses.py`).

Notation: B: sequences, T: tokens, V: vocabulary.
"""

import torch
from torch import Tensor

FLOAT32_CHUNK_ELEMENTS = 2**24  # 64 MiB of float32 logits per chunk, on a CPU
# On a GPU, 1 GiB: chunks sized for a CPU are a handful of tokens of a large vocabulary, and the many small kernels
# a packed pass then launches left the GPU idle for much of the step (docs/benchmarks.md, "GPU learner").
GPU_FLOAT32_CHUNK_ELEMENTS = 2**28


def _row_chunks(logits: Tensor) -> list[Tensor]:
    """`logits` [B, T, V] as consecutive row blocks of at most FLOAT32_CHUNK_ELEMENTS elements on a CPU,
    GPU_FLOAT32_CHUNK_ELEMENTS elsewhere (at least one row)."""
    per_row = max(logits.shape[1] * logits.shape[2], 1)
    budget = FLOAT32_CHUNK_ELEMENTS if logits.device.type == "cpu" else GPU_FLOAT32_CHUNK_ELEMENTS
    return list(logits.split(max(1, budget // per_row)))


def _scaled(chunk: Tensor, temperature: float) -> Tensor:
    """z / tau in float32; at tau = 1 the float32 copy itself (the same values, one kernel and copy fewer)."""
    wide = chunk.float()
    return wide if temperature == 1.0 else wide / temperature


def _check_temperature(temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (use the sampler's temperature), got {temperature}")


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of each label under softmax(logits / temperature), computed in float32.

    log pi(y_t) = z_{t,y_t} / tau - log sum_v exp(z_{t,v} / tau)   (log_softmax gathered at the label)

    Args:
        logits: [B, T, V] logits at the positions that predict labels (already shifted), any float dtype.
        labels: [B, T] integer token ids in [0, V).
        temperature: tau > 0, the sampling temperature, so the log-probabilities match the sampler's.

    Returns:
        [B, T] float32 log-probabilities; differentiable with respect to logits.

    Notation: B: sequences, T: tokens, V: vocabulary.
    """
    _check_temperature(temperature)
    if logits.dim() != 3 or labels.shape != logits.shape[:-1]:
        raise ValueError(f"need logits [B, T, V] and labels [B, T], got {tuple(logits.shape)}, {tuple(labels.shape)}")
    rows = []
    start = 0
    for chunk in _row_chunks(logits):  # the float32 copy is one chunk's
        chunk_labels = labels[start : start + len(chunk)]
        start += len(chunk)
        scaled = _scaled(chunk, temperature)  # z / tau
        label_logits = scaled.gather(-1, chunk_labels.long().unsqueeze(-1)).squeeze(-1)  # z_{t,y_t} / tau
        rows.append(label_logits - torch.logsumexp(scaled, dim=-1))  # - log sum_v exp(z_{t,v} / tau)
    if not rows:
        return logits.new_zeros(labels.shape, dtype=torch.float32)
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the next-token distribution softmax(logits / temperature), computed in float32.

    H_t = -sum_v p_{t,v} log p_{t,v} = log sum_v exp(z_{t,v}) - sum_v p_{t,v} z_{t,v},   z = logits / tau

    Args:
        logits: [B, T, V] logits, any float dtype.
        temperature: tau > 0; the default 1 gives the entropy of the model's own distribution.

    Returns:
        [B, T] float32 entropies in nats; differentiable with respect to logits.

    Notation: B: sequences, T: tokens, V: vocabulary.
    """
    _check_temperature(temperature)
    if logits.dim() != 3:
        raise ValueError(f"need logits [B, T, V], got {tuple(logits.shape)}")
    rows = []
    for chunk in _row_chunks(logits):  # the float32 copies are one chunk's
        scaled = _scaled(chunk, temperature)  # z = logits / tau
        probs = torch.softmax(scaled, dim=-1)  # p_{t,v}
        rows.append(torch.logsumexp(scaled, dim=-1) - (probs * scaled).sum(dim=-1))  # H = lse(z) - sum_v p z
    if not rows:
        return logits.new_zeros(logits.shape[:-1], dtype=torch.float32)
    return rows[0] if len(rows) == 1 else torch.cat(rows)

"""Scoring a pass's tokens through the output head a chunk of tokens at a time (`learner.fast_paths.head_chunk_tokens`).

Owns `PassScorer` (the learner's logprobs and entropies of a pass, by the plain path or the chunked one) and
`chunked_head`: the decoder's final hidden states are run through the output head chunk by chunk, each chunk's
logits scored by the same `learner.algo.logprobs` functions the plain path uses and then freed; under gradients each
chunk is checkpointed, so the backward recomputes one chunk's logits at a time. A pass never holds its whole
[tokens x vocabulary] logits. The same numbers as the plain path up to the head's summation order (bit for bit when
one chunk holds the whole pass; the bounds: tests/unit/test_fast_paths.py).
Does not own: cutting or running the passes (`learner.passes.sequences`, `packing`), the softmax arithmetic
(`learner.algo.logprobs`). Only for heads that are one linear layer with nothing after it (`chunkable`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from learner.algo.logprobs import (
    FLOAT32_CHUNK_ELEMENTS,
    GPU_FLOAT32_CHUNK_ELEMENTS,
    entropy_from_logits,
    logprobs_from_logits,
)
from learner.passes.compiled import compile_layers
from learner.passes.packing import PackedPaths, packed_paths
from learner.passes.sequences import SharedPrompts, pass_logits, sequence_logprobs, sequence_logprobs_and_entropy

# Architectures whose causal LM computes logits as `lm_head(final hidden states)` and nothing more (no soft-capping,
# no logit scale): what the decoder returns, run through the head here, is what the model's own forward returns.
CHUNKABLE_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})


def chunkable(model: torch.nn.Module) -> bool:
    """The model's logits are its output head applied to its decoder's hidden states (`CHUNKABLE_MODEL_TYPES`),
    and both can be reached (`get_decoder`, `get_output_embeddings`; through peft's wrappers too)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in CHUNKABLE_MODEL_TYPES:
        return False
    try:
        return model.get_decoder() is not None and model.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError):
        return False


class Headless:
    """A causal LM without its head: called as the model is, its `.logits` are the final hidden states [..., H], so
    every pass (`pass_logits`: padded, packed, on shared prompts) runs unchanged and returns hidden states. Anything
    else is the model's own (its config, `set_attn_implementation`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.decoder = model.get_decoder()

    def __call__(self, **kwargs: Any) -> SimpleNamespace:
        kwargs.pop("logits_to_keep", None)
        return SimpleNamespace(logits=self.decoder(**kwargs).last_hidden_state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def chunked_head(head: torch.nn.Module, vocab: int, hidden: torch.Tensor, labels: torch.Tensor, temperature: float,
                 chunk_tokens: int, entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of `labels` [N, R] and (with `entropy`) entropies [N, R] from hidden states [N, R, H] (a packed
    pass's [T, 1, H], a padded one's [b, R, H]), `head` (to `vocab` logits) run over consecutive blocks of the
    first dimension of about `chunk_tokens` tokens. A block's length is a multiple of what `logprobs_from_logits`
    takes as one float32 chunk of [.., R, V] logits, so the log-softmax runs on the same row blocks as in the
    plain path. Under gradients each block is checkpointed: its logits are recomputed in the backward, never
    kept. The entropy carries gradients only with `entropy_grad`.

    Notation: N: rows of the pass (tokens when packed), R: positions per row, H: hidden size, V: vocabulary."""
    budget = FLOAT32_CHUNK_ELEMENTS if hidden.device.type == "cpu" else GPU_FLOAT32_CHUNK_ELEMENTS
    softmax_rows = max(1, budget // max(1, hidden.shape[1] * vocab))  # `logprobs.py`'s `_row_chunks`
    rows = max(1, chunk_tokens // max(1, hidden.shape[1]))
    rows = max(softmax_rows, rows - rows % softmax_rows) if rows >= softmax_rows else rows
    grad = torch.is_grad_enabled()

    def score(part: torch.Tensor, part_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with _uncached_casts(part.device):
            logits = head(part)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = entropy_from_logits(logits, temperature) if entropy else part_labels.new_zeros(0, dtype=torch.float)
        return logprobs_from_logits(logits, part_labels, temperature), ent

    logprobs, entropies = [], []
    for part, part_labels in zip(hidden.split(rows), labels.split(rows)):
        if grad:
            lp, ent = checkpoint(score, part, part_labels, use_reentrant=False)
        else:
            lp, ent = score(part, part_labels)
        logprobs.append(lp)
        entropies.append(ent)
    if not logprobs:
        empty = hidden.new_zeros(labels.shape, dtype=torch.float32)
        return empty, (empty if entropy else None)
    joined = logprobs[0] if len(logprobs) == 1 else torch.cat(logprobs)
    if not entropy:
        return joined, None
    return joined, entropies[0] if len(entropies) == 1 else torch.cat(entropies)


def _uncached_casts(device: torch.device) -> contextlib.AbstractContextManager:
    """Under autocast, the head's weight cast afresh for each chunk instead of once for all (autocast's cache): each
    chunk's weight gradient then reaches the float32 master weight and adds up there in float32, not in the compute
    dtype, which would round once per chunk."""
    if not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.get_autocast_dtype(device.type), cache_enabled=False)


@dataclass(frozen=True)
class PassScorer:
    """How the learner scores a pass: the plain path (`sequence_logprobs`, `sequence_logprobs_and_entropy`: the whole
    pass's logits at once), or, with `chunk_tokens`, the output head over that many tokens at a time (`chunked_head`)
    where the model allows it (`chunkable`); packed passes run by `packed` (`learner.passes.packing.PackedPaths`)."""

    chunk_tokens: int | None = None
    packed: PackedPaths = PackedPaths()

    def logprobs(self, model: torch.nn.Module, batch: Any, temperature: float, prompts: SharedPrompts | None,
                 pack: bool) -> torch.Tensor:
        """`sequence_logprobs`'s [B, L-1]."""
        with packed_paths(self.packed):
            if not self._chunks(model):
                return sequence_logprobs(model, batch, temperature, prompts, pack)
            logprobs, _ = self._scored(model, batch, temperature, prompts, pack, False, False)
        return logprobs

    def logprobs_and_entropy(self, model: torch.nn.Module, batch: Any, temperature: float, entropy_grad: bool,
                             prompts: SharedPrompts | None, pack: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`sequence_logprobs_and_entropy`'s two [B, L-1]."""
        with packed_paths(self.packed):
            if not self._chunks(model):
                return sequence_logprobs_and_entropy(model, batch, temperature, entropy_grad, prompts, pack)
            return self._scored(model, batch, temperature, prompts, pack, True, entropy_grad)

    def _chunks(self, model: torch.nn.Module) -> bool:
        return self.chunk_tokens is not None and chunkable(model)

    def _scored(self, model: torch.nn.Module, batch: Any, temperature: float, prompts: SharedPrompts | None,
                pack: bool, entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, Any]:
        hidden, labels, place = pass_logits(Headless(model), batch, prompts, pack)
        logprobs, entropies = chunked_head(model.get_output_embeddings(), model.config.vocab_size, hidden, labels,
                                           temperature, self.chunk_tokens, entropy, entropy_grad)
        placed: Callable[[torch.Tensor], torch.Tensor] = place
        return placed(logprobs), (placed(entropies) if entropy else None)


def pass_scorer(model: torch.nn.Module, fast: Any, budget: Any) -> PassScorer:
    """The learner's `PassScorer` for its `learner.fast_paths` (`fast`), the model's layers compiled when it asks
    (`compile_layers`: for the buckets of passes of up to `budget` tokens, with and without gradients, LoRA's
    adapters on and off, and a few longer rows alone in their passes)."""
    bucket = fast.compile_bucket_tokens
    if bucket is not None:
        longest = budget if isinstance(budget, int) else 2**16  # no budget, or one not yet resolved
        compile_layers(model, fast.compile_backend, 4 * -(-longest // bucket) + 8)
    return PassScorer(fast.head_chunk_tokens, PackedPaths(fast.varlen_attention, bucket))

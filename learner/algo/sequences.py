"""Turning ragged prompt/response token lists into padded tensors, and scoring them with a causal LM.

Owns: the token layout every torch-side consumer shares (learner, reference worker): a sequence is
prompt + response, right-padded; position j of every per-token tensor [B, L-1] is about token j+1, predicted from
tokens 0..j; `response_mask` marks the response tokens (where per-token values live), `loss_mask` those of them the
model sampled (what is trained: a multi-turn episode's environment tokens are response tokens, not model ones).
Tensors are built in host memory and moved to the consumer's device in one copy; everything computed from a batch
stays on the batch's device, and results for Python lists come back through the CPU. Also how a batch is cut
into micro-batches (`MicroBatching`): rows sorted by length, each pass holding at most a token budget of padded
tokens, so compute follows the real tokens (a pass is trimmed to its own longest sequence), not the batch's longest.
Does not own: models, optimizers, or choosing the device. Imports only torch and numpy.

Why sorted, padded passes rather than packed rows (several sequences in one row, attention kept within each): on
CPU, transformers keeps packed sequences apart with a dense block-diagonal mask, whose cost grows with the square
of the row; measured on the 25M-parameter model (docs/benchmarks.md, "Compute proportional to real tokens"),
length-sorted passes were as fast or faster at every budget, and they need no layout of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from learner.algo.logprobs import entropy_from_logits, logprobs_from_logits


class Rows(list):
    """A list of 1-D rows (a batch's token ids, or per-token values) that travels between processes (Ray) as one
    flat array and the rows' lengths, not as an object per row; it arrives as numpy arrays (read-write copies),
    which `pad_sequences` and `pad_per_token` take as they take lists. Every row has the first row's dtype."""

    def __reduce__(self):
        arrays = [np.asarray(row) for row in self]
        dtype = arrays[0].dtype if arrays else np.int64
        lengths = np.fromiter(map(len, arrays), np.int64, len(arrays))
        flat = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
        return (_unpack_rows, (lengths, flat))


def _unpack_rows(lengths: np.ndarray, flat: np.ndarray) -> Rows:
    # Zero-copy arrays from Ray's object store are read-only: one copy of the whole, then views of it.
    return Rows(np.split(np.array(flat), np.cumsum(lengths)[:-1]) if len(lengths) else [])


@dataclass(frozen=True)
class MicroBatching:
    """How rows are cut into forward/backward passes: sorted longest first, a pass closes when one more row would
    take it over `max_rows` rows or `max_tokens` padded tokens (rows x its longest sequence; a longer sequence
    than that is a pass alone). None: no limit of that kind (both None: one pass)."""

    max_rows: int | None = None
    max_tokens: int | None = None

    def split(self, lengths: torch.Tensor) -> list[torch.Tensor]:
        """Passes over rows whose token counts are `lengths` [N]: each a tensor of positions into `lengths` (on its
        device), every position exactly once, in a fixed order (a stable sort: ties keep their order)."""
        host = lengths.detach().to("cpu", torch.long)
        order = torch.sort(host, descending=True, stable=True).indices
        cuts, rows, longest = [], 0, 0
        for position, length in enumerate(host[order].tolist()):
            longest = max(longest, length)
            if rows and ((self.max_rows is not None and rows + 1 > self.max_rows)
                         or (self.max_tokens is not None and (rows + 1) * longest > self.max_tokens)):
                cuts.append(position)
                rows, longest = 0, length
            rows += 1
        return [part.to(lengths.device) for part in order.tensor_split(cuts)] if len(host) else []


@dataclass(frozen=True)
class SequenceBatch:
    """B sequences of prompt + response tokens. L: longest prompt + response in the batch."""

    input_ids: torch.Tensor  # [B, L] long, right-padded with pad_id
    attention_mask: torch.Tensor  # [B, L] long, 1 on real tokens
    response_mask: torch.Tensor  # [B, L-1] float, 1 where position j predicts a response token (token j+1)
    # [B, L-1] float, 1 where position j predicts a token the model sampled: the response mask without the
    # environment's tokens of a multi-turn episode. None (given): `response_mask` itself, the same tensor.
    loss_mask: torch.Tensor = None  # type: ignore[assignment]

    def __post_init__(self):
        if self.loss_mask is None:
            object.__setattr__(self, "loss_mask", self.response_mask)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def has_env_tokens(self) -> bool:
        """Some response token was not sampled by the model (`loss_mask` differs from `response_mask`)."""
        return self._own_loss_mask and not torch.equal(self.loss_mask, self.response_mask)

    def to(self, device: torch.device | str) -> SequenceBatch:
        """The same batch on `device` (no copy of tensors that are there already)."""
        return SequenceBatch(self.input_ids.to(device), self.attention_mask.to(device), self.response_mask.to(device),
                             self.loss_mask.to(device) if self._own_loss_mask else None)

    @property
    def lengths(self) -> torch.Tensor:
        """[B] tokens of each sequence (prompt + response), on the batch's device."""
        return self.attention_mask.sum(dim=1)

    def select(self, index: torch.Tensor | slice) -> SequenceBatch:
        """A sub-batch, trimmed to its own longest sequence (saves compute on short micro-batches)."""
        attention = self.attention_mask[index]
        length = max(int(attention.sum(dim=1).max()), 2)
        return SequenceBatch(self.input_ids[index][:, :length], attention[:, :length],
                             self.response_mask[index][:, : length - 1],
                             self.loss_mask[index][:, : length - 1] if self._own_loss_mask else None)

    @property
    def _own_loss_mask(self) -> bool:
        """`loss_mask` is a tensor of its own (else it is `response_mask`, and stays so in derived batches)."""
        return self.loss_mask is not self.response_mask


def pad_sequences(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                  pad_id: int = 0, device: torch.device | str = "cpu",
                  model_masks: Sequence[Sequence[float]] | None = None) -> SequenceBatch:
    """Concatenate each prompt with its response and right-pad to a [B, L] batch on `device` (filled in host
    memory with a few array operations, not a loop over rows, then moved in one copy). `model_masks` [B][T_resp_i]:
    1 at the response tokens the model sampled, 0 at those the environment added (multi-turn episodes); they give
    the batch's `loss_mask`. None, or all 1: `loss_mask` is `response_mask` itself."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    prompt_lengths = np.fromiter(map(len, prompt_ids), np.int64, len(prompt_ids))
    response_lengths = np.fromiter(map(len, response_ids), np.int64, len(response_ids))
    if (prompt_lengths == 0).any():
        raise ValueError(f"sequence {int(np.argmin(prompt_lengths))} has an empty prompt; every prompt needs at least "
                         "one token")
    lengths = prompt_lengths + response_lengths
    length = int(lengths.max()) if len(lengths) else 1
    position = np.arange(length)[None, :]
    in_prompt = position < prompt_lengths[:, None]  # [B, L]; row-major order is the rows' tokens one after another
    in_response = ~in_prompt & (position < lengths[:, None])
    input_ids = np.full((len(lengths), length), pad_id, dtype=np.int64)
    input_ids[in_prompt] = _concatenate(prompt_ids)
    input_ids[in_response] = _concatenate(response_ids)
    # position j scores token j+1: the response mask is the response tokens' mask shifted left by one
    response_mask = _shifted(in_response)
    batch = SequenceBatch(torch.from_numpy(input_ids), torch.from_numpy((in_prompt | in_response).astype(np.int64)),
                          torch.from_numpy(response_mask))
    if model_masks is not None:
        sampled = _model_tokens(model_masks, response_lengths)  # [sum T_resp_i] bool
        if not sampled.all():
            in_model = np.zeros_like(in_response)
            in_model[in_response] = sampled
            batch = SequenceBatch(batch.input_ids, batch.attention_mask, batch.response_mask,
                                  torch.from_numpy(_shifted(in_model)))
    return batch.to(device)


def _shifted(in_tokens: np.ndarray) -> np.ndarray:
    """[B, L] bool token mask -> [B, L-1] float32 mask of the positions that predict those tokens."""
    shifted = in_tokens[:, 1:] if in_tokens.shape[1] > 1 else np.zeros((len(in_tokens), 1), dtype=bool)
    return shifted.astype(np.float32)


def _model_tokens(model_masks: Sequence[Sequence[float]], response_lengths: np.ndarray) -> np.ndarray:
    """Every response token's model mask (> 0: the model's), row after row, checked against the responses."""
    if len(model_masks) != len(response_lengths):
        raise ValueError(f"{len(model_masks)} model masks for {len(response_lengths)} responses")
    rows = [np.asarray(row, dtype=np.float32) for row in model_masks]
    for i, (row, count) in enumerate(zip(rows, response_lengths.tolist())):
        if len(row) != count:
            raise ValueError(f"sequence {i}: {len(row)} model-mask values for {count} response tokens")
    return np.concatenate(rows) > 0 if rows else np.zeros(0, dtype=bool)


def _concatenate(rows: Sequence[Sequence[int]]) -> np.ndarray:
    """Every row's tokens, one after another, as one int64 array."""
    arrays = [np.asarray(row, dtype=np.int64) for row in rows]
    return np.concatenate(arrays) if arrays else np.zeros(0, np.int64)


def pad_per_token(values: Sequence[Sequence[float]] | torch.Tensor, batch: SequenceBatch) -> torch.Tensor:
    """Place per-response-token values ([B][T_resp_i], or all of them in one flat array in that order) at the
    response positions of a [B, L-1] float32 tensor on the batch's device (filled in host memory, then moved in one
    copy)."""
    response_mask = batch.response_mask.cpu()
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device="cpu")
    keep = response_mask.bool()
    if getattr(values, "ndim", 2) != 1:  # rows: checked row by row, then one flat array
        counts = keep.sum(dim=1).tolist()
        for i, row in enumerate(values):
            if len(row) != counts[i]:
                raise ValueError(f"sequence {i}: {len(row)} values for {counts[i]} response tokens")
        values = np.concatenate([np.asarray(row, dtype=np.float32) for row in values]) if len(values) else \
            np.zeros(0, np.float32)
    if values.size != int(keep.sum()):  # the mask's row-major order is the rows one after another
        raise ValueError(f"{values.size} values for {int(keep.sum())} response tokens")
    out[keep] = torch.as_tensor(values, dtype=torch.float32, device="cpu")
    return out.to(batch.device)


def flat_per_token(values: torch.Tensor, batch: SequenceBatch) -> torch.Tensor:
    """Inverse of `pad_per_token` for a flat array: [B, L-1] (on any device) -> every response token's value, row
    after row, in one float32 host tensor."""
    return values.detach().cpu()[batch.response_mask.cpu().bool()].to(torch.float32)


def unpad_per_token(values: torch.Tensor, batch: SequenceBatch) -> list[list[float]]:
    """Inverse of `pad_per_token`: [B, L-1] (on any device) -> [B][T_resp_i] Python floats."""
    values, keep = values.detach().cpu(), batch.response_mask.cpu().bool()  # one copy each, not one per row
    return [values[i][keep[i]].tolist() for i in range(len(batch))]


def sequence_logprobs(model: torch.nn.Module, batch: SequenceBatch, temperature: float = 1.0) -> torch.Tensor:
    """log pi(token j+1 | tokens 0..j) for every position: [B, L-1]; gradients flow if enabled by the caller."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    return logprobs_from_logits(logits[:, :-1], batch.input_ids[:, 1:], temperature)


def sequence_logprobs_and_entropy(model: torch.nn.Module, batch: SequenceBatch, temperature: float = 1.0,
                                  entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logprobs` plus the entropy of each position's next-token distribution at `temperature`:
    two [B, L-1] tensors from one forward pass. Gradients flow if enabled by the caller, and into the entropy only
    with `entropy_grad` (else its [B, L-1, V] softmax is not kept for backward)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits[:, :-1]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = entropy_from_logits(logits, temperature)
    return logprobs_from_logits(logits, batch.input_ids[:, 1:], temperature), entropy


@torch.no_grad()
def batched_logprobs(model: torch.nn.Module, batch: SequenceBatch, batching: MicroBatching,
                     temperature: float = 1.0) -> torch.Tensor:
    """`sequence_logprobs` without gradients, pass by pass (`batching`): [B, L-1] on the batch's device (the
    model's; zeros past each sequence)."""
    return per_pass(batch, batching, lambda part: sequence_logprobs(model, part, temperature))


def per_pass(batch: SequenceBatch, batching: MicroBatching,
             compute: Callable[[SequenceBatch], torch.Tensor]) -> torch.Tensor:
    """`compute(part)` -> [B_part, L_part-1] for each pass of `batching` over the batch, assembled into [B, L-1]
    float32 on the batch's device (zeros past each sequence)."""
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=batch.device)
    for rows in batching.split(batch.lengths):
        values = compute(batch.select(rows))
        out[rows, : values.shape[1]] = values.float()
    return out

"""Turning ragged prompt/response token lists into padded tensors, and scoring them with a causal LM.

Owns: the token layout every torch-side consumer shares: a sequence is prompt + response, right-padded; position j of
every per-token tensor [B, L-1] is about token j+1; `response_mask` marks the response tokens, `loss_mask` those the
model sampled (what is trained). Built in host memory, moved to the consumer's device in one copy. The passes over a
batch, cut by its `MicroBatching`: packed (`learner.passes.packing`) or padded to their own longest, and prompts
shared by a group's rows computed once (`SharedPrompts`). `Rows`, the wire form of token rows the driver sends the
Learner and the ReferenceWorker, beside `pad_sequences`, which each receiver applies to it.
Does not own: models, optimizers, choosing the device (`learner.passes.device`), or the math on what a pass returns
(`learner.algo`). Imports only torch, numpy, `learner.algo.logprobs` and its neighbours here (and transformers' cache
class, when prompts are shared; its attention interface, when passes are packed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from learner.algo.logprobs import entropy_from_logits, logprobs_from_logits
from learner.passes.micro_batches import MicroBatching
from learner.passes.packing import packable, packed_logits


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


def sequence_logprobs(model: torch.nn.Module, batch: SequenceBatch, temperature: float = 1.0,
                      prompts: SharedPrompts | None = None, pack: bool = False) -> torch.Tensor:
    """log pi(token j+1 | tokens 0..j) for every position: [B, L-1]; gradients flow if enabled by the caller. With
    `prompts` (covering the batch's rows), only each row's own tokens are run, on its prompt's cached states: the
    response positions hold the same values, the prompt positions 0. `pack`: whole rows run as one packed pass
    where the model allows it (`learner.passes.packing`; with `prompts`, they decide)."""
    logits, labels, place = pass_logits(model, batch, prompts, pack)
    return place(logprobs_from_logits(logits, labels, temperature))


def sequence_logprobs_and_entropy(model: torch.nn.Module, batch: SequenceBatch, temperature: float = 1.0,
                                  entropy_grad: bool = True, prompts: SharedPrompts | None = None,
                                  pack: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logprobs` plus the entropy of each position's next-token distribution at `temperature`:
    two [B, L-1] tensors from one forward pass. Gradients flow if enabled by the caller, and into the entropy only
    with `entropy_grad` (else its [B, L-1, V] softmax is not kept for backward). `prompts`: as `sequence_logprobs`
    (the entropy, too, 0 at prompt positions) and `pack`."""
    logits, labels, place = pass_logits(model, batch, prompts, pack)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = place(entropy_from_logits(logits, temperature))
    return place(logprobs_from_logits(logits, labels, temperature)), entropy


def _as_is(values: torch.Tensor) -> torch.Tensor:
    return values


def pass_logits(model: torch.nn.Module, batch: SequenceBatch, prompts: SharedPrompts | None, pack: bool
                ) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """One pass's logits (any head's outputs: a value model's too), the tokens they predict and `place` (per-position
    values -> [B, L-1]): each row's own tokens on its prompt's cached states with `prompts` (`SharedPrompts.forward`);
    else whole rows, in one packed pass over their real tokens with `pack` where the model allows it (`_packed`), or
    one padded pass."""
    if prompts is not None:
        return prompts.forward(model, batch)
    if pack and packable(model):
        positions = torch.arange(batch.input_ids.shape[1], device=batch.device).expand_as(batch.input_ids)
        return _packed(model, batch.input_ids, batch.attention_mask.bool(), positions)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    return logits[:, :-1], batch.input_ids[:, 1:], _as_is


def _packed(model: torch.nn.Module, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
            prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None, prefix_mask: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """A packed pass over rows `ids` [b, R] (`packed_logits`): the real tokens' logits as [T, 1, V] (a row per token,
    so the float32 log-softmax is chunked by tokens), the tokens they predict [T, 1] (the next one in the row; past
    the row's end, token 0, scored but never used, as a padded pass scores padding) and `place`, which puts [T, 1]
    values at their positions of the [b, R-1] layout (position j predicts token j+1; 0 where no real token is)."""
    logits, flat = packed_logits(model, ids, valid, positions, prefix, prefix_mask)
    rows, width = ids.shape
    following = torch.cat([ids[:, 1:], ids.new_zeros(rows, 1)], dim=1).flatten()[flat]

    def place(values: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros(rows * width).index_copy(0, flat, values[:, 0])
        return out.view(rows, width)[:, :-1]

    return logits[:, None], following[:, None], place


def prompt_lengths(batch: SequenceBatch) -> torch.Tensor:
    """[B] prompt tokens of each row: up to its first response token (a row without one: all of it)."""
    responded = batch.response_mask.bool()
    first = responded.to(torch.uint8).argmax(dim=1)  # the first response position (argmax: the first maximum)
    return torch.where(responded.any(dim=1), first + 1, batch.lengths)


def tail_lengths(batch: SequenceBatch) -> torch.Tensor:
    """[B] tokens a pass runs for each row when prompts are shared: its prompt's last token and its response."""
    return batch.lengths - prompt_lengths(batch) + 1


def prompts_shared(batch: SequenceBatch) -> bool:
    """Some two rows have the same prompt of at least two tokens (`SharedPrompts` then saves compute)."""
    prefixes = [prefix for prefix in _prefixes(batch) if prefix]
    return len(set(prefixes)) < len(prefixes)


def sharing(model: torch.nn.Module, batch: SequenceBatch, batching: MicroBatching) -> bool:
    """Passes over `batch` share prompts: `batching` says so, some of its rows do share one and the model's cache
    allows it (`SharedPrompts.supports`)."""
    return batching.share_prompts and prompts_shared(batch) and SharedPrompts.supports(model)


def _distinct(keys: list[bytes], itemsize: int) -> tuple[dict[bytes, int], torch.Tensor]:
    """Each distinct prefix's position, in the order of first appearance, and its tokens [U] (host memory)."""
    index: dict[bytes, int] = {}
    for key in keys:
        index.setdefault(key, len(index))
    return index, torch.tensor([len(key) // itemsize for key in index], dtype=torch.long, device="cpu")


def _prefixes(batch: SequenceBatch) -> list[bytes]:
    """Each row's prompt without its last token, as bytes (a dictionary key)."""
    ids, lengths = batch.input_ids.cpu().numpy(), (prompt_lengths(batch) - 1).tolist()
    return [ids[i, :n].tobytes() for i, n in enumerate(lengths)]


class SharedPrompts:
    """Each distinct prompt of some rows, all its tokens but the last (its "prefix"), run through the model once;
    its key/value states are kept for the passes over the rows' own tokens (the prompt's last token and the
    response), which attend to them as to the prompt itself. A group of G completions of one prompt computes that
    prompt once instead of G times; the logprobs, entropies and gradients are those of whole rows. The prefixes run
    in passes of their own under `batching`'s budget (sorted by length, each padded to its longest).

    With `grad`, the prefixes' states are leaves of each pass's graph: the passes' backwards accumulate their
    gradients, and `backward` (after the last pass) carries them through the prefixes' forward into the
    parameters, once; the prefixes' activations are kept until then (`prompt_rounds` bounds them to one pass's).
    Only models whose cache is transformers' plain per-layer key/value cache (`SharedPrompts.supports`; no sliding
    window, no recurrent state)."""

    def __init__(self, model: torch.nn.Module, batch: SequenceBatch, grad: bool = False,
                 batching: MicroBatching = MicroBatching()):
        # One per distinct prompt (a step's prompts, not its rows), built in host memory, then moved to the batch's
        # device in one copy each.
        self.index, sizes = _distinct(_prefixes(batch), batch.input_ids.element_size())
        distinct = list(self.index)
        ids = torch.zeros(len(distinct), int(sizes.max()), dtype=torch.long, device="cpu")
        self.mask = torch.zeros_like(ids)  # [U, P] 1 on each prefix's tokens
        for u, key in enumerate(distinct):
            if key:
                ids[u, : sizes[u]] = torch.frombuffer(bytearray(key), dtype=batch.input_ids.dtype)
                self.mask[u, : sizes[u]] = 1
        ids, self.mask = ids.to(batch.device), self.mask.to(batch.device)
        self.grad = grad
        self.pack = batching.pack  # the rows' passes (`forward`) packed where the model allows it
        # Per pass: its prefixes' positions among the distinct ones and, per layer, their (keys, values)
        # [u, heads, p, head_dim]. Prefixes of no token (one-token prompts) run in no pass: their rows attend to no
        # cached state (zeros, masked), not to a forward of an all-padding row (which has nothing to attend to).
        self.computed: list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        live = torch.nonzero(sizes > 0).flatten()
        for part in batching.padded.split(sizes[live]) if len(live) else []:
            rows = live[part].to(batch.device)
            width = int(sizes[live[part]].max())
            with torch.set_grad_enabled(grad):
                cache = model(input_ids=ids[rows, :width], attention_mask=self.mask[rows, :width], use_cache=True,
                              logits_to_keep=1).past_key_values
            self.computed.append((rows, [(layer.keys, layer.values) for layer in cache.layers]))
        self.states: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: [U, heads, P, head_dim] each
        for layer in range(len(self.computed[0][1]) if self.computed else 0):
            pair = []
            for which in range(2):
                first = self.computed[0][1][layer][which]
                full = first.new_zeros((len(distinct), first.shape[1], ids.shape[1], first.shape[3]))
                for rows, layers in self.computed:
                    tensor = layers[layer][which]
                    full[rows, :, : tensor.shape[2]] = tensor.detach()
                pair.append(full.requires_grad_(grad))
            self.states.append((pair[0], pair[1]))
        if not grad:
            self.computed = []  # only `backward` needs them: without gradients, the states are all that is kept

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """The model's cache is one plain key/value layer per layer (what the prefixes' states are kept as)."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        config = getattr(model, "config", None)
        if config is None:
            return False
        try:
            cache = DynamicCache(config=config)
        except Exception:  # an architecture transformers' cache does not describe
            return False
        return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)

    def forward(self, model: torch.nn.Module, part: SequenceBatch
                ) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """One pass over `part` (rows among the ones this was built for): the logits of each row's own tokens
        [b, R-1, V] (R: the longest tail; packed, [T, 1, V] for its T real tokens, `_packed`), the tokens they
        predict (the logits' shape without V), and `place`, which puts per-position values of that shape where
        `sequence_logprobs` has them, [b, L-1] (0 at prompt positions and past each row)."""
        from transformers import DynamicCache

        try:
            group = torch.tensor([self.index[key] for key in _prefixes(part)], device=part.device)
        except KeyError:
            raise ValueError("a row's prompt is not among the shared prompts: build SharedPrompts over every row "
                             "its passes compute") from None
        prompt = prompt_lengths(part)  # [b]
        tail = part.lengths - prompt + 1  # [b] the prompt's last token, then the response
        width = max(int(tail.max()), 2)
        offsets = torch.arange(width, device=part.device)
        valid = offsets[None, :] < tail[:, None]  # [b, R]
        last = part.input_ids.shape[1] - 1
        positions = ((prompt - 1)[:, None] + offsets[None, :]).clamp(max=last)  # [b, R] each token's own position
        ids = part.input_ids.gather(1, positions)
        cached = int(prompt.max()) - 1  # the longest prefix among these rows
        # The rows' cached states, per layer, and where they are real; none when no row has a prefix.
        states = [(keys[group, :, :cached], values[group, :, :cached]) for keys, values in self.states] \
            if cached > 0 else None
        prefix_mask = self.mask[group, :cached] if cached > 0 else None
        if self.pack and packable(model):
            logits, labels, unpack = _packed(model, ids, valid, positions, states, prefix_mask)
        else:
            if states is not None:
                past = DynamicCache(ddp_cache_data=states)
                mask = torch.cat([prefix_mask, valid.long()], dim=1)
            else:
                past, mask = None, valid.long()
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=past,
                           use_cache=past is not None).logits[:, :-1]
            labels, unpack = ids[:, 1:], _as_is
        scored = valid[:, 1:]  # tail position j predicts tail token j+1
        columns = last  # the [b, L-1] layout's width
        # Row i's tail position j is layout position prompt_i - 1 + j: distinct within a row for the positions that
        # score a token; the others were clamped to `last` (one column past the layout) and carry 0.
        index = positions[:, :-1]

        def place(values: torch.Tensor) -> torch.Tensor:
            values = unpack(values)  # [b, R-1]
            kept = torch.where(scored, values, torch.zeros((), dtype=values.dtype, device=values.device))
            return values.new_zeros((len(part), columns + 1)).scatter_add(1, index, kept)[:, :columns]

        return logits, labels, place

    def backward(self) -> None:
        """Carry the gradients the passes left on the prefixes' states through the prefixes' forward (once, after
        the last pass's backward)."""
        if not self.grad:
            raise RuntimeError("SharedPrompts was built without gradients")
        outputs, grads = [], []
        for rows, layers in self.computed:
            for computed, states in zip(layers, self.states):
                for tensor, state in zip(computed, states):
                    if state.grad is not None and tensor.requires_grad:
                        outputs.append(tensor)
                        grads.append(state.grad[rows, :, : tensor.shape[2]])
        if outputs:
            torch.autograd.backward(outputs, grads)
        self.computed, self.states = [], []  # the prefixes' graph is freed


def prompt_rounds(batch: SequenceBatch, rows: torch.Tensor, batching: MicroBatching) -> list[torch.Tensor]:
    """`rows` (indices into `batch`) in rounds: every row of a prompt in the same round, each round's distinct
    prefixes one pass of `batching` (so a round's `SharedPrompts` with gradients keeps one pass's activations until
    its backward). In the order of the prefixes' passes."""
    keys = _prefixes(batch.select(rows))
    index, sizes = _distinct(keys, batch.input_ids.element_size())
    round_of = torch.empty(len(index), dtype=torch.long, device="cpu")
    for number, part in enumerate(batching.padded.split(sizes)):
        round_of[part] = number
    of_row = round_of[torch.tensor([index[key] for key in keys], device="cpu")].to(rows.device)
    return [rows[of_row == number] for number in range(int(round_of.max()) + 1)] if len(index) else []


def shared_prompts(model: torch.nn.Module, batch: SequenceBatch, batching: MicroBatching,
                   grad: bool = False) -> SharedPrompts | None:
    """`SharedPrompts` over `batch`'s rows when its passes share prompts (`sharing`); else None (whole rows)."""
    return SharedPrompts(model, batch, grad, batching) if sharing(model, batch, batching) else None


@torch.no_grad()
def batched_logprobs(model: torch.nn.Module, batch: SequenceBatch, batching: MicroBatching,
                     temperature: float = 1.0) -> torch.Tensor:
    """`sequence_logprobs` without gradients, pass by pass (`batching`, prompts shared if it says so): [B, L-1] on
    the batch's device (the model's; zeros past each sequence, and at prompt positions when prompts are shared)."""
    prompts = shared_prompts(model, batch, batching)
    return per_pass(batch, batching, lambda part: sequence_logprobs(model, part, temperature, prompts, batching.pack),
                    tail_lengths(batch) if prompts is not None else None)


def per_pass(batch: SequenceBatch, batching: MicroBatching, compute: Callable[[SequenceBatch], torch.Tensor],
             lengths: torch.Tensor | None = None) -> torch.Tensor:
    """`compute(part)` -> [B_part, L_part-1] for each pass of `batching` over the batch, assembled into [B, L-1]
    float32 on the batch's device (zeros past each sequence). `lengths` [B]: the tokens a pass runs per row, which
    the budget counts (default: whole rows; `tail_lengths` when prompts are shared)."""
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=batch.device)
    for rows in batching.split(batch.lengths if lengths is None else lengths):
        values = compute(batch.select(rows))
        out[rows, : values.shape[1]] = values.float()
    return out

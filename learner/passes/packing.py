"""Packed passes: a pass's rows run through the model as one sequence of their real tokens, each row attending only
to its own tokens (and to its prompt's cached key/value states when prompts are shared).

Owns: `packed_logits` and the attention function it needs (`IMPLEMENTATION`, registered with transformers'
attention interface on first use; how and why: `_attention`). Everything but attention works on tokens one at a
time, so in a packed pass it runs on the real tokens only; attention gathers each row into a padded row of its own.
The attention function is sdpa itself for every other call, so a model is switched once (`packable`) and keeps
generating, caching and scoring whole rows as before. Models whose attention is not sdpa, or that keep a sliding
window, are not packed. A pass checks that every layer's attention saw its layout, so a model whose layers do not
call transformers' attention interface fails loudly instead of letting packed rows see each other. Faster paths
(`packed_paths`): attention over the pack itself (`varlen`), lengths bucketed for compiled layers (`compiled`).
Does not own: cutting passes (`MicroBatching`), shared prompts' states (`SharedPrompts`), logprobs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from learner.passes import varlen

IMPLEMENTATION = "relay_packed"  # the attention implementation a packable model is switched to


@dataclass(frozen=True)
class PackedPaths:
    """How packed passes run (`learner.fast_paths`): attention over the pack itself (`varlen`), and the pack's
    tokens padded to a multiple of `bucket_tokens` through compiled layers (`learner.passes.compiled`)."""

    varlen: bool = False
    bucket_tokens: int | None = None


# The paths of the packed passes under way, and the layout of the one running: set around a pass, not passed through
# the model's forward, so that compiled layers see no argument whose shape follows the rows.
_PATHS: ContextVar[PackedPaths] = ContextVar("packed_paths", default=PackedPaths())
_LAYOUT: ContextVar["_Layout | varlen.Segments | None"] = ContextVar("packed_layout", default=None)


@contextlib.contextmanager
def packed_paths(paths: PackedPaths) -> Iterator[None]:
    """Packed passes inside run by `paths`."""
    token = _PATHS.set(paths)
    try:
        yield
    finally:
        _PATHS.reset(token)


@dataclass
class _Layout:
    """Where a pack's tokens sit in the padded per-row layout attention works in ([rows, width])."""

    rows: int
    width: int
    tokens: int  # the pack's length, bucket padding included (the rows' real tokens come first)
    flat: torch.Tensor  # [T] the packed tokens' positions in the flattened [rows * width] layout
    slots: torch.Tensor  # [rows * width] each layout position's packed token; T (a row of zeros) for padding
    mask: torch.Tensor  # [rows, 1, width, cached + width] bool, True where a query may attend
    prefix: list[tuple[torch.Tensor, torch.Tensor]] | None  # per layer: cached keys, values [rows, kv_heads, P, d]
    calls: int = 0  # attention calls that used this layout (one per layer, checked after the pass)


def packable(model: torch.nn.Module) -> bool:
    """The model's passes can be packed: its attention is sdpa (switched here, once, to `IMPLEMENTATION`, which is
    sdpa for every call without a layout) or already that, and no layer keeps a sliding window."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", IMPLEMENTATION) or not hasattr(model, "set_attn_implementation"):
        return False
    layer_types = getattr(config, "layer_types", None)
    if (any(kind != "full_attention" for kind in layer_types) if layer_types
            else getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)):
        return False
    if implementation == "sdpa":
        _register()
        model.set_attn_implementation(IMPLEMENTATION)
    return True


def packed_logits(model: torch.nn.Module, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                  prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                  prefix_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed pass over the real tokens of right-padded rows `ids` [b, R] (real where `valid` [b, R] bool; each
    at its position `positions` [b, R]): the logits of those tokens [T, V], in the rows' order, and their places in
    the flattened [b * R] layout [T]. No [b, R, V] tensor is made: a pass of short rows beside a long one would pad
    its logits to the long one. With `prefix` (per layer, the rows' cached keys and values [b, kv_heads, P,
    head_dim]) and `prefix_mask` [b, P] (1 on real cached tokens), each row attends to its cached states before its
    own tokens, as to a prompt. The model must be `packable`. Gradients flow into the model and into `prefix` if
    enabled by the caller. Under `packed_paths`: attention over the pack itself (`varlen`), and with `bucket_tokens`
    the pack padded to a multiple of it (tokens 0 at position 0, after the rows' and seen by none of them, their
    outputs dropped: no loss or gradient reaches or leaves them)."""
    rows, width = ids.shape
    paths = _PATHS.get()
    flat = torch.nonzero(valid.flatten()).flatten()  # [T]
    count = len(flat)
    tokens = bucketed(count, paths.bucket_tokens)
    if paths.varlen:
        layout = varlen.segments(valid, tokens, prefix, prefix_mask)
    else:
        layout = _gathered(valid, flat, tokens, prefix, prefix_mask)
    padding = tokens - count
    packed_ids = torch.cat([ids.flatten()[flat], ids.new_zeros(padding)])[None]
    packed_positions = torch.cat([positions.flatten()[flat], positions.new_zeros(padding)])[None]
    # A 4-D mask is handed to the model as is (transformers builds none); attention reads the layout instead.
    placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=ids.device)
    token = _LAYOUT.set(layout)
    try:
        logits = model(input_ids=packed_ids, position_ids=packed_positions, attention_mask=placeholder,
                       use_cache=False).logits[0, :count]  # [T, V]
    finally:
        _LAYOUT.reset(token)
    layers = getattr(model.config, "num_hidden_layers", None)
    if layout.calls == 0 or (layers is not None and layout.calls != layers):
        raise RuntimeError(f"a packed pass reached the attention of {layout.calls} of the model's {layers} layers "
                           f"(its layers do not call transformers' attention interface): packed rows would see each "
                           "other; set learner.pack_sequences=false and reference.pack_sequences=false")
    return logits, flat


def bucketed(tokens: int, bucket: int | None) -> int:
    """`tokens` rounded up to a multiple of `bucket` (as it is when None): the lengths compiled layers see."""
    return tokens if bucket is None else max(1, -(-tokens // bucket)) * bucket


def bucketed_pass() -> bool:
    """A packed pass runs with its length bucketed (`PackedPaths.bucket_tokens`): compiled layers may run it."""
    return _LAYOUT.get() is not None and _PATHS.get().bucket_tokens is not None


def _gathered(valid: torch.Tensor, flat: torch.Tensor, tokens: int,
              prefix: list[tuple[torch.Tensor, torch.Tensor]] | None, prefix_mask: torch.Tensor | None) -> _Layout:
    """The padded per-row layout of a pack of `tokens` whose real tokens are `valid`'s at `flat`."""
    rows, width = valid.shape
    device = valid.device
    slots = torch.full((rows * width,), len(flat), dtype=torch.long, device=device)
    slots[flat] = torch.arange(len(flat), device=device)
    offsets = torch.arange(width, device=device)
    mask = (offsets[None, :, None] >= offsets[None, None, :]) & valid[:, None, :]  # [b, R, R] causal, real keys
    if prefix is not None:
        cached = prefix_mask.to(torch.bool)[:, None, :].expand(rows, width, prefix_mask.shape[1])
        mask = torch.cat([cached, mask], dim=2)
    return _Layout(rows, width, tokens, flat, slots, mask[:, None], prefix)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention; inside a packed pass, over each row's tokens alone. query [1, heads, N, d],
    key and value [1, kv_heads, N, d] (the pack, N = T real tokens and any bucket padding) -> [1, N, heads, d].

    The packed queries, keys and values are gathered into one padded row per sequence ([rows, heads, longest, d]),
    run through sdpa with each row's causal mask, and scattered back: the CPU equivalent of a GPU's variable-length
    attention, whose padding costs only here, where transformers' own packed format (position ids that restart)
    builds a dense block-diagonal mask over the whole pack, whose cost grows with its square (docs/benchmarks.md,
    "How passes are cut"). Bucket padding attends to nothing here: its outputs are zeros. With `PackedPaths.varlen`,
    `varlen.attention` instead. Never traced into a compiled layer's graph (`_register`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = _LAYOUT.get()
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layout.calls += 1
    if isinstance(layout, varlen.Segments):
        return varlen.attention(layout, module, query, key, value, dropout, scaling), None
    count = len(layout.flat)

    def per_row(states: torch.Tensor) -> torch.Tensor:  # [1, h, N, d] -> [rows, h, width, d]
        real = states[0, :, :count]
        padded = torch.cat([real, real.new_zeros(real.shape[0], 1, real.shape[2])], dim=1)
        padded = padded.index_select(1, layout.slots)
        return padded.view(padded.shape[0], layout.rows, layout.width, padded.shape[2]).transpose(0, 1)

    query, key, value = per_row(query), per_row(key), per_row(value)
    if layout.prefix is not None:
        keys, values = layout.prefix[module.layer_idx]
        key, value = torch.cat([keys, key], dim=2), torch.cat([values, value], dim=2)
    out, _ = sdpa_attention_forward(module, query, key, value, layout.mask, dropout=dropout, scaling=scaling,
                                    is_causal=False)  # [rows, width, heads, d]
    out = out.reshape(layout.rows * layout.width, *out.shape[2:]).index_select(0, layout.flat)
    if layout.tokens > count:
        out = torch.cat([out, out.new_zeros(layout.tokens - count, *out.shape[1:])])
    return out[None], None


_registered = False


def _register() -> None:
    """`IMPLEMENTATION` in transformers' attention and mask interfaces (masks: sdpa's), once per process."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        # Outside dynamo's graphs: compiled layers (`learner.passes.compiled`) break around it, so their graphs see
        # only the pack's length, never the rows' shapes the layout holds.
        AttentionInterface.register(IMPLEMENTATION, torch.compiler.disable(_attention))
        AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
        _registered = True

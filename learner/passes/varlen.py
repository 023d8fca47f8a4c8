"""Attention over a packed pass's tokens as they lie in the pack (`learner.fast_paths.varlen_attention`): no row is
gathered into a padded row of its own.

Owns `Segments` (where each row's tokens sit in the pack, bucket padding a segment of its own) and `attention`:
torch's `varlen_attn` (flash attention over `cu_seqlens`) on CUDA in float16 and bfloat16, when no row attends to a
shared prompt's cached states; else FlexAttention with a block mask that lets a query see its own row's cached states
and its row's tokens up to itself, compiled (on a CPU, which has no FlexAttention backward, its mask evaluated for
every query and key of the pack through sdpa, with or without gradients alike: tiny shapes only). `varlen_attn`
cannot take the prefixes, whose lengths differ from the rows' own: those passes run FlexAttention. The same numbers as
the gathered path up to the softmax's summation order (tests/unit/test_packed_fast_paths.py).
Does not own: the pack itself or the choice of path (`learner.passes.packing`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Segments:
    """A pack of `tokens` tokens: each row's real tokens one after another, then bucket padding (one more segment)."""

    tokens: int
    row_of: torch.Tensor  # [N] each token's row; the padding's is the row count
    cu_seqlens: torch.Tensor  # [segments + 1] int32 where each segment starts, then the pack's end
    longest: int  # the longest segment
    prefix: list[tuple[torch.Tensor, torch.Tensor]] | None  # per layer: cached keys, values [rows, kv_heads, P, d]
    cached: torch.Tensor | None  # [C] the real cached tokens' places in the flattened [rows * P] prefix
    block_mask: Any = None  # FlexAttention's, built on the first layer that needs it, shared by the others
    calls: int = 0  # attention calls that used this layout (one per layer, checked after the pass)


def segments(valid: torch.Tensor, tokens: int, prefix: list[tuple[torch.Tensor, torch.Tensor]] | None,
             prefix_mask: torch.Tensor | None) -> Segments:
    """The segments of a pack of `tokens` tokens holding the real tokens of rows `valid` [b, R] (bool, each row's
    real tokens first), with the rows' cached `prefix` states where `prefix_mask` [b, P] is 1."""
    rows = valid.shape[0]
    lengths = valid.sum(dim=1)  # [b]
    count = int(lengths.sum())
    row_of = torch.repeat_interleave(torch.arange(rows, device=valid.device), lengths)
    if tokens > count:
        lengths = torch.cat([lengths, lengths.new_full((1,), tokens - count)])
        row_of = torch.cat([row_of, row_of.new_full((tokens - count,), rows)])
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=valid.device)
    cu_seqlens[1:] = torch.cumsum(lengths, dim=0)
    cached = None if prefix is None else torch.nonzero(prefix_mask.flatten().to(torch.bool)).flatten()
    return Segments(tokens, row_of, cu_seqlens, int(lengths.max()) if len(lengths) else 0, prefix, cached)


def attention(layout: Segments, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, dropout: float, scaling: float | None) -> torch.Tensor:
    """Each pack token's attention over its own row (its cached states, then its row's tokens up to itself): query
    [1, heads, N, d], key and value [1, kv_heads, N, d] -> [1, N, heads, d]."""
    if dropout:
        raise ValueError("variable-length attention has no dropout: set the model's attention_dropout to 0 or "
                         "learner.fast_paths.varlen_attention=false")
    if layout.prefix is None and _flash(query):
        from torch.nn.attention.varlen import varlen_attn

        q, k, v = (states[0].transpose(0, 1).contiguous() for states in (query, key, value))  # [N, heads, d]
        out = varlen_attn(q, k, v, layout.cu_seqlens, layout.cu_seqlens, layout.longest, layout.longest,
                          scale=scaling, window_size=(-1, 0), enable_gqa=q.shape[1] != k.shape[1])
        return out[None]
    if layout.prefix is not None:  # the rows' real cached states before the pack's keys and values
        keys, values = layout.prefix[module.layer_idx]
        key = torch.cat([_flattened(keys, layout.cached), key], dim=2)
        value = torch.cat([_flattened(values, layout.cached), value], dim=2)
    gqa = query.shape[1] != key.shape[1]
    if _dense(query):
        from torch.nn.attention.flex_attention import create_mask

        mask = create_mask(_same_row_causal(layout, key.shape[2]), None, None, layout.tokens, key.shape[2],
                           device=query.device)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                               enable_gqa=gqa)
        return out.transpose(1, 2)
    if layout.block_mask is None:
        from torch.nn.attention.flex_attention import create_block_mask

        layout.block_mask = create_block_mask(_same_row_causal(layout, key.shape[2]), None, None, layout.tokens,
                                              key.shape[2], device=query.device, _compile=query.device.type == "cuda")
    out = _flex(query.device)(query, key, value, block_mask=layout.block_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2)


def _dense(query: torch.Tensor) -> bool:
    """FlexAttention's mask evaluated for every query and key, through sdpa: on a CPU, where FlexAttention has no
    backward, with or without gradients alike, so old logprobs run the update's arithmetic."""
    return query.device.type == "cpu"


def _flash(query: torch.Tensor) -> bool:
    """torch's `varlen_attn` can run this: a CUDA device, a half-precision dtype, a torch whose `varlen_attn` takes
    a causal window and grouped keys (older ones spell them otherwise: FlexAttention then)."""
    if query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    import inspect

    return {"window_size", "enable_gqa"} <= set(inspect.signature(varlen_attn).parameters)


def _flattened(states: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """[rows, kv_heads, P, d] cached states -> [1, kv_heads, C, d], the real ones, row after row."""
    rows, heads, width, dim = states.shape
    return states.transpose(0, 1).reshape(heads, rows * width, dim).index_select(1, cached)[None]


def _same_row_causal(layout: Segments, keys: int) -> Any:
    """FlexAttention's mask function over `keys` keys (the real cached states of every row, then the pack): query q
    sees key k when both are of the same row and k is cached or not after q."""
    row_of = layout.row_of
    cached = keys - layout.tokens
    kv_row, kv_order = row_of, torch.arange(layout.tokens, device=row_of.device)
    if cached:
        width = layout.prefix[0][0].shape[2]
        kv_row = torch.cat([layout.cached // width, row_of])
        kv_order = torch.cat([kv_order.new_full((cached,), -1), kv_order])

    def same_row_causal(b, h, q, kv):
        return (row_of[q] == kv_row[kv]) & (kv_order[kv] <= q)

    return same_row_causal


_compiled_flex: Any = None


def _flex(device: torch.device) -> Any:
    """FlexAttention: compiled on CUDA (once per process), eager elsewhere."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex

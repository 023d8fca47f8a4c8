"""Packed passes: a pass's rows run through the model as one sequence of their real tokens, each row attending only
to its own tokens (and to its prompt's cached key/value states when prompts are shared).

Owns: `packed_logits` and the attention function it needs (`IMPLEMENTATION`, registered with transformers'
attention interface on first use; how and why: `_attention`). Everything but attention works on tokens one at a
time, so in a packed pass it runs on the real tokens only; attention gathers each row into a padded row of its own.
The attention function is sdpa itself for every other call, so a model is switched once (`packable`) and keeps
generating, caching and scoring whole rows as before. Models whose attention is not sdpa, or that keep a sliding
window, are not packed. A pass checks that every layer's attention saw its layout, so a model whose layers do not
call transformers' attention interface fails loudly instead of letting packed rows see each other.
Does not own: cutting passes (`MicroBatching`), shared prompts' states (`SharedPrompts`), logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IMPLEMENTATION = "relay_packed"  # the attention implementation a packable model is switched to


@dataclass
class _Layout:
    """Where a pack's tokens sit in the padded per-row layout attention works in ([rows, width])."""

    rows: int
    width: int
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
    enabled by the caller."""
    rows, width = ids.shape
    device = ids.device
    flat = torch.nonzero(valid.flatten()).flatten()  # [T]
    slots = torch.full((rows * width,), len(flat), dtype=torch.long, device=device)
    slots[flat] = torch.arange(len(flat), device=device)
    offsets = torch.arange(width, device=device)
    mask = (offsets[None, :, None] >= offsets[None, None, :]) & valid[:, None, :]  # [b, R, R] causal, real keys
    if prefix is not None:
        cached = prefix_mask.to(torch.bool)[:, None, :].expand(rows, width, prefix_mask.shape[1])
        mask = torch.cat([cached, mask], dim=2)
    layout = _Layout(rows, width, flat, slots, mask[:, None], prefix)
    # The 4-D mask is handed to the model as is (transformers passes a prepared 4-D mask through), so it builds none.
    logits = model(input_ids=ids.flatten()[flat][None], position_ids=positions.flatten()[flat][None],
                   attention_mask=layout.mask, use_cache=False, packed_layout=layout).logits[0]  # [T, V]
    layers = getattr(model.config, "num_hidden_layers", None)
    if layout.calls == 0 or (layers is not None and layout.calls != layers):
        raise RuntimeError(f"a packed pass reached the attention of {layout.calls} of the model's {layers} layers "
                           f"(its layers do not call transformers' attention interface): packed rows would see each "
                           "other; set learner.pack_sequences=false and reference.pack_sequences=false")
    return logits, flat


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               packed_layout: _Layout | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention; given a `packed_layout`, over each row's tokens alone. query [1, heads, T, d],
    key and value [1, kv_heads, T, d] (the pack) -> [1, T, heads, d].

    The packed queries, keys and values are gathered into one padded row per sequence ([rows, heads, longest, d]),
    run through sdpa with each row's causal mask, and scattered back: the CPU equivalent of a GPU's variable-length
    attention, whose padding costs only here, where transformers' own packed format (position ids that restart)
    builds a dense block-diagonal mask over the whole pack, whose cost grows with its square (docs/benchmarks.md,
    "How passes are cut")."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layout = packed_layout
    layout.calls += 1

    def per_row(states: torch.Tensor) -> torch.Tensor:  # [1, h, T, d] -> [rows, h, width, d]
        padded = torch.cat([states[0], states.new_zeros(states.shape[1], 1, states.shape[3])], dim=1)
        padded = padded.index_select(1, layout.slots)
        return padded.view(padded.shape[0], layout.rows, layout.width, padded.shape[2]).transpose(0, 1)

    query, key, value = per_row(query), per_row(key), per_row(value)
    if layout.prefix is not None:
        keys, values = layout.prefix[module.layer_idx]
        key, value = torch.cat([keys, key], dim=2), torch.cat([values, value], dim=2)
    out, _ = sdpa_attention_forward(module, query, key, value, layout.mask, dropout=dropout, scaling=scaling,
                                    is_causal=False)  # [rows, width, heads, d]
    out = out.reshape(layout.rows * layout.width, *out.shape[2:]).index_select(0, layout.flat)
    return out[None], None


_registered = False


def _register() -> None:
    """`IMPLEMENTATION` in transformers' attention and mask interfaces (masks: sdpa's), once per process."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(IMPLEMENTATION, _attention)
        AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
        _registered = True

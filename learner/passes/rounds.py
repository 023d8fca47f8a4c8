"""The passes of a minibatch's update, and the old logprobs computed in those same passes.

Owns `update_rounds` (a rank's passes over a minibatch's rows, in rounds that share their prompts) and
`in_update_passes` (per-token values of the whole batch computed pass by pass in the first epoch's minibatches, the
rows of each pass in the same order and shapes as the update's forward will run them). In bfloat16 a row's logits
depend on the shapes of the pass it is in (a matmul's blocking: verl #6280), so old logprobs computed in other passes
than the update's would give ratios that are not 1 before anything changed; computed in the same passes they are
the same numbers (tests/unit/test_fast_paths.py).
Does not own: cutting passes (`MicroBatching`), shared prompts (`SharedPrompts`), ranks (`learner.distributed`,
passed in as `dp`), the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from learner.passes.micro_batches import MicroBatching
from learner.passes.sequences import SequenceBatch, SharedPrompts, prompt_rounds, sharing, tail_lengths

Passes = list[tuple[torch.Tensor, bool]]  # each pass's rows (global indices) and whether it is live


def update_rounds(model: torch.nn.Module, batch: SequenceBatch, rows: torch.Tensor, batching: MicroBatching, dp: Any,
                  whole_rows: bool, compute: Callable[[], Any], grad: bool = True
                  ) -> Iterator[tuple[SharedPrompts | None, Passes]]:
    """This rank's passes over `rows`, in rounds that share their prompts: each round's `SharedPrompts` (computed,
    with gradients when `grad`, in the `compute()` context when the round is reached: one prefix pass's activations
    are kept at a time) and its passes, cut by the tokens they run (each row's own; whole rows with `whole_rows`, as a
    value model runs them). Without shared prompts, one round of `dp.micro_batches`."""
    mine = dp.share(rows)
    if not sharing(model, batch.select(mine), batching):
        yield None, dp.micro_batches(rows, batch.lengths, batching)
        return
    lengths = batch.lengths if whole_rows else tail_lengths(batch)
    for round_rows in prompt_rounds(batch, mine, batching):
        with compute():
            prompts = SharedPrompts(model, batch.select(round_rows), grad, batching)
        yield prompts, [(round_rows[part], True) for part in batching.split(lengths[round_rows])]


def in_update_passes(batch: SequenceBatch, minibatches: list[torch.Tensor],
                     rounds: Callable[[torch.Tensor], Iterator[tuple[SharedPrompts | None, Passes]]],
                     score: Callable[[SequenceBatch, SharedPrompts | None], torch.Tensor],
                     all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`score(pass, prompts)` -> [b, l-1] for every pass `rounds(b_idx)` gives of each minibatch `b_idx`, placed into
    the batch's [B, L-1] float32 (zeros past each sequence) and summed over ranks (`all_reduce`: each row is one
    rank's, 0 on the others). Dead passes run (ranks run equally many) and are not placed."""
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=batch.device)
    for b_idx in minibatches:
        for prompts, passes in rounds(b_idx):
            for mb_idx, live in passes:
                values = score(batch.select(mb_idx), prompts)
                if live:
                    out[mb_idx, : values.shape[1]] = values.float()
    return all_reduce(out)

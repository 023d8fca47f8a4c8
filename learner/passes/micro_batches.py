"""How a batch's rows are cut into forward/backward passes: `MicroBatching`, a budget of rows and tokens per pass.

Owns: the budgets (`max_rows`, `max_tokens`) and the cut (`MicroBatching.split`: rows sorted longest first, a pass
closing when one more row would take it over a budget), so compute follows the real tokens, not the batch's longest;
and the two choices that decide what the token budget counts: prompts shared by a group's rows (`share_prompts`) and
packed passes (`pack`). Every pass over token rows is cut here: the learner's, the value model's, the reference's
and the reward models'.
Does not own: the token layout or running the passes (`learner.passes.sequences`: `per_pass`, `SharedPrompts`),
packing (`learner.passes.packing`), or which of a minibatch's passes a rank runs (`learner.distributed`). Imports
only torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class MicroBatching:
    """How rows are cut into forward/backward passes: sorted longest first, a pass closes when one more row would
    take it over `max_rows` rows or `max_tokens` tokens (padded tokens, rows x its longest sequence; packed, the
    rows' own tokens; a longer sequence than that is a pass alone). None: no limit of that kind (both None: one
    pass)."""

    max_rows: int | None = None
    max_tokens: int | None = None
    # Each distinct prompt computed once for the rows that share it (`SharedPrompts`); the budgets then count each
    # row's own tokens (its prompt's last token and its response: `tail_lengths`).
    share_prompts: bool = False
    # Each pass's rows run as one packed sequence of their real tokens (`learner.passes.packing`), where the model
    # allows it (`packable`; else padded passes); the budget then counts real tokens.
    pack: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int | None):  # `auto` is made a number before a run starts
            raise ValueError(f"max_tokens_per_micro_batch={self.max_tokens!r} reached the learner unresolved: "
                             "relay train, plan and serve make `auto` a number (cluster.plan.resolve_token_budget)")

    @property
    def padded(self) -> MicroBatching:
        """The same budgets over padded passes (what prompts' prefix passes are cut by)."""
        return replace(self, pack=False) if self.pack else self

    def split(self, lengths: torch.Tensor) -> list[torch.Tensor]:
        """Passes over rows whose token counts are `lengths` [N]: each a tensor of positions into `lengths` (on its
        device), every position exactly once, in a fixed order (a stable sort: ties keep their order)."""
        host = lengths.detach().to("cpu", torch.long)
        order = torch.sort(host, descending=True, stable=True).indices
        cuts, rows, longest, tokens = [], 0, 0, 0
        for position, length in enumerate(host[order].tolist()):
            longest = max(longest, length)
            if rows and ((self.max_rows is not None and rows + 1 > self.max_rows)
                         or (self.max_tokens is not None
                             and (tokens + length if self.pack else (rows + 1) * longest) > self.max_tokens)):
                cuts.append(position)
                rows, longest, tokens = 0, length, 0
            rows += 1
            tokens += length
        return [part.to(lengths.device) for part in order.tensor_split(cuts)] if len(host) else []

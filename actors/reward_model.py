"""RewardModelWorker: a frozen reward model scoring prompt + completion texts, in batches.

Owns: a transformers `AutoModelForSequenceClassification` with one output (the score) in eval mode with gradients
off, on the actor's GPU when it has one (`learner.device.pick_device`), its own tokenizer (a reward model need not
share the policy's), and batched scoring of right-padded text (texts sorted by token count and cut into passes by
a token budget, `learner.algo.sequences.MicroBatching`, each padded to its own longest).
Does not own: combining or normalising scores (the driver, `cluster/run/scoring.py`). A plain class: Ray wraps it in
`cluster/`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from learner.algo.sequences import MicroBatching
from learner.device import pick_device


class RewardModelWorker:
    """`score(prompts, completions)` -> one float per pair: the model's output on the concatenated text."""

    def __init__(self, model_path: str, dtype: str = "float32", num_threads: int = 1,
                 batching: MicroBatching = MicroBatching(max_tokens=1024)):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.set_num_threads(num_threads)
        self.device = pick_device()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=getattr(torch, dtype))
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {model_path} has {self.model.config.num_labels} outputs; a reward model "
                             "has one (num_labels=1)")
        self.model.to(self.device).eval().requires_grad_(False)
        pad_id = self.model.config.pad_token_id
        if pad_id is None:  # the classifier reads the last non-pad token, so it must know which id pads
            pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else \
                self.tokenizer.eos_token_id
            self.model.config.pad_token_id = pad_id
        self.pad_id = pad_id
        self.batching = batching  # how a request's texts are cut into forward passes

    @torch.no_grad()
    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """Scores of `prompt + completion`, [B], in order; tokenised in one call, scored pass by pass
        (`self.batching`), right-padded."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        if not prompts:
            return []
        ids = self.tokenizer([p + c for p, c in zip(prompts, completions)], add_special_tokens=False)["input_ids"]
        scores = torch.zeros(len(ids), dtype=torch.float32, device="cpu")
        for rows in self.batching.split(torch.tensor([len(row) for row in ids], device="cpu")):
            part = [ids[i] for i in rows.tolist()]
            length = max(len(row) for row in part)
            # Filled in host memory row by row, then moved to the model's device in one copy each.
            input_ids = torch.full((len(part), length), self.pad_id, dtype=torch.long, device="cpu")
            attention_mask = torch.zeros((len(part), length), dtype=torch.long, device="cpu")
            for i, row in enumerate(part):
                input_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long, device="cpu")
                attention_mask[i, :len(row)] = 1
            logits = self.model(input_ids=input_ids.to(self.device),
                                attention_mask=attention_mask.to(self.device)).logits  # [b, 1]
            scores[rows] = logits[:, 0].float().cpu()
        return scores.tolist()

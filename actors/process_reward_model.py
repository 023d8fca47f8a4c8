"""ProcessRewardModelWorker: a frozen process reward model (PRM) scoring each step of prompt + completion texts.

Owns: a transformers `AutoModelForTokenClassification` (one output: the score is the raw output; two: the softmax
probability of label 1, as Qwen2.5-Math-PRM reads its step tokens) in eval mode with gradients off, on the actor's GPU
when it has one (`learner.passes.device.pick_device`), its own fast tokenizer (offset mappings find each step's end
token), and batched scoring of right-padded text (texts sorted by token count and cut into passes by a token budget,
`learner.passes.micro_batches.MicroBatching`, each padded to its own longest). A sample's text is the prompt, then every
step followed by the separator; step j is scored at the token holding the first character of its separator.
Does not own: splitting completions into steps, or turning step scores into rewards or advantages (the driver,
`cluster/run/scoring.py`). A plain class: Ray wraps it in `cluster/`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from learner.passes.device import pick_device
from learner.passes.micro_batches import MicroBatching


class ProcessRewardModelWorker:
    """`score_steps(prompts, steps, separator)` -> one float per step of each sample: the model's output at the token
    that holds the first character of the separator after that step."""

    def __init__(self, model_path: str, dtype: str = "float32", num_threads: int = 1,
                 batching: MicroBatching = MicroBatching(max_tokens=1024)):
        from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

        torch.set_num_threads(num_threads)
        self.device = pick_device()
        config = AutoConfig.from_pretrained(model_path)
        # A causal LM or sequence classifier also loads as a token classifier, with a fresh random head: refuse it.
        architectures = config.architectures or []
        if not any(name.endswith("ForTokenClassification") for name in architectures):
            named = ", ".join(architectures) or "of no named architecture"
            raise ValueError(f"process reward model {model_path} is {named}, not a token classifier: "
                             "config.architectures must name a *ForTokenClassification model")
        if config.num_labels not in (1, 2):
            raise ValueError(f"process reward model {model_path} has {config.num_labels} outputs; a process reward "
                             "model has 1 (the score) or 2 (the score is the probability of label 1)")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if not self.tokenizer.is_fast:
            raise ValueError(f"the tokenizer of process reward model {model_path} is a slow one, which gives no offset "
                             "mappings: save a fast tokenizer (tokenizer.json) with the model")
        self.model, loading = AutoModelForTokenClassification.from_pretrained(
            model_path, config=config, dtype=getattr(torch, dtype), output_loading_info=True)
        if loading["missing_keys"]:
            raise ValueError(f"process reward model {model_path} lacks weights {sorted(loading['missing_keys'])}, "
                             "which would be random: save the whole token classifier")
        self.model.to(self.device).eval().requires_grad_(False)
        self.num_labels = config.num_labels
        self.max_positions = getattr(config, "max_position_embeddings", None)  # None: the model sets no limit
        # Any id pads: padding is masked and comes after every token that is read.
        self.pad_id = next((i for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id) if i is not None), 0)
        self.batching = batching  # how a request's texts are cut into forward passes

    @torch.no_grad()
    def score_steps(self, prompts: Sequence[str], steps: Sequence[Sequence[str]], separator: str) -> list[list[float]]:
        """Scores of each step, [B][S_i], in order. Sample i's text is `prompts[i]` then every step of `steps[i]`
        followed by `separator`, tokenised once without special tokens; step j's score is read at the token holding
        the first character of the separator after it (steps whose separators share a token share its score, e.g.
        an empty step's separator merged with the next one). A sample with no steps gets [] and no forward pass.
        Scored pass by pass (`self.batching`), right-padded."""
        if len(prompts) != len(steps):
            raise ValueError(f"{len(prompts)} prompts but {len(steps)} step lists")
        if not separator:
            raise ValueError("the step separator is empty: give the string that ends each step, e.g. '\\n'")
        scores: list[list[float]] = [[] for _ in prompts]
        samples = [i for i, sample_steps in enumerate(steps) if sample_steps]
        if not samples:
            return scores
        texts, starts = [], []  # starts[k]: where each separator of samples[k] begins, in characters
        for i in samples:
            text, separator_starts = prompts[i], []
            for step in steps[i]:
                separator_starts.append(len(text) + len(step))
                text += step + separator
            texts.append(text)
            starts.append(separator_starts)
        encoded = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        positions = []  # positions[k][j]: the token that scores step j of samples[k]
        for k, i in enumerate(samples):
            if self.max_positions is not None and len(ids[k]) > self.max_positions:
                raise ValueError(f"sample {i}: prompt + steps are {len(ids[k])} tokens but the process reward model "
                                 f"takes at most {self.max_positions}: shorten the prompt or the completion")
            positions.append(separator_tokens(encoded["offset_mapping"][k], starts[k], len(separator), i))
        for rows in self.batching.split(torch.tensor([len(row) for row in ids], device="cpu")):
            part = rows.tolist()
            length = max(len(ids[k]) for k in part)
            # Filled in host memory row by row, then moved to the model's device in one copy each.
            input_ids = torch.full((len(part), length), self.pad_id, dtype=torch.long, device="cpu")
            attention_mask = torch.zeros((len(part), length), dtype=torch.long, device="cpu")
            for row, k in enumerate(part):
                input_ids[row, :len(ids[k])] = torch.tensor(ids[k], dtype=torch.long, device="cpu")
                attention_mask[row, :len(ids[k])] = 1
            logits = self.model(input_ids=input_ids.to(self.device),
                                attention_mask=attention_mask.to(self.device)).logits.float().cpu()  # [b, L, labels]
            for row, k in enumerate(part):
                read = logits[row, positions[k]]  # [S, labels]
                step_scores = read[:, 0] if self.num_labels == 1 else torch.softmax(read, dim=-1)[:, 1]
                scores[samples[k]] = step_scores.tolist()
        return scores


def separator_tokens(offsets: Sequence[tuple[int, int]], starts: Sequence[int], width: int,
                     sample: int) -> list[int]:
    """For separators of `width` characters starting at characters `starts` (increasing), the index of the first
    token (by its `offsets`, (start, end) per token) that holds one of their characters: the one holding the first
    character, unless the tokenizer's offsets leave that character out. One token may serve several separators."""
    tokens, k = [], 0
    for start in starts:
        # Skip the tokens that end before this separator, and zero-width tokens.
        while k < len(offsets) and (offsets[k][1] <= start or offsets[k][0] == offsets[k][1]):
            k += 1
        if k == len(offsets) or offsets[k][0] >= start + width:
            raise ValueError(f"sample {sample}: no token holds the step separator at character {start}; the process "
                             "reward model's tokenizer drops it: choose a separator in its vocabulary")
        tokens.append(k)
    return tokens

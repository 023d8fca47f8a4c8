"""Critic: PPO's value model, a transformer with a scalar head, trained beside the policy in the learner actor.

Owns: the value model (a transformers `AutoModelForTokenClassification` with one label, so it saves and loads as a
plain Hugging Face checkpoint), its own AdamW and warm-up schedule, computing values in the token layout of
`learner.algo.sequences`, accumulating the clipped value loss micro-batch by micro-batch, and saving/restoring
itself for checkpoints. Also the two Hugging Face directory helpers the policy and the value model share
(`save_model_dir`, `load_model_weights`). Does not own: GAE (`learner.algo.advantages`), the loss math
(`learner.algo.losses`), when to step or checkpoint (the `Learner`, the driver), or checkpoint atomicity
(`cluster.checkpoint`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from learner.algo.losses import value_loss
from learner.algo.sequences import SequenceBatch

if TYPE_CHECKING:
    from cluster.config import CriticConfig


# Files beside the weights that a model directory needs to be served or tokenized as it is (generation defaults,
# tokenizer, chat template). Weights and config.json come from `save_pretrained`, never from the source.
SIDE_FILE_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                      "*.tiktoken", "spiece.model", "chat_template.*", "generation_config.json",
                      "preprocessor_config.json")


def save_model_dir(model: torch.nn.Module, source: str, directory: str | os.PathLike) -> None:
    """`model` as a Hugging Face directory: safetensors weights and config.json (`save_pretrained`), plus the
    tokenizer and generation files of `source` (the directory or hub id it was loaded from), so that transformers
    and vLLM load `directory` exactly as they load `source`."""
    model.save_pretrained(directory)
    source_dir = Path(source)
    if not source_dir.is_dir():  # a hub id: its files are in (or go to) the local hub cache
        from huggingface_hub import snapshot_download

        source_dir = Path(snapshot_download(source, allow_patterns=list(SIDE_FILE_PATTERNS)))
    for pattern in SIDE_FILE_PATTERNS:
        for path in source_dir.glob(pattern):
            if path.is_file():
                shutil.copyfile(path, Path(directory) / path.name)


def load_model_weights(model: torch.nn.Module, directory: str | os.PathLike) -> None:
    """Copy the safetensors weights of a `save_model_dir` directory into `model` in place, strictly: every key
    must be a parameter or buffer of `model`, and every one of those must be loaded, except tied weights that
    share storage with a loaded one (save_pretrained writes a tied output head once, as the embedding)."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights to load")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(path))
    expected = model.state_dict()
    unexpected = sorted(state.keys() - expected.keys())
    loaded = {expected[name].data_ptr() for name in state.keys() & expected.keys()}
    missing = sorted(name for name in expected.keys() - state.keys() if expected[name].data_ptr() not in loaded)
    if unexpected or missing:
        raise ValueError(f"{directory}: weights do not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}; was it saved from another architecture?")
    model.load_state_dict(state, strict=False)  # strictness checked above, with tied weights allowed for


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear learning-rate warm-up from 0 to the optimizer's lr over `warmup_steps` steps, then constant."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda n: min(1.0, (n + 1) / warmup_steps) if warmup_steps else 1.0)


class Critic:
    """V(s_t) for every position of a batch; `accumulate` adds the value loss's gradient, `step` applies it."""

    def __init__(self, model_path: str, config: CriticConfig, dtype: str = "float32"):
        from transformers import AutoModelForTokenClassification
        from transformers.utils import logging as hf_logging

        self.config = config
        self.model_path = config.path or model_path  # where the tokenizer files of a saved value model come from
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report calls the new head "MISSING": expected, and handled below
        try:
            self.model, info = AutoModelForTokenClassification.from_pretrained(
                config.path or model_path, num_labels=1, dtype=getattr(torch, dtype), output_loading_info=True)
        finally:
            hf_logging.set_verbosity(verbosity)
        # A new head on a policy checkpoint (whatever the architecture calls it): start at V = 0 (rewards are O(1)),
        # not at random values scaled by the backbone's hidden-state norm.
        parameters = dict(self.model.named_parameters())
        with torch.no_grad():
            for name in info["missing_keys"]:
                if name in parameters:
                    parameters[name].zero_()
        self.model.eval()  # no dropout: the value clip compares V with V_old from the same function
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = warmup_schedule(self.optimizer, config.warmup_steps)

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        """V of the state before each next token: [B, L-1], position j is V(tokens 0..j) (scores token j+1's state),
        the layout of `sequence_logprobs`. Gradients flow if enabled by the caller."""
        out = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return out[:, :-1, 0].float()

    @torch.no_grad()
    def compute_values(self, batch: SequenceBatch, micro_batch_size: int) -> torch.Tensor:
        """`values` without gradients, micro-batch by micro-batch: [B, L-1] (zeros past each sequence)."""
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        for start in range(0, len(batch), micro_batch_size):
            part = batch.select(slice(start, start + micro_batch_size))
            out[start : start + micro_batch_size, : part.response_mask.shape[1]] = self.values(part)
        return out

    def accumulate(self, mb: SequenceBatch, old_values: torch.Tensor, returns: torch.Tensor,
                   weight: float) -> dict[str, float]:
        """Backpropagate `weight` x the token-mean clipped value loss of one micro-batch; returns weighted metrics.

        The value loss is always a token mean: it is a regression, and every token's return is one target."""
        values = self.values(mb)
        loss, metrics = value_loss(values, old_values, returns, mb.response_mask, self.config.value_clip, "token-mean")
        (loss * weight).backward()
        with torch.no_grad():
            mask = mb.response_mask.bool()
            mean_value = float(values[mask].mean()) if mask.any() else 0.0
        return {"loss/value": float(loss.detach()) * weight, "value/clip_fraction": float(metrics["clip_fraction"])
                * weight, "value/mean": mean_value * weight}

    def clip_gradients(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))

    def step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def save_model(self, directory: str | os.PathLike) -> None:
        """The value model as a Hugging Face token-classification directory (safetensors)."""
        save_model_dir(self.model, self.model_path, directory)

    def load_model(self, directory: str | os.PathLike) -> None:
        load_model_weights(self.model, directory)

    def training_state(self) -> dict[str, Any]:
        """Optimizer and scheduler state: plain containers of tensors and numbers (`torch.load(weights_only=True)`
        reads them back; the schedule's lambda is not in it and is rebuilt from the config)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_training_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

"""Critic: PPO's value model, a transformer with a scalar head, trained beside the policy in the learner actor.

Owns: the value model (a transformers `AutoModelForTokenClassification` with one label, so it saves and loads as a
plain Hugging Face checkpoint), its own AdamW and warm-up schedule, computing values in the token layout of
`learner.passes.sequences` (in packed passes, `learner.passes.packing`, as the policy's), accumulating the clipped value
loss micro-batch by micro-batch, and saving/restoring itself for checkpoints, data-parallel over the learner's ranks
like the policy (`distribute`). Also the Hugging
Face directory helpers the policy and the value model share (`save_model_dir`, `read_model_weights`,
`load_model_weights`). Does not own: GAE (`learner.algo.advantages`), the loss math
(`learner.algo.losses`), when to step or checkpoint (the `Learner`, the driver), or checkpoint atomicity
(`cluster.run.checkpoint`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from learner.algo.losses import value_loss
from learner.distributed import DataParallel, clip_grad_norm, tied_names
from learner.passes.device import compute_in, matmuls_in, pick_device, warmup_schedule
from learner.passes.sequences import SequenceBatch, pass_logits

if TYPE_CHECKING:
    from learner.config import CriticConfig


# Files beside the weights that a model directory needs to be served or tokenized as it is (generation defaults,
# tokenizer, chat template). Weights and config.json come from `save_pretrained`, never from the source.
SIDE_FILE_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                      "*.tiktoken", "spiece.model", "chat_template.*", "generation_config.json",
                      "preprocessor_config.json")


def save_model_dir(model: torch.nn.Module, source: str, directory: str | os.PathLike,
                   state_dict: dict[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None) -> None:
    """`model` as a Hugging Face directory: safetensors weights and config.json (`save_pretrained`), plus the
    tokenizer and generation files of `source` (the directory or hub id it was loaded from), so that transformers
    and vLLM load `directory` exactly as they load `source`. `state_dict`: the whole weights to write instead of the
    model's own (a sharded model's, gathered, or cast); `dtype`: theirs, recorded in config.json (save_pretrained
    records the model's parameters' dtype)."""
    model.save_pretrained(directory, **({"state_dict": state_dict} if state_dict is not None else {}))
    if dtype is not None and dtype != model.dtype:
        config_path = Path(directory) / "config.json"
        config = json.loads(config_path.read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    source_dir = Path(source)
    if not source_dir.is_dir():  # a hub id: its files are in (or go to) the local hub cache
        from huggingface_hub import snapshot_download

        source_dir = Path(snapshot_download(source, allow_patterns=list(SIDE_FILE_PATTERNS)))
    for pattern in SIDE_FILE_PATTERNS:
        for path in source_dir.glob(pattern):
            if path.is_file():
                shutil.copyfile(path, Path(directory) / path.name)


def load_model_weights(model: torch.nn.Module, directory: str | os.PathLike) -> None:
    """Copy the safetensors weights of a `save_model_dir` directory into `model` in place, strictly (see
    `read_model_weights`)."""
    model.load_state_dict(read_model_weights(model, directory), strict=False)  # strictness checked when read


def read_model_weights(model: torch.nn.Module, directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The safetensors weights of a `save_model_dir` directory, checked strictly against `model`: every key must
    be a parameter or buffer of `model`, and every one of those must be there, except tied weights that are the
    same tensor as a loaded one (save_pretrained writes a tied output head once, as the embedding). In host memory:
    loading them copies each into the model's own device (or, sharded, each rank's slice of it)."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights to load")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(path))
    return check_weights(model, state, directory)


def check_weights(model: torch.nn.Module, state: dict[str, torch.Tensor],
                  source: str | os.PathLike) -> dict[str, torch.Tensor]:
    """`state` (read from `source`), checked strictly against `model` as `read_model_weights` describes."""
    expected = model.state_dict().keys()
    tied = tied_names(model)  # by identity, not storage: also right for a sharded model
    unexpected = sorted(state.keys() - expected)
    loaded = {tied.get(name, name) for name in state.keys() & expected}
    missing = sorted(name for name in expected - state.keys() if tied.get(name, name) not in loaded)
    if unexpected or missing:
        raise ValueError(f"{source}: weights do not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}; was it saved from another architecture?")
    return state


def value_pass(model: torch.nn.Module, batch: SequenceBatch, pack: bool = False) -> torch.Tensor:
    """One pass of a value model (a token classifier with one label) over `batch`'s whole rows: [B, L-1] float32,
    position j the value of tokens 0..j. The policy's pass (`pass_logits`): with `pack`, where the model allows it,
    the rows run as one packed sequence of their real tokens, 0 where no real token is; else one padded pass."""
    outputs, _, place = pass_logits(model, batch, None, pack)  # [B, L-1, 1], or packed [T, 1, 1]
    return place(outputs[..., 0]).float()


class Critic:
    """V(s_t) for every position of a batch; `accumulate` adds the value loss's gradient, `step` applies it."""

    def __init__(self, model_path: str, config: CriticConfig, dtype: str = "float32", master_dtype: str = "float32",
                 pack: bool = False):
        from transformers import AutoModelForTokenClassification
        from transformers.utils import logging as hf_logging

        self.config = config
        self.device = pick_device()
        self.compute_dtype = getattr(torch, dtype)  # forward and backward (autocast when master_dtype is wider)
        self.master_dtype = getattr(torch, master_dtype)  # parameters, gradients, AdamW state, the saved directory
        self.model_path = config.path or model_path  # where the tokenizer files of a saved value model come from
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report calls the new head "MISSING": expected, and handled below
        try:
            self.model, info = AutoModelForTokenClassification.from_pretrained(
                config.path or model_path, num_labels=1, dtype=self.master_dtype, output_loading_info=True)
        finally:
            hf_logging.set_verbosity(verbosity)
        # A new head on a policy checkpoint (whatever the architecture calls it): start at V = 0 (rewards are O(1)),
        # not at random values scaled by the backbone's hidden-state norm.
        parameters = dict(self.model.named_parameters())
        with torch.no_grad():
            for name in info["missing_keys"]:
                if name in parameters:
                    parameters[name].zero_()
        self.model.to(self.device)  # backbone and head, before the optimizer: its state is made beside them
        self.model.eval()  # no dropout: the value clip compares V with V_old from the same function
        self.pack = pack  # a pass's rows run as one packed sequence of their real tokens where the model allows it
        self.dp = DataParallel()
        self._make_optimizer()

    def _make_optimizer(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.lr,
                                           weight_decay=self.config.weight_decay)
        self.scheduler = warmup_schedule(self.optimizer, self.config.warmup_steps)

    def distribute(self, dp: DataParallel) -> None:
        """Make the value model data-parallel over `dp`'s ranks (joined already), before any update: its optimizer
        is rebuilt (fully_shard replaces the parameters)."""
        self.dp = dp
        dp.distribute(self.model)
        self._make_optimizer()

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        """V of the state before each next token: [B, L-1], position j is V(tokens 0..j) (scores token j+1's state),
        the layout of `sequence_logprobs` (packed, `pack`: 0 where no real token is; padded, the padding's own values:
        everything reading them masks them). Gradients flow if enabled by the caller."""
        with compute_in(self.device, self.compute_dtype, self.master_dtype):
            return value_pass(self.model, batch, self.pack)

    @torch.no_grad()
    def compute_values(self, batch: SequenceBatch) -> torch.Tensor:
        """`values` without gradients: [B, L-1] float32 on the batch's device (the caller cuts passes)."""
        return self.values(batch)

    def accumulate(self, mb: SequenceBatch, old_values: torch.Tensor, returns: torch.Tensor,
                   weight: float) -> dict[str, float]:
        """Backpropagate `weight` x the token-mean clipped value loss of one micro-batch; returns weighted metrics.

        The value loss is always a token mean: it is a regression, and every token's return is one target. Over the
        model's tokens (`mb.loss_mask`): the environment's tokens of an episode have no value target."""
        values = self.values(mb)
        loss, metrics = value_loss(values, old_values, returns, mb.loss_mask, self.config.value_clip, "token-mean")
        with matmuls_in(self.device, self.compute_dtype):
            (loss * weight).backward()
        with torch.no_grad():
            mask = mb.loss_mask.bool()
            mean_value = float(values[mask].mean()) if mask.any() else 0.0
        return {"loss/value": float(loss.detach()) * weight, "value/clip_fraction": float(metrics["clip_fraction"])
                * weight, "value/mean": mean_value * weight}

    def clip_gradients(self) -> float:
        return clip_grad_norm(self.model.parameters(), self.config.max_grad_norm)

    def step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def save_model(self, directory: str | os.PathLike) -> None:
        """The value model as a Hugging Face token-classification directory (safetensors), written by rank 0
        (with several ranks every rank must call it: a sharded model's weights are gathered)."""
        weights = self.dp.gather_weights(self.model)
        if self.dp.is_writer:
            save_model_dir(self.model, self.model_path, directory, weights)

    def load_model(self, directory: str | os.PathLike) -> None:
        self.dp.load_weights(self.model, read_model_weights(self.model, directory))

    def training_state(self) -> dict[str, Any]:
        """Optimizer and scheduler state: plain containers of tensors and numbers (`torch.load(weights_only=True)`
        reads them back; the schedule's lambda is not in it and is rebuilt from the config). Whole tensors, on rank 0,
        whatever the ranks (every rank must call it)."""
        return {"optimizer": self.dp.full_optimizer_state(self.optimizer), "scheduler": self.scheduler.state_dict()}

    def load_training_state(self, state: dict[str, Any]) -> None:
        self.dp.load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

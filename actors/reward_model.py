"""RewardModelWorker: a reward model scoring prompt + completion texts, in batches, frozen or fine-tuned during a run.

Owns: a transformers `AutoModelForSequenceClassification` with one output (the score) in eval mode (no dropout, ever),
on the actor's GPU when it has one, its own tokenizer (a reward model need not share the policy's), batched scoring
in passes cut by a token budget (`MicroBatching`); trained (iterative reward modelling), float32 master parameters
computed in `dtype`, AdamW, `fit` on verifier-labelled completions with a loss from REWARD_MODEL_LOSSES (Bradley-Terry
pairs or regression), and `save_state`/`load_state` of the weights and the optimizer. Frozen: gradients off, `dtype`.
Does not own: combining or normalising scores (the driver, `cluster/run/scoring.py`), choosing what to fit on or when,
the training config model, or checkpoint directories and their atomicity (cluster/). A plain class: Ray wraps it in
`cluster/`.

Notation: B: completions (prompts x G, the G completions of a prompt consecutive), G: group size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from learner.passes.device import compute_in, matmuls_in, pick_device, to_cpu
from learner.passes.micro_batches import MicroBatching

OPTIMIZER_FILE = "optimizer.pt"  # beside the Hugging Face files that `save_state` writes: AdamW state, update count
OPTIMIZER_STATE_FORMAT = 1


@dataclass(frozen=True)
class RewardModelTraining:
    """How the reward model is fine-tuned (the `training` dict the driver builds from the config)."""

    lr: float  # AdamW learning rate
    loss: str  # a key of REWARD_MODEL_LOSSES
    epochs: int  # passes over each `fit`'s examples, one optimizer step each
    weight_decay: float
    max_grad_norm: float  # global gradient-norm clip before each step
    seed: int  # the new head's initialisation (fit itself draws no random numbers: no shuffling, no dropout)
    # Start from a model without a reward head (the policy's causal LM, as InstructGPT starts from the SFT model):
    # a new scalar head, seeded. False: the directory is a reward model already.
    new_head: bool = False


@dataclass
class FitLoss:
    """A reward-model loss on one batch of scores."""

    loss: torch.Tensor  # [] the mean over `terms`; 0 (and no gradient to speak of) when terms == 0
    terms: int  # how many terms the mean is over; 0: nothing to learn from
    unit: str  # what a term is: "pairs" (preference pairs) or "examples"
    metrics: dict[str, float]  # how well the scores fit the targets (`accuracy`, `mae`)


def bradley_terry_loss(scores: torch.Tensor, targets: torch.Tensor, group_size: int) -> FitLoss:
    """Bradley-Terry pairwise loss within groups (Ouyang et al. 2022, InstructGPT, eq. 1): every ordered pair (i, j)
    of one group with targets[i] > targets[j] says i is preferred, and
        loss = mean over pairs of -log sigmoid(s_i - s_j).
    Groups whose targets are all equal give no pair. Metrics: `accuracy` (share of pairs with s_i > s_j, 0 when
    there are no pairs).

    Args: scores [B] (with gradient or not), targets [B], group_size G (B divisible by G)."""
    s = scores.view(-1, group_size)  # [B/G, G]
    t = targets.view(-1, group_size)
    prefer = t[:, :, None] > t[:, None, :]  # [B/G, G, G] (i, j): i preferred over j
    margins = (s[:, :, None] - s[:, None, :])[prefer]  # [pairs] s_i - s_j
    pairs = margins.numel()
    if pairs == 0:
        return FitLoss(scores.sum() * 0.0, 0, "pairs", {"accuracy": 0.0})
    loss = -F.logsigmoid(margins).mean()  # -log sigma(s_i - s_j), mean over pairs
    accuracy = float((margins.detach() > 0).float().mean())
    return FitLoss(loss, pairs, "pairs", {"accuracy": accuracy})


def regression_loss(scores: torch.Tensor, targets: torch.Tensor, group_size: int) -> FitLoss:
    """Mean squared error between score and target, loss = mean_b (s_b - y_b)^2; groups play no part. Metrics: `mae`
    (mean |s_b - y_b|).

    Args: scores [B], targets [B], group_size G (unused: one signature for REWARD_MODEL_LOSSES)."""
    examples = scores.numel()
    if examples == 0:
        return FitLoss(scores.sum() * 0.0, 0, "examples", {"mae": 0.0})
    errors = scores - targets  # [B]
    loss = errors.square().mean()  # mean (s - y)^2
    return FitLoss(loss, examples, "examples", {"mae": float(errors.detach().abs().mean())})


class RewardModelWorker:
    """`score(prompts, completions)` -> one float per pair: the model's output on the concatenated text. With
    `training`, `fit(prompts, completions, targets, group_size)` fine-tunes it, and `score` uses the new weights."""

    def __init__(self, model_path: str, dtype: str = "float32", num_threads: int = 1,
                 batching: MicroBatching = MicroBatching(max_tokens=1024), training: dict[str, Any] | None = None):
        from transformers import AutoTokenizer

        torch.set_num_threads(num_threads)
        self.device = pick_device()
        self.training = _training_settings(training) if training is not None else None
        self.compute_dtype = getattr(torch, dtype)  # what the forward (and backward) passes compute in
        # Trained: float32 master parameters, gradients and AdamW state (bfloat16 ones would round small updates away)
        self.master_dtype = torch.float32 if self.training else self.compute_dtype
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = _load_classifier(model_path, self.master_dtype, self.training)
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {model_path} has {self.model.config.num_labels} outputs; a reward model "
                             "has one (num_labels=1)")
        # eval(): no dropout, so scores and the gradients of `fit` come from one deterministic function
        self.model.to(self.device).eval().requires_grad_(self.training is not None)
        pad_id = self.model.config.pad_token_id
        if pad_id is None:  # the classifier reads the last non-pad token, so it must know which id pads
            pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else \
                self.tokenizer.eos_token_id
            self.model.config.pad_token_id = pad_id
        self.pad_id = pad_id
        self.batching = batching  # how a request's texts are cut into forward passes
        self.updates = 0  # optimizer steps taken so far (restored by `load_state`)
        self.optimizer = None
        if self.training:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.training.lr,
                                               weight_decay=self.training.weight_decay)

    @torch.no_grad()
    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """Scores of `prompt + completion`, [B], in order; tokenised in one call, scored pass by pass
        (`self.batching`), right-padded."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        if not prompts:
            return []
        return self._scores(self._passes(prompts, completions)).cpu().tolist()

    def fit(self, prompts: Sequence[str], completions: Sequence[str], targets: Sequence[float],
            group_size: int) -> dict[str, float]:
        """One round of fine-tuning on B = prompts x G examples (`group_size` consecutive completions per prompt)
        labelled with `targets` [B] (e.g. the verifier's rewards): `epochs` full-batch AdamW steps on the configured
        loss, the gradient clipped to `max_grad_norm`. No update when the loss has nothing to learn from (no
        preference pair). Deterministic: no random draws, the passes in sorted order.

        Returns: `loss_before` and the fit metric before any update (`accuracy_before` or `mae_before`), `loss` and
        that metric after the last update (one more forward pass), the count (`pairs` or `examples`), `grad_norm` of
        the last step, `updates` (steps so far, all fits) and `skipped_updates` (steps of this fit dropped for a
        non-finite gradient)."""
        training = self._require_training("fit")
        if not len(prompts) == len(completions) == len(targets):
            raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions and {len(targets)} targets: "
                             "give one of each per example")
        if group_size < 1 or len(prompts) % group_size:
            raise ValueError(f"{len(prompts)} examples do not split into groups of group_size={group_size}")
        loss_fn = REWARD_MODEL_LOSSES[training.loss]
        passes = self._passes(prompts, completions)
        b_targets = torch.tensor(list(targets), dtype=torch.float32, device=self.device)
        first = last = None
        grad_norm, skipped = 0.0, 0
        for _ in range(training.epochs):
            # The loss depends on the model only through the B scores: dL/dtheta = sum_b dL/ds_b ds_b/dtheta. So take
            # dL/ds at no-grad scores, then backpropagate each pass's share: exact for any passes (pairs may span
            # passes), with the memory of one pass, for one more forward per epoch (GradCache, Gao et al. 2021).
            b_scores = self._scores(passes).requires_grad_()
            last = loss_fn(b_scores, b_targets, group_size)
            first = last if first is None else first
            if last.terms == 0:
                break
            last.loss.backward()  # into b_scores.grad: dL/ds, [B]
            self.optimizer.zero_grad(set_to_none=True)
            for rows, input_ids, attention_mask in passes:
                mb_scores = self._forward(input_ids, attention_mask)  # [b] with gradient
                with matmuls_in(self.device, self.compute_dtype):  # sum_b dL/ds_b s_b: the chain rule's share
                    (mb_scores * b_scores.grad[rows]).sum().backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), training.max_grad_norm))
            if math.isfinite(grad_norm):
                self.optimizer.step()
                self.updates += 1
            else:  # a non-finite step would spoil every later score of the run: drop it, report norm 0 (as the learner)
                skipped, grad_norm = skipped + 1, 0.0
            self.optimizer.zero_grad(set_to_none=True)
        if first.terms:  # one more no-grad pass: how the scores fit after the last update
            with torch.no_grad():
                last = loss_fn(self._scores(passes), b_targets, group_size)
        before = {f"{name}_before": value for name, value in first.metrics.items()}
        return {"loss_before": float(first.loss.detach()), "loss": float(last.loss.detach()), **before, **last.metrics,
                first.unit: float(first.terms), "grad_norm": grad_norm, "updates": float(self.updates),
                "skipped_updates": float(skipped)}

    def save_state(self, directory: str) -> None:
        """Write the trained reward model into `directory` (made if missing; the caller makes it atomic): a Hugging
        Face directory of the float32 master weights and the tokenizer (a frozen `RewardModelWorker` loads it as a
        reward model), and `optimizer.pt` (AdamW state, update count; `torch.load(weights_only=True)` reads it).
        `load_state` on a worker built with the same settings then continues bitwise as this one would."""
        self._require_training("save_state")
        root = Path(directory)
        self.model.save_pretrained(root)
        self.tokenizer.save_pretrained(root)
        torch.save(to_cpu({"format": OPTIMIZER_STATE_FORMAT, "optimizer": self.optimizer.state_dict(),
                           "updates": self.updates}), root / OPTIMIZER_FILE)

    def load_state(self, directory: str) -> None:
        """Restore what `save_state` wrote: the weights (strictly: every parameter, nothing else) and the optimizer.
        This worker's `lr` and `weight_decay` apply from here on (the config's, not the checkpoint's)."""
        from safetensors.torch import load_file

        training = self._require_training("load_state")
        root = Path(directory)
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{root}: no *.safetensors weights to load; is it a save_state directory?")
        weights: dict[str, torch.Tensor] = {}
        for path in files:
            weights.update(load_file(path))
        # No arbitrary unpickling; into host memory, from where loading copies each tensor to its parameter's device
        state = torch.load(root / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        if state.get("format") != OPTIMIZER_STATE_FORMAT:
            raise ValueError(f"{root / OPTIMIZER_FILE}: format {state.get('format')!r}, this relay reads "
                             f"{OPTIMIZER_STATE_FORMAT}; resume with the relay version that wrote it")
        self.model.load_state_dict(weights, strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = training.lr, training.weight_decay
        self.updates = int(state["updates"])

    def _require_training(self, method: str) -> RewardModelTraining:
        if self.training is None:
            raise RuntimeError(f"RewardModelWorker.{method}: this reward model is frozen; build it with training "
                               "settings to fine-tune it")
        return self.training

    def _passes(self, prompts: Sequence[str], completions: Sequence[str]) -> list[tuple[torch.Tensor, ...]]:
        """The texts `prompt + completion` tokenised in one call and cut into passes (`self.batching`): each
        (rows [b] positions into the texts, input_ids [b, L_pass], attention_mask [b, L_pass]), right-padded to the
        pass's longest, on the model's device."""
        ids = self.tokenizer([p + c for p, c in zip(prompts, completions)], add_special_tokens=False)["input_ids"]
        passes = []
        for rows in self.batching.split(torch.tensor([len(row) for row in ids], device="cpu")):
            part = [ids[i] for i in rows.tolist()]
            length = max(len(row) for row in part)
            # Filled in host memory row by row, then moved to the model's device in one copy each.
            input_ids = torch.full((len(part), length), self.pad_id, dtype=torch.long, device="cpu")
            attention_mask = torch.zeros((len(part), length), dtype=torch.long, device="cpu")
            for i, row in enumerate(part):
                input_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long, device="cpu")
                attention_mask[i, :len(row)] = 1
            passes.append((rows.to(self.device), input_ids.to(self.device), attention_mask.to(self.device)))
        return passes

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Scores of one pass, [b] float32; gradients flow if the caller enables them (the backward runs outside
        the autocast context, as torch advises)."""
        with compute_in(self.device, self.compute_dtype, self.master_dtype):
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits  # [b, 1]
        return logits[:, 0].float()

    @torch.no_grad()
    def _scores(self, passes: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """Scores of every text of `passes`, [B] float32 in the texts' order, on the model's device."""
        scores = torch.zeros(sum(len(rows) for rows, _, _ in passes), dtype=torch.float32, device=self.device)
        for rows, input_ids, attention_mask in passes:
            scores[rows] = self._forward(input_ids, attention_mask)
        return scores


def _load_classifier(model_path: str, dtype: torch.dtype, training: RewardModelTraining | None) -> torch.nn.Module:
    """The sequence classifier of `model_path` in `dtype`; with `training.new_head`, the model there (e.g. a causal
    LM) under a new one-output head drawn from N(0, 1/(d_model + 1)) with `training.seed` (Stiennon et al. 2020,
    "Learning to summarize from human feedback", p. 11), bias 0."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    if training is None or not training.new_head:
        return AutoModelForSequenceClassification.from_pretrained(model_path, dtype=dtype)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report calls the new head "MISSING": expected, and made below
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            model_path, num_labels=1, dtype=dtype, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    backbone = [name for name in info["missing_keys"] if name.startswith(model.base_model_prefix + ".")]
    if backbone:
        raise ValueError(f"{model_path} lacks backbone weights {sorted(backbone)[:5]} as a sequence classifier: "
                         "give a causal LM or reward model directory of a transformers architecture")
    parameters = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(training.seed)  # on the host: the same head on any device
    with torch.no_grad():
        for name in sorted(info["missing_keys"]):
            if name in parameters and name.endswith("bias"):
                parameters[name].zero_()
            elif name in parameters:
                std = 1 / math.sqrt(model.config.hidden_size + 1)
                parameters[name].copy_(torch.randn(parameters[name].shape, generator=generator) * std)
    return model


def _training_settings(training: dict[str, Any]) -> RewardModelTraining:
    """`training` checked: the fields of RewardModelTraining (`new_head` optional), a known loss, sane numbers."""
    names = set(RewardModelTraining.__dataclass_fields__)
    if not names - {"new_head"} <= set(training) <= names:
        raise ValueError(f"reward model training settings {sorted(training)}: expected {sorted(names)} "
                         "(new_head optional)")
    settings = RewardModelTraining(**training)
    if settings.loss not in REWARD_MODEL_LOSSES:
        raise ValueError(f"reward model training loss {settings.loss!r}: choose one of {sorted(REWARD_MODEL_LOSSES)}")
    if settings.epochs < 1 or settings.lr < 0 or settings.max_grad_norm <= 0:
        raise ValueError(f"reward model training settings {training}: need epochs >= 1, lr >= 0, max_grad_norm > 0")
    return settings


# The config's loss names -> loss functions, one signature: (scores [B], targets [B], group_size) -> FitLoss.
REWARD_MODEL_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor, int], FitLoss]] = {
    "bradley_terry": bradley_terry_loss,
    "regression": regression_loss,
}

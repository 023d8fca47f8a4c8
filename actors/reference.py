"""ReferenceWorker: the frozen reference policy, scoring prompt+response tokens for the KL penalty.

Owns: a transformers causal LM in eval mode with gradients off, on the actor's GPU when it has one
(`learner.passes.device.pick_device`); with `reference.refresh_every` (iterative GRPO), taking the learner's weights in
place (reporting the fingerprints of what it got, as an engine does) and saving / restoring them with checkpoints.
Does not own: the KL itself (learner/algo/losses) or when to refresh (cluster/fleet/reference_refresh.py). A plain
class: Ray wraps it in `cluster/`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from learner.passes.device import count_parameters, default_threads, matmuls_in, pick_device
from learner.passes.micro_batches import MicroBatching
from learner.passes.sequences import batched_logprobs, flat_per_token, pad_sequences, unpad_per_token
from sync.receive import Loaded, Weights, fingerprints, received
from sync.startup import mark


class ReferenceWorker:
    """Per-token logprobs of given sequences under the reference policy: the initial one, or the policy's weights
    it last took (`load_weights`)."""

    def __init__(self, model_path: str, dtype: str = "float32", num_threads: int | None = None,
                 batching: MicroBatching = MicroBatching(max_tokens=1024, share_prompts=True, pack=True),
                 temperature: float = 1.0):
        from transformers import AutoModelForCausalLM

        mark("loading")  # start-up marks (sync/startup.py)
        torch.set_num_threads(num_threads or default_threads(count_parameters(model_path)))
        self.device = pick_device()
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device)
        self.model.eval().requires_grad_(False)
        self.pad_id = self.model.config.pad_token_id or 0
        self.batching = batching  # how a request's sequences are cut into forward passes
        self.temperature = temperature
        mark("ready")

    def compute_logprobs(self, prompt_ids: Sequence[Sequence[int]],
                         response_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """log pi_ref of every response token: [B][T_resp_i] (float32 logprobs, computed on the model's device)."""
        batch = pad_sequences(prompt_ids, response_ids, self.pad_id, self.device)
        with matmuls_in(self.device, self.model.dtype):
            return unpad_per_token(batched_logprobs(self.model, batch, self.batching, self.temperature), batch)

    def compute_flat_logprobs(self, prompt_ids: Sequence[Sequence[int]],
                              response_ids: Sequence[Sequence[int]]) -> tuple[int, np.ndarray]:
        """The same logprobs as one flat float32 array, row after row, and their count: called with
        `num_returns=2`, the driver reads the count (did it succeed, in time?) and hands the array's ref to the
        learner, so the logprobs go from this actor to the learner without passing through the driver."""
        batch = pad_sequences(prompt_ids, response_ids, self.pad_id, self.device)
        with matmuls_in(self.device, self.model.dtype):
            flat = flat_per_token(batched_logprobs(self.model, batch, self.batching, self.temperature), batch)
        return len(flat), flat.numpy()  # numpy: read zero-copy from the object store

    def load_weights(self, version: int, *buckets: Weights, fingerprint: bool = True) -> Loaded:
        """Take the learner's weights (object-store buckets of (name, array), every parameter) in place; return the
        version now held and the fingerprints of what was handed over (`sync.fingerprint`)."""
        params = dict(self.model.named_parameters())  # tied weights once
        state = self.model.state_dict()
        with torch.no_grad(), received(buckets) as named:
            report = Loaded(version, fingerprints(named, fingerprint))
            given = set()
            for name, tensor in named:
                if name not in state:
                    raise KeyError(f"the learner's weights hold {name!r}, which the reference model does not have")
                state[name].copy_(tensor)
                given.add(name)
        missing = sorted(set(params) - given)
        if missing:
            raise KeyError(f"the learner's weights lack {len(missing)} of the reference's parameters: {missing[:3]}")
        return report

    def save_weights(self, path: str) -> None:
        """The weights it holds, as `path/model.safetensors` (a checkpoint's `reference/`)."""
        from safetensors.torch import save_model

        Path(path).mkdir(parents=True, exist_ok=True)
        save_model(self.model, str(Path(path) / "model.safetensors"))

    def load_saved(self, path: str) -> None:
        """The weights `save_weights` wrote to `path`."""
        from safetensors.torch import load_model

        load_model(self.model, str(Path(path) / "model.safetensors"), device=str(self.device))

"""Which device the torch-side actors (learner, value model, reference, reward model) run their models on.

Owns `pick_device` (the GPU this process sees, else the CPU), `compute_in` (mixed precision: float32 parameters
computed in bfloat16) and `to_cpu` (a nested state moved to host memory for a checkpoint). Does not own asking for
GPUs: each actor asks Ray for `num_gpus` (cluster/), and Ray sets CUDA_VISIBLE_DEVICES in the actor's process, so the
one GPU it was given is `cuda:0` there. One device per process: nothing here spreads a model over several GPUs.
Imports only torch.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def pick_device() -> torch.device:
    """`cuda:0` when this process sees a GPU, else the CPU: the same code runs on both."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def compute_in(device: torch.device, compute: torch.dtype, params: torch.dtype) -> contextlib.AbstractContextManager:
    """The context a forward pass runs in: torch's autocast to `compute` when the parameters are kept in a wider
    dtype (float32 master weights, bfloat16 compute), else nothing. Matmuls then run in `compute` on weights cast per
    use, the numerically sensitive ops (softmax, norms) stay float32, and gradients reach the parameters in their own
    dtype. Run the backward outside it (torch's advice): it follows the dtypes the forward recorded."""
    if compute == params:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=compute)


def to_cpu(state: Any) -> Any:
    """`state` (dicts, lists and tuples of tensors and plain values) with every tensor in host memory, so a
    checkpoint loads on a machine without the GPU that wrote it. Tensors already on the CPU are returned as they are
    (no copy)."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {key: to_cpu(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_cpu(value) for value in state)
    return state

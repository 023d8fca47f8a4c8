"""Which device the torch-side actors (learner, value model, reference, reward model) run their models on, and
how many threads the learner and the reference take.

Owns `pick_device` (the GPU this process sees, else the CPU), `default_threads` (by the model's size, when
`num_threads` is unset), `compute_in` (mixed precision: float32 parameters computed in bfloat16), `matmuls_in`
(bfloat16 matmuls at float32's speed on a CPU without bfloat16 instructions), `fused_adamw` (whether torch fuses
AdamW here), `warmup_schedule` (the optimizers' learning-rate warm-up), `peak_rss_mb` and `to_cpu` (a nested
state moved to host memory for a checkpoint). Here, in `learner/passes/`, because every model pass runs on this
device in these contexts, and `actors/` may import the pass package but not the learner's training code.
Does not own asking for GPUs: each actor asks Ray for `num_gpus` (cluster/), and Ray sets CUDA_VISIBLE_DEVICES in
the actor's process, so its one GPU is `cuda:0` there. One device per process: nothing here spreads a model over
several GPUs. Imports only torch (and safetensors, to read a model's size).
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def pick_device() -> torch.device:
    """`cuda:0` when this process sees a GPU, else the CPU: the same code runs on both."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


# Below this many parameters a second torch thread does not pay on a CPU shared with Ray's processes: a small
# model's passes are too short to split (docs/benchmarks.md, "The sync probe inside its request").
SMALL_MODEL_PARAMETERS = 1_000_000


def default_threads(num_parameters: int | None) -> int:
    """Torch threads of an actor whose `num_threads` is unset: 1 for a model under SMALL_MODEL_PARAMETERS (its ops
    are too small for a second thread's share to outweigh waiting for it, and a core busy with anything else stalls
    every parallel op), else 2; 2 when the size is not known."""
    return 1 if num_parameters is not None and num_parameters < SMALL_MODEL_PARAMETERS else 2


def count_parameters(model_path: str) -> int | None:
    """Parameters of the Hugging Face model in `model_path`, read from its safetensors files' headers (nothing is
    loaded); None when it has none."""
    import glob

    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        return None
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total


def compute_in(device: torch.device, compute: torch.dtype, params: torch.dtype) -> contextlib.AbstractContextManager:
    """The context a forward pass runs in: torch's autocast to `compute` when the parameters are kept in a wider
    dtype (float32 master weights, bfloat16 compute), else nothing; and `matmuls_in(device, compute)`. Matmuls then
    run in `compute` on weights cast per use, the numerically sensitive ops (softmax, norms) stay float32, and
    gradients reach the parameters in their own dtype. Run the backward outside it (torch's advice), in
    `matmuls_in`: it follows the dtypes the forward recorded."""
    stack = contextlib.ExitStack()
    if compute != params:
        stack.enter_context(torch.autocast(device.type, dtype=compute))
    stack.enter_context(matmuls_in(device, compute))
    return stack


def matmuls_in(device: torch.device, compute: torch.dtype) -> contextlib.AbstractContextManager:
    """The context a forward or backward pass in `compute` runs in: on a CPU without bfloat16 instructions (AVX2:
    no AVX-512), bfloat16 matmuls computed as float32 ones on the same bfloat16 inputs, rounded back to bfloat16
    (`_Float32Matmuls`); elsewhere nothing."""
    if device.type != "cpu" or compute != torch.bfloat16 or _native_bfloat16():
        return contextlib.nullcontext()
    return _Float32Matmuls()


# Set to "torch" (in the environment of the process that starts Ray: relay passes it on to its actors): torch's own
# bfloat16 matmuls on every CPU, e.g. to compare with code from before `matmuls_in`.
CPU_BFLOAT16_MATMULS = "RELAY_CPU_BFLOAT16_MATMULS"


def _native_bfloat16() -> bool:
    """This CPU multiplies bfloat16 matrices in hardware (oneDNN's bfloat16 kernels: AVX-512 and newer), or torch's
    own kernels were asked for (`CPU_BFLOAT16_MATMULS`)."""
    return os.environ.get(CPU_BFLOAT16_MATMULS) == "torch" or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class _Float32Matmuls(TorchDispatchMode):
    """bfloat16 matrix products computed in float32 and rounded to bfloat16. Without bfloat16 instructions torch's
    own CPU kernel does the same, products of bfloat16 inputs summed in float32 and the sum rounded once (it and this
    agree bit for bit on all but ~1e-4 of the elements, where the order of the sums differs), 40-100x slower than a
    float32 matmul here (docs/vllm-cpu.md). Every other op runs as it is."""

    OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                     torch.ops.aten.baddbmm.default})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.OPS and all(a.dtype == torch.bfloat16 for a in args if isinstance(a, torch.Tensor)):
            wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*wide, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def fused_adamw(asked: bool, named: list[tuple[str, torch.nn.Parameter]]) -> bool | None:
    """AdamW's `fused` argument: True when asked (`learner.fast_paths.fused_adamw`) and torch has the fused kernel
    for the device of every parameter in `named`; None (torch's own choice) otherwise."""
    if not asked:
        return None
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    return True if all(p.device.type in devices and p.is_floating_point() for _, p in named) else None


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear learning-rate warm-up from 0 to the optimizer's lr over `warmup_steps` steps, then constant."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda n: min(1.0, (n + 1) / warmup_steps) if warmup_steps else 1.0)


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

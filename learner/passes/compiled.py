"""Each decoder layer compiled by torch.compile, run on packed passes whose length is bucketed
(`learner.fast_paths.compile_bucket_tokens`).

Owns `compile_layers`: every layer of the model's decoder (not the whole model) gets a compiled forward of fixed
shapes, which it runs only inside a packed pass whose token count `learner.passes.packing` padded to a multiple of the
bucket: the compiled shapes are one per bucket, shared by every layer (they run the same code on their own weights),
and attention, left out of the graphs, sees the rows. Every other forward (padded passes, shared prompts' prefixes,
generation) runs the layer as it was.
Does not own: the padding and its attention (`learner.passes.packing`), which backend a run asks for (the config).
"""

from __future__ import annotations

from typing import Any

import torch

from learner.passes.packing import bucketed_pass

# torch.compile's backends a run may ask for: inductor (fused kernels: the GPU's), aot_eager (traced forward and
# backward graphs run by eager kernels: what the CPU's tests run, as inductor compiles for minutes there).
BACKENDS = ("inductor", "aot_eager")


def compile_layers(model: torch.nn.Module, backend: str, shapes: int) -> int:
    """Give each layer of `model`'s decoder (`get_decoder().layers`; through peft's wrappers too) a forward compiled
    by `backend` for fixed shapes, run inside bucketed packed passes (`packing.bucketed_pass`); dynamo's recompile
    limit raised to `shapes` (the distinct bucketed lengths a run may see) if lower. The layers compiled."""
    if backend not in BACKENDS:
        raise ValueError(f"compile backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    import torch._dynamo

    config = torch._dynamo.config
    if config.disable:  # TORCHDYNAMO_DISABLE, or a process's own choice (a CPU vLLM engine's: actors/engine.py)
        raise RuntimeError("learner.fast_paths.compile_bucket_tokens: torch.compile is disabled in this process "
                           "(torch._dynamo.config.disable, TORCHDYNAMO_DISABLE): nothing would compile")
    config.recompile_limit = max(config.recompile_limit, shapes)
    layers = list(getattr(model.get_decoder(), "layers", []))
    for layer in layers:
        if getattr(layer, "_relay_compiled", False):
            continue
        eager = layer.forward
        layer.forward = _dispatch(eager, torch.compile(eager, backend=backend, dynamic=False))
        layer._relay_compiled = True
    return len(layers)


def _dispatch(eager: Any, compiled: Any) -> Any:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return (compiled if bucketed_pass() else eager)(*args, **kwargs)

    return forward

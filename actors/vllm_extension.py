"""Code that runs inside vLLM's worker process: the in-place weight update of a running engine.

Owns: `RelayWorkerExtension`, mixed into vLLM's worker through `LLM(worker_extension_cls=...)` and reached with
`llm.collective_rpc("relay_...")`. Method names carry a `relay_` prefix so they never clash with worker attributes.
Each vLLM worker is also one member of the `collective` transport's weight group (`relay_join_weight_group`,
`relay_receive_weights`), so the broadcast reaches every worker of a tensor-parallel engine in its own process.
Does not own: where the weights come from (see `actors.engine`) or the group's plumbing (`sync.group`).
Must stay importable in the engine's processes: it imports only torch and relay modules that need only torch and numpy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from sync.fingerprint import fingerprint as relay_fingerprint
from sync.group import GroupSpec, WeightGroup

# Rows `torch_linear` pads its input to a multiple of. Torch's float32 CPU matmul computes the rows left over after
# the last full block of its micro-kernel (per thread's share of the rows) with another kernel, whose sums round
# differently: a sequence's logprobs would then depend on how many others its decode step held (docs/vllm-cpu.md,
# batch invariance). Padded to whole blocks, each row gets the same bits in any batch; the engine checks it on the
# machine it runs on (`rows_invariant`).
ROW_BLOCK = 4


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The CPU kernel of a linear layer in an engine started with `rollout.cpu_linear` torch: torch's linear on the
    layer's weight as it is at the call, so a weight copied in place is the one used; over rows padded with zeros
    to a multiple of `ROW_BLOCK`, so that each row's result does not depend on the batch's size."""
    rows = x.numel() // x.shape[-1]
    if rows % ROW_BLOCK == 0:
        return torch.nn.functional.linear(x, weight, bias)
    padded = torch.nn.functional.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, ROW_BLOCK - rows % ROW_BLOCK))
    return torch.nn.functional.linear(padded, weight, bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])


def rows_invariant(kernel: Callable, width: int, dtype: torch.dtype, batches: int = 48) -> bool:
    """Whether `kernel(x, weight, bias)` gives each row of `x` the same bits in batches of every size from 1 to
    `batches` rows, at any position, as in one batch of them all: with this process's threads, on random rows of
    `width` features (a model's hidden size) in `dtype`."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batches, width, generator=generator).to(dtype)
    weight = torch.randn(2 * width, width, generator=generator).to(dtype)
    everything = kernel(x, weight, None)
    order = torch.randperm(batches, generator=generator)
    for size in range(1, batches):
        rows = order[:size]
        if not torch.equal(kernel(x[rows], weight, None), everything[rows]):
            return False
    return True


def torch_linear_dispatch(vllm_dispatch: Callable) -> Callable:
    """A stand-in for vLLM's `dispatch_cpu_unquantized_gemm(layer, remove_weight)`, which picks a CPU linear layer's
    kernel after its weights are loaded: `torch_linear` for 2-D weights, kept where they were loaded; vLLM's own
    choice for the rest (meta or non-2-D weights)."""

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return vllm_dispatch(layer, remove_weight)
        layer.cpu_linear = torch_linear

    return dispatch


class RelayWorkerExtension:
    """Methods added to vLLM's GPU/CPU worker class."""

    def relay_use_direct_loads(self) -> bool:
        """From now on load weights with the model's own `load_weights`, copying into its tensors in place, if every
        CPU linear kernel of the model is `torch_linear` (no kernel holds a copy of a weight); returns whether so."""
        kernels = [m.cpu_linear for m in self.model_runner.get_model().modules() if hasattr(m, "cpu_linear")]
        self._relay_direct = bool(kernels) and all(kernel is torch_linear for kernel in kernels)
        return self._relay_direct

    def relay_reload_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
                             path: str | None = None) -> int:
        """Load new weights in place; return tensors loaded. After `relay_use_direct_loads`, with the model's own
        `load_weights` (each tensor copied into the model's, fused ones into their share; a tied head is the
        embedding itself); else through vLLM's reload path (restore, load, re-pack).

        A direct `model.load_weights` fails on the CPU backend's default kernels, which pre-pack linear weights after
        loading. The reload re-packs every layer that shares a loaded tensor, so a tied head follows the new
        embedding (docs/vllm-cpu.md; tests/actors/test_rollout_worker.py checks the engine's head after every load).
        """
        tensors = list(named_tensors) if named_tensors is not None else None
        direct = getattr(self, "_relay_direct", False)
        if tensors is None and direct:  # vLLM's reload would give the layers its kernels back, on copies
            raise RuntimeError("an engine loading weights directly (rollout.cpu_linear) takes tensors, not a path")
        if tensors is not None and direct:
            with torch.no_grad():
                self.model_runner.get_model().load_weights(iter(tensors))
        elif tensors is not None:
            self.model_runner.reload_weights(weights_iterator=iter(tensors))
        else:
            self.model_runner.reload_weights(weights_path=path)
        return len(tensors) if tensors is not None else -1

    def relay_join_weight_group(self, spec: dict, first_rank: int) -> None:
        """Leave any previous weight group and join the one of `spec` (a `GroupSpec.to_dict()`) as rank `first_rank`
        + this worker's rank in the engine (returns once every member has joined, or raises at the timeout)."""
        spec = GroupSpec.from_dict(spec)
        self.relay_leave_weight_group()
        # NCCL receives on this worker's GPU; gloo on CPU (the reload copies to the model's device either way).
        device = self.device if spec.backend == "nccl" else torch.device("cpu")
        group = WeightGroup.connect(spec, device)
        group.join(first_rank + self.rank)
        self._relay_weight_group = group

    def relay_receive_weights(self, fingerprint: bool = True) -> dict:
        """Receive the learner's broadcast and load it through `relay_reload_weights`: {"tensors", "receive_s",
        "fingerprint_s", "reload_s", "fingerprint"} (the received tensors' fingerprints, sync/fingerprint.py,
        computed on the device they arrived on; empty without `fingerprint`). A failed broadcast leaves the engine's
        weights as they were."""
        group = getattr(self, "_relay_weight_group", None)
        if group is None:
            raise RuntimeError("this engine worker is in no weight group: call relay_join_weight_group first")
        started = time.perf_counter()
        named = group.receive()
        received = time.perf_counter()
        fingerprints = relay_fingerprint(named) if fingerprint else {}
        fingerprinted = time.perf_counter()
        count = self.relay_reload_weights(named_tensors=named)
        return {"tensors": float(count), "receive_s": received - started, "fingerprint_s": fingerprinted - received,
                "reload_s": time.perf_counter() - fingerprinted, "fingerprint": fingerprints}

    def relay_leave_weight_group(self) -> None:
        group = getattr(self, "_relay_weight_group", None)
        self._relay_weight_group = None
        if group is not None:
            group.close()

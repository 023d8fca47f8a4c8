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

# The row counts `torch_linear`'s matmuls may have, in the order tried (`row_block`). Torch's CPU matmul computes
# some rows of a batch with another micro-kernel than others (its leftover rows, per thread's share), and which rows
# depends on the CPU, the thread count and the layer's shape (docs/vllm-cpu.md, batch invariance): a sequence's
# logprobs would then depend on how many others its forward pass held. `torch_linear` runs every matmul on exactly
# `row_block` rows (the last block padded with zeros), so the kernel's code path never changes with the batch; a row
# can still land at any position of a block, so a block size is taken only once every position is shown to compute
# the same bits (`positions_alike`). One row at a time (1) always holds: the last resort, and the slowest.
ROW_BLOCKS = (16, 32, 64, 24, 48, 28, 14, 12, 8, 6, 4, 2, 1)

# (in features, out features, dtype, bias, threads, matmul) -> the block `row_block` chose for them in this process.
_blocks: dict[tuple, int] = {}


def positions_alike(matmul: Callable, rows: int, width: int, out: int, dtype: torch.dtype, bias: bool) -> bool:
    """Whether `matmul(x, weight, bias)` on exactly `rows` rows of `width` features gives a row the same bits at every
    position of the batch, with whatever rows beside it: two random batches, each row put at every position (all
    cyclic shifts), in this process's threads. Kernels do not branch on values, so random rows show a position whose
    arithmetic differs."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out, width, generator=generator).to(dtype)
    b = torch.randn(out, generator=generator).to(dtype) if bias else None
    for _ in range(2):
        x = torch.randn(rows, width, generator=generator).to(dtype)
        first = matmul(x, weight, b)
        for shift in range(1, rows):
            if not torch.equal(matmul(x.roll(shift, 0), weight, b).roll(-shift, 0), first):
                return False
    return True


def row_block(width: int, out: int, dtype: torch.dtype, bias: bool,
              matmul: Callable = torch.nn.functional.linear) -> int:
    """The first of `ROW_BLOCKS` whose every position computes the same bits (`positions_alike`) for a layer of this
    shape on this machine and thread count: found once per process, at the layer's first call."""
    key = (width, out, dtype, bias, torch.get_num_threads(), matmul)
    if key not in _blocks:
        _blocks[key] = next(rows for rows in ROW_BLOCKS if positions_alike(matmul, rows, width, out, dtype, bias))
    return _blocks[key]


def blocked_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 matmul: Callable = torch.nn.functional.linear) -> torch.Tensor:
    """`matmul(x, weight, bias)` (a linear layer's) computed in matmuls of exactly `row_block` rows each, every block
    starting 64-byte aligned: a row's bits depend on the row and the weights only, not on the batch."""
    width = x.shape[-1]
    rows = x.numel() // width
    block = row_block(width, weight.shape[0], weight.dtype, bias is not None, matmul)
    count = -(-rows // block)
    flat = x.reshape(rows, width)
    if rows == count * block and flat.is_contiguous() and flat.data_ptr() % 64 == 0:
        padded = flat
    else:  # a fresh allocation is 64-byte aligned
        padded = x.new_empty(count * block, width)
        padded[:rows] = flat
        padded[rows:].zero_()
    if count == 1:
        out = matmul(padded, weight, bias)
    else:
        aligned = (block * width * padded.element_size()) % 64 == 0
        out = torch.cat([matmul(part if aligned else part.clone(), weight, bias)
                         for part in padded.split(block)])
    return out[:rows].reshape(*x.shape[:-1], weight.shape[0])


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The CPU kernel of a linear layer in an engine started with `rollout.cpu_linear` torch: torch's linear on the
    layer's weight as it is at the call, so a weight copied in place is the one used; in blocks of a fixed number
    of rows (`blocked_rows`), so that each row's result does not depend on the batch."""
    return blocked_rows(x, weight, bias)


ROWS_CHECKED = (*range(1, 49), 64, 97)  # batch sizes `rows_invariant` compares: several blocks, too


def rows_invariant(kernel: Callable, width: int, dtype: torch.dtype, out: int | None = None,
                   weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> bool:
    """Whether `kernel(x, weight, bias)` gives each row of `x` the same bits in batches of every size of
    `ROWS_CHECKED`, at any position, as in one batch of them all: with this process's threads, on random rows of
    `width` features (a layer's input size) in `dtype`, and `weight` (random, `out` x `width`, if not given)."""
    generator = torch.Generator().manual_seed(0)
    batches = max(ROWS_CHECKED) + 1
    x = torch.randn(batches, width, generator=generator).to(dtype)
    if weight is None:
        weight = torch.randn(out or 2 * width, width, generator=generator).to(dtype)
    everything = kernel(x, weight, bias)
    order = torch.randperm(batches, generator=generator)
    for size in ROWS_CHECKED:
        rows = order[:size]
        if not torch.equal(kernel(x[rows], weight, bias), everything[rows]):
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

    def relay_batch_invariance(self) -> dict:
        """Whether each CPU linear kernel of the model gives every row the same bits in a batch of any size
        (`rows_invariant`, on the layer's own weights and bias, in this worker's threads), checked once per kernel
        kind and shape: {"invariant": bool, "detail": a line saying which kernels, and which layers failed}."""
        model = self.model_runner.get_model()
        dtype = self.model_config.dtype
        checked: dict[tuple, bool] = {}
        failed: list[str] = []
        with torch.inference_mode():
            for name, layer in model.named_modules():
                kernel, shape = getattr(layer, "cpu_linear", None), _linear_shape(layer)
                if kernel is None or shape is None:
                    continue
                key = (kernel is torch_linear, shape, getattr(layer, "bias", None) is not None)
                if key not in checked:
                    weight = layer.weight if layer.weight.ndim == 2 and layer.weight.numel() else None
                    checked[key] = rows_invariant(kernel, shape[0], dtype, out=shape[1], weight=weight,
                                                  bias=getattr(layer, "bias", None))
                if not checked[key]:
                    failed.append(name)
        ours = [k for k in checked if k[0]]
        kinds = ("torch's linear in blocks of " + ", ".join(
            sorted({f"{row_block(w, o, dtype, b)} rows" for _, (w, o), b in ours})) if ours else "")
        if len(ours) < len(checked):
            kinds += ("; " if kinds else "") + "vLLM's CPU kernels"
        detail = f"{kinds}: " + (f"rows depend on the batch in {', '.join(failed[:4])}"
                                 + (f" and {len(failed) - 4} more" if len(failed) > 4 else "")
                                 if failed else f"every row the same bits in batches of 1-{max(ROWS_CHECKED)} rows")
        return {"invariant": not failed and bool(checked), "detail": detail}

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


def _linear_shape(layer: torch.nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a vLLM CPU linear layer or output head, whether or not its kernel dropped the weight."""
    weight = getattr(layer, "weight", None)
    if weight is None or weight.is_meta:
        return None
    if weight.ndim == 2 and weight.numel():
        return weight.shape[1], weight.shape[0]
    for width, out in (("input_size_per_partition", "output_size_per_partition"),
                       ("embedding_dim", "num_embeddings_per_partition")):
        if hasattr(layer, width) and hasattr(layer, out):
            return getattr(layer, width), getattr(layer, out)
    return None

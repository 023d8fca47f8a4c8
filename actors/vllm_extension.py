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
from collections.abc import Iterable

import torch

from sync.fingerprint import fingerprint as relay_fingerprint
from sync.group import GroupSpec, WeightGroup


class RelayWorkerExtension:
    """Methods added to vLLM's GPU/CPU worker class."""

    def relay_reload_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
                             path: str | None = None) -> int:
        """Load new weights in place through vLLM's reload path (restore, load, re-pack); return tensors loaded.

        A direct `model.load_weights` fails on the CPU backend, which pre-packs linear weights after loading. The
        reload re-packs every layer that shares a loaded tensor, so a tied head follows the new embedding
        (docs/vllm-cpu.md; tests/actors/test_rollout_worker.py checks the engine's head after every load).
        """
        tensors = list(named_tensors) if named_tensors is not None else None
        if tensors is not None:
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

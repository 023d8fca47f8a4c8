"""The learner's side of weight sync: its weights as every transport hands them out, and their fingerprints.

Owns: `WeightPublisher`, the methods a transport calls on the learner's rank 0: `export_weights` (buckets of
(name, array) for the object store; `export_weight_buckets` and `count_buckets` shape it for one Ray call),
`share_weights` (the shared-memory buffer for engines on its node), `weights_fingerprint` (what every engine must
report it received), and the collective's `open_weight_group`, `join_weight_group`, `broadcast_weights` and
`leave_weight_group`; and the casts to the engines' dtype (`to_engine`, `cast_to_engine`, each distinct tensor once:
`per_tensor`), which the Learner also uses for the saved policy. Everything leaves in the engines' dtype
(`sync.layout.engine_dtype`), cast one tensor at a time, a tied head once.
Does not own: training (learner/), the layout (sync/layout.py), or when and to whom weights go (sync/transport.py).
The Learner mixes it in (one level of inheritance), so Ray calls reach these methods on the learner's actor; the
Learner provides `policy_state_dict()`, `compute_dtype` and `weights_version`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from sync.fingerprint import tensor_fingerprint
from sync.group import GroupSpec, WeightGroup
from sync.layout import engine_dtype, plan_weights
from sync.shared_memory import SharedWeights, SharedWeightsHandle


class WeightPublisher:
    """Hands the policy's weights to the transports. Rank 0's alone: other ranks of a group never publish."""

    compute_dtype: torch.dtype
    weights_version: int
    shared_weights: SharedWeights | None = None  # made by the first `share_weights`
    shared_at = -1  # `weights_version` when the buffer was last written
    weight_group: WeightGroup | None = None

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def export_weights(self, bucket_bytes: int) -> list[list[tuple[str, np.ndarray | torch.Tensor]]]:
        """The policy's weights in the engines' dtype as buckets of (name, array) of about `bucket_bytes` each
        (`sync.layout.plan_weights`), in checkpoint names.

        numpy arrays travel through Ray's object store zero-copy; dtypes numpy lacks (bfloat16) stay tensors; both
        in host memory whatever the model's device. On the CPU, when the master weights are in the engines' dtype,
        the arrays are views of the live parameters: load or copy them before the next `train_step`."""
        state = self.policy_state_dict()
        engine = per_tensor(state, lambda t: to_engine(t, self.compute_dtype).contiguous().cpu())
        return [[(slot.name, _array(engine[slot.name])) for slot in bucket.slots]
                for bucket in plan_weights(state, self.compute_dtype, bucket_bytes)]

    def weights_bytes(self) -> int:
        """Bytes of what one sync hands each engine: the published weights in the engines' dtypes, a tied head once
        (with LoRA, the adapters alone)."""
        state = self.policy_state_dict()
        return sum(t.numel() * engine_dtype(t, self.compute_dtype).itemsize for t in {id(t): t for t in state.values()}
                   .values())

    def export_weight_buckets(self, bucket_bytes: int):
        """`export_weights` shaped for a Ray call with `num_returns=count_buckets(...)`: one object per bucket
        (Ray stores a method's whole return value as one object when num_returns is 1, so one bucket goes bare)."""
        buckets = self.export_weights(bucket_bytes)
        return buckets[0] if len(buckets) == 1 else buckets

    def count_buckets(self, bucket_bytes: int) -> int:
        return len(plan_weights(self.policy_state_dict(), self.compute_dtype, bucket_bytes))

    def share_weights(self, version: int) -> SharedWeightsHandle:
        """The policy's weights, as `version`, in this process's shared-memory buffer (laid out by the first call,
        rewritten in place by later ones; not again for the same `version` while the weights are unchanged), for
        engines on this node to read (sync/shared_memory.py)."""
        shared = self.shared_weights
        if shared is not None and shared.version == version and self.shared_at == self.weights_version:
            return shared.handle()  # engines may be reading it now (a replacement's load during a step)
        state = self.policy_state_dict()
        if shared is None:
            shared = self.shared_weights = SharedWeights(state, self.compute_dtype)  # written cast to it
        self.shared_at = self.weights_version
        return shared.write(state, version)

    def weights_fingerprint(self) -> dict[str, str]:
        """{name: fingerprint} of the policy's weights as the engines must receive them (sync/fingerprint.py).
        Computed from the weights themselves, not from what a transport packed, so a packing error is caught too."""
        return per_tensor(self.policy_state_dict(), lambda t: tensor_fingerprint(to_engine(t, self.compute_dtype)))

    def open_weight_group(self, host: str, world_size: int, bucket_bytes: int, timeout: float) -> GroupSpec:
        """Leave the previous weight group and open a new one of `world_size` members as its rank 0: a rendezvous
        store on a fresh port of `host` (this node's address), buckets of about `bucket_bytes`, `timeout` seconds for
        every collective. Returns the `GroupSpec` the engines join with; `join_weight_group` then completes it."""
        old, self.weight_group = self.weight_group, None
        if old is not None:
            old.close()
        state = self.policy_state_dict()
        # Laid out in the engines' dtype: packing a bucket casts the master weights into it (one cast per sync).
        layout = plan_weights(state, self.compute_dtype, bucket_bytes)
        self.weight_group = WeightGroup.host(host, world_size, layout, next(iter(state.values())).device, timeout,
                                             avoid_port=old.spec.port if old is not None else None)
        return self.weight_group.spec

    def join_weight_group(self) -> None:
        """Join the group `open_weight_group` opened, as rank 0; returns once every member has joined."""
        self._joined_group().join(0)

    def broadcast_weights(self) -> dict[str, float]:
        """Broadcast the current weights to every member of the weight group: {"seconds", "bytes"}."""
        group = self._joined_group()
        seconds = group.send(self.policy_state_dict())
        return {"seconds": seconds, "bytes": float(sum(b.nbytes for b in group.spec.layout))}

    def leave_weight_group(self) -> None:
        group, self.weight_group = self.weight_group, None
        if group is not None:
            group.close()

    def shutdown(self) -> None:
        """Release what the publishing holds outside Python's memory (the weight group, the shared-memory buffer),
        so that the process can serve another run (a pool that re-initialises actors in place: tests/fleets.py)."""
        self.leave_weight_group()
        shared, self.shared_weights = self.shared_weights, None
        if shared is not None:
            shared.close()

    def _joined_group(self) -> WeightGroup:
        if self.weight_group is None:
            raise RuntimeError("the learner is in no weight group: call open_weight_group first")
        return self.weight_group


def to_engine(tensor: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """`tensor` in the engines' dtype (`engine_dtype`), itself when already in it."""
    return tensor.detach().to(engine_dtype(tensor, compute))


def cast_to_engine(state: dict[str, torch.Tensor], compute: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` in the engines' dtypes; names that share a tensor (a tied head) share the cast."""
    return per_tensor(state, lambda tensor: to_engine(tensor, compute))


def per_tensor(state: dict[str, torch.Tensor], convert: Callable[[torch.Tensor], Any]) -> dict[str, Any]:
    """{name: convert(tensor)}, converting each distinct tensor once: names that share one (a tied head) share the
    result."""
    done: dict[int, Any] = {}
    for tensor in state.values():
        if id(tensor) not in done:
            done[id(tensor)] = convert(tensor)
    return {name: done[id(tensor)] for name, tensor in state.items()}


def _array(tensor: torch.Tensor) -> np.ndarray | torch.Tensor:
    return tensor.numpy() if tensor.dtype != torch.bfloat16 else tensor

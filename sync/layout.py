"""The one layout of weights in flat byte buffers, shared by every transport and both ends of a transfer.

Owns: where each named tensor sits (`TensorSlot`: name, shape, dtype, aligned offset) in which `Bucket`, planned in
order by `plan_buckets` (buckets of about a given size, or one for everything), the dtype the engines get a learner
tensor in (`engine_dtype`), and packing tensors into a bucket's buffer and viewing them in it without a copy. The
object store's buckets, the shared-memory buffer and the collective's broadcasts are all laid out here.
Does not own: the buffers themselves (sync/shared_memory.py, sync/group.py) or moving them (sync/transport.py).
Imports torch only where it is used, so a layout unpickles in any process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ALIGN = 64  # bytes: every tensor starts on a multiple, so a slice of a bucket can be viewed with the tensor's dtype


@dataclass(frozen=True)
class TensorSlot:
    """Where one named tensor lives in its bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"
    offset: int  # bytes from the bucket's start, a multiple of ALIGN

    @property
    def nbytes(self) -> int:
        import torch

        return _numel(self.shape) * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class Bucket:
    """One flat byte buffer of `nbytes` holding `slots`: one object-store object, one broadcast of the collective,
    or the whole shared-memory buffer."""

    slots: tuple[TensorSlot, ...]
    nbytes: int


def engine_dtype(tensor: torch.Tensor, compute: torch.dtype) -> torch.dtype:
    """The dtype `tensor` has where the engines and the saved policy get it: `compute` (`model.dtype`) for weights,
    its own for anything else (integer buffers)."""
    return compute if tensor.is_floating_point() else tensor.dtype


def plan_buckets(specs: Iterable[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: float = float("inf"),
                 start: int = 0) -> list[Bucket]:
    """Lay out (name, shape, dtype) tensors, in order, in buckets of about `bucket_bytes` (default: one bucket),
    the first tensor of each at offset `start` (room for a header): a tensor that would overflow a non-empty bucket
    starts the next one (so a tensor larger than `bucket_bytes` gets a bucket of its own)."""
    buckets: list[Bucket] = []
    slots: list[TensorSlot] = []
    size = start
    for name, shape, dtype in specs:
        slot = TensorSlot(name, tuple(int(d) for d in shape), str(dtype).removeprefix("torch."), _align(size))
        if slots and slot.offset + slot.nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(slots), size))
            slots, slot = [], TensorSlot(slot.name, slot.shape, slot.dtype, _align(start))
        slots.append(slot)
        size = slot.offset + slot.nbytes
    if slots:
        buckets.append(Bucket(tuple(slots), size))
    return buckets


def plan_weights(tensors: Mapping[str, torch.Tensor], compute: torch.dtype, bucket_bytes: float = float("inf"),
                 start: int = 0) -> list[Bucket]:
    """`plan_buckets` of a model's tensors as the engines get them (`engine_dtype`)."""
    return plan_buckets(((name, t.shape, engine_dtype(t, compute)) for name, t in tensors.items()), bucket_bytes,
                        start)


def pack_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """Copy each of the bucket's tensors into its slot of `out` (uint8, at least `bucket.nbytes`)."""
    for slot, view in zip(bucket.slots, _views(bucket, out)):
        view.copy_(tensors[slot.name].detach().reshape(slot.shape))


def unpack_bucket(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as (name, view of `buffer`): no copy, valid until the buffer is written again."""
    return [(slot.name, view) for slot, view in zip(bucket.slots, _views(bucket, buffer))]


def _views(bucket: Bucket, buffer: torch.Tensor) -> list[torch.Tensor]:
    import torch

    return [buffer[s.offset:s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape) for s in bucket.slots]


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count



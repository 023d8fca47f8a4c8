"""Weights in one shared-memory buffer of the learner, rewritten in place at every sync, for engines on its node.

Owns: the buffer (an anonymous `memfd` of the learner's process, sized for the whole model once, so its pages are
allocated and touched once, not at every sync as a new object-store object would be; laid out as one bucket of
sync/layout.py after a header), writing the weights into it, and opening it read-only from another process
of the same node and PID namespace (through `/proc/<pid>/fd/<fd>`). A header holds the buffer's token (a process that
reuses the learner's pid and fd number is not mistaken for it), the version written (-1 while a write is under way)
and a count of writes; a reader checks them before and after it loads, so a load that a rewrite overlapped fails
instead of serving torn weights. The memory goes back to the system once the learner and every reader have closed it,
whatever way the learner ends (nothing is left in /dev/shm). torch is imported where it is used, so a handle
unpickles in any process without it.
Does not own: when to write or who reads (sync/transport.py), loading into an engine (actors/).
"""

from __future__ import annotations

import mmap
import os
import struct
import uuid
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sync.layout import Bucket, engine_dtype, plan_buckets, unpack_bucket

if TYPE_CHECKING:
    import torch

HEADER = struct.Struct("<16sqq")  # token, version written (-1: being written), count of writes
WRITING = -1


@dataclass(frozen=True)
class SharedWeightsHandle:
    """What a reader needs to open the buffer and find each tensor in it (small: it travels with every sync)."""

    pid: int  # the learner's process
    fd: int  # its memfd, opened by readers as /proc/<pid>/fd/<fd>
    nbytes: int
    token: bytes  # uuid4, also in the buffer's header
    version: int  # the weights version the buffer holds
    writes: int  # which write of the buffer holds it (a rewrite of the same version is a different one)
    layout: Bucket  # where each tensor is, after the header


class SharedWeights:
    """The learner's side: a buffer laid out for `tensors` (name -> tensor), each in `dtype` (default: its own),
    written by `write`."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None):
        import torch

        [self.layout] = plan_buckets(((name, t.shape, t.dtype if dtype is None else engine_dtype(t, dtype))
                                      for name, t in tensors.items()), start=HEADER.size)
        self.nbytes = max(self.layout.nbytes, HEADER.size)
        self.token = uuid.uuid4().bytes
        self.version: int | None = None
        self.writes = 0
        self.fd = os.memfd_create("relay-weights", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self.map = mmap.mmap(self.fd, self.nbytes)
        except OSError:
            os.close(self.fd)
            raise
        self.flat = torch.frombuffer(self.map, dtype=torch.uint8)
        self._stamp(WRITING)

    def write(self, tensors: Mapping[str, torch.Tensor], version: int) -> SharedWeightsHandle:
        """Copy `tensors` (the same names and shapes as the layout; any device; floating tensors are cast to the
        layout's dtype as they are copied) into the buffer as weights `version`. A reader of the previous version
        fails its check from here on."""
        if len(tensors) != len(self.layout.slots):
            raise ValueError(f"{len(tensors)} tensors to share, but the buffer was laid out for "
                             f"{len(self.layout.slots)}")
        self.version = None
        self.writes += 1
        self._stamp(WRITING)
        for (name, tensor), (slot, view) in zip(tensors.items(), unpack_bucket(self.layout, self.flat)):
            if name != slot or tensor.shape != view.shape or (
                    tensor.dtype != view.dtype and not (tensor.is_floating_point() and view.is_floating_point())):
                raise ValueError(f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} does not match the shared "
                                 f"buffer's {slot} {tuple(view.shape)} {view.dtype}")
            view.copy_(tensor.detach())
        self._stamp(version)
        self.version = version
        return self.handle()

    def handle(self) -> SharedWeightsHandle:
        """How readers find the version last written; raises if there is none (nothing written yet, or the last
        write failed)."""
        if self.version is None:
            raise RuntimeError("the shared weight buffer holds no complete version")
        return SharedWeightsHandle(os.getpid(), self.fd, self.nbytes, self.token, self.version, self.writes,
                                   self.layout)

    def close(self) -> None:
        del self.flat
        self.map.close()
        os.close(self.fd)

    def _stamp(self, version: int) -> None:
        HEADER.pack_into(self.map, 0, self.token, version, self.writes)


@contextmanager
def read_shared(handle: SharedWeightsHandle) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The learner's tensors as read-only views of its buffer, for the duration of the block; raises RuntimeError
    if the buffer does not hold `handle.version` when the block starts or when it ends (rewritten meanwhile)."""
    flat = _open(handle)
    _check(flat, handle)
    yield unpack_bucket(handle.layout, flat)
    _check(flat, handle)


_OPEN: dict[bytes, torch.Tensor] = {}  # token -> this process's mapping of that buffer (one is kept)


def _open(handle: SharedWeightsHandle) -> torch.Tensor:
    import torch

    if handle.token in _OPEN:
        return _OPEN[handle.token]
    path = f"/proc/{handle.pid}/fd/{handle.fd}"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise RuntimeError(f"cannot open the learner's shared weights at {path} ({err.strerror}): this worker is not "
                           "on the learner's node and PID namespace; set sync.shared_memory=false") from err
    try:
        buffer = mmap.mmap(fd, handle.nbytes, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only memory: the engine's reload copies out of it
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
    _OPEN.clear()  # the learner's earlier buffer (a run has one at a time)
    _OPEN[handle.token] = flat
    return flat


def _check(flat: torch.Tensor, handle: SharedWeightsHandle) -> None:
    token, version, writes = HEADER.unpack(flat[:HEADER.size].numpy().tobytes())
    if token != handle.token:
        raise RuntimeError(f"/proc/{handle.pid}/fd/{handle.fd} is not the learner's weight buffer any more (the "
                           "learner restarted?)")
    if (version, writes) != (handle.version, handle.writes):
        state = ("being rewritten" if version == WRITING else
                 f"holds version {version}" if version != handle.version else "rewritten")
        raise RuntimeError(f"the learner's shared weights are {state}, not version {handle.version}: the learner "
                           "wrote new weights after this load was asked for")


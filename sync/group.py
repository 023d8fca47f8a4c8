"""A process group of its own that broadcasts the learner's weights to the engines' workers, in flat buckets.

Owns: forming a group from a
TCPStore hosted by rank 0 (the learner) on a fresh port and a gloo (CPU) or NCCL (GPU) backend built directly, so it
never touches torch.distributed's default group (vLLM owns that one inside its workers), the bucketed broadcast with a
timeout on every collective, and aborting: a member whose collective fails writes the cause into the store, and every
other member, polling for it while it waits, gives up at once instead of waiting out its own timeout.
Does not own: the bucket layout (sync/layout.py), who the members are or re-forming the group after a failure
(sync/transport.py), or loading the received weights into an engine (actors/vllm_extension.py). Imports only torch
and sync/layout.py: the learner and vLLM's worker both use it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
from torch.distributed import BroadcastOptions, PrefixStore, TCPStore

from sync.layout import Bucket, TensorSlot, pack_bucket, unpack_bucket

ABORT_KEY = "abort"
ARRIVED_KEY = "arrived"  # how many members reached the rendezvous
ABORT_POLL_S = 0.05  # how often a waiting member looks for another member's abort


@dataclass(frozen=True)
class GroupSpec:
    """What a member needs to join a group: rank 0's store address, the group's size, backend and timeout (seconds,
    for every collective), and the bucket layout of the weights it will receive."""

    host: str
    port: int
    world_size: int
    backend: str  # "gloo" | "nccl"
    timeout: float
    layout: tuple[Bucket, ...]

    def to_dict(self) -> dict:
        """Plain data: vLLM's RPC to a worker in another process carries dicts and lists, not dataclasses."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> GroupSpec:
        layout = tuple(Bucket(tuple(TensorSlot(s["name"], tuple(s["shape"]), s["dtype"], s["offset"])
                                    for s in b["slots"]), b["nbytes"]) for b in data["layout"])
        return cls(data["host"], data["port"], data["world_size"], data["backend"], data["timeout"], layout)


class WeightGroupError(RuntimeError):
    """A collective of the weight group failed, timed out, or another member aborted the group."""


def backend_for(device: torch.device) -> str:
    """NCCL for weights on a GPU, gloo on CPU: the same code otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


class WeightGroup:
    """One member's end of a weight-broadcast group: rank 0 sends (`send`), the others receive (`receive`).

    Built with `host` (rank 0: starts the rendezvous store on a free port) or `connect` (the others), then `join`.
    Any failure inside a collective aborts the group for every member; the group is then closed and a new one must be
    formed (on a new port)."""

    def __init__(self, store: TCPStore, spec: GroupSpec, device: torch.device):
        self.store = store
        self.spec = spec
        self.device = device
        self.rank = -1
        self.backend = None  # the torch.distributed backend, once joined
        self.buffers: list[torch.Tensor] = []
        self.works: list = []  # the collectives of the broadcast in progress

    @classmethod
    def host(cls, host: str, world_size: int, layout: Sequence[Bucket], device: torch.device, timeout: float,
             avoid_port: int | None = None) -> WeightGroup:
        """Rank 0's end: a new rendezvous store listening on a free port (never `avoid_port`, the last group's)."""
        for _ in range(8):
            store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
            if store.port != avoid_port:
                break
        spec = GroupSpec(host, store.port, world_size, backend_for(device), timeout, tuple(layout))
        return cls(store, spec, device)

    @classmethod
    def connect(cls, spec: GroupSpec, device: torch.device) -> WeightGroup:
        """Another member's end: a client of rank 0's store (receive buffers on `device`)."""
        return cls(TCPStore(spec.host, spec.port, is_master=False, timeout=timedelta(seconds=spec.timeout)), spec,
                   device)

    def join(self, rank: int) -> None:
        """Form the group with every other member (blocks until all have joined, up to the timeout) and allocate one
        buffer per bucket, kept for the group's lifetime. A member that fails here aborts the others' joins too."""
        try:
            self._arrive()
            self._connect(rank)
        except Exception as err:
            self._abort(f"rank {rank} (joining): {err.__class__.__name__}: {_first_line(err)}")
            raise
        self.rank = rank
        self.buffers = [torch.empty(b.nbytes, dtype=torch.uint8, device=self.device) for b in self.spec.layout]

    def _arrive(self) -> None:
        """Wait until every member has reached the rendezvous, or one aborted: the backend's own connection step
        cannot be interrupted, so it starts only once all are there."""
        self.store.add(ARRIVED_KEY, 1)
        deadline = time.monotonic() + self.spec.timeout
        while (arrived := self.store.add(ARRIVED_KEY, 0)) < self.spec.world_size:
            if self.store.check([ABORT_KEY]):
                raise WeightGroupError(f"aborted by {self.store.get(ABORT_KEY).decode()}")
            if time.monotonic() >= deadline:
                raise WeightGroupError(f"only {arrived} of {self.spec.world_size} members joined the weight group "
                                       f"within the {self.spec.timeout:g} s timeout")
            time.sleep(0.01)

    def _connect(self, rank: int) -> None:
        spec = self.spec
        store = PrefixStore("relay-weights", self.store)  # the abort and arrival keys live outside this prefix
        timeout = timedelta(seconds=spec.timeout)
        if spec.backend == "gloo":
            from torch.distributed import ProcessGroupGloo

            self.backend = ProcessGroupGloo(store, rank, spec.world_size, timeout)
        elif spec.backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.backend = ProcessGroupNCCL(store, rank, spec.world_size, options)
        else:
            raise ValueError(f"unknown weight group backend {spec.backend!r}: use 'gloo' or 'nccl'")

    def send(self, tensors: Mapping[str, torch.Tensor]) -> float:
        """Rank 0: pack and broadcast every bucket (packing bucket k+1 overlaps sending bucket k); returns seconds."""
        started = time.perf_counter()
        self._broadcast(lambda k: pack_bucket(self.spec.layout[k], tensors, self.buffers[k]))
        return time.perf_counter() - started

    def receive(self) -> list[tuple[str, torch.Tensor]]:
        """Other ranks: receive every bucket; returns (name, tensor) views of the buffers (valid until the next
        `receive`)."""
        self._broadcast(None)
        return [pair for bucket, buffer in zip(self.spec.layout, self.buffers)
                for pair in unpack_bucket(bucket, buffer)]

    def close(self) -> None:
        """Leave the group: its connections close and its buffers are freed; returns at once."""
        backend, buffers, works = self.backend, self.buffers, self.works
        self.backend, self.buffers, self.works = None, [], []
        if backend is not None and all(work.is_completed() for work in works):
            backend.abort()
        elif backend is not None:
            # A collective still in flight ends by its timeout at the latest and may write into its buffer until
            # then; aborting the backend before would block this process's Python (the GIL) for that long. A thread
            # holds the three until then, and this member is free to join a new group meanwhile. Not a daemon: an
            # interpreter that exits under a live backend aborts the process (std::terminate).
            threading.Thread(target=_release, args=(backend, buffers, works, self.spec.timeout),
                             name="relay-weight-group-release").start()

    def _broadcast(self, fill: Callable[[int], None] | None) -> None:
        if self.backend is None:
            raise WeightGroupError("this member is in no weight group (it was closed or aborted): form a new one")
        options = BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        deadline = time.monotonic() + self.spec.timeout  # for all buckets together, as the caller waits
        try:
            for k, buffer in enumerate(self.buffers):
                if fill is not None:
                    fill(k)
                self.works.append(self.backend.broadcast([buffer], options))
                if k > 0:
                    self._wait(self.works[k - 1], deadline)
            if self.works:
                self._wait(self.works[-1], deadline)
            self.works = []
        except Exception as err:
            self._abort(f"rank {self.rank}: {err.__class__.__name__}: {_first_line(err)}")
            if isinstance(err, WeightGroupError):
                raise
            raise WeightGroupError(f"weight broadcast failed on rank {self.rank}: {err}") from err

    def _wait(self, work, deadline: float) -> None:
        """Wait for one collective: the backend's own timeout ends it on a dead or stalled peer; meanwhile look for
        another member's abort, so that one failure releases everyone at once."""
        next_poll = time.monotonic() + ABORT_POLL_S
        delay = 1e-4
        while not work.is_completed():
            time.sleep(delay)
            delay = min(2 * delay, 2e-3)
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + ABORT_POLL_S
                if self.store.check([ABORT_KEY]):
                    raise WeightGroupError(f"aborted by {self.store.get(ABORT_KEY).decode()}")
            if now >= deadline:  # the backend should have timed out by now; do not depend on it
                raise WeightGroupError(f"the broadcast did not finish within the {self.spec.timeout:g} s timeout")
        work.wait()  # raises the collective's own error, if it had one

    def _abort(self, cause: str) -> None:
        try:  # the first cause wins; members waiting in `_wait` see it
            self.store.compare_set(ABORT_KEY, "", cause)
        except RuntimeError:
            pass  # rank 0, the store's host, is gone: the others see its connections close instead
        self.close()


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0][:300] if str(err) else ""


def _release(backend, buffers: list[torch.Tensor], works: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout + 30
    while not all(work.is_completed() for work in works) and time.monotonic() < deadline:
        time.sleep(0.05)
    backend.abort()
    del buffers  # only now may the memory go

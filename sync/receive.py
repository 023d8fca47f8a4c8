"""The engines' side of weight sync: turning what a transport delivered into named tensors, and the report of a load.

Owns: `Weights` (what an object-store or shared-memory load carries), `received` (the named tensors of a load, read
zero-copy from the object store's arrays or from the learner's shared-memory buffer, checked not to have been
rewritten meanwhile), `fingerprints` (of the tensors handed to an engine) and `Loaded` (what a worker reports after a
load: the version and those fingerprints).
Does not own: loading tensors into an engine (actors/engine.py) or comparing reports with the learner's
(sync/verify.py). torch, numpy and the fingerprint are imported where they are used, so processes that only read
reports (the driver, the benchmarks' stand-in engines) need none of them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple, Union

from sync.shared_memory import SharedWeightsHandle, read_shared

if TYPE_CHECKING:
    import numpy as np
    import torch

# What an object-store or shared-memory load carries: buckets of (name, array), or one handle of the learner's
# shared-memory buffer.
Weights = Union["list[tuple[str, np.ndarray | torch.Tensor]]", SharedWeightsHandle]


class Loaded(NamedTuple):
    """What a worker reports after loading weights: the version it now serves and, for each engine process that
    received them (one per tensor-parallel shard with the `collective` transport, else one), the fingerprint of every
    tensor it handed to the engine ({name: fingerprint}, sync/fingerprint.py; empty when `sync.fingerprint` is
    off). `sync.verify.check_loaded` compares them with the learner's."""

    version: int
    fingerprints: tuple[dict[str, str], ...] = ()


@contextmanager
def received(buckets: Sequence[Weights]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The named tensors of one load, valid inside the block: views of the learner's shared-memory buffer (one
    handle; raises if the learner rewrote it before the block ended) or of the object store's arrays."""
    if len(buckets) == 1 and isinstance(buckets[0], SharedWeightsHandle):
        with read_shared(buckets[0]) as named:
            yield named
    else:
        yield [(name, _as_tensor(array)) for bucket in buckets for name, array in bucket]


def fingerprints(named: list[tuple[str, torch.Tensor]], enabled: bool) -> tuple[dict[str, str], ...]:
    """The `Loaded.fingerprints` of tensors one engine process was handed (none when `sync.fingerprint` is off)."""
    from sync.fingerprint import fingerprint

    return (fingerprint(named),) if enabled else ()


def _as_tensor(array: np.ndarray | torch.Tensor) -> torch.Tensor:
    import torch

    if isinstance(array, torch.Tensor):
        return array
    with warnings.catch_warnings():
        # Arrays read zero-copy from Ray's object store are read-only; the reload copies them into the model.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)

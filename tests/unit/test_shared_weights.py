"""The learner's shared weight buffer: layout, in-place rewrites, reads from another process, and the version stamp
that turns a read overlapped by a rewrite into an error."""

import dataclasses
import os
import pickle
import subprocess
import sys

import pytest
import torch

from sync.layout import ALIGN
from sync.shared_memory import SharedWeights, read_shared


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(7, 5, generator=g),  # 140 bytes: the next tensor must be re-aligned
            "norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),
            "head.bias": torch.randint(0, 100, (2, 3), generator=g),
            "scale": torch.tensor(2.5)}


def as_dict(named):
    return {name: tensor.clone() for name, tensor in named}


def test_a_buffer_holds_every_tensor_aligned_and_another_process_reads_them():
    source = weights(0)
    shared = SharedWeights(source)
    try:
        handle = shared.write(source, version=3)
        assert [slot.name for slot in handle.layout.slots] == list(source)
        assert all(slot.offset % ALIGN == 0 for slot in handle.layout.slots)
        assert handle.nbytes >= sum(t.numel() * t.element_size() for t in source.values())
        reader = ("import pickle, sys; from sync.shared_memory import read_shared\n"
                  "with read_shared(pickle.loads(sys.stdin.buffer.read())) as named:\n"
                  "    sys.stdout.buffer.write(pickle.dumps({n: t.clone() for n, t in named}))")
        out = subprocess.run([sys.executable, "-c", reader], input=pickle.dumps(handle), capture_output=True,
                             check=True, cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
        read = pickle.loads(out.stdout)
        assert list(read) == list(source)
        for name, tensor in source.items():
            assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name
    finally:
        shared.close()


def test_a_new_version_is_written_in_place():
    shared = SharedWeights(weights(0))
    try:
        first = shared.write(weights(0), version=1)
        with read_shared(first) as named:
            assert all(torch.equal(t, weights(0)[n]) for n, t in named)
        handle = shared.write(weights(1), version=2)
        assert (handle.fd, handle.token, handle.version) == (first.fd, first.token, 2)  # the same buffer
        with read_shared(handle) as named:
            assert all(torch.equal(t, weights(1)[n]) for n, t in named)
    finally:
        shared.close()


def test_a_read_fails_if_the_buffer_was_rewritten_during_it_or_holds_another_version():
    shared = SharedWeights(weights(0))
    try:
        first = shared.write(weights(0), version=1)
        with pytest.raises(RuntimeError, match="wrote new weights after this load was asked for"):
            with read_shared(first) as named:
                assert len(named) == 4
                shared.write(weights(1), version=2)
        with pytest.raises(RuntimeError, match="holds version 2, not version 1"):
            with read_shared(first):
                pass
    finally:
        shared.close()


def test_the_layout_is_fixed_and_a_missing_process_is_a_clear_error():
    shared = SharedWeights(weights(0))
    try:
        changed = {**weights(0), "scale": torch.zeros(2)}
        with pytest.raises(ValueError, match=r"scale \(2,\) torch.float32 does not match"):
            shared.write(changed, version=1)
        handle = shared.write(weights(0), version=1)
    finally:
        shared.close()
    assert not os.path.exists(f"/proc/{handle.pid}/fd/{handle.fd}") or os.readlink(
        f"/proc/{handle.pid}/fd/{handle.fd}").find("relay-weights") < 0  # closed with the writer
    gone = dataclasses.replace(handle, pid=2**22 + 1)  # beyond pid_max
    with pytest.raises(RuntimeError, match="set sync.shared_memory=false"):
        with read_shared(gone):
            pass

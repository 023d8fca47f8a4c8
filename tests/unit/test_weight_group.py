"""The weight group of the `collective` transport without Ray or vLLM: the bucket layout (hand-computed offsets),
packing and unpacking (bit-exact, no copy on the way out), and a real gloo group whose members are threads of this
process: a broadcast arrives bit-exact, a sender that never sends makes the others fail at the timeout instead of
hanging, and a member that fails (in the broadcast or while joining) releases the others at once."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sync.group import GroupSpec, WeightGroup, WeightGroupError
from sync.layout import ALIGN, Bucket, TensorSlot, pack_bucket, plan_buckets, unpack_bucket

TIMEOUT = 2.0  # seconds, for every collective of the groups below


def named_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, generator=g),  # float32, 12 bytes
        "b": torch.randn(5, generator=g).to(torch.bfloat16),  # 10 bytes
        "c": torch.tensor([7, -1], dtype=torch.int64),  # 16 bytes
        "d": torch.randn(10, 10, generator=g),  # float32, 400 bytes
    }


def specs(tensors):
    return [(name, t.shape, t.dtype) for name, t in tensors.items()]


def test_layout_by_hand():
    buckets = plan_buckets(specs(named_tensors()), bucket_bytes=128)
    # a at 0 (ends 12); b at align(12) = 64 (ends 74); c would start at 128 and end at 144 > 128: next bucket;
    # d would start at align(16) = 64 and end at 464 > 128: a bucket of its own although larger than 128.
    assert buckets == [
        Bucket((TensorSlot("a", (3,), "float32", 0), TensorSlot("b", (5,), "bfloat16", 64)), 74),
        Bucket((TensorSlot("c", (2,), "int64", 0),), 16),
        Bucket((TensorSlot("d", (10, 10), "float32", 0),), 400),
    ]


@pytest.mark.parametrize("bucket_bytes", [1, 128, 10**9])
def test_layout_keeps_order_and_alignment(bucket_bytes):
    tensors = named_tensors()
    buckets = plan_buckets(specs(tensors), bucket_bytes)
    assert [s.name for b in buckets for s in b.slots] == list(tensors)
    assert all(s.offset % ALIGN == 0 and s.offset + s.nbytes <= b.nbytes for b in buckets for s in b.slots)
    assert len(buckets) == {1: 4, 128: 3, 10**9: 1}[bucket_bytes]


def test_pack_then_unpack_is_bit_exact_and_unpack_does_not_copy():
    tensors = named_tensors()
    for bucket in plan_buckets(specs(tensors), bucket_bytes=128):
        buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        pack_bucket(bucket, tensors, buffer)
        for name, view in unpack_bucket(bucket, buffer):
            assert view.dtype == tensors[name].dtype and torch.equal(view, tensors[name])
            assert buffer.data_ptr() <= view.data_ptr() < buffer.data_ptr() + bucket.nbytes


def run_members(world_size: int, member, join: bool = True) -> dict[int, object]:
    """Run `member(group, rank, tensors)` for every rank in its own thread, each on its end of a gloo group hosted
    here (joined first unless `join` is False): {rank: result or the exception it raised}."""
    tensors = named_tensors()
    layout = plan_buckets(specs(tensors), bucket_bytes=128)
    host = WeightGroup.host("127.0.0.1", world_size, layout, torch.device("cpu"), timeout=TIMEOUT)
    results: dict[int, object] = {}

    def run(rank: int) -> None:
        try:
            group = host if rank == 0 else WeightGroup.connect(host.spec, torch.device("cpu"))
            if join:
                group.join(rank)
            results[rank] = member(group, rank, tensors)
        except Exception as err:  # the test inspects it
            results[rank] = err

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a member hangs"
    return results


def send_or_receive(group, rank, tensors):
    if rank == 0:
        group.send(tensors)
        return None
    return {name: t.clone() for name, t in group.receive()}


def test_broadcast_arrives_bit_exact_in_every_member():
    results = run_members(3, send_or_receive)
    assert results[0] is None
    for rank in (1, 2):
        assert results[rank].keys() == named_tensors().keys()
        assert all(torch.equal(results[rank][k], v) for k, v in named_tensors().items())


def test_receivers_of_a_sender_that_never_sends_fail_at_the_timeout():
    def stall_rank_0(group, rank, tensors):
        started = time.monotonic()
        if rank == 0:
            time.sleep(TIMEOUT + 1.5)  # past the timeout, then leaves without sending
            group.close()
            return "stalled"
        with pytest.raises(WeightGroupError):
            send_or_receive(group, rank, tensors)
        return time.monotonic() - started

    results = run_members(3, stall_rank_0)
    assert results[0] == "stalled"
    assert all(TIMEOUT - 0.1 < results[rank] < TIMEOUT + 1.5 for rank in (1, 2)), results  # not early, no hang


def test_a_failing_member_releases_the_others_at_once():
    def fail_rank_1(group, rank, tensors):
        started = time.monotonic()
        if rank == 1:
            group._abort("rank 1: its engine failed")  # what `_broadcast` does on any error
            return "failed"
        with pytest.raises(WeightGroupError) as err:
            send_or_receive(group, rank, tensors)
        return time.monotonic() - started, str(err.value)

    results = run_members(3, fail_rank_1)
    assert results[1] == "failed"
    assert all(results[rank][0] < TIMEOUT / 2 for rank in (0, 2)), results  # well inside the timeout
    assert any("aborted by rank 1: its engine failed" in results[rank][1] for rank in (0, 2)), results


def test_a_member_that_fails_to_join_releases_the_others_at_once():
    def fail_rank_2(group, rank, tensors):
        started = time.monotonic()
        if rank == 2:
            group._abort("rank 2 (joining): its engine failed")  # what `join` does on any error
            return "failed"
        with pytest.raises(WeightGroupError, match="aborted by rank 2 \\(joining\\): its engine failed"):
            group.join(rank)
        return time.monotonic() - started

    results = run_members(3, fail_rank_2, join=False)
    assert results[2] == "failed"
    assert all(results[rank] < TIMEOUT / 2 for rank in (0, 1)), results


def test_group_spec_survives_the_trip_as_plain_data():
    """vLLM's RPC to a worker process turns dataclasses into dicts and tuples into lists."""
    import json

    layout = plan_buckets(specs(named_tensors()), bucket_bytes=128)
    spec = WeightGroup.host("127.0.0.1", 2, layout, torch.device("cpu"), timeout=TIMEOUT).spec
    assert GroupSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_every_configured_transport_is_registered():
    from typing import get_args

    from sync.config import SyncConfig
    from sync.transport import TRANSPORTS

    assert set(TRANSPORTS) == set(get_args(SyncConfig.model_fields["transport"].annotation)) == {"object_store",
                                                                                               "collective"}

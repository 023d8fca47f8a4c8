"""learner.distributed without a process group: which rows each rank computes, the dead passes that keep ranks in
step, tied-weight names, gradient buckets, and a rendezvous that gives up within its timeout."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from learner.distributed import DataParallel, _buckets, tied_names
from learner.passes.micro_batches import MicroBatching

EVEN = torch.ones(8, dtype=torch.long)  # every row one token: the passes are cut by the row limit alone


def test_one_rank_splits_like_the_single_learner():
    rows = torch.tensor([4, 0, 3, 1, 2])
    assert [(p.tolist(), live) for p, live in DataParallel().micro_batches(rows, EVEN, MicroBatching(2))] == [
        ([4, 0], True), ([3, 1], True), ([2], True)]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("num_rows", [1, 5, 6, 7])
def test_ranks_partition_the_rows_and_run_equally_many_passes(world_size, num_rows):
    rows = torch.randperm(num_rows, generator=torch.Generator().manual_seed(num_rows))
    per_rank = [DataParallel(rank, world_size).micro_batches(rows, EVEN, MicroBatching(2))
                for rank in range(world_size)]
    live = [i for passes in per_rank for part, is_live in passes if is_live for i in part.tolist()]
    assert live == rows.tolist()  # every row exactly once, each rank a contiguous share
    assert len({len(passes) for passes in per_rank}) == 1  # fsdp2: each pass is a collective every rank joins
    shares = [sum(len(p) for p, is_live in passes if is_live) for passes in per_rank]
    assert max(shares) - min(shares) <= 1
    assert all(len(part) for passes in per_rank for part, _ in passes)  # never an empty pass (1 row, 2 ranks)
    for passes in per_rank:  # a dead pass is a real row (finite loss), weighted 0 by the learner
        assert all(part.tolist() == rows[:1].tolist() for part, is_live in passes if not is_live)


def test_bad_rank_or_strategy_is_refused():
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        DataParallel(2, 2)
    with pytest.raises(ValueError, match="unknown data-parallel strategy 'zero3'"):
        DataParallel(0, 2, "zero3")


def test_tied_names_follow_identity():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    assert tied_names(model) == {}
    model[1].weight = model[0].weight
    assert tied_names(model) == {"1.weight": "0.weight"}


def test_gradient_buckets_keep_one_dtype_and_the_size():
    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.float64)
    big = torch.zeros(100)
    assert [[t.numel() for t in bucket] for bucket in _buckets([a, b, c, big, a], 32)] == [[4, 4], [4], [100], [4]]


def test_a_rank_alone_gives_up_within_the_timeout():
    rank0 = DataParallel(0, 2)
    port = rank0.listen("127.0.0.1", timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(Exception, match="[Tt]imed out|[Tt]imeout"):  # gloo waits for rank 1's address in the store
        rank0.join("127.0.0.1", port, timeout_s=1.0)
    assert time.monotonic() - started < 10
    assert not torch.distributed.is_initialized()


def test_a_rank_without_rank_0_listening_gives_up_within_the_timeout():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(Exception, match="[Tt]imed out|[Tt]imeout"):
        DataParallel(1, 2).join("127.0.0.1", port, timeout_s=1.0)
    assert time.monotonic() - started < 10
    assert not torch.distributed.is_initialized()


def test_rank_0_listens_on_the_port_it_returns_before_anyone_joins():
    """The port is held from `listen` on (it was once probed free, closed and taken by another process before rank 0
    bound it): nothing else can bind it, and only rank 0 may listen."""
    rank0 = DataParallel(0, 2)
    port = rank0.listen("127.0.0.1", timeout_s=5.0)
    with socket.socket() as intruder, pytest.raises(OSError):
        intruder.bind(("127.0.0.1", port))
    with pytest.raises(RuntimeError, match="rank 1 cannot host"):
        DataParallel(1, 2).listen("127.0.0.1", timeout_s=1.0)
    with pytest.raises(RuntimeError, match="call listen"):
        DataParallel(0, 2).join("127.0.0.1", port, timeout_s=1.0)

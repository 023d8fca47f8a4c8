"""Weight fingerprints (sync/fingerprint.py): exact, in every dtype, the same on the host and on a device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sync.fingerprint import ROW, _sums_on_device, _sums_on_host, fingerprint, tensor_fingerprint
from sync.verify import differences, digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
def test_any_change_of_one_element_or_of_the_order_changes_the_fingerprint(dtype):
    normal = torch.randn(2 * ROW + 7, generator=torch.Generator().manual_seed(0))
    base = normal > 0 if dtype == torch.bool else (normal * 50).to(dtype)
    pairs = [(0, 1), (0, ROW), (ROW - 1, 2 * ROW + 1)]  # in one row, across rows, into the partial last row
    for i, j in pairs:
        base[j] = ~base[i] if dtype == torch.bool else base[i] + 1
    same = tensor_fingerprint(base.clone())
    assert tensor_fingerprint(base) == same
    for i in (0, 5, ROW + 3, 2 * ROW + 6):  # in a full row and in the partial last one
        changed = base.clone()
        changed[i] = ~changed[i] if dtype == torch.bool else changed[i] + 1
        assert tensor_fingerprint(changed) != same, i
    for i, j in pairs:  # two different elements swapped: same plain sum, different weighted ones
        swapped = base.clone()
        swapped[i], swapped[j] = base[j], base[i]
        assert tensor_fingerprint(swapped) != same, (i, j)


def test_one_bfloat16_ulp_changes_it():
    weights = torch.randn(1000).to(torch.bfloat16)
    nudged = weights.clone()
    nudged[123] = torch.nextafter(weights[123].float(), torch.tensor(10.0)).to(torch.bfloat16)  # the float32 step up
    if nudged[123] == weights[123]:  # rounded back: take bfloat16's own next value
        nudged.view(torch.int16)[123] += 1
    assert nudged[123] != weights[123]
    assert tensor_fingerprint(nudged) != tensor_fingerprint(weights)


def test_dtype_and_shape_are_part_of_it():
    zeros = torch.zeros(6)
    assert len({tensor_fingerprint(zeros), tensor_fingerprint(zeros.view(2, 3)), tensor_fingerprint(zeros.double()),
                tensor_fingerprint(zeros.to(torch.bfloat16))}) == 4
    assert tensor_fingerprint(torch.zeros(0)) != tensor_fingerprint(torch.zeros(0, 3))


def test_numpy_arrays_torch_tensors_and_non_contiguous_views_agree():
    tensor = torch.randn(40, 30)
    array = tensor.numpy().copy()
    array.setflags(write=False)  # as read zero-copy from Ray's object store
    assert tensor_fingerprint(array) == tensor_fingerprint(tensor)
    assert tensor_fingerprint(tensor.t()) == tensor_fingerprint(tensor.t().contiguous())


def test_the_host_and_the_device_reductions_give_the_same_sums():
    """torch's reduction runs where tensors live on a GPU (NCCL receives there); numpy's on the host. Compared here on
    the host, on extreme values: integer sums are exact whichever order they run in."""
    bits = torch.randint(-2**15, 2**15, (3 * ROW + 11,), dtype=torch.int32).to(torch.int16)
    bits[:ROW] = -2**15  # a whole row at the most negative value
    assert _sums_on_host(bits) == _sums_on_device(bits)
    assert _sums_on_host(bits[:5]) == _sums_on_device(bits[:5])  # no full row


def test_differences_name_what_is_missing_wrong_or_extra():
    expected = fingerprint([("a", torch.zeros(3)), ("b", torch.ones(3)), ("c", torch.ones(2))])
    assert differences(expected, dict(expected)) is None
    received = fingerprint([("a", torch.zeros(3)), ("b", torch.full((3,), 2.0)), ("d", torch.ones(1))])
    assert differences(expected, received) == (
        "1 of the 3 tensors never reached the engine (first: c); 1 arrived with other contents than the learner's "
        "(first: b); 1 that the learner did not send (first: d)")
    assert differences(expected, {}) == "3 of the 3 tensors never reached the engine (first: a)"


def test_a_tied_name_given_twice_counts_once_and_the_digest_ignores_order():
    embedding = torch.randn(4, 3)
    fingerprints = fingerprint([("embed", embedding), ("head", embedding)])
    assert fingerprints["embed"] == fingerprints["head"]
    assert digest(fingerprints) == digest(dict(reversed(list(fingerprints.items()))))
    assert digest(fingerprints) != digest({**fingerprints, "head": tensor_fingerprint(embedding + 1)})


def test_the_host_path_does_not_widen_the_weights_in_memory():
    """No int64 copy of the weights (a 16M-element float32 tensor would need 256 MiB more): numpy's reduction widens
    as it goes."""
    import tracemalloc

    weights = np.random.default_rng(0).standard_normal(1 << 24, dtype=np.float32)
    tracemalloc.start()
    tensor_fingerprint(weights)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 32 * 2**20

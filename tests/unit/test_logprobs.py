"""Log-probabilities and entropies from logits, against hand values and a naive per-token softmax loop."""

import math

import pytest
import torch
from torch.testing import assert_close

from learner.algo import logprobs as logprobs_module
from learner.algo.logprobs import entropy_from_logits, logprobs_from_logits


def _naive_logprobs(logits, labels, temperature=1.0):
    """Python-float softmax, one token at a time: log(exp(z_y / tau) / sum_v exp(z_v / tau))."""
    batch, length, _ = logits.shape
    result = torch.empty(batch, length, dtype=torch.float64)
    for b in range(batch):
        for i in range(length):
            scaled = [z / temperature for z in logits[b, i].double().tolist()]
            top = max(scaled)  # shift for overflow; cancels in the ratio
            denominator = sum(math.exp(z - top) for z in scaled)
            result[b, i] = math.log(math.exp(scaled[labels[b, i]] - top) / denominator)
    return result


def _naive_entropy(logits):
    """-sum_v p_v log p_v with p from a Python-float softmax, one token at a time."""
    batch, length, _ = logits.shape
    result = torch.empty(batch, length, dtype=torch.float64)
    for b in range(batch):
        for i in range(length):
            weights = [math.exp(z) for z in logits[b, i].double().tolist()]
            probs = [w / sum(weights) for w in weights]
            result[b, i] = -sum(p * math.log(p) for p in probs)
    return result


def _random_inputs(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 3, 11, generator=generator) * 4).to(dtype)
    labels = torch.randint(0, 11, (2, 3), generator=generator)
    return logits, labels


def test_logprobs_match_hand_computed_values():
    # logits [0, log 3] -> p = [1/4, 3/4]; uniform logits over 4 -> 1/4 each.
    logits = torch.tensor([[[0.0, math.log(3.0), -math.inf, -math.inf], [2.0, 2.0, 2.0, 2.0]]])
    labels = torch.tensor([[1, 2]])
    assert_close(logprobs_from_logits(logits, labels), torch.tensor([[math.log(0.75), math.log(0.25)]]))


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_logprobs_equal_a_naive_softmax_loop(temperature):
    logits, labels = _random_inputs()
    result = logprobs_from_logits(logits, labels, temperature=temperature)
    assert result.dtype == torch.float32
    assert_close(result, _naive_logprobs(logits, labels, temperature).float())


def test_temperature_divides_the_logits():
    # logits [0, log 3] at tau = 0.5 are [0, 2 log 3] -> p = [1/10, 9/10]
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    labels = torch.tensor([[1]])
    assert_close(logprobs_from_logits(logits, labels, temperature=0.5), torch.tensor([[math.log(0.9)]]))


def test_bfloat16_logits_are_computed_in_float32():
    # The bf16 values are exact in float32, so the float32 result must match a float64 loop on those same values;
    # a bf16 log_softmax would be off by ~1e-2.
    logits, labels = _random_inputs(torch.bfloat16)
    result = logprobs_from_logits(logits, labels)
    assert result.dtype == torch.float32
    assert_close(result, _naive_logprobs(logits, labels).float())


def test_logprobs_gradient_is_onehot_minus_softmax_over_temperature():
    # d/dz log softmax(z / tau)_y = (onehot(y) - softmax(z / tau)) / tau
    logits, labels = _random_inputs()
    logits.requires_grad_()
    temperature = 0.7
    (grad,) = torch.autograd.grad(logprobs_from_logits(logits, labels, temperature).sum(), logits)
    probs = torch.softmax(logits.detach() / temperature, dim=-1)
    expected = (torch.nn.functional.one_hot(labels, 11) - probs) / temperature
    assert_close(grad, expected)


def test_entropy_matches_hand_computed_values():
    # uniform over 4 -> log 4;  p = [1/4, 3/4] -> -(1/4 log 1/4 + 3/4 log 3/4)
    logits = torch.tensor([[[5.0, 5.0, 5.0, 5.0]], [[0.0, math.log(3.0), -30.0, -30.0]]])
    two_point = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert_close(entropy_from_logits(logits), torch.tensor([[math.log(4.0)], [two_point]]))


def test_entropy_equals_a_naive_softmax_loop():
    logits, _ = _random_inputs()
    result = entropy_from_logits(logits)
    assert result.dtype == torch.float32
    assert_close(result, _naive_entropy(logits).float())


def test_entropy_temperature_divides_the_logits():
    logits, _ = _random_inputs()
    assert_close(entropy_from_logits(logits, temperature=2.0), entropy_from_logits(logits / 2.0))
    assert not torch.allclose(entropy_from_logits(logits, temperature=2.0), entropy_from_logits(logits))


@pytest.mark.parametrize("function", [logprobs_from_logits, entropy_from_logits])
def test_non_positive_temperature_is_rejected(function):
    logits, labels = _random_inputs()
    args = (logits, labels) if function is logprobs_from_logits else (logits,)
    with pytest.raises(ValueError, match="temperature"):
        function(*args, temperature=0.0)


def test_labels_must_match_logits():
    logits, labels = _random_inputs()
    with pytest.raises(ValueError, match="labels"):
        logprobs_from_logits(logits, labels[:, :2])


@pytest.mark.parametrize("chunk_elements", [1, 3 * 11 * 2, 3 * 11 * 5])  # one row, two rows, all in one chunk
def test_chunked_rows_give_the_values_and_gradients_of_one_pass(monkeypatch, chunk_elements):
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(5, 3, 11, generator=generator) * 4).requires_grad_()
    labels = torch.randint(0, 11, (5, 3), generator=generator)
    whole_lp, whole_h = logprobs_from_logits(logits, labels, 0.7), entropy_from_logits(logits, 0.7)
    whole_grad = torch.autograd.grad((whole_lp.sum() + whole_h.sum()), logits)[0]
    monkeypatch.setattr(logprobs_module, "FLOAT32_CHUNK_ELEMENTS", chunk_elements)
    lp, h = logprobs_from_logits(logits, labels, 0.7), entropy_from_logits(logits, 0.7)
    assert_close(lp, _naive_logprobs(logits.detach(), labels, 0.7).float())
    assert torch.equal(lp, whole_lp) and torch.equal(h, whole_h)
    assert torch.equal(torch.autograd.grad((lp.sum() + h.sum()), logits)[0], whole_grad)


def test_a_gpu_takes_larger_chunks_than_a_cpu():
    # A packed pass's logits are [T, 1, V]: a CPU's chunks hold a handful of tokens of a large vocabulary, any
    # other device's many more (the meta device stands in for a GPU).
    shape = (8192, 1, 151936)
    on_cpu = logprobs_module._row_chunks(torch.empty(1, 1, 1).expand(*shape))
    on_gpu = logprobs_module._row_chunks(torch.empty(shape, device="meta"))
    assert [len(c) for c in on_cpu[:2]] == [110, 110] and len(on_cpu) == 75
    assert [len(c) for c in on_gpu] == [1766] * 4 + [8192 - 4 * 1766]


def test_temperature_one_is_the_division_by_one():
    # At temperature 1 the float32 copy is scored as it is: the same bits as dividing it by 1.
    logits, labels = _random_inputs()
    wide = logits.float()
    expected = wide.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(wide / 1.0, dim=-1)
    assert torch.equal(logprobs_from_logits(logits, labels, 1.0), expected)

"""The shared token layout: prompt + response, right-padded; position j scores token j+1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.algo.sequences import flat_per_token, pad_per_token, pad_sequences, unpad_per_token


def test_layout_marks_the_positions_that_predict_response_tokens():
    batch = pad_sequences([[7, 8], [9]], [[3, 4, 1], [5]], pad_id=0)
    assert batch.input_ids.tolist() == [[7, 8, 3, 4, 1], [9, 5, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # row 0: positions 1, 2, 3 predict tokens 3, 4, 1; row 1: position 0 predicts token 5
    assert batch.response_mask.tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]


def test_per_token_values_round_trip_and_sub_batches_trim():
    batch = pad_sequences([[7, 8], [9]], [[3, 4, 1], [5]])
    values = [[0.1, 0.2, 0.3], [0.4]]
    padded = pad_per_token(values, batch)
    assert padded[0].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3]) and padded[1].tolist() == pytest.approx(
        [0.4, 0.0, 0.0, 0.0])
    assert [pytest.approx(v) for v in values] == unpad_per_token(padded, batch)
    short = batch.select(torch.tensor([1]))
    assert short.input_ids.tolist() == [[9, 5]] and short.response_mask.tolist() == [[1.0]]


def test_mismatched_inputs_are_refused():
    batch = pad_sequences([[7]], [[3, 4]])
    with pytest.raises(ValueError, match="2 response tokens"):
        pad_per_token([[0.1]], batch)
    with pytest.raises(ValueError, match="empty prompt"):
        pad_sequences([[]], [[3]])


def test_a_flat_array_of_per_token_values_pads_like_its_rows_and_flattens_back():
    batch = pad_sequences([[7, 8], [9]], [[3, 4, 1], [5]])
    rows = [[0.1, 0.2, 0.3], [0.4]]
    flat = np.asarray([0.1, 0.2, 0.3, 0.4], dtype=np.float32)
    assert torch.equal(pad_per_token(flat, batch), pad_per_token(rows, batch))
    assert torch.equal(flat_per_token(pad_per_token(rows, batch), batch), torch.from_numpy(flat))
    with pytest.raises(ValueError, match="3 values for 4 response tokens"):
        pad_per_token(flat[:3], batch)

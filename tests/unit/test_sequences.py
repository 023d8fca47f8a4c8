"""The shared token layout: prompt + response, right-padded; position j scores token j+1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.passes.micro_batches import MicroBatching
from learner.passes.sequences import (
    Rows,
    flat_per_token,
    pad_per_token,
    pad_sequences,
    per_pass,
    unpad_per_token,
)


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


def split(lengths, max_rows=None, max_tokens=None, pack=False) -> list[list[int]]:
    return [part.tolist() for part in MicroBatching(max_rows, max_tokens, pack=pack).split(torch.tensor(lengths))]


def test_passes_are_cut_by_the_token_budget_over_rows_sorted_longest_first():
    lengths = [3, 9, 2, 9, 5, 1, 4]
    # sorted: 9 (1), 9 (3), 5 (4), 4 (6), 3 (0), 2 (2), 1 (5); padded tokens = rows x the pass's longest
    assert split(lengths, max_tokens=18) == [[1, 3], [4, 6, 0], [2, 5]]
    assert split(lengths, max_tokens=8) == [[1], [3], [4], [6, 0], [2, 5]]  # 9 > 8: a pass alone
    assert split(lengths, max_rows=3) == [[1, 3, 4], [6, 0, 2], [5]]
    assert split(lengths, max_rows=2, max_tokens=100) == [[1, 3], [4, 6], [0, 2], [5]]
    assert split(lengths) == [[1, 3, 4, 6, 0, 2, 5]]  # no limit: one pass
    assert split([]) == [] and split([4, 4, 4], max_tokens=8) == [[0, 1], [2]]  # ties keep their order


def test_packed_passes_count_their_rows_own_tokens():
    lengths = [3, 9, 2, 9, 5, 1, 4]
    # sorted: 9 (1), 9 (3), 5 (4), 4 (6), 3 (0), 2 (2), 1 (5); packed tokens = the rows' lengths summed
    assert split(lengths, max_tokens=18, pack=True) == [[1, 3], [4, 6, 0, 2, 5]]  # padded: 3 passes
    assert split(lengths, max_tokens=8, pack=True) == [[1], [3], [4], [6, 0], [2, 5]]
    assert split(lengths, max_rows=2, max_tokens=100, pack=True) == [[1, 3], [4, 6], [0, 2], [5]]
    assert MicroBatching(max_tokens=8, pack=True).padded == MicroBatching(max_tokens=8)


@pytest.mark.parametrize("max_rows", [None, 1, 3])
@pytest.mark.parametrize("max_tokens", [None, 1, 7, 40])
@pytest.mark.parametrize("pack", [False, True])
def test_every_row_is_in_exactly_one_pass_within_both_limits(max_rows, max_tokens, pack):
    lengths = torch.randint(1, 20, (37,), generator=torch.Generator().manual_seed(7))
    passes = MicroBatching(max_rows, max_tokens, pack=pack).split(lengths)
    assert sorted(i for part in passes for i in part.tolist()) == list(range(37))
    for part in passes:
        tokens = int(lengths[part].sum()) if pack else len(part) * int(lengths[part].max())
        assert max_rows is None or len(part) <= max_rows
        assert max_tokens is None or len(part) == 1 or tokens <= max_tokens


def test_each_pass_computes_on_its_rows_only_and_lands_in_the_batch_layout():
    batch = pad_sequences([[7, 8], [9], [4, 5, 6]], [[3, 4, 1], [5], [2]])
    widths = []

    def compute(part):  # value = the token id each position predicts, from the pass's own trimmed tensors
        widths.append(part.input_ids.shape[1])
        return part.input_ids[:, 1:].float()

    out = per_pass(batch, MicroBatching(max_tokens=5), compute)
    assert torch.equal(out, torch.where(batch.attention_mask[:, 1:].bool(), batch.input_ids[:, 1:], 0).float())
    assert widths == [5, 4, 2]  # one row per pass, each trimmed to its own sequence (lengths 5, 4, 2)


def test_rows_travel_as_one_flat_array_and_arrive_as_writable_arrays():
    import pickle

    rows = Rows([np.asarray([3, 4, 1], np.int32), np.asarray([5], np.int32), np.asarray([], np.int32)])
    reduced = rows.__reduce__()
    assert reduced[1][0].tolist() == [3, 1, 0] and reduced[1][1].tolist() == [3, 4, 1, 5]  # lengths, values
    back = pickle.loads(pickle.dumps(rows))
    assert isinstance(back, Rows) and [r.tolist() for r in back] == [[3, 4, 1], [5], []]
    assert all(r.dtype == np.int32 and r.flags.writeable for r in back)
    assert pickle.loads(pickle.dumps(Rows([[0.5, 0.25]])))[0].dtype == np.float64  # lists keep numpy's dtype
    assert pickle.loads(pickle.dumps(Rows())) == []
    batch = pad_sequences(back[:2], [[7], [8, 9]])
    assert batch.input_ids.tolist() == [[3, 4, 1, 7], [5, 8, 9, 0]]


def test_model_masks_make_the_loss_mask_and_leave_the_response_layout_as_it_is():
    # Row 0's response: 3 (model), 4, 6 (environment), 1 (model); row 1's: 5, 2, both the model's.
    batch = pad_sequences([[7, 8], [9]], [[3, 4, 6, 1], [5, 2]], model_masks=[[1, 0, 0, 1], [1.0, 1.0]])
    assert batch.response_mask.tolist() == [[0, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 0, 0, 1], [1, 1, 0, 0, 0]] and batch.has_env_tokens
    assert batch.loss_mask.dtype == batch.response_mask.dtype == torch.float32
    # Per-token values still cover every response token, the environment's included.
    values = [[0.1, 0.2, 0.3, 0.4], [0.5, 0.6]]
    assert [pytest.approx(v) for v in values] == unpad_per_token(pad_per_token(values, batch), batch)
    short = batch.select(torch.tensor([1]))
    assert short.loss_mask.tolist() == [[1.0, 1.0]] and not short.has_env_tokens
    assert batch.select(torch.tensor([0, 1])).loss_mask.tolist() == batch.loss_mask.tolist()
    assert batch.to("cpu").loss_mask.tolist() == batch.loss_mask.tolist()


def test_without_environment_tokens_the_loss_mask_is_the_response_mask_itself():
    for masks in (None, [[1, 1, 1], [1]], Rows([np.ones(3, np.float32), np.ones(1, np.float32)])):
        batch = pad_sequences([[7, 8], [9]], [[3, 4, 1], [5]], model_masks=masks)
        assert batch.loss_mask is batch.response_mask and not batch.has_env_tokens
        part = batch.select(torch.tensor([1]))
        assert part.loss_mask is part.response_mask and batch.to("cpu").loss_mask is batch.to("cpu").response_mask


def test_model_masks_travel_packed_and_are_checked_against_the_responses():
    import pickle

    masks = pickle.loads(pickle.dumps(Rows([np.array([1, 0, 1], np.float32), np.array([1], np.float32)])))
    assert pad_sequences([[7], [9]], [[3, 4, 1], [5]], model_masks=masks).loss_mask.tolist() == [
        [1, 0, 1], [1, 0, 0]]
    with pytest.raises(ValueError, match="sequence 0: 2 model-mask values for 3 response tokens"):
        pad_sequences([[7], [9]], [[3, 4, 1], [5]], model_masks=[[1, 0], [1]])
    with pytest.raises(ValueError, match="1 model masks for 2 responses"):
        pad_sequences([[7], [9]], [[3, 4, 1], [5]], model_masks=[[1, 0, 1]])

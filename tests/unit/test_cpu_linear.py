"""Choices made from the policy's size and the threads before the actors start: which kernel a CPU engine's linear
layers take (`rollout.cpu_linear`), that torch's gives each row the same bits in a batch of any size, and whether
on-policy steps send the update before the reference's logprobs arrive (`learner.overlap_reference`)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from actors.engine import EngineSettings, wants_torch_linear
from actors.vllm_extension import ROW_BLOCKS, blocked_rows, row_block, rows_invariant, torch_linear
from cluster.config import ConfigError, load_config
from cluster.fleet.placement import with_default_threads
from cluster.run.logprob_asks import overlaps_reference
from learner.passes.device import SMALL_MODEL_PARAMETERS


def _model(tmp_path, parameters: int) -> str:
    save_file({"embed.weight": torch.zeros(parameters // 100, 100), "norm.weight": torch.zeros(parameters % 100)},
              str(tmp_path / "model.safetensors"))
    return str(tmp_path)


@pytest.mark.parametrize("parameters,expected", [(SMALL_MODEL_PARAMETERS - 1, True), (SMALL_MODEL_PARAMETERS, False)])
def test_auto_takes_torch_linear_below_the_small_model_size_in_a_one_shard_engine_here(tmp_path, parameters,
                                                                                          expected):
    path = _model(tmp_path, parameters)
    assert wants_torch_linear(EngineSettings(model_path=path), in_process=True) is expected
    assert not wants_torch_linear(EngineSettings(model_path=path), in_process=False)
    assert not wants_torch_linear(EngineSettings(model_path=path, tensor_parallel_size=2), in_process=True)
    assert not wants_torch_linear(EngineSettings(model_path=str(tmp_path / "none")), in_process=True)  # size unknown


def test_an_explicit_kernel_is_taken_whatever_the_size_and_torch_needs_a_one_shard_engine_here(tmp_path):
    path = _model(tmp_path, 10 * SMALL_MODEL_PARAMETERS)
    assert wants_torch_linear(EngineSettings(model_path=path, cpu_linear="torch"), in_process=True)
    (tmp_path / "small").mkdir()
    small = _model(tmp_path / "small", 1000)
    assert not wants_torch_linear(EngineSettings(model_path=small, cpu_linear="onednn"), in_process=True)
    for settings, here in ((EngineSettings(model_path=path, cpu_linear="torch"), False),
                           (EngineSettings(model_path=path, cpu_linear="torch", tensor_parallel_size=2), True)):
        with pytest.raises(ValueError, match="rollout.cpu_linear=torch needs a one-shard engine"):
            wants_torch_linear(settings, in_process=here)


def test_auto_overlaps_the_learner_and_reference_where_they_do_not_compete_for_the_cpus_cores(tmp_path):
    (tmp_path / "small").mkdir()
    small, large = _model(tmp_path / "small", SMALL_MODEL_PARAMETERS - 1), _model(tmp_path, SMALL_MODEL_PARAMETERS)
    assert overlaps_reference(with_default_threads(load_config(None, []), small))  # one thread each
    assert not overlaps_reference(with_default_threads(load_config(None, []), large))  # two each
    assert not overlaps_reference(load_config(None, ["learner.num_threads=1", "reference.num_threads=2"]))
    assert overlaps_reference(load_config(None, ["learner.num_threads=4", "reference.num_threads=4",
                                                 "learner.num_gpus=1", "reference.num_gpus=1"]))
    assert overlaps_reference(load_config(None, ["learner.num_threads=2", "reference.num_threads=2",
                                                 "learner.overlap_reference=true"]))
    assert not overlaps_reference(load_config(None, ["learner.num_threads=1", "reference.num_threads=1",
                                                     "learner.overlap_reference=false"]))
    with pytest.raises(ConfigError, match="learner.overlap_reference"):
        load_config(None, ["learner.overlap_reference=sometimes"])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_linear_gives_each_row_the_same_bits_in_a_batch_of_any_size(threads, dtype):
    """An engine's `torch_linear` runs every matmul on a fixed number of rows, so a sequence's logits do not depend
    on how many others its forward pass held (docs/vllm-cpu.md, batch invariance), on this machine's kernels; the same
    values as torch's linear, in any shape of leading dimensions."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert rows_invariant(torch_linear, 128, dtype)
        assert rows_invariant(torch_linear, 128, dtype, out=17, bias=torch.randn(17).to(dtype))
    finally:
        torch.set_num_threads(before)
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(5, 8, generator=generator), torch.randn(5, generator=generator)
    for shape in ((3, 8), (2, 3, 8), (4, 8), (8,), (40, 8), (2, 17, 8)):
        x = torch.randn(*shape, generator=generator)
        out = torch_linear(x, weight, bias)
        assert out.shape == (*shape[:-1], 5)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias))


def micro_blocked(block: int):
    """A linear kernel like a CPU matmul whose micro-kernel takes `block` rows at a time: the rows left over after
    the last whole block are computed by another kernel, whose sums round differently (here: one ulp up). Each row
    of the whole blocks is exact whatever the batch (computed alone)."""

    def linear(x, weight, bias):
        rows = torch.stack([torch.nn.functional.linear(row, weight, bias) for row in x])
        whole = len(x) - len(x) % block
        return torch.cat([rows[:whole], torch.nextafter(rows[whole:], torch.full_like(rows[whole:], float("inf")))])

    return linear


@pytest.mark.parametrize("block", [3, 4, 6, 14])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_row_blocks_make_a_kernel_of_any_blocking_batch_invariant(block, dtype):
    """The construction does not depend on one CPU's blocking: against kernels whose micro-kernels take 3, 4, 6 or 14
    rows, each batch-dependent alone, `blocked_rows` picks a block every position of which computes alike (a whole
    number of the kernel's blocks) and gives every row the same bits in batches of any size."""
    kernel = micro_blocked(block)
    assert not rows_invariant(kernel, 32, dtype, out=8)
    chosen = row_block(32, 8, dtype, False, kernel)
    assert chosen % block == 0 and chosen in ROW_BLOCKS
    assert rows_invariant(lambda x, w, b: blocked_rows(x, w, b, kernel), 32, dtype, out=8)


@pytest.mark.parametrize("limit", [20, 32, 64])
def test_a_kernel_that_takes_another_path_for_larger_batches_is_batch_invariant_in_fixed_row_blocks(limit):
    """CPU matmuls switch code paths with the matrices' size (a small-matrix kernel up to some row count, a packed
    one above it, rounding differently): padding a batch to a whole number of blocks would still cross the switch;
    matmuls of a fixed row count never do."""

    def by_size(x, weight, bias):
        out = torch.stack([torch.nn.functional.linear(row, weight, bias) for row in x])
        return out if len(x) <= limit else torch.nextafter(out, torch.full_like(out, float("inf")))

    assert not rows_invariant(by_size, 32, torch.float32, out=8)
    assert row_block(32, 8, torch.float32, False, by_size) <= limit
    assert rows_invariant(lambda x, w, b: blocked_rows(x, w, b, by_size), 32, torch.float32, out=8)


def test_a_kernel_whose_every_position_computes_differently_is_run_one_row_at_a_time():
    """The last resort holds for any kernel whose rows depend on their position: one row per matmul."""

    def by_position(x, weight, bias):
        out = torch.nn.functional.linear(x, weight, bias)
        return out + torch.arange(len(x), dtype=out.dtype)[:, None] * 2.0**-20

    assert not rows_invariant(by_position, 16, torch.float32, out=4)
    assert row_block(16, 4, torch.float32, False, by_position) == 1
    assert rows_invariant(lambda x, w, b: blocked_rows(x, w, b, by_position), 16, torch.float32, out=4)


def test_the_engines_start_check_finds_a_kernel_whose_rows_depend_on_the_batch():
    """`rows_invariant`, which decides whether an engine is batch-invariant, can fail: a kernel whose result moves
    with the batch's row count in the last bit only."""

    def uneven(x, weight, bias):
        out = torch.nn.functional.linear(x, weight, bias)
        return out if x.shape[0] % 3 else torch.nextafter(out, torch.full_like(out, float("inf")))

    assert not rows_invariant(uneven, 64, torch.float32)

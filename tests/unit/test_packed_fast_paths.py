"""The packed passes' fast paths (`learner.fast_paths`) against today's packed path, on the CPU, in float32 and
bfloat16 (autocast on float32 master weights, as the learner runs): logprobs, entropies and every gradient.

- Variable-length attention (`varlen_attention`; on a CPU FlexAttention's mask, evaluated densely through sdpa):
  the attention's softmax and weighted sums run over other shapes, in another order, so it is not equal bit for bit.
  The bound: both paths err from the same computation in float64 by rounding alone, and the fast path's largest
  error is at most twice the plain path's, plus 2 u of the largest value (u: the dtype's unit roundoff, 2^-24
  float32, 2^-8 bfloat16). Rows that saw each other would err by far more, and the test that changes one row's tokens
  asserts the other rows' logprobs do not move at all.
- Compiled layers on bucketed lengths (`compile_bucket_tokens`, here with the `aot_eager` backend, so dynamo really
  traces): the forward runs the same kernels on the same rows (bucket padding only adds rows to the token-wise
  matmuls), so logprobs and entropies are equal bit for bit; the backward sums the weight gradients over the padded
  token count in AOTAutograd's order: within the float64 bound above. Compiled shapes: one set per bucket.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from learner.config import FastPathsConfig
from learner.passes import varlen
from learner.passes.compiled import compile_layers
from learner.passes.device import compute_in
from learner.passes.head import PassScorer
from learner.passes.micro_batches import MicroBatching
from learner.passes.packing import PackedPaths, bucketed
from learner.passes.sequences import SharedPrompts, pad_sequences
from tests.unit.test_fast_paths import DTYPES, UNIT_ROUNDOFF, recorded_passes, rows, tiny_model

SHARED = {"packed": False, "shared, packed": True}  # every packed pass: whole rows, rows on shared prompts' states
VARLEN = PackedPaths(varlen=True)
BUCKET = 16
SHARING = MicroBatching(share_prompts=True, pack=True)  # the rows' passes on shared prompts packed


def scored(model, dtype: torch.dtype, shared: bool, paths: PackedPaths = PackedPaths(), responses=None):
    """Logprobs and entropies [B, L-1] of `rows()` (with `responses` instead of its own, if given) in packed passes
    run by `paths`, and every parameter's gradient of sum(logprobs) + 0.1 sum(entropies) over the response tokens."""
    prompts, own = rows()
    batch = pad_sequences(prompts, responses or own)
    model.zero_grad(set_to_none=True)
    precision = compute_in(torch.device("cpu"), dtype, torch.float32) if dtype != torch.float64 else nullcontext()
    with precision:
        shared_prompts = SharedPrompts(model, batch, True, SHARING) if shared else None
        logprobs, entropy = PassScorer(None, paths).logprobs_and_entropy(model, batch, 1.0, True, shared_prompts, True)
    mask = batch.response_mask
    ((logprobs * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
    if shared_prompts is not None:
        shared_prompts.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return (logprobs * mask).detach(), (entropy * mask).detach(), grads


@pytest.fixture(autouse=True)
def dynamo_on():
    """An in-process CPU vLLM engine of another test turns dynamo off process-wide (actors/engine.py): on here."""
    import torch._dynamo

    with torch._dynamo.config.patch(disable=False):
        yield


@pytest.fixture(scope="module")
def exact():
    """The plain packed path in float64: what both paths approximate."""
    return {shared: scored(tiny_model().double(), torch.float64, shared) for shared in (False, True)}


def assert_within_float64_bound(fast, plain, exact, dtype):
    u = UNIT_ROUNDOFF[dtype]
    for name, mine, theirs, truth in zip(("logprobs", "entropies", "gradients"), fast, plain, exact):
        error, plain_error = (mine.double() - truth).abs().max(), (theirs.double() - truth).abs().max()
        assert error <= 2 * plain_error + 2 * u * truth.abs().max(), (name, float(error), float(plain_error))


@pytest.mark.parametrize("layout", list(SHARED))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_varlen_attention_errs_from_float64_at_most_twice_as_far_as_the_gathered_path(dtype, layout, exact):
    model, torch_dtype = tiny_model(), DTYPES[dtype]
    plain = scored(model, torch_dtype, SHARED[layout])
    for paths in (VARLEN, PackedPaths(varlen=True, bucket_tokens=BUCKET)):
        assert_within_float64_bound(scored(model, torch_dtype, SHARED[layout], paths), plain, exact[SHARED[layout]],
                                    torch_dtype)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager, as asked
@pytest.mark.parametrize("layout", list(SHARED))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_without_gradients_flex_attention_s_block_mask_scores_as_the_gathered_path(dtype, layout, monkeypatch):
    # FlexAttention itself with its block mask (what a GPU runs; eager here, and only without gradients: it has no
    # backward on a CPU) instead of its mask evaluated densely, the CPU's path.
    monkeypatch.setattr(varlen, "_dense", lambda query: False)
    model, torch_dtype = tiny_model(), DTYPES[dtype]
    prompts, responses = rows()
    batch = pad_sequences(prompts, responses)
    out = {}
    for paths in (PackedPaths(), VARLEN):
        with torch.no_grad(), compute_in(torch.device("cpu"), torch_dtype, torch.float32):
            shared = SharedPrompts(model, batch, False, SHARING) if SHARED[layout] else None
            out[paths] = PassScorer(None, paths).logprobs(model, batch, 1.0, shared, True) * batch.response_mask
    bound = 4 * UNIT_ROUNDOFF[torch_dtype] * (1 + out[PackedPaths()].abs().max())
    assert (out[VARLEN] - out[PackedPaths()]).abs().max() <= bound


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("layout", list(SHARED))
def test_with_varlen_attention_changing_one_row_s_tokens_leaves_every_other_row_s_logprobs_unchanged(layout, grad):
    model = tiny_model()
    _, responses = rows()
    changed = [list(row) for row in responses]
    changed[1] = [(token * 7 + 3) % 299 + 1 for token in changed[1]]  # row 1's response, its length kept
    out = []
    for own in (responses, changed):
        with torch.set_grad_enabled(grad):
            batch = pad_sequences(rows()[0], own)
            shared = SharedPrompts(model, batch, grad, SHARING) if SHARED[layout] else None
            out.append(PassScorer(None, VARLEN).logprobs(model, batch, 1.0, shared, True).detach())
    others = [i for i in range(len(responses)) if i != 1]
    assert not torch.equal(out[0][1], out[1][1])  # the changed row's own logprobs did change
    assert torch.equal(out[0][others], out[1][others])


@pytest.mark.parametrize("layout", list(SHARED))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_compiled_layers_on_bucketed_lengths_score_bit_for_bit_and_train_within_the_float64_bound(dtype, layout,
                                                                                                  exact):
    torch_dtype = DTYPES[dtype]
    plain = scored(tiny_model(), torch_dtype, SHARED[layout])
    model = tiny_model()
    torch._dynamo.reset()  # no graphs of another test's model: these compile afresh
    assert compile_layers(model, "aot_eager", 8) == 2
    for paths in (PackedPaths(bucket_tokens=BUCKET), PackedPaths(varlen=True, bucket_tokens=BUCKET)):
        fast = scored(model, torch_dtype, SHARED[layout], paths)
        if not paths.varlen:
            assert torch.equal(fast[0], plain[0]) and torch.equal(fast[1], plain[1])
        assert_within_float64_bound(fast, plain, exact[SHARED[layout]], torch_dtype)


def test_compiled_layers_compile_once_per_bucket_whatever_the_passes_rows():
    from torch._dynamo.utils import counters

    model = tiny_model()
    torch._dynamo.reset()
    compile_layers(model, "aot_eager", 8)
    prompts, responses = rows()
    graphs = []
    # Five passes of different rows and token counts: 41, 46 and 47 tokens share the bucket of 48, 49 and 60 that
    # of 64 (`BUCKET` 16).
    for count in (2, 3, 4, 5, 6):
        batch = pad_sequences(prompts[:count], [row[:5] for row in responses[:count]])
        before = counters["stats"]["unique_graphs"]
        PassScorer(None, PackedPaths(bucket_tokens=BUCKET)).logprobs(model, batch, 1.0, None, True).sum().backward()
        graphs.append((bucketed(int(batch.attention_mask.sum()), BUCKET), counters["stats"]["unique_graphs"] - before))
    first = graphs[0][1]
    assert first > 0  # dynamo did trace the layers
    new_buckets = {bucket for bucket, _ in graphs}
    assert sum(added for _, added in graphs) == first * len(new_buckets) and len(new_buckets) < len(graphs)
    assert all(added == (first if bucket not in {b for b, _ in graphs[:i]} else 0)
               for i, (bucket, added) in enumerate(graphs))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("packed-fast-paths-model")
    tiny_model(tied=True).save_pretrained(path)
    return path


FAST = FastPathsConfig(varlen_attention=True, compile_bucket_tokens=BUCKET, compile_backend="aot_eager")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_old_logprobs_and_the_update_run_the_same_bucketed_passes_so_first_ratios_are_exactly_one(model_dir, dtype):
    # The bfloat16 shape trap (verl #6280): two epochs of two minibatches, so old logprobs run in passes of their own
    # (without gradients), which must bucket as the first epoch's training passes do.
    calls, ratios = recorded_passes(model_dir, dtype, ppo_epochs=2, max_tokens_per_micro_batch=16, fast_paths=FAST)
    old = [ids for ids, grad in calls if not grad]
    first_epoch = [ids for ids, grad in calls if grad][:len(old)]
    packed = [ids for ids in old if ids.shape[0] == 1 and ids.shape[1] % BUCKET == 0]
    assert len(packed) > 2  # the rows' packed passes, bucketed (the others: shared prompts' padded prefixes)
    assert all(torch.equal(a, b) for a, b in zip(old, first_epoch))  # the same tokens, padding and shapes
    first = ratios[: len(ratios) // 4]  # the first minibatch's passes: nothing has changed yet
    assert first and all(torch.equal(logprobs, before) for logprobs, before in first)


def test_with_one_update_per_batch_old_logprobs_are_the_training_forward_s_own_on_the_packed_fast_paths(model_dir):
    _, ratios = recorded_passes(model_dir, "bfloat16", num_minibatches=1, max_tokens_per_micro_batch=10**4,
                                fast_paths=FAST)
    assert ratios and all(torch.equal(logprobs, before) for logprobs, before in ratios)


def test_compile_asks_for_a_known_backend():
    with pytest.raises(ValueError, match="inductor, aot_eager"):
        compile_layers(tiny_model(), "cudagraphs", 8)


def test_compile_refuses_a_process_where_dynamo_is_off():
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True), pytest.raises(RuntimeError, match="is disabled in this process"):
        compile_layers(tiny_model(), "aot_eager", 8)

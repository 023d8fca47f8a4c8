"""Passes cut by a token budget over length-sorted rows, packed passes (`learner.passes.packing`), prompts shared by a
group's rows computed once (`SharedPrompts`), and the single-update path that takes old logprobs from the training
forward: the Learner's update (every gradient and metric, and with PPO the value model's) equals the one-pass
computation over whole padded rows, in every aggregation mode, on ragged lengths, in float32 and under bfloat16
compute; the reference's logprobs do not depend on how their passes are cut, whether they are packed or whether
prompts are shared."""

from __future__ import annotations

import math

import pytest
import torch

from actors.reference import ReferenceWorker
from learner.batch import TrainBatch
from learner.config import CriticConfig, LearnerConfig
from learner.learner import Learner
from learner.passes.micro_batches import MicroBatching
from learner.passes.packing import IMPLEMENTATION, packable
from learner.passes.sequences import (
    SharedPrompts,
    pad_sequences,
    prompt_lengths,
    prompts_shared,
    sequence_logprobs,
    sequence_logprobs_and_entropy,
    tail_lengths,
)

# Four groups of two; prompts of 2 to 6 tokens, responses of 1 to 7: sequences of 3 to 12 tokens.
PROMPTS = [[5, 9, 12, 6, 7, 15]] * 2 + [[3, 15]] * 2 + [[9, 12, 9, 15]] * 2 + [[4, 12, 15]] * 2
RESPONSES = [[12, 2, 1], [4, 4, 7, 8, 2, 9, 1], [5], [9, 3, 1], [13, 1], [3, 12, 2, 4, 1], [7, 7, 7, 7, 7, 1], [2, 1]]
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, 1.0, 1.0, 0.0]
BUDGET = 16  # padded tokens per pass: the 8 rows go in 5 passes of 1 or 2 rows, each padded to its own longest
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# Tolerance of the weight change (= -gradient, SGD lr 1, no clipping), relative to the largest element of the
# expected change and as the relative norm of the difference. float32: only summation order differs; measured
# 3e-7 (norm) and 1e-6 of the largest element at worst. bfloat16 compute: a row's logits depend on how much
# padding its pass carries (other matmul shapes round differently); measured up to 1.2e-2 (norm) and 1.5e-2 of the
# largest element (seq-mean-token-sum). A real mistake (a wrong normaliser, a lost pass) is 10% or more.
TOLERANCE = {"float32": (1e-5, 1e-5), "bfloat16": (3e-2, 3e-2)}  # (element / largest, norm)
# Of every metric, relative. bfloat16: the same padding effect; differences of logprobs move most (approx_kl: 2.6%
# on an AVX2 CPU, whose bfloat16 kernels round differently from AVX-512's).
METRIC_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
# Absolute, for metrics that are ~0 (the policy loss: advantages sum to 0 and ratios are ~1). bfloat16: pi_old from a
# pass over other rows than the training forward's (ranks' shares, shared prompts' prefix passes) rounds differently,
# and ratios move by ~1e-3: measured up to 5.6e-5 on the loss (seq-mean-token-sum, which sums tokens). A real mistake
# shows in the gradients, checked above.
METRIC_ABS_TOLERANCE = {"float32": 1e-6, "bfloat16": 2e-4}


def make(model_dir, dtype: str, critic: CriticConfig | None = None, **overrides) -> Learner:
    config = LearnerConfig(**{"lr": 1.0, "warmup_steps": 0, "kl_coef": 0.1, "entropy_coef": 0.01, "num_threads": 2,
                              "max_grad_norm": 1e9, "share_prompts": False, "pack_sequences": False,
                              **overrides})
    learner = Learner(str(model_dir), config, dtype=dtype, seed=0, norm_length=8, critic=critic)
    learner.optimizer = torch.optim.SGD(learner.model.parameters(), lr=1.0)  # the step is -gradient
    learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda n: 1.0)
    return learner


def update(learner: Learner, behavior, ref) -> tuple[dict[str, torch.Tensor], dict[str, float], int]:
    """One train_step: the weight change per tensor, the metrics, and how many forward passes the policy made."""
    before = {name: tensor.detach().clone() for name, tensor in learner.model.state_dict().items()}
    passes = []
    hook = learner.model.register_forward_hook(lambda module, args, kwargs, out: passes.append(kwargs["input_ids"]),
                                               with_kwargs=True)
    try:
        metrics = learner.train_step(TrainBatch(PROMPTS, RESPONSES, behavior, REWARDS, 2, ref))
    finally:
        hook.remove()
    after = learner.model.state_dict()
    assert all(ids.numel() <= BUDGET or len(ids) == 1 for ids in passes if learner.batching.max_tokens == BUDGET)
    return {name: after[name] - before[name] for name in before}, metrics, len(passes)


def inputs(model_dir, dtype: str):
    """The engines' logprobs (the base weights, shifted so the mismatch metrics are not 0) and the reference's."""
    base = make(model_dir, dtype)
    behavior = [[lp + 0.01 * (i % 3) for lp in row] for i, row in enumerate(base.compute_logprobs(PROMPTS, RESPONSES))]
    ref = ReferenceWorker(str(model_dir), dtype).compute_logprobs(PROMPTS, RESPONSES)
    return behavior, [[lp - 0.05 * (i % 2) for lp in row] for i, row in enumerate(ref)]


def assert_same_update(ours, theirs, dtype: str) -> None:
    (delta, metrics, _), (expected_delta, expected_metrics, _) = ours, theirs
    element, norm = TOLERANCE[dtype]
    changed = torch.cat([d.flatten() for d in expected_delta.values()])
    assert changed.abs().max() > 1e-3  # the update is not trivially zero
    for name in expected_delta:
        torch.testing.assert_close(delta[name], expected_delta[name], msg=name, rtol=0,
                                   atol=element * float(changed.abs().max()))
    total = torch.cat([d.flatten() for d in delta.values()])
    assert (total - changed).norm() / changed.norm() < norm
    assert metrics.keys() == expected_metrics.keys()
    for name, value in expected_metrics.items():
        if not name.startswith(("memory/", "grad_norm")):
            expected = pytest.approx(value, rel=METRIC_TOLERANCE[dtype], abs=METRIC_ABS_TOLERANCE[dtype])
            assert metrics[name] == expected, name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_token_budget_passes_make_the_one_pass_update_in_every_mode(tiny_model_dir, dtype, mode):
    behavior, ref = inputs(tiny_model_dir, dtype)
    for policy_loss in (["ppo", "gspo"] if mode == "seq-mean-token-mean" else ["ppo"]):
        settings = dict(loss_agg=mode, policy_loss=policy_loss, num_minibatches=2)  # two updates: pi_old its own pass
        whole = update(make(tiny_model_dir, dtype, max_tokens_per_micro_batch=None, **settings), behavior, ref)
        # pi_old in the passes of the first epoch's minibatches (learner.passes.rounds), then one pass per minibatch
        assert whole[2] == 2 + 2
        for pack in (False, True):  # padded passes: 5 + 4 or 5; packed (real tokens count): 4 + 2 or 3 at least
            split = make(tiny_model_dir, dtype, max_tokens_per_micro_batch=BUDGET, pack_sequences=pack, **settings)
            assert split.batching.pack == pack
            ours = update(split, behavior, ref)
            assert ours[2] > whole[2] + (2 if pack else 4)
            assert_same_update(ours, whole, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_value_models_passes_cut_and_packed_make_the_one_pass_update(tiny_model_dir, dtype):
    """PPO: the value model runs the policy's passes, packed too (`learner.pack_sequences`): its values, its update
    and the policy's equal the one-pass computation over whole padded rows."""
    behavior, ref = inputs(tiny_model_dir, dtype)
    critic = CriticConfig(enabled=True, lr=1.0, max_grad_norm=1e9)

    def make_ppo(**overrides) -> Learner:
        learner = make(tiny_model_dir, dtype, advantage="gae", critic=critic, **overrides)
        learner.critic.optimizer = torch.optim.SGD(learner.critic.model.parameters(), lr=1.0)
        learner.critic.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.critic.optimizer, lambda n: 1.0)
        noise = torch.Generator().manual_seed(1)  # the same values in every learner, and not 0: a new head is 0,
        with torch.no_grad():  # which would leave the backbone without a gradient
            for parameter in learner.critic.model.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=noise).to(parameter.dtype))
        return learner

    whole = make_ppo(max_tokens_per_micro_batch=None)
    batch = pad_sequences(PROMPTS, RESPONSES)
    values = whole.critic.compute_values(batch)
    trained = batch.attention_mask[:, :-1].bool()  # every real token's state
    whole_critic = {n: t.detach().clone() for n, t in whole.critic.model.state_dict().items()}
    expected = update(whole, behavior, ref)
    expected_critic = {n: whole.critic.model.state_dict()[n] - t for n, t in whole_critic.items()}
    largest = max(float(d.abs().max()) for d in expected_critic.values())
    assert largest > 1e-3
    for pack in (False, True):
        split = make_ppo(max_tokens_per_micro_batch=BUDGET, pack_sequences=pack)
        assert split.batching.pack == split.critic.pack == pack
        ours = split.critic.compute_values(batch)
        tolerance = 1e-5 if dtype == "float32" else 3e-2
        torch.testing.assert_close(ours[trained], values[trained], rtol=0,
                                   atol=tolerance * float(values[trained].abs().max()))
        if pack:
            assert torch.all(ours[~trained] == 0)  # no real token, no value
        before = {n: t.detach().clone() for n, t in split.critic.model.state_dict().items()}
        assert_same_update(update(split, behavior, ref), expected, dtype)
        element, _ = TOLERANCE[dtype]
        for name, change in expected_critic.items():
            torch.testing.assert_close(split.critic.model.state_dict()[name] - before[name], change, msg=name, rtol=0,
                                       atol=element * largest)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_one_update_per_batch_takes_old_logprobs_from_the_training_forward(tiny_model_dir, dtype, mode):
    behavior, ref = inputs(tiny_model_dir, dtype)
    fused = make(tiny_model_dir, dtype, loss_agg=mode, max_tokens_per_micro_batch=BUDGET)
    separate = make(tiny_model_dir, dtype, loss_agg=mode, max_tokens_per_micro_batch=BUDGET)
    assert fused.single_update
    separate.single_update = False  # the general path: a no-grad pass for pi_old first
    ours, theirs = update(fused, behavior, ref), update(separate, behavior, ref)
    assert theirs[2] == 2 * ours[2]  # the same passes, without the no-grad one over the batch
    assert_same_update(ours, theirs, dtype)
    metrics = ours[1]
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_fraction"] == 0.0  # pi_old is this very forward
    # The mismatch metrics measure the engines' shift (0.01 on two rows of three), not 0.
    assert metrics["logprob/mismatch"] == pytest.approx(theirs[1]["logprob/mismatch"], abs=1e-6)
    assert metrics["logprob/mismatch"] > 0.003 and metrics["mismatch/kl"] > 1e-5


def test_the_general_path_is_kept_whenever_pi_old_is_needed_before_or_across_updates(tiny_model_dir):
    assert make(tiny_model_dir, "float32").single_update
    for settings in (dict(ppo_epochs=2), dict(num_minibatches=2), dict(kl_coef=0.0, kl_reward_coef=0.1)):
        assert not make(tiny_model_dir, "float32", **settings).single_update, settings


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("correction", [("tis", "token"), ("mis", "sequence"), ("tis", "sequence")])
def test_one_update_per_batch_takes_the_rollout_correction_from_the_training_forward(tiny_model_dir, dtype,
                                                                                     correction):
    """Decoupled PPO's weights pi_proximal / pi_behavior (asynchronous training) need no pass of their own either:
    per token, and per sequence (a row is never split across passes)."""
    mode, level = correction
    settings = dict(rollout_correction=mode, rollout_correction_level=level, rollout_correction_cap=math.exp(0.1),
                    max_tokens_per_micro_batch=BUDGET)
    behavior, ref = inputs(tiny_model_dir, dtype)
    # log rho = -0.2, ~0 or +0.2 per row (by i % 3): beyond the cap (e^0.1) both ways, or well inside it.
    behavior = [[lp + 0.2 * ((i + 1) % 3 - 1) for lp in row] for i, row in enumerate(behavior)]
    fused, separate = make(tiny_model_dir, dtype, **settings), make(tiny_model_dir, dtype, **settings)
    assert fused.single_update
    separate.single_update = False
    ours, theirs = update(fused, behavior, ref), update(separate, behavior, ref)
    assert theirs[2] == 2 * ours[2]
    assert_same_update(ours, theirs, dtype)
    name = "capped_fraction" if mode == "tis" else "masked_fraction"
    assert 0 < ours[1][f"rollout_correction/{name}"] < 1  # the cap bites on some tokens (or sequences), not all


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_logprobs_do_not_depend_on_the_passes(tiny_model_dir, dtype):
    one = ReferenceWorker(str(tiny_model_dir), dtype, batching=MicroBatching()).compute_logprobs(PROMPTS, RESPONSES)
    for batching in (MicroBatching(max_tokens=BUDGET), MicroBatching(max_rows=1), MicroBatching(3, 20),
                     MicroBatching(max_tokens=BUDGET, share_prompts=True), MicroBatching(3, 20, True),
                     MicroBatching(pack=True), MicroBatching(max_tokens=BUDGET, pack=True),
                     MicroBatching(max_tokens=BUDGET, share_prompts=True, pack=True), MicroBatching(3, 20, True, True)):
        cut = ReferenceWorker(str(tiny_model_dir), dtype, batching=batching).compute_logprobs(PROMPTS, RESPONSES)
        for ours, theirs in zip(cut, one):
            # float32: the same values up to summation order; bfloat16: padding and packing change the matmul shapes'
            # rounding
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0,
                                       atol=1e-5 if dtype == "float32" else 0.05)


# Shared prompts: groups of two and three sharing a prompt, two one-token prompts (no prefix to share), two prompts
# that differ in their last token only (one prefix), and a row without a response.
SHARED_PROMPTS = ([[5, 9, 12, 6, 7, 15]] * 3 + [[3, 15]] * 2 + [[7]] * 2 + [[9, 12, 9, 4]] + [[9, 12, 9, 15]]
                  + [[4, 12, 15]])
SHARED_RESPONSES = [[12, 2, 1], [4, 4, 7, 8, 2, 9, 1], [5], [9, 3, 1], [13, 1], [3, 12, 2, 4, 1], [2, 1],
                    [7, 7, 7, 7, 7, 1], [2, 1], []]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pack", [False, True])
def test_shared_prompts_give_every_rows_logprobs_entropies_and_gradients(tiny_model_dir, dtype, pack):
    """Each distinct prefix (a prompt without its last token) runs once; the passes run each row's own tokens on its
    states (padded, or packed into one sequence); logprobs and entropies at the response positions, and the
    gradients of a loss over them, are the ones of whole rows (0 at prompt positions)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=getattr(torch, dtype))
    batch = pad_sequences(SHARED_PROMPTS, SHARED_RESPONSES)
    weights = torch.linspace(0.5, 1.5, batch.response_mask.numel()).view_as(batch.response_mask)
    assert prompt_lengths(batch).tolist() == [len(p) for p in SHARED_PROMPTS] and prompts_shared(batch)

    def loss(logprobs, entropy, mask, rows):
        return ((logprobs + 0.1 * entropy) * mask * weights[rows, : mask.shape[1]]).sum()

    logprobs, entropy = sequence_logprobs_and_entropy(model, batch)
    loss(logprobs, entropy, batch.response_mask, slice(None)).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    rows_run = []
    hook = model.register_forward_hook(lambda m, args, kwargs, out: rows_run.append(kwargs["input_ids"].shape),
                                       with_kwargs=True)
    prompts = SharedPrompts(model, batch, grad=True, batching=MicroBatching(pack=pack))
    assert rows_run == [(4, 5)]  # 4 distinct non-empty prefixes, padded to the longest (5 tokens)
    got_logprobs, got_entropy = torch.zeros_like(logprobs), torch.zeros_like(entropy)
    passes = MicroBatching(max_tokens=BUDGET, pack=pack).split(tail_lengths(batch))
    assert len(passes) > 2
    for rows in passes:
        part = batch.select(rows)
        lp, ent = sequence_logprobs_and_entropy(model, part, prompts=prompts)
        loss(lp, ent, part.response_mask, rows).backward()
        got_logprobs[rows, : lp.shape[1]], got_entropy[rows, : ent.shape[1]] = lp.detach(), ent.detach()
    prompts.backward()
    hook.remove()
    assert sum(r * t for r, t in rows_run[1:]) < int(batch.lengths.sum())  # the passes ran fewer tokens than rows
    if pack:  # one sequence per pass, of the rows' own tokens only
        assert all(r == 1 for r, _ in rows_run[1:])
        assert sum(t for _, t in rows_run[1:]) == int(tail_lengths(batch).sum())
    response = batch.response_mask.bool()
    tolerance = dict(rtol=0, atol=1e-5) if dtype == "float32" else dict(rtol=0, atol=0.1)
    torch.testing.assert_close(got_logprobs[response], logprobs.detach()[response], **tolerance)
    torch.testing.assert_close(got_entropy[response], entropy.detach()[response], **tolerance)
    assert not got_logprobs[~response].any() and not got_entropy[~response].any()
    element, norm = TOLERANCE[dtype]
    for name, grad in expected.items():
        got = dict(model.named_parameters())[name].grad
        assert got is not None, name
        torch.testing.assert_close(got, grad, rtol=0, atol=element * float(grad.abs().max()) + 1e-7, msg=name)
    every = torch.cat([g.flatten().float() for g in expected.values()])
    got_every = torch.cat([p.grad.flatten().float() for p in model.parameters()])
    assert (got_every - every).norm() / every.norm() < norm
    with pytest.raises(ValueError, match="not among the shared prompts"):
        prompts.forward(model, pad_sequences([[8, 8, 15]], [[1]]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pack", [False, True])
def test_shared_prompts_make_the_one_pass_update_in_every_mode(tiny_model_dir, dtype, mode, pack):
    """The Learner with shared prompts (budgeted passes over each row's own tokens, pi_old from the training forward
    or from a no-grad pass of its own) makes the update of one pass over whole rows; each minibatch runs each of
    its prompts' prefixes once."""
    behavior, ref = inputs(tiny_model_dir, dtype)
    for settings in (dict(loss_agg=mode), dict(loss_agg=mode, num_minibatches=2)):
        whole = update(make(tiny_model_dir, dtype, max_tokens_per_micro_batch=None, **settings), behavior, ref)
        shared = make(tiny_model_dir, dtype, max_tokens_per_micro_batch=BUDGET, share_prompts=True,
                      pack_sequences=pack, **settings)
        assert shared.batching.share_prompts and shared.batching.pack == pack
        ours = update(shared, behavior, ref)
        # One pass per minibatch whole; shared: a prefix pass and at least one pass per minibatch (+ the same for
        # pi_old's no-grad pass with two minibatches).
        assert ours[2] > whole[2] + settings.get("num_minibatches", 1)
        assert_same_update(ours, whole, dtype)


def test_prompts_are_shared_only_where_it_saves_and_is_safe(tiny_model_dir):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    assert not prompts_shared(pad_sequences([[5, 9, 15], [3, 9, 15], [7]], [[1], [2, 1], [1]]))  # none repeats
    assert not prompts_shared(pad_sequences([[7], [7]], [[1], [2, 1]]))  # one token: nothing to share
    assert not prompts_shared(pad_sequences([[7], [7], [5, 9, 15], [3, 9, 15]], [[1], [1], [1], [1]]))
    assert prompts_shared(pad_sequences([[5, 9, 15], [5, 9, 4]], [[1], [2, 1]]))  # the same prefix
    dense = Qwen2Config(vocab_size=17, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1)
    assert SharedPrompts.supports(Qwen2ForCausalLM(dense))
    sliding = Qwen2Config(**{**dense.to_dict(), "use_sliding_window": True, "sliding_window": 8,
                             "layer_types": ["sliding_attention"] * 2})
    assert not SharedPrompts.supports(Qwen2ForCausalLM(sliding))  # its cache keeps a window, not every state
    assert not make(tiny_model_dir, "float32", share_prompts=True, num_ranks=2, strategy="fsdp2").batching.share_prompts
    assert make(tiny_model_dir, "float32", share_prompts=True, num_ranks=2, strategy="ddp").batching.share_prompts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packing_switches_only_models_it_can_pack_and_leaves_their_other_calls_as_they_were(tiny_model_dir, dtype):
    """A model whose attention is sdpa is switched to the packed implementation, which is sdpa bit for bit for a
    call without a layout (padded passes, generation); eager attention and sliding windows are not packed, and a
    pass asked to pack them runs padded, with the same logprobs."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=getattr(torch, dtype))
    batch = pad_sequences(PROMPTS, RESPONSES)
    with torch.no_grad():
        before = sequence_logprobs(model, batch)
        generated = model.generate(batch.input_ids[:1, :6], do_sample=False, max_new_tokens=5, pad_token_id=0)
        assert model.config._attn_implementation == "sdpa" and packable(model)
        assert model.config._attn_implementation == IMPLEMENTATION
        assert torch.equal(sequence_logprobs(model, batch), before)
        assert torch.equal(model.generate(batch.input_ids[:1, :6], do_sample=False, max_new_tokens=5,
                                          pad_token_id=0), generated)
        packed = sequence_logprobs(model, batch, pack=True)
    response = batch.response_mask.bool()
    torch.testing.assert_close(packed[response], before[response], rtol=0,
                               atol=1e-5 if dtype == "float32" else 0.05)

    eager = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=getattr(torch, dtype),
                                                 attn_implementation="eager")
    assert not packable(eager) and eager.config._attn_implementation == "eager"
    with torch.no_grad():
        torch.testing.assert_close(sequence_logprobs(eager, batch, pack=True), sequence_logprobs(eager, batch))
    sliding = Qwen2Config(vocab_size=17, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=8,
                          layer_types=["sliding_attention"] * 2, attn_implementation="sdpa")
    assert not packable(Qwen2ForCausalLM(sliding))

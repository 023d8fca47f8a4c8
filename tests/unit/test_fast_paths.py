"""Each of the learner's fast paths (`learner.fast_paths`) against the plain path it replaces, on the CPU, in float32
and bfloat16 (autocast on float32 master weights, as the learner runs): bit for bit where the arithmetic is the same,
else within the bound each test states and derives. The bounds follow from how the arithmetic differs, not from
this CPU's kernels: u is the unit roundoff of the dtype (2^-24 float32, 2^-8 bfloat16), ulp(x) the spacing of that
dtype's numbers at |x|.

- The head in chunks (`head_chunk_tokens`): one chunk holding the pass runs the plain path's operations on the same
  shapes, so it is equal bit for bit; smaller chunks change only the row count of the head's matmul (whose dot
  products a kernel may sum in another order) and how its weight gradient is summed (per chunk, then across chunks).
- Metrics on the device (`metrics_on_device`): the same float64 sums in the same order: bit for bit.
- Fused AdamW (`fused_adamw`): the same update formula in another order of operations.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.batch import TrainBatch
from learner.config import FastPathsConfig, LearnerConfig
from learner.learner import Learner
from learner.passes.device import compute_in
from learner.passes.head import PassScorer
from learner.passes.micro_batches import MicroBatching
from learner.passes.sequences import SharedPrompts, pad_sequences

VOCAB = 300  # larger than the hidden size, as in real models
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
# (packed, prompts shared): every way the learner runs a pass
LAYOUTS = {"padded": (False, False), "packed": (True, False), "shared, padded": (False, True),
           "shared, packed": (True, True)}


def tiny_model(seed: int = 0, tied: bool = False) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=128, max_position_embeddings=128,
                         tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def rows(seed: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """Two groups of three rows sharing a prompt, responses of 2-19 tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [[5, 6, 7, 8]] * 3 + [[9, 10, 11]] * 3
    lengths = torch.randint(2, 20, (len(prompts),), generator=generator).tolist()
    return prompts, [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def scored(model, dtype, layout: str, chunk: int | None, grad: bool = True):
    """Logprobs and entropies [B, L-1] of `rows()` by `PassScorer(chunk)`, and with `grad` every parameter's gradient of
    sum(logprobs) + 0.1 sum(entropies) over the response tokens (flattened, in parameter order)."""
    pack, share = LAYOUTS[layout]
    batch = pad_sequences(*rows())
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad), compute_in(torch.device("cpu"), dtype, torch.float32):
        prompts = SharedPrompts(model, batch, grad, MicroBatching(share_prompts=True, pack=pack)) if share else None
        logprobs, entropy = PassScorer(chunk).logprobs_and_entropy(model, batch, 1.0, True, prompts, pack)
    mask = batch.response_mask
    if not grad:
        return logprobs * mask, entropy * mask, None
    ((logprobs * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
    if prompts is not None:
        prompts.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    return (logprobs * mask).detach(), (entropy * mask).detach(), grads


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_one_chunk_holding_the_pass_is_the_plain_path_bit_for_bit(dtype, layout):
    model = tiny_model(tied=layout == "packed")
    plain = scored(model, DTYPES[dtype], layout, None)
    whole = scored(model, DTYPES[dtype], layout, 10**6)
    for a, b in zip(plain, whole):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_under_lora_with_a_trained_head_one_chunk_is_the_plain_path_bit_for_bit(dtype):
    # peft's wrappers: the decoder and the head reached through them, the head trained whole (`modules_to_save`)
    from learner.config import LoraConfig
    from learner.lora import add_adapters

    model = add_adapters(tiny_model(), LoraConfig(rank=4, modules_to_save=["lm_head", "model.norm"])).eval()
    plain = scored(model, DTYPES[dtype], "shared, packed", None)
    whole = scored(model, DTYPES[dtype], "shared, packed", 10**6)
    for a, b in zip(plain, whole):
        assert torch.equal(a, b)


def largest_logit(model) -> float:
    """max |z| over the pass's logits (float32, the plain path)."""
    batch = pad_sequences(*rows())
    with torch.no_grad():
        return float(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.abs().max())


def logit_bound(model, dtype) -> float:
    """How far one logit may move when the head's matmul sums its H products in another order: float32, by the
    standard bound on a dot product, 2 x (H u) x max sum_i |h_i w_i| (both orders err from the exact sum by at most
    H u of it); bfloat16 (the products summed in float32, then rounded), that plus one bfloat16 ulp of the largest
    logit (two sums this close may round to neighbouring bfloat16 numbers). max |h| <= sqrt(H) max |g| (the final
    RMS norm's output, g its weight)."""
    head = model.get_output_embeddings().weight.detach()
    hidden = head.shape[1]
    h_max = math.sqrt(hidden) * float(model.model.norm.weight.detach().abs().max())
    float32 = 2 * hidden * 2.0**-24 * h_max * float(head.abs().sum(dim=1).max())
    if dtype == torch.float32:
        return float32
    return float32 + 2.0 ** (math.floor(math.log2(largest_logit(model))) - 7)


@pytest.mark.parametrize("layout, chunk", [*((layout, 7) for layout in LAYOUTS), ("shared, packed", 1)])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_smaller_chunks_stay_within_the_head_s_summation_bound(dtype, layout, chunk):
    # Logprobs: |d log_softmax(z)_y| <= |dz_y| + max_v |dz_v| <= 2 d (d: `logit_bound`), plus the float32 log-softmax's
    # own rounding of the result, 4 u |logprob| + 4 u. Entropies: |dH| <= (max z - min z) d <= 2 max|z| d, plus 4 u
    # (max|z| + H). Gradients: every gradient downstream of the head's (the hidden states', through every block) moves
    # by the same reordering and by the head's weight gradient summed per chunk (each chunk's rounded once in the
    # compute dtype, where the plain path rounds the whole sum once): within 8 u of the largest gradient.
    model = tiny_model()
    torch_dtype = DTYPES[dtype]
    plain = scored(model, torch_dtype, layout, None)
    chunked = scored(model, torch_dtype, layout, chunk)
    d, u = logit_bound(model, torch_dtype), 2.0**-24
    z_max = largest_logit(model)
    assert (chunked[0] - plain[0]).abs().max() <= 2 * d + 4 * u * (1 + plain[0].abs().max())
    assert (chunked[1] - plain[1]).abs().max() <= 2 * z_max * d + 4 * u * (z_max + plain[1].abs().max())
    gap = (chunked[2] - plain[2]).abs().max()
    assert gap <= 8 * UNIT_ROUNDOFF[torch_dtype] * plain[2].abs().max()


def test_the_bound_is_tight_enough_to_see_a_label_off_by_one(monkeypatch):
    # The chunked path scoring each token's neighbour's label (a broken gather) is far outside the bound.
    import learner.passes.head as head_module

    model = tiny_model()
    plain = scored(model, torch.bfloat16, "packed", None, grad=False)
    real = head_module.logprobs_from_logits
    monkeypatch.setattr(head_module, "logprobs_from_logits",
                        lambda logits, labels, t=1.0: real(logits, labels.roll(1, 0), t))
    broken = scored(model, torch.bfloat16, "packed", 7, grad=False)
    assert (broken[0] - plain[0]).abs().max() > 10 * (2 * logit_bound(model, torch.bfloat16))


@pytest.mark.parametrize("grad", [True, False])
def test_the_head_never_runs_over_more_than_a_chunk_of_tokens(grad):
    model = tiny_model()
    seen = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: seen.append(output.shape[:-1].numel()))
    scored(model, torch.float32, "packed", 7, grad=grad)
    tokens = int(pad_sequences(*rows()).attention_mask.sum())
    assert seen and max(seen) <= 7 and sum(seen) >= tokens  # the backward's recomputation runs chunks too


def test_a_head_that_is_not_plain_runs_the_plain_path():
    model = tiny_model()
    model.config.model_type = "gemma2"  # soft-capped logits: the decoder's states through the head are not them
    calls = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: calls.append(output.shape))
    scored(model, torch.float32, "padded", 1, grad=False)
    assert len(calls) == 1  # one call over the whole pass


# The learner with each path on against the plain learner: two steps of GRPO with the KL in the loss and an entropy
# bonus, two minibatches (so passes are weighed), passes cut at 24 tokens.
LEARNER = dict(lr=1e-3, kl_coef=0.01, entropy_coef=0.01, num_minibatches=2, max_tokens_per_micro_batch=24,
               warmup_steps=0, num_threads=1)


def train_two_steps(model_dir, dtype: str, **fast) -> tuple[list[dict], dict[str, torch.Tensor]]:
    learner = Learner(str(model_dir), LearnerConfig(**LEARNER, fast_paths=FastPathsConfig(**fast)), dtype=dtype)
    prompts, responses = rows()
    metrics = []
    for step in range(2):
        behaviour = learner.compute_logprobs(prompts, responses)
        rewards = [float((i + step) % 2) for i in range(len(prompts))]
        step_metrics = learner.train_step(TrainBatch(prompts, responses, behaviour, rewards, 3, behaviour))
        metrics.append({name: value for name, value in step_metrics.items() if not name.startswith("memory/")})
    return metrics, {name: p.detach().clone() for name, p in learner.model.named_parameters()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fast-paths-model")
    tiny_model(tied=True).save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_metrics_on_the_device_and_a_whole_pass_chunk_train_bit_for_bit_as_the_plain_learner(model_dir, dtype):
    plain_metrics, plain_weights = train_two_steps(model_dir, dtype)
    for fast in ({"metrics_on_device": True}, {"head_chunk_tokens": 10**6}):
        metrics, weights = train_two_steps(model_dir, dtype, **fast)
        assert metrics == plain_metrics, fast
        assert all(torch.equal(weights[name], plain_weights[name]) for name in weights), fast


class HostReads(TorchFunctionMode):
    """Counts the tensor reads that make the host wait for the device: `.item()`, `float()`, `int()`, `bool()`,
    `.tolist()`."""

    NAMES = frozenset({"item", "__float__", "__int__", "__bool__", "tolist", "__index__"})

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.NAMES
        return func(*args, **(kwargs or {}))


def test_metrics_on_the_device_read_nothing_per_pass_for_the_metrics_and_weights(model_dir, monkeypatch):
    reads = {}
    for on_device in (False, True):
        learner = Learner(str(model_dir), LearnerConfig(**LEARNER, fast_paths=FastPathsConfig(
            metrics_on_device=on_device)), dtype="float32")
        real, counter, passes = learner._micro_batch_backward, HostReads(), []

        def counted(*args, real=real, counter=counter, passes=passes):
            passes.append(1)
            with counter:
                return real(*args)

        monkeypatch.setattr(learner, "_micro_batch_backward", counted)
        prompts, responses = rows()
        behaviour = learner.compute_logprobs(prompts, responses)
        metrics = learner.train_step(TrainBatch(prompts, responses, behaviour, [1.0, 0.0] * 3, 3, behaviour))
        reads[on_device] = counter.count / len(passes)
    # The plain path reads each metric and 3 weights' 6 counts per pass; what is left is the pass's layout (trimming
    # it to its longest row, packing's token index).
    metric_count = len([name for name in metrics if name.startswith(("loss/", "kl/", "entropy/", "clip", "pg/"))])
    assert reads[True] <= reads[False] - 6 - metric_count


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fused_adamw_steps_within_a_weight_ulp_and_its_update_s_rounding(dtype):
    # One step from the same state (parameters, moments, step count), ten times over gradients from 1e-6 to 1:
    # p' = p (1 - lr wd) - lr m^ / (sqrt(v^) + eps), computed by both in the parameter's dtype's opmath (float32) with
    # about 8 roundings of at most u of the update each, then stored: at most one ulp of p' apart from the stores, and
    # 16 u lr (r + wd |p|) from the update (r = max |m^| / (sqrt(v^) + eps), computed here in float64).
    torch_dtype = DTYPES[dtype]
    lr, wd, betas, eps = 1e-3, 0.01, (0.9, 0.999), 1e-8
    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 300), (300,), (7, 5, 3)]
    params = [[torch.nn.Parameter(torch.randn(s, generator=generator).to(torch_dtype) * 0.5) for s in shapes]
              for _ in range(2)]
    plain = torch.optim.AdamW(params[0], lr=lr, weight_decay=wd, betas=betas, eps=eps)
    fused = torch.optim.AdamW(params[1], lr=lr, weight_decay=wd, betas=betas, eps=eps, fused=True)
    u = UNIT_ROUNDOFF[torch_dtype]
    for step in range(10):
        for mine, theirs in zip(params[1], params[0]):
            mine.data.copy_(theirs.data)
        fused.load_state_dict(copy.deepcopy(plain.state_dict()))  # its own tensors, not the plain one's
        before = [p.detach().double() for p in params[0]]
        scale = 10.0 ** -(step % 7)
        grads = [torch.randn(s, generator=generator).to(torch_dtype) * scale for s in shapes]
        for group, optimizer in zip(params, (plain, fused)):
            for p, g in zip(group, grads):
                p.grad = g.clone()
            optimizer.step()
        for p, q, old in zip(params[0], params[1], before):
            state = plain.state[p]
            t = int(state["step"])
            m = state["exp_avg"].double() / (1 - betas[0] ** t)
            v = state["exp_avg_sq"].double() / (1 - betas[1] ** t)
            r = float((m.abs() / (v.sqrt() + eps)).max())
            new = p.detach().double()
            ulp = torch.finfo(torch_dtype).eps * torch.maximum(new.abs(), old.abs())
            bound = ulp + 16 * u * lr * (r + wd * old.abs())
            assert ((q.detach().double() - new).abs() <= bound).all(), (dtype, step)


def test_the_learner_asks_torch_for_fused_adamw_only_when_configured(model_dir):
    for fused in (False, True):
        learner = Learner(str(model_dir), LearnerConfig(fast_paths=FastPathsConfig(fused_adamw=fused)))
        assert learner.optimizer.defaults["fused"] is (True if fused else None)


# The bfloat16 shape trap (verl #6280): a row's bfloat16 logits depend on the shapes of the pass it runs in, so old
# logprobs from other passes than the update's make ratios that are not 1 before anything changed.
def recorded_passes(model_dir, dtype: str, **config) -> tuple[list, list]:
    """One train step: every decoder call's (input ids, whether gradients were on), and each policy-loss call's
    (logprobs, old logprobs) over the trained tokens."""
    import learner.objective as objective

    learner = Learner(str(model_dir), LearnerConfig(**{**LEARNER, "kl_coef": 0.0, "entropy_coef": 0.0, **config}),
                      dtype=dtype)
    prompts, responses = rows()
    behaviour = learner.compute_logprobs(prompts, responses)
    calls, ratios = [], []
    learner.model.model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((kwargs["input_ids"].clone(), torch.is_grad_enabled())),
        with_kwargs=True)
    real = objective.POLICY_LOSSES["ppo"]

    def recorded(logprobs, old, advantages, mask, *args):
        ratios.append((logprobs.detach()[mask.bool()], old[mask.bool()]))
        return real(logprobs, old, advantages, mask, *args)

    objective.POLICY_LOSSES["ppo"] = recorded
    try:
        learner.train_step(TrainBatch(prompts, responses, behaviour, [1.0, 0.0] * 3, 3))
    finally:
        objective.POLICY_LOSSES["ppo"] = real
    return calls, ratios


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_old_logprobs_run_in_the_passes_of_the_first_epoch_so_its_first_ratios_are_exactly_one(model_dir, dtype):
    # Two epochs of two minibatches (old logprobs needed before the update), passes packed, prompts shared.
    calls, ratios = recorded_passes(model_dir, dtype, ppo_epochs=2, max_tokens_per_micro_batch=16)
    old = [ids for ids, grad in calls if not grad]
    first_epoch = [ids for ids, grad in calls if grad][:len(old)]
    assert len(old) > 2 and all(torch.equal(a, b) for a, b in zip(old, first_epoch))  # the same rows, order, shapes
    minibatches = 2
    first = ratios[: len(ratios) // (2 * minibatches)]  # the first minibatch's passes: nothing has changed yet
    assert first and all(torch.equal(logprobs, before) for logprobs, before in first)


def test_with_one_update_per_batch_old_logprobs_are_the_training_forward_s_own_with_every_fast_path(model_dir):
    _, ratios = recorded_passes(model_dir, "bfloat16", num_minibatches=1, max_tokens_per_micro_batch=10**4,
                                fast_paths=FastPathsConfig(head_chunk_tokens=5, metrics_on_device=True,
                                                           fused_adamw=True))
    assert ratios and all(torch.equal(logprobs, before) for logprobs, before in ratios)

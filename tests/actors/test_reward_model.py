"""RewardModelWorker in-process on a tiny random sequence classifier: scores equal a plain transformers forward
pass, do not depend on batching or padding, and a frozen model stays frozen; fine-tuning (`fit`) computes the
Bradley-Terry and regression losses exactly, learns, does not depend on micro-batching, and `save_state`/`load_state`
continue bitwise."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from actors.reward_model import REWARD_MODEL_LOSSES, RewardModelWorker, bradley_terry_loss, regression_loss
from learner.passes.micro_batches import MicroBatching

PROMPTS = ["37+45=", "1+2=", "99+99=", "5+5="]
COMPLETIONS = ["82", "3", "1", "10 and then some more text"]


def test_scores_equal_a_plain_forward_pass(tiny_reward_model_dir):
    worker = RewardModelWorker(str(tiny_reward_model_dir), batching=MicroBatching(4))
    scores = worker.score(PROMPTS, COMPLETIONS)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model_dir)
    for prompt, completion, score in zip(PROMPTS, COMPLETIONS, scores):
        ids = torch.tensor([tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            expected = model(input_ids=ids).logits[0, 0].item()  # one unpadded sequence: no padding to get wrong
        assert score == pytest.approx(expected, abs=1e-5)
    assert len(set(scores)) == len(scores)  # a random model still tells the texts apart


def test_batching_and_padding_do_not_change_scores(tiny_reward_model_dir):
    whole = RewardModelWorker(str(tiny_reward_model_dir), batching=MicroBatching(4)).score(PROMPTS, COMPLETIONS)
    single = RewardModelWorker(str(tiny_reward_model_dir), batching=MicroBatching(1)).score(PROMPTS, COMPLETIONS)
    assert whole == pytest.approx(single, abs=1e-5)
    for batching in (MicroBatching(max_tokens=12), MicroBatching(2, 30), MicroBatching()):  # sorted passes, in order
        assert RewardModelWorker(str(tiny_reward_model_dir), batching=batching).score(PROMPTS, COMPLETIONS) == \
            pytest.approx(single, abs=1e-5)
    assert RewardModelWorker(str(tiny_reward_model_dir)).score([], []) == []


def test_model_is_frozen_and_rejects_mismatched_inputs(tiny_reward_model_dir):
    worker = RewardModelWorker(str(tiny_reward_model_dir))
    assert not any(p.requires_grad for p in worker.model.parameters()) and not worker.model.training
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        worker.score(PROMPTS[:2], COMPLETIONS[:1])


def test_a_causal_lm_is_not_a_reward_model(tiny_model_dir):
    # A causal LM directory loads as a classifier with a fresh head of 2 labels: refuse it rather than score noise.
    with pytest.raises(ValueError, match="has 2 outputs; a reward model has one"):
        RewardModelWorker(str(tiny_model_dir))


# Fine-tuning (iterative reward modelling): prompts x G=2, the right sum (target 1) and a wrong one (target 0).
FIT_PROMPTS = ["1+2=", "1+2=", "3+4=", "3+4=", "5+5=", "5+5="]
FIT_COMPLETIONS = ["3", "4", "7", "8", "10", "11"]
FIT_TARGETS = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def training(**overrides):
    return {"lr": 1e-3, "loss": "bradley_terry", "epochs": 2, "weight_decay": 0.0, "max_grad_norm": 1.0,
            "seed": 0, **overrides}


def weights(worker):
    return {name: p.detach().clone() for name, p in worker.model.named_parameters()}


def test_loss_registry_names_the_two_losses():
    assert set(REWARD_MODEL_LOSSES) == {"bradley_terry", "regression"}


def test_bradley_terry_loss_by_hand():
    # Group 1: targets [1, 0, .5], scores [1, 0, 0]. Pairs (i preferred over j): (0,1) margin 1, (0,2) margin 1,
    # (2,1) margin 0. loss = (2 softplus(-1) + softplus(0)) / 3 = (2 x 0.3132616875 + 0.6931471806) / 3 = 0.4398901852.
    # Group 2: all targets equal, no pair. Accuracy: margins > 0 in 2 of 3 pairs.
    scores = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.5], requires_grad=True)
    targets = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 1.0])
    fitted = bradley_terry_loss(scores, targets, group_size=3)
    assert fitted.terms == 3 and fitted.unit == "pairs"
    assert float(fitted.loss.detach()) == pytest.approx(0.4398901852, abs=1e-7)
    assert fitted.metrics["accuracy"] == pytest.approx(2 / 3)
    fitted.loss.backward()  # group 2 gives no pair: no gradient reaches its scores
    assert scores.grad[3:].tolist() == [0.0, 0.0, 0.0]
    none = bradley_terry_loss(torch.zeros(4), torch.ones(4), group_size=2)
    assert none.terms == 0 and float(none.loss) == 0.0


def test_regression_loss_by_hand():
    # errors s - y = [1 - 0, 0 - 2] = [1, -2]: MSE (1 + 4) / 2 = 2.5, MAE (1 + 2) / 2 = 1.5.
    fitted = regression_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]), group_size=1)
    assert (float(fitted.loss), fitted.terms, fitted.unit, fitted.metrics) == (2.5, 2, "examples", {"mae": 1.5})


def test_bradley_terry_fit_matches_a_plain_forward_then_learns_the_preferences(tiny_reward_model_dir):
    worker = RewardModelWorker(str(tiny_reward_model_dir), training=training(epochs=1))
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model_dir)
    with torch.no_grad():  # one unpadded sequence per forward: the scores before any update
        s = [model(input_ids=torch.tensor([tokenizer(p + c, add_special_tokens=False)["input_ids"]])).logits[0, 0]
             for p, c in zip(FIT_PROMPTS, FIT_COMPLETIONS)]
    # Pairs: (0, 1), (2, 3), (4, 5), the right sum preferred; loss = mean of -log sigmoid(s_right - s_wrong).
    expected = -sum(torch.nn.functional.logsigmoid(s[i] - s[i + 1]) for i in (0, 2, 4)).item() / 3
    metrics = worker.fit(FIT_PROMPTS, FIT_COMPLETIONS, FIT_TARGETS, group_size=2)
    assert metrics["loss_before"] == pytest.approx(expected, abs=1e-6)
    assert metrics["pairs"] == 3 and metrics["updates"] == 1 and metrics["skipped_updates"] == 0
    assert metrics["loss"] < metrics["loss_before"]
    for _ in range(4):
        metrics = worker.fit(FIT_PROMPTS, FIT_COMPLETIONS, FIT_TARGETS, group_size=2)
    assert metrics["accuracy"] == 1.0 and metrics["updates"] == 5
    scores = worker.score(FIT_PROMPTS, FIT_COMPLETIONS)  # the new weights: preferred above the others
    assert all(scores[i] > scores[i + 1] for i in (0, 2, 4))
    after = bradley_terry_loss(torch.tensor(scores), torch.tensor(FIT_TARGETS), group_size=2)
    assert float(after.loss) == pytest.approx(metrics["loss"], abs=1e-6)  # `loss` is after the last update


def test_regression_fit_moves_scores_toward_targets(tiny_reward_model_dir):
    worker = RewardModelWorker(str(tiny_reward_model_dir), training=training(loss="regression"))
    targets = [1.0, -1.0, 0.5, -0.5, 2.0, 0.0]

    def mse() -> float:
        scores = worker.score(FIT_PROMPTS, FIT_COMPLETIONS)
        return sum((s - y) ** 2 for s, y in zip(scores, targets)) / len(targets)

    start = mse()
    first = worker.fit(FIT_PROMPTS, FIT_COMPLETIONS, targets, group_size=2)
    assert first["loss_before"] == pytest.approx(start, abs=1e-6)
    assert first["examples"] == 6 and first["loss"] < first["loss_before"]
    for _ in range(3):
        metrics = worker.fit(FIT_PROMPTS, FIT_COMPLETIONS, targets, group_size=2)
    assert mse() == pytest.approx(metrics["loss"], abs=1e-6) and mse() < start / 4
    assert metrics["mae"] < first["mae_before"]


def test_no_pairs_no_update(tiny_reward_model_dir):
    worker = RewardModelWorker(str(tiny_reward_model_dir), training=training())
    before = weights(worker)
    metrics = worker.fit(FIT_PROMPTS, FIT_COMPLETIONS, [1.0, 1.0, 0.0, 0.0, 0.5, 0.5], group_size=2)  # ties only
    assert metrics["pairs"] == 0 and metrics["updates"] == 0 and metrics["loss"] == 0.0
    assert all(torch.equal(before[name], p) for name, p in worker.model.named_parameters())
    assert not worker.optimizer.state  # AdamW never stepped: no moments, no step count
    with pytest.raises(ValueError, match="do not split into groups of group_size=4"):
        worker.fit(FIT_PROMPTS, FIT_COMPLETIONS, FIT_TARGETS, group_size=4)


@pytest.mark.parametrize("loss", ["bradley_terry", "regression"])
def test_micro_batching_does_not_change_the_update(tiny_reward_model_dir, loss):
    runs = []
    for batching in (MicroBatching(1), MicroBatching(8), MicroBatching(max_tokens=9)):
        worker = RewardModelWorker(str(tiny_reward_model_dir), batching=batching, training=training(loss=loss))
        grads = []  # each step's (clipped) gradient, as AdamW gets it
        worker.optimizer.register_step_pre_hook(
            lambda optimizer, args, kwargs, worker=worker, grads=grads: grads.append(
                {name: p.grad.clone() for name, p in worker.model.named_parameters()}))
        metrics = worker.fit(FIT_PROMPTS, FIT_COMPLETIONS, FIT_TARGETS, group_size=2)
        runs.append((grads, weights(worker), metrics))
    (reference_grads, reference, reference_metrics), *others = runs
    start = weights(RewardModelWorker(str(tiny_reward_model_dir)))
    assert len(reference_grads) == 2 and any(not torch.equal(start[n], p) for n, p in reference.items())  # moved
    for grads, other, metrics in others:
        assert metrics == pytest.approx(reference_metrics, abs=1e-6)
        for step, reference_step in zip(grads, reference_grads):  # the invariant: the gradient
            for name, grad in step.items():
                torch.testing.assert_close(grad, reference_step[name], rtol=0, atol=1e-6)
        # The weights agree to lr / 10, not 1e-6: Adam divides by sqrt(v) ~ |g|, so for the few elements whose
        # gradient is near 0, float rounding noise in g becomes a visible share (seen: 1%) of an lr-sized step. A
        # wrong gradient differs by ~lr per element and step.
        for name, p in other.items():
            torch.testing.assert_close(p, reference[name], rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_and_load_state_continue_exactly(tiny_reward_model_dir, tmp_path, dtype):
    settings = training(epochs=1, weight_decay=0.01)
    worker = RewardModelWorker(str(tiny_reward_model_dir), dtype=dtype, training=settings)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in worker.model.parameters())  # master weights
    worker.fit(FIT_PROMPTS, FIT_COMPLETIONS, FIT_TARGETS, group_size=2)
    worker.save_state(str(tmp_path))
    saved_scores = worker.score(PROMPTS, COMPLETIONS)
    continued = worker.fit(FIT_PROMPTS[:4], FIT_COMPLETIONS[:4], FIT_TARGETS[:4], group_size=2)

    resumed = RewardModelWorker(str(tiny_reward_model_dir), dtype=dtype, training=settings)
    resumed.load_state(str(tmp_path))
    assert resumed.updates == 1 and resumed.score(PROMPTS, COMPLETIONS) == saved_scores
    assert resumed.fit(FIT_PROMPTS[:4], FIT_COMPLETIONS[:4], FIT_TARGETS[:4], group_size=2) == continued
    assert resumed.score(PROMPTS, COMPLETIONS) == worker.score(PROMPTS, COMPLETIONS)  # bitwise
    assert all(torch.equal(p, q) for p, q in zip(resumed.model.parameters(), worker.model.parameters()))
    if dtype == "float32":  # the directory is a plain reward model: a frozen worker scores with the saved weights
        assert RewardModelWorker(str(tmp_path)).score(PROMPTS, COMPLETIONS) == saved_scores


def test_frozen_worker_does_not_train(tiny_reward_model_dir, tmp_path):
    worker = RewardModelWorker(str(tiny_reward_model_dir), training=None)
    assert worker.optimizer is None and not any(p.requires_grad for p in worker.model.parameters())
    assert len(worker.score(PROMPTS, COMPLETIONS)) == 4
    for call in (lambda: worker.fit(FIT_PROMPTS, FIT_COMPLETIONS, FIT_TARGETS, 2),
                 lambda: worker.save_state(str(tmp_path)), lambda: worker.load_state(str(tmp_path))):
        with pytest.raises(RuntimeError, match="this reward model is frozen; build it with training settings"):
            call()


def test_training_settings_are_checked(tiny_reward_model_dir):
    with pytest.raises(ValueError, match="loss 'hinge': choose one of"):
        RewardModelWorker(str(tiny_reward_model_dir), training=training(loss="hinge"))
    with pytest.raises(ValueError, match="new_head optional"):
        RewardModelWorker(str(tiny_reward_model_dir), training=training(momentum=0.9))


def test_a_new_head_on_a_causal_lm_is_seeded_and_trains(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    heads = [RewardModelWorker(str(tiny_model_dir), training=training(new_head=True, seed=seed)).model.score.weight
             for seed in (0, 0, 1)]
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])
    # N(0, 1/(d_model + 1)), d_model = 64: std 1/sqrt(65) = 0.124; 64 draws land within a factor of 2 of it
    assert 0.062 < float(heads[0].detach().std()) < 0.25
    worker = RewardModelWorker(str(tiny_model_dir), training=training(new_head=True, lr=1e-2))
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert torch.equal(worker.model.model.embed_tokens.weight, policy.model.embed_tokens.weight)  # the policy's
    for _ in range(3):
        metrics = worker.fit(FIT_PROMPTS, FIT_COMPLETIONS, FIT_TARGETS, group_size=2)
    assert metrics["accuracy"] == 1.0 and metrics["loss"] < metrics["loss_before"]

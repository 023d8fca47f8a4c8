"""RewardModelWorker in-process on a tiny random sequence classifier: scores equal a plain transformers forward
pass, do not depend on batching or padding, and the model stays frozen."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from actors.reward_model import RewardModelWorker
from learner.algo.sequences import MicroBatching

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

"""ProcessRewardModelWorker in-process on tiny random Qwen2 token classifiers (char tokenizer: one token per character):
step scores equal a plain unpadded transformers forward pass read at hand-computed separator positions, do not depend
on batching or padding, and the model stays frozen; wrong models and inputs are refused with one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForTokenClassification, AutoTokenizer

from actors.process_reward_model import ProcessRewardModelWorker, separator_tokens
from learner.passes.micro_batches import MicroBatching

PROMPTS = ["12+34+56=", "1+2=", "99+99=", "5+5=", "7*8="]
STEPS = [["46", "102"], ["3"], ["198", "", "1 9 8"], [], ["5", "6", "56", "0"]]


@pytest.fixture(scope="module")
def tiny_two_label_prm_dir(tmp_path_factory):
    """Like `tiny_prm_dir` with two labels: the score is the softmax probability of label 1."""
    from cluster.demo.model import make_random_process_reward_model_dir

    return make_random_process_reward_model_dir(tmp_path_factory.mktemp("models") / "tiny_prm2", seed=4, num_labels=2)


def plain_outputs(model_dir, text: str) -> torch.Tensor:
    """[T, labels]: the model's outputs on `text` alone, unpadded, no attention mask: no padding to get wrong."""
    model = AutoModelForTokenClassification.from_pretrained(model_dir).eval()
    ids = AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # the char tokenizer: token t holds character t
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_one_label_scores_are_the_output_at_each_separator(tiny_prm_dir):
    worker = ProcessRewardModelWorker(str(tiny_prm_dir), batching=MicroBatching(2))
    scores = worker.score_steps(PROMPTS[:2], STEPS[:2], " ")
    # "12+34+56=" is characters 0-8, "46" 9-10, " " 11, "102" 12-14, " " 15: read at 11 and 15.
    outputs = plain_outputs(tiny_prm_dir, "12+34+56=46 102 ")
    assert scores[0] == pytest.approx([outputs[11, 0].item(), outputs[15, 0].item()], abs=1e-5)
    # "1+2=" is 0-3, "3" 4, " " 5.
    assert scores[1] == pytest.approx([plain_outputs(tiny_prm_dir, "1+2=3 ")[5, 0].item()], abs=1e-5)
    assert all(type(score) is float for sample in scores for score in sample)
    assert scores[0][0] != pytest.approx(scores[0][1], abs=1e-3)  # a random model still tells the steps apart


def test_two_label_scores_are_the_probability_of_label_one(tiny_two_label_prm_dir):
    worker = ProcessRewardModelWorker(str(tiny_two_label_prm_dir))
    scores = worker.score_steps(["12+34+56="], [["46", "102"]], " ")
    probabilities = torch.softmax(plain_outputs(tiny_two_label_prm_dir, "12+34+56=46 102 "), dim=-1)[:, 1]
    assert scores == [pytest.approx([probabilities[11].item(), probabilities[15].item()], abs=1e-6)]
    assert all(0 < score < 1 for score in scores[0])


def test_a_longer_separator_is_read_at_its_first_character(tiny_prm_dir):
    # "1+1" is 0-2, "=2" 3-4, "==" 5-6, "+2" 7-8, "==" 9-10: read at 5 and 9.
    scores = ProcessRewardModelWorker(str(tiny_prm_dir)).score_steps(["1+1"], [["=2", "+2"]], "==")
    outputs = plain_outputs(tiny_prm_dir, "1+1=2==+2==")
    assert scores == [pytest.approx([outputs[5, 0].item(), outputs[9, 0].item()], abs=1e-5)]


def test_empty_steps_and_empty_step_lists(tiny_prm_dir):
    worker = ProcessRewardModelWorker(str(tiny_prm_dir))
    # An empty step: "1+2=" is 0-3, step "" then " " at 4, "3" 5, " " 6: read at 4 and 6.
    outputs = plain_outputs(tiny_prm_dir, "1+2= 3 ")
    assert worker.score_steps(["1+2="], [["", "3"]], " ") == [pytest.approx([outputs[4, 0].item(),
                                                                              outputs[6, 0].item()], abs=1e-5)]
    # A sample with no steps gets [] and the others are still scored, in order.
    scores = worker.score_steps(["5+5=", "1+2=", "7="], [[], ["", "3"], []], " ")
    assert scores[0] == [] and scores[2] == []
    assert scores[1] == pytest.approx([outputs[4, 0].item(), outputs[6, 0].item()], abs=1e-5)
    assert worker.score_steps(["1+2=", "3="], [[], []], " ") == [[], []]
    assert worker.score_steps([], [], " ") == []


def test_batching_and_padding_do_not_change_scores(tiny_prm_dir):
    single = ProcessRewardModelWorker(str(tiny_prm_dir), batching=MicroBatching(1)).score_steps(PROMPTS, STEPS, " ")
    assert [len(sample) for sample in single] == [len(sample) for sample in STEPS]
    # Sorted passes padded to their own longest, results in input order.
    for batching in (MicroBatching(), MicroBatching(max_tokens=12), MicroBatching(2, 30), MicroBatching(max_rows=3),
                     MicroBatching(max_tokens=1024)):
        scores = ProcessRewardModelWorker(str(tiny_prm_dir), batching=batching).score_steps(PROMPTS, STEPS, " ")
        assert [pytest.approx(sample, abs=1e-5) for sample in single] == scores
    # Each sample alone, unpadded, equals it too.
    for prompt, steps, scores in zip(PROMPTS, STEPS, single):
        if steps:
            outputs = plain_outputs(tiny_prm_dir, prompt + "".join(step + " " for step in steps))
            ends = [len(prompt) + sum(len(s) + 1 for s in steps[:j]) + len(steps[j]) for j in range(len(steps))]
            assert scores == pytest.approx(outputs[ends, 0].tolist(), abs=1e-5)


def test_bfloat16_scores_are_close_to_float32(tiny_prm_dir):
    float32 = ProcessRewardModelWorker(str(tiny_prm_dir)).score_steps(PROMPTS, STEPS, " ")
    worker = ProcessRewardModelWorker(str(tiny_prm_dir), dtype="bfloat16")
    assert next(worker.model.parameters()).dtype == torch.bfloat16
    bfloat16 = worker.score_steps(PROMPTS, STEPS, " ")
    assert all(type(score) is float for sample in bfloat16 for score in sample)
    # bfloat16 keeps 8 bits of mantissa: on scores of ~0.2 the two layers drift ~0.002 (measured), allow 0.01.
    assert [pytest.approx(sample, abs=0.01) for sample in float32] == bfloat16


def test_model_is_frozen_and_rejects_bad_inputs(tiny_prm_dir):
    worker = ProcessRewardModelWorker(str(tiny_prm_dir))
    assert not any(p.requires_grad for p in worker.model.parameters()) and not worker.model.training
    with pytest.raises(ValueError, match="2 prompts but 1 step lists"):
        worker.score_steps(PROMPTS[:2], STEPS[:1], " ")
    with pytest.raises(ValueError, match="separator is empty"):
        worker.score_steps(PROMPTS[:1], STEPS[:1], "")


def test_a_text_longer_than_the_model_takes_is_refused_not_truncated(tiny_prm_dir):
    worker = ProcessRewardModelWorker(str(tiny_prm_dir))  # max_position_embeddings 64
    assert worker.score_steps(["1+2="], [["3" * 59]], " ")[0]  # 4 + 59 + 1 = 64 tokens: fits
    with pytest.raises(ValueError, match=r"^sample 1: prompt \+ steps are 65 tokens but the process reward model "
                                         r"takes at most 64"):
        worker.score_steps(["1+2=", "1+2="], [["3"], ["3" * 30, "4" * 29]], " ")  # 4 + 31 + 30 = 65


def test_separator_tokens_share_a_token_and_refuse_a_dropped_separator():
    # Token 1 holds characters 1-2, so separators at 1 and 2 (an empty step between them) share it.
    assert separator_tokens([(0, 1), (1, 3), (3, 4)], [1, 2], 1, sample=0) == [1, 1]
    # Offsets that leave out the separator's first character (1): the first token holding one of its characters.
    assert separator_tokens([(0, 1), (2, 3)], [1], 2, sample=0) == [1]
    with pytest.raises(ValueError, match="sample 7: no token holds the step separator at character 1"):
        separator_tokens([(0, 1), (2, 3)], [1], 1, sample=7)
    with pytest.raises(ValueError, match="sample 0: no token holds"):
        separator_tokens([(0, 1)], [1], 1, sample=0)  # the text ends before it


def test_a_dropped_separator_is_refused_by_the_worker(tiny_prm_dir):
    # The char tokenizer drops characters outside its vocabulary, so a "\n" separator would leave no token to read.
    with pytest.raises(ValueError, match="sample 0: no token holds the step separator"):
        ProcessRewardModelWorker(str(tiny_prm_dir)).score_steps(["1+2="], [["3"]], "\n")


def test_models_that_are_not_process_reward_models_are_refused(tiny_model_dir, tiny_reward_model_dir, tmp_path):
    # Both load as token classifiers with a fresh random head (2 labels for the causal LM): refuse, not score noise.
    with pytest.raises(ValueError, match="is Qwen2ForCausalLM, not a token classifier"):
        ProcessRewardModelWorker(str(tiny_model_dir))
    with pytest.raises(ValueError, match="is Qwen2ForSequenceClassification, not a token classifier"):
        ProcessRewardModelWorker(str(tiny_reward_model_dir))
    from cluster.demo.model import make_random_process_reward_model_dir

    with pytest.raises(ValueError, match="has 3 outputs; a process reward model has 1"):
        ProcessRewardModelWorker(str(make_random_process_reward_model_dir(tmp_path / "prm3", num_labels=3)))
    # A config that claims a token classifier over weights that lack its head.
    relabelled = shutil.copytree(tiny_model_dir, tmp_path / "relabelled")
    config = json.loads((relabelled / "config.json").read_text())
    (relabelled / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen2ForTokenClassification"],
                                                                 "num_labels": 1, "id2label": {"0": "LABEL_0"},
                                                                 "label2id": {"LABEL_0": 0}}))
    with pytest.raises(ValueError, match=r"lacks weights \['score.bias', 'score.weight'\]"):
        ProcessRewardModelWorker(str(relabelled))


def test_a_slow_tokenizer_is_refused(tiny_prm_dir, monkeypatch):
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    monkeypatch.setattr(TokenizersBackend, "is_fast", property(lambda self: False))
    with pytest.raises(ValueError, match="is a slow one, which gives no offset mappings"):
        ProcessRewardModelWorker(str(tiny_prm_dir))

"""The calc demo model: its tokenizer (the char tokenizer plus `[` and `]`), the warm-up sequences' loss mask (none
on the tool's answer), a small deterministic build, and the real build's targets measured on episodes with the tool.

The real build (about a minute) is made once, into RELAY_CACHE_DIR as the suite's other demo models are.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import get_args

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.config import DataConfig
from cluster.demo.cache import demo_model_dir
from cluster.demo.calc import (
    calc_segments,
    call_probabilities,
    draw_calc_sequences,
    encode_segments,
    run_calc_episodes,
    summarize_episodes,
)
from cluster.demo.catalog import DEMO_TASKS
from cluster.demo.model import (
    CALC_CHARACTERS,
    CALC_RECIPE,
    REPORT_FILE,
    WarmupRecipe,
    build_char_tokenizer,
    build_demo_model,
    draw_warmup_problems,
)
from cluster.demo.task import Problem, make_calc_problems

# The char tokenizer's ids, which the arithmetic and chain_sum models were trained with: they must never move.
OLD_VOCAB = {"<pad>": 0, "<eos>": 1, "0": 2, "1": 3, "2": 4, "3": 5, "4": 6, "5": 7, "6": 8, "7": 9, "8": 10,
             "9": 11, "+": 12, "-": 13, "*": 14, "=": 15, "Ġ": 16}


@pytest.fixture(scope="module")
def calc_tokenizer():
    return build_char_tokenizer(characters=CALC_CHARACTERS)


def test_the_calc_tokenizer_adds_brackets_and_keeps_the_old_ids(calc_tokenizer) -> None:
    assert build_char_tokenizer().get_vocab() == OLD_VOCAB  # the other demo models' tokenizer is unchanged
    assert calc_tokenizer.get_vocab() == OLD_VOCAB | {"[": 17, "]": 18}
    old = build_char_tokenizer()
    expected = old.encode("37*48=") + [17] + old.encode("37*48") + [18] + old.encode("1776 1776")
    assert calc_tokenizer.encode("37*48=[37*48]1776 1776") == expected
    with pytest.raises(ValueError, match="must be distinct"):
        build_char_tokenizer(characters="0123456789" + "0")


def test_the_segments_of_a_tool_episode_and_a_direct_answer() -> None:
    problem = Problem("37*48=", "1776")
    assert calc_segments(problem, True, "<eos>") == [("37*48=", False), ("[37*48]", True), ("1776 ", False),
                                                     ("1776<eos>", True)]
    assert calc_segments(problem, False, "<eos>") == [("37*48=", False), ("1776<eos>", True)]


def test_only_the_models_tokens_get_labels(calc_tokenizer) -> None:
    problem = Problem("2*3=", "6")
    sequences = [calc_segments(problem, True, "<eos>"), calc_segments(problem, False, "<eos>")]
    input_ids, labels = encode_segments(calc_tokenizer, sequences)
    # ids: 2 -> 4, * -> 14, 3 -> 5, = -> 15, [ -> 17, ] -> 18, 6 -> 8, space -> 16, <eos> -> 1, <pad> -> 0.
    #            prompt 2*3=        call [2*3]          tool "6 "  answer 6<eos>
    assert input_ids.tolist() == [[4, 14, 5, 15, 17, 4, 14, 5, 18, 8, 16, 8, 1],
                                  [4, 14, 5, 15, 8, 1, 0, 0, 0, 0, 0, 0, 0]]  # right-padded
    assert labels.tolist() == [[-100, -100, -100, -100, 17, 4, 14, 5, 18, -100, -100, 8, 1],
                               [-100, -100, -100, -100, 8, 1, -100, -100, -100, -100, -100, -100, -100]]


def test_the_warmup_form_follows_the_tool_fraction_reproducibly() -> None:
    problems = make_calc_problems(random.Random(0), 2000)
    sequences = draw_calc_sequences(problems, 0.25, random.Random(1), "<eos>")
    assert sequences == draw_calc_sequences(problems, 0.25, random.Random(1), "<eos>")
    tool_share = sum(len(s) == 4 for s in sequences) / len(sequences)
    assert 0.22 <= tool_share <= 0.28
    assert all(len(s) == 2 for s in draw_calc_sequences(problems[:50], 0.0, random.Random(1), "<eos>"))


def test_the_calc_problems_of_the_build_are_reproducible_and_two_digit() -> None:
    first = draw_warmup_problems("calc", CALC_RECIPE, random.Random(CALC_RECIPE.eval_seed), 64)
    assert first == draw_warmup_problems("calc", CALC_RECIPE, random.Random(CALC_RECIPE.eval_seed), 64)
    assert first == make_calc_problems(random.Random(CALC_RECIPE.eval_seed), 64, 10, 99)
    assert first != draw_warmup_problems("calc", CALC_RECIPE, random.Random(CALC_RECIPE.val_seed), 64)


def test_calc_is_a_demo_task_with_its_own_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RELAY_CACHE_DIR", str(tmp_path))
    # Every data.task has a demo model: its own, or (a dataset, reasoning-gym's tasks) the arithmetic one.
    assert set(DEMO_TASKS) | {"dataset", "reasoning_gym"} == set(get_args(DataConfig.model_fields["task"].annotation))
    assert demo_model_dir("calc") == tmp_path / "demo-calc-model-v1"
    with pytest.raises(ValueError, match="calc takes a CalcRecipe"):
        build_demo_model(tmp_path / "wrong", task="calc", recipe=WarmupRecipe())
    with pytest.raises(ValueError, match="calc takes a CalcRecipe"):
        build_demo_model(tmp_path / "wrong", task="arithmetic", recipe=CALC_RECIPE)
    assert not any(tmp_path.iterdir())


def test_a_short_calc_build_is_deterministic_and_reports_episodes(tmp_path: Path) -> None:
    from dataclasses import replace

    recipe = replace(CALC_RECIPE, max_steps=6, eval_every=3, num_val_problems=16, num_eval_problems=16)
    reports = [build_demo_model(tmp_path / name, seed=3, recipe=recipe, task="calc") for name in ("a", "b")]
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in ("a", "b")]
    assert weights[0] == weights[1]
    for report in reports:
        report.pop("seconds")
    assert reports[0] == reports[1]
    saved = json.loads((tmp_path / "a" / REPORT_FILE).read_text())
    assert saved["task"] == "calc" and saved["steps"] == 6 and saved["recipe"]["tool_fraction"] == 0.25
    for key in ("sampled_accuracy", "sampled_tool_use_rate", "sampled_accuracy_given_call", "greedy_accuracy"):
        assert 0.0 <= saved[key] <= 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # saved atomically: no temporary left


@pytest.mark.slow
def test_calc_model_meets_its_targets(calc_model_dir: Path) -> None:
    assert calc_model_dir.name == "demo-calc-model-v1"
    report = json.loads((calc_model_dir / REPORT_FILE).read_text())
    assert report["task"] == "calc" and report["num_eval_problems"] >= 256
    # A low start: the tool is used on a minority of first turns, and direct answers are mostly wrong...
    assert 0.15 <= report["sampled_accuracy"] <= 0.35
    assert 0.1 <= report["sampled_tool_use_rate"] <= 0.4
    assert report["sampled_accuracy_given_direct"] <= 0.1
    # ...but a call is nearly always right: RL has only to learn to call.
    assert report["sampled_accuracy_given_call"] >= 0.85
    assert report["sampled_invalid_call_rate"] <= 0.05


@pytest.mark.slow
def test_the_saved_calc_model_runs_tool_episodes(calc_model_dir: Path) -> None:
    # Loaded as the engines load it (the reloaded tokenizer), on fresh problems.
    model = AutoModelForCausalLM.from_pretrained(calc_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(calc_model_dir)
    assert tokenizer.get_vocab() == build_char_tokenizer(characters=CALC_CHARACTERS).get_vocab()
    ids = tokenizer.encode("37*48=[37*48]1776 1776")
    assert len(ids) == 22 and tokenizer.decode(ids) == "37*48=[37*48]1776 1776"
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, model.config.vocab_size) == (1, 0, 19)

    problems = make_calc_problems(random.Random(2024), 256)
    torch.manual_seed(0)
    expected_next = torch.rand(1)
    torch.manual_seed(0)
    episodes = run_calc_episodes(model, tokenizer, problems, temperature=1.0, seed=1)
    assert torch.rand(1) == expected_next  # the runner's sampling RNG is its own
    metrics = summarize_episodes(episodes)
    assert 0.1 <= metrics["tool_use_rate"] <= 0.4 and metrics["accuracy_given_call"] >= 0.8
    called = next(e for e, p in zip(episodes, problems) if e.called and e.reward == 1.0)
    assert len(called.turns) == 2 and called.turns[0].endswith("]") and called.text.isdigit()
    # Once RL makes it call the tool every time, it is right about as often as its calls are.
    tool_probability, call_accuracy = call_probabilities(model, tokenizer, problems)
    assert 0.1 <= tool_probability <= 0.4 and call_accuracy >= 0.85

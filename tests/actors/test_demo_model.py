"""The demo model directory: char tokenizer, tiny Qwen2 config, atomic save, and the warmed-up demo build."""

import json
import random
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.demo import model as demo_model
from cluster.demo.accuracy import evaluate_accuracy, generate_completions, step_accuracy
from cluster.demo.cache import demo_model_dir, ensure_demo_model, shipped_demo_model
from cluster.demo.catalog import DEMO_TASKS
from cluster.demo.model import (
    CHAIN_RECIPE,
    REPORT_FILE,
    WarmupRecipe,
    build_char_tokenizer,
    demo_recipe,
    make_random_model_dir,
    save_model_dir,
    tiny_qwen2_config,
)
from cluster.demo.task import make_chain_problems, make_problems


@pytest.fixture
def random_model_dir(tmp_path: Path) -> Path:
    return make_random_model_dir(tmp_path / "tiny")


def test_tokenizer_round_trips_after_reload(random_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(random_model_dir)  # how vLLM loads it
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, None)
    assert len(tokenizer) == 17  # <pad>, <eos>, 0-9, + - * = and space
    for text in ["37+45=", "0", "198", "3 * 4 - 5 = 7"]:
        ids = tokenizer.encode(text)
        assert len(ids) == len(text)  # one token per character, nothing added (no BOS, no EOS)
        assert tokenizer.decode(ids) == text
    ids = tokenizer.encode("37+45=") + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids) == "37+45=<eos>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "37+45="
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("9+1=")) == ["9", "+", "1", "="]


def test_reloaded_tokenizer_behaves_like_the_built_one(random_model_dir: Path) -> None:
    # transformers reloads a qwen2 dir as Qwen2Tokenizer, rebuilt from the saved vocabulary: it must not differ.
    built = build_char_tokenizer()
    reloaded = AutoTokenizer.from_pretrained(random_model_dir)
    assert reloaded.get_vocab() == built.get_vocab()
    for text in ["37+45=", " 1 ", "3 * 4 - 5 = 7", "12\n3", "a1"]:
        assert reloaded.encode(text) == built.encode(text)
    assert built.encode("a1") == built.encode("1")  # unknown characters are dropped, by both
    all_ids = list(range(len(built)))
    assert reloaded.decode(all_ids) == built.decode(all_ids) == "<pad><eos>0123456789+-*= "


def test_tokenizer_left_pads_with_pad_id() -> None:
    batch = build_char_tokenizer()(["1+1=", "37+45="], padding=True, padding_side="left")
    assert batch["input_ids"][0][:2] == [0, 0]
    assert batch["attention_mask"] == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]


def test_random_model_dir_loads_with_consistent_special_tokens(random_model_dir: Path) -> None:
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in random_model_dir.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    config = model.config
    shape = (config.model_type, config.hidden_size, config.num_attention_heads, config.num_key_value_heads)
    assert shape == ("qwen2", 64, 2, 1)
    assert (config.eos_token_id, config.pad_token_id, config.vocab_size) == (1, 0, 17)
    assert config.tie_word_embeddings is False
    assert json.loads((random_model_dir / "generation_config.json").read_text())["eos_token_id"] == 1
    logits = model(input_ids=torch.tensor([[5, 9, 12, 6, 7, 15]])).logits
    assert logits.shape == (1, 6, 17)


def test_random_model_dir_is_deterministic_per_seed(tmp_path: Path) -> None:
    first = make_random_model_dir(tmp_path / "a", seed=3)
    second = make_random_model_dir(tmp_path / "b", seed=3)
    other = make_random_model_dir(tmp_path / "c", seed=4)
    weights = [(d / "model.safetensors").read_bytes() for d in (first, second, other)]
    assert weights[0] == weights[1]
    assert weights[0] != weights[2]


@pytest.mark.parametrize(("hidden_size", "num_heads"), [(32, 2), (64, 4)])
def test_config_rejects_head_dim_unsupported_by_vllm_cpu(hidden_size: int, num_heads: int) -> None:
    with pytest.raises(AssertionError, match="head_dim = hidden_size / num_heads"):
        tiny_qwen2_config(vocab_size=17, hidden_size=hidden_size, num_heads=num_heads)


def test_save_model_dir_refuses_existing_dir_and_leaves_no_temporary(tmp_path: Path, random_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    with pytest.raises(FileExistsError, match="already exists"):
        save_model_dir(model, build_char_tokenizer(), random_model_dir)
    saved = save_model_dir(model, build_char_tokenizer(), tmp_path / "copy", extra_files={"note.txt": "hi"})
    assert (saved / "note.txt").read_text() == "hi"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "tiny"]  # the temporary sibling was renamed


def test_evaluate_accuracy_is_seeded_and_keeps_global_rng(random_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(random_model_dir)
    problems = make_problems(random.Random(0), 64, max_operand=4)  # one-digit sums: a random model hits some
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = evaluate_accuracy(model, tokenizer, problems, temperature=1.0, seed=5)
    assert torch.rand(1) == expected_next
    assert evaluate_accuracy(model, tokenizer, problems, temperature=1.0, seed=5) == first
    assert 0.0 <= first <= 1.0


def test_demo_model_dir_follows_relay_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RELAY_CACHE_DIR", str(tmp_path))
    assert demo_model_dir() == tmp_path / "demo-model-v1"
    monkeypatch.delenv("RELAY_CACHE_DIR")
    assert demo_model_dir() == Path.home() / ".cache" / "relay" / "demo-model-v1"


def test_each_task_has_its_demo_model_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RELAY_CACHE_DIR", str(tmp_path))
    assert demo_model_dir("arithmetic") == demo_model_dir("dataset") == tmp_path / "demo-model-v1"
    assert demo_model_dir("chain_sum") == tmp_path / "demo-chain-model-v1"
    with pytest.raises(ValueError, match="no demo model for task 'sorting'; use one of arithmetic, chain_sum"):
        ensure_demo_model(task="sorting")
    assert not any(tmp_path.iterdir())  # nothing built for an unknown task


@pytest.mark.slow
def test_demo_model_is_built_once_from_its_recipe_and_calibrated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path
                                                                  ) -> None:
    # The suite's one build, of the default recipe cut short and on fewer problems (about half the whole recipe's
    # time): warm-up, the output scale's bisection, the held-out evaluation and the atomic save all run. What the
    # whole recipe reaches is its shipped report's (the next test); that the shipped model is the recipe's,
    # `test_each_shipped_model_is_what_its_recipe_builds`.
    short = replace(WarmupRecipe(), max_steps=400, num_val_problems=128, num_eval_problems=256)
    monkeypatch.setitem(demo_model._RECIPES, "arithmetic", short)
    monkeypatch.setenv("RELAY_CACHE_DIR", str(tmp_path))
    messages: list[str] = []
    path = ensure_demo_model(log=messages.append, build=True)
    assert path == tmp_path / "demo-model-v1"
    assert any("Building" in m for m in messages)
    report = json.loads((path / REPORT_FILE).read_text())
    assert report["recipe"] == json.loads(json.dumps(asdict(short))) and report["num_eval_problems"] == 256
    # Cut short, it stops before the greedy target; the bisection's scale (inside its bounds: it bound) still brings
    # sampling near its target, below greedy.
    assert report["steps"] == 400 and report["greedy_accuracy"] < short.target_greedy_accuracy
    assert 0 < report["output_scale"] < short.max_output_scale * 0.9
    assert abs(report["sampled_accuracy"] - short.target_sampled_accuracy) <= 0.1
    assert report["greedy_accuracy"] >= report["sampled_accuracy"] + 0.1
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert sum(p.numel() for p in loaded.parameters()) == report["params"]

    messages.clear()
    assert ensure_demo_model(log=messages.append, build=True) == path
    assert messages == []  # found in the cache, not rebuilt


def test_the_shipped_demo_model_meets_its_targets() -> None:
    report = json.loads((shipped_demo_model("arithmetic") / REPORT_FILE).read_text())
    # Right on most problems greedily, far less often when sampling: what GRPO needs to show progress.
    assert 0.05 <= report["sampled_accuracy"] <= 0.5
    assert report["greedy_accuracy"] >= report["sampled_accuracy"] + 0.3
    assert report["num_eval_problems"] >= 256


@pytest.mark.parametrize("task", DEMO_TASKS)
def test_a_fresh_cache_gets_a_copy_of_the_shipped_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, task: str
) -> None:
    monkeypatch.setenv("RELAY_CACHE_DIR", str(tmp_path))
    messages: list[str] = []
    path = ensure_demo_model(log=messages.append, task=task)
    assert path == demo_model_dir(task)
    assert len(messages) == 1 and messages[0].startswith("Copied relay's shipped") and str(path) in messages[0]
    shipped = shipped_demo_model(task)
    assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in shipped.iterdir())
    assert (path / "model.safetensors").read_bytes() == (shipped / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # copied atomically: no temporary left
    messages.clear()
    assert ensure_demo_model(log=messages.append, task=task) == path and messages == []


@pytest.mark.parametrize("task", DEMO_TASKS)
def test_each_shipped_model_is_what_its_recipe_builds(task: str) -> None:
    # A recipe changed without rebuilding (and renaming) its model fails here: `relay build-demo-model --task T`
    # into an empty RELAY_CACHE_DIR, then copy the directory to cluster/demo/models/.
    shipped = shipped_demo_model(task)
    report = json.loads((shipped / REPORT_FILE).read_text())
    assert shipped.name == report["name"] == demo_model_dir(task).name
    assert (report["task"], report["seed"]) == (task, 0)
    assert report["recipe"] == json.loads(json.dumps(asdict(demo_recipe(task))))
    model = AutoModelForCausalLM.from_pretrained(shipped)
    assert sum(p.numel() for p in model.parameters()) == report["params"]
    assert len(AutoTokenizer.from_pretrained(shipped)) == model.config.vocab_size


@pytest.mark.slow
def test_chain_model_meets_its_targets(chain_model_dir: Path) -> None:
    assert chain_model_dir.name == "demo-chain-model-v1"
    report = json.loads((chain_model_dir / REPORT_FILE).read_text())
    assert report["task"] == "chain_sum" and report["recipe"]["num_terms"] == 3
    # Greedy: the whole answer mostly right. Sampled at T=1: whole answers seldom, single steps more often.
    assert report["greedy_accuracy"] >= 0.9
    assert 0.15 <= report["sampled_accuracy"] <= 0.35
    assert report["sampled_step_accuracy"] >= report["sampled_accuracy"] + 0.1

    # The saved model answers fresh problems in the label's format (as the engines load it: the reloaded tokenizer).
    model = AutoModelForCausalLM.from_pretrained(chain_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(chain_model_dir)
    problems = make_chain_problems(random.Random(2024), 128)
    greedy = generate_completions(model, tokenizer, problems, 0.0, CHAIN_RECIPE.max_new_tokens)
    assert sum(c == p.label for p, c in zip(problems, greedy)) / len(problems) >= 0.8
    assert step_accuracy(problems, greedy) >= 0.85

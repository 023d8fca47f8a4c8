"""`relay train data.task=reasoning_gym` with the real reasoning-gym: on the demo model its prompts are refused before
anything starts (the demo tokenizer holds digits and + - * = only), one line naming the entry and the character, as a
user runs it; on a tiny model whose tokenizer holds any text, a short run (the run `relay train` makes with the same
arguments, made in the test's process on the session's shared fleets) trains end to end, scored by the
`reasoning_gym` verifier that the task makes the default reward source."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.e2e.test_cli import relay

pytest.importorskip("reasoning_gym")

TASK = ["data.task=reasoning_gym", "data.reasoning_gym.datasets.basic_arithmetic.weight=1",
        "data.reasoning_gym.datasets.basic_arithmetic.config={min_terms: 2, max_terms: 2, max_digits: 2}",
        "data.reasoning_gym.datasets.leg_counting.weight=1", "data.reasoning_gym.size=8"]


@pytest.fixture(scope="module")
def byte_model_dir(tmp_path_factory):
    """A randomly initialised tiny Qwen2 whose tokenizer is the demo's over the whole byte-level alphabet: any text is
    held, one token per UTF-8 byte."""
    import torch
    from tokenizers import pre_tokenizers
    from transformers import Qwen2ForCausalLM

    from cluster.demo.model import save_model_dir, tiny_qwen2_config
    from cluster.demo.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(model_max_length=1024,
                                     characters="".join(sorted(pre_tokenizers.ByteLevel.alphabet())))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=len(tokenizer), max_position_embeddings=1024))
    return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("models") / "bytes")


def test_on_the_demo_model_the_prompts_are_refused_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    result = relay("train", *TASK, f"run_dir={run_dir}", timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert result.stderr.startswith("relay: config error: data.reasoning_gym entry 0 (")
    assert "cannot hold the prompt: its token ids decode to other text from character 0 ('G') on" in result.stderr
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_short_run_trains_on_reasoning_gym_tasks(tmp_path, byte_model_dir, fleets):
    from cluster.config import load_config
    from cluster.run.launch import run_training

    run_dir = tmp_path / "run"
    # `relay train` as a process: the test above and tests/e2e/test_cli.py. In this process a parked fleet spares
    # the run its actors' start.
    config = load_config(None, [*TASK, f"model.path={byte_model_dir}", f"run_dir={run_dir}", "max_steps=2",
                                "data.prompts_per_step=2", "rollout.group_size=2", "rollout.num_workers=1",
                                "rollout.max_model_len=1024", "rollout.max_new_tokens=8", "checkpoint.every=0",
                                "logging.tensorboard=false", "ray.dashboard=false"])
    run_training(config, run_dir, display=False, pool=fleets)
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["reward"]["sources"] == {"correct": {"type": "rule", "verifier": "reasoning_gym", "params": {},
                                                         "weight": 1.0, "level": "outcome"}}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(0.0 <= r["reward/correct"] <= 1.0 and r["verifier/failures"] == 0 for r in records)
    assert [r["data/epoch"] for r in records] == [0.25, 0.5]  # 2 of the 8 generated prompts per step
    assert all(r["data/filtered_prompts"] == 0 for r in records)
    assert all(r["weights/version"] == r["step"] for r in records)

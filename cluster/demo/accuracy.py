"""The demo models' accuracy, measured with transformers: completions of held-out or validation problems, and the
fraction right, of whole answers (`exact_match_rate`) and of single steps (`step_accuracy`).

Owns `generate_completions` (greedy or seeded sampling, leaving the global RNG alone, each completion decoded as vLLM
decodes it) and `evaluate_accuracy`, what the warm-up's stopping rule, the output layer's calibration and the
model's report measure (`cluster.demo.model`). Does not own building the models or their reports, nor the calc
task's episodes with the tool (`cluster.demo.calc`), nor the reward (`exact_match`, from `cluster.demo.task`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from cluster.demo.task import Problem, exact_match


@torch.no_grad()
def evaluate_accuracy(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: Sequence[Problem],
    temperature: float,
    max_new_tokens: int = 5,
    batch_size: int = 256,
    seed: int = 0,
) -> float:
    """Mean `exact_match` reward of one completion per problem: greedy if `temperature == 0`, else sampled.

    Completions as `generate_completions` makes them.
    """
    completions = generate_completions(model, tokenizer, problems, temperature, max_new_tokens, batch_size, seed)
    return exact_match_rate(problems, completions)


def exact_match_rate(problems: Sequence[Problem], completions: Sequence[str]) -> float:
    """Fraction of the completions that `exact_match` their problem's label."""
    return sum(exact_match(c, p.label) for p, c in zip(problems, completions, strict=True)) / len(problems)


def step_accuracy(problems: Sequence[Problem], completions: Sequence[str]) -> float:
    """Fraction of the labels' steps (space-separated partial sums) that the completions have right in place.

    Step i of a completion is its i-th space-separated field; a missing field is wrong. "46 103" for "46 102"
    has 1 of 2 steps right. For one-step labels (arithmetic) this is the exact-match accuracy.
    """
    right = total = 0
    for problem, completion in zip(problems, completions, strict=True):
        expected, got = problem.label.split(" "), completion.split(" ")
        right += sum(i < len(got) and got[i] == step for i, step in enumerate(expected))
        total += len(expected)
    return right / total


@torch.no_grad()
def generate_completions(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: Sequence[Problem],
    temperature: float,
    max_new_tokens: int = 5,
    batch_size: int = 256,
    seed: int = 0,
) -> list[str]:
    """One completion per problem: greedy if `temperature == 0`, else sampled.

    The completion is the generated text before the first `<eos>` (all of it if none came), decoded without
    special tokens as vLLM does by default. Sampling uses the full distribution (no top-k/top-p) and a seeded
    RNG of its own, leaving the global torch RNG untouched.
    """
    model.eval()
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    sampling: dict[str, object] = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    completions = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            batch = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True, padding_side="left")
            output = model.generate(
                **batch, max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=pad_id, **sampling
            )
            for ids in output[:, batch["input_ids"].shape[1] :].tolist():
                completion_ids = ids[: ids.index(eos_id)] if eos_id in ids else ids
                completions.append(tokenizer.decode(completion_ids, skip_special_tokens=True))
    return completions

"""The calc demo task's episodes on transformers: the warm-up sequences, their encoding, and an episode runner.

An episode of `37*48=` (the model's turns between `|`): `37*48=` | `[37*48]` | `1776 ` (the `Calculator` tool's
answer) | `1776<eos>` |, or a direct answer `37*48=` | `1776<eos>` |. A tool call ends at its `]` (the engines' stop
string; the `]` is the model's token), the tool's answer is the environment's (no loss on it), and the last turn's
text is the answer that `Calculator` scores. Owns `calc_segments` and `encode_segments` (supervised sequences with
loss on the model's tokens only), `call_probabilities` (teacher-forced checks for the warm-up's stopping rule) and
`run_calc_episodes` / `summarize_episodes` (real sampled episodes for the model's report). Does not own the model's
recipe or build (`cluster.demo.model`), the tool's rules (`rewards.environments.examples.Calculator`) nor the RL
episode loop, which drives the engines.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cluster.demo.task import Problem
from rewards.environments.examples import Calculator

Segment = tuple[str, bool]  # (text, trained): the model's text is trained, the prompt's and the tool's are not
CALL_END = "]"  # ends a tool-call turn: the engines' stop string


def calc_segments(problem: Problem, use_tool: bool, eos_token: str) -> list[Segment]:
    """The warm-up sequence of `problem` (`a*b=`), in the tool form or the direct form, as segments.

    Tool form: prompt, `[a*b]` (trained), the tool's answer `a*b ` as `Calculator` gives it, `label<eos>`
    (trained). Direct form: prompt, `label<eos>` (trained): the true product, which the tiny model cannot compute,
    so its direct answers stay mostly wrong.
    """
    answer = (f"{problem.label}{eos_token}", True)
    if not use_tool:
        return [(problem.prompt, False), answer]
    call = f"[{problem.prompt.removesuffix('=')}{CALL_END}"
    calculator = Calculator()
    calculator.reset(problem.prompt, problem.label)
    return [(problem.prompt, False), (call, True), (calculator.step(call).observation, False), answer]


def draw_calc_sequences(problems: Sequence[Problem], tool_fraction: float, rng: random.Random,
                        eos_token: str) -> list[list[Segment]]:
    """One warm-up sequence per problem: the tool form with probability `tool_fraction` (one `rng.random()` each),
    else the direct form. The form does not depend on the prompt, so the warmed-up model calls the tool on about
    `tool_fraction` of its first turns, whatever the problem."""
    return [calc_segments(problem, rng.random() < tool_fraction, eos_token) for problem in problems]


def encode_segments(tokenizer: PreTrainedTokenizerBase,
                    sequences: Sequence[Sequence[Segment]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids of the concatenated segments, and labels equal to them on trained segments, -100 elsewhere.

    Each segment is tokenised on its own (the char tokenizer gives the same ids either way; `<eos>` in a text is
    the special token). As `_encode_batch` for one-turn tasks: positions start at 0, pads after every real token.
    Returns input_ids, labels: both [B, T].
    """
    encoded = [[(tokenizer.encode(text, add_special_tokens=False), trained) for text, trained in sequence]
               for sequence in sequences]
    width = max(sum(len(ids) for ids, _ in sequence) for sequence in encoded)
    input_ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    for row, sequence in enumerate(encoded):
        start = 0
        for ids, trained in sequence:
            input_ids[row, start : start + len(ids)] = torch.tensor(ids)
            if trained:
                labels[row, start : start + len(ids)] = torch.tensor(ids)
            start += len(ids)
    return input_ids, labels


@torch.no_grad()
def call_probabilities(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                       problems: Sequence[Problem]) -> tuple[float, float]:
    """Teacher-forced, one forward pass: the mean probability of `[` as the first token (the tool-use rate at T=1),
    and the mean probability of the rest of the right tool episode after it (`a*b]`, then `label<eos>` after the
    tool's answer): the accuracy at T=1 given a call, less the few right answers reached another way."""
    model.eval()
    input_ids, labels = encode_segments(tokenizer, [calc_segments(p, True, tokenizer.eos_token) for p in problems])
    labels = labels[:, 1:]  # [B, T-1]: position t predicts token t+1
    logprobs = torch.log_softmax(model(input_ids=input_ids).logits[:, :-1].float(), dim=-1)
    mask = labels != -100
    token_logprobs = logprobs.gather(2, labels.clamp(min=0).unsqueeze(2)).squeeze(2) * mask  # [B, T-1]
    first = mask.int().argmax(dim=1)  # [B]: where `[` is predicted
    call = token_logprobs[torch.arange(len(problems)), first]  # [B]
    rest = token_logprobs.sum(dim=1) - call
    return call.exp().mean().item(), rest.exp().mean().item()


@dataclass(frozen=True)
class CalcEpisode:
    """One episode: the model's turn texts (`<eos>` dropped; a call keeps its `]`) and `Calculator`'s reward."""

    turns: list[str]
    reward: float
    called: bool  # the first turn was a tool call

    @property
    def text(self) -> str:
        """The text scored at the end: the last turn's."""
        return self.turns[-1]


@torch.no_grad()
def run_calc_episodes(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    temperature: float,
    max_new_tokens: int = 8,
    max_turns: int = 3,
    max_calls: int = 2,
    batch_size: int = 256,
    seed: int = 0,
) -> list[CalcEpisode]:
    """One episode per problem with `Calculator(max_calls)`, as the RL loop runs them, on transformers.

    Each turn generates up to `max_new_tokens` until `<eos>` or `]` (greedy if `temperature == 0`, else sampled
    from the full distribution with a seeded RNG of its own, leaving the global torch RNG untouched); the tool's
    answer is appended as tokens; an episode still going after `max_turns` turns earns 0.
    """
    model.eval()
    stop_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(CALL_END)]
    episodes = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            episodes += _run_batch(model, tokenizer, chunk, temperature, max_new_tokens, max_turns, max_calls, stop_ids)
    return episodes


def _run_batch(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: Sequence[Problem],
               temperature: float, max_new_tokens: int, max_turns: int, max_calls: int,
               stop_ids: list[int]) -> list[CalcEpisode]:
    environments = [Calculator(max_calls) for _ in problems]
    sequences = [tokenizer.encode(p.prompt + e.reset(p.prompt, p.label), add_special_tokens=False)
                 for p, e in zip(problems, environments)]
    turns: list[list[str]] = [[] for _ in problems]
    rewards = [0.0] * len(problems)
    active = list(range(len(problems)))
    for _ in range(max_turns):
        if not active:
            break
        generated = _generate_turn(model, tokenizer, [sequences[i] for i in active], temperature, max_new_tokens,
                                   stop_ids)
        still_active = []
        for i, ids in zip(active, generated):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            result = environments[i].step(text)
            turns[i].append(text)
            sequences[i] += ids + tokenizer.encode(result.observation, add_special_tokens=False)
            rewards[i] += result.reward
            if not result.done:
                still_active.append(i)
        active = still_active
    return [CalcEpisode(t, r, "[" in t[0]) for t, r in zip(turns, rewards)]  # a call as `Calculator` sees it


def _generate_turn(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sequences: list[list[int]],
                   temperature: float, max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
    """One turn's new ids per sequence, up to and including its first stop token (any after it dropped)."""
    pad_id = tokenizer.pad_token_id
    width = max(map(len, sequences))
    input_ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in sequences])  # left-padded: [B, T]
    attention_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
    sampling: dict[str, object] = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                            eos_token_id=stop_ids, pad_token_id=pad_id, **sampling)
    new_ids = []
    for ids in output[:, width:].tolist():
        end = next((k + 1 for k, token in enumerate(ids) if token in stop_ids), len(ids))
        new_ids.append(ids[:end])
    return new_ids


def summarize_episodes(episodes: Sequence[CalcEpisode]) -> dict[str, float]:
    """accuracy (mean reward), tool_use_rate (first turn a call), accuracy_given_call and accuracy_given_direct
    (0.0 if there are none), invalid_call_rate (calls that `Calculator` refused, per call), mean_turns."""
    called = [e for e in episodes if e.called]
    direct = [e for e in episodes if not e.called]
    calls = [turn for e in episodes for turn in e.turns if "[" in turn]
    return {
        "accuracy": _mean([e.reward for e in episodes]),
        "tool_use_rate": len(called) / len(episodes),
        "accuracy_given_call": _mean([e.reward for e in called]),
        "accuracy_given_direct": _mean([e.reward for e in direct]),
        "invalid_call_rate": _mean([_invalid(turn) for turn in calls]),
        "mean_turns": _mean([len(e.turns) for e in episodes]),
    }


def _invalid(call: str) -> float:
    calculator = Calculator()
    calculator.reset("", "")
    return float(calculator.step(call).info.get("invalid_call", False))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0

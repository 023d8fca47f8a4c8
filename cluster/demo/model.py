"""The demo's base models: a character tokenizer and tiny Qwen2s warmed up on the demo tasks, built locally.

Owns building and saving (atomically) the model directories that the demo's engines and learner load (one per task:
`arithmetic`, `a+b=`; `chain_sum`, `12+34+56=` -> `46 102`; `calc`, `37*48=` -> `1776` with a calculator tool), each
like a pretrained base whose sampling RL then sharpens: right greedily on most held-out problems but, its output layer
scaled down to that target, on about a quarter when sampling at T=1 (calc's by calling its tool, which RL teaches it
to call more: `CalcRecipe`); docs/benchmarks.md, "Why the demo model looks the way it does".
Does not own the transformers-based accuracy checks that tune and report them (`cluster.demo.accuracy`), the RL loop,
the tasks and their reward (`cluster.demo.task`), the calc task's episodes (`cluster.demo.calc`), where the models are
cached and shipped (`cluster.demo.cache`, whose `ensure_demo_model` calls `build_demo_model` only when a model must be
built) or any engine: the directory is a plain Hugging Face model dir, read like any other.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from cluster.demo.accuracy import evaluate_accuracy, exact_match_rate, generate_completions, step_accuracy
from cluster.demo.calc import (
    call_probabilities,
    draw_calc_sequences,
    encode_segments,
    run_calc_episodes,
    summarize_episodes,
)
from cluster.demo.catalog import MODEL_NAMES, atomic_dir, demo_task
from cluster.demo.task import Problem, make_calc_problems, make_chain_problems, make_problems
from cluster.demo.tokenizer import CALC_CHARACTERS, CHARACTERS, build_char_tokenizer

REPORT_FILE = "relay_demo_report.json"
BUILD_THREADS = 1
SUPPORTED_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM's CPU attention kernels


def tiny_qwen2_config(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    max_position_embeddings: int = 64,
    tie_word_embeddings: bool = False,
) -> Qwen2Config:
    """A small Qwen2 config whose special-token ids match `build_char_tokenizer` (BOS = EOS, never prepended).

    Untied embeddings by default: the demo's calibration scales the output layer alone (`_calibrate_output_scale`,
    `_fold_output_gain`), which a tied head would share with the input embedding. Engines reload a tied head
    correctly too (docs/vllm-cpu.md, tied embeddings).
    """
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    head_dim = hidden_size // num_heads
    assert head_dim >= 32 and head_dim in SUPPORTED_CPU_HEAD_DIMS, (
        f"head_dim = hidden_size / num_heads = {hidden_size}/{num_heads} = {head_dim}, but vLLM's CPU attention "
        f"supports only head_dim in {SUPPORTED_CPU_HEAD_DIMS}: raise hidden_size or lower num_heads"
    )
    eos_id, pad_id = 1, 0  # fixed by build_char_tokenizer's vocabulary
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=eos_id,
    )


def save_model_dir(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    out_dir: str | os.PathLike[str],
    extra_files: Mapping[str, str] | None = None,
) -> Path:
    """Writes config, safetensors weights, tokenizer, generation config and `extra_files` (name -> text).

    Atomic: everything goes to a temporary sibling directory that is renamed to `out_dir` at the end, so a
    reader sees either no directory or a complete one. Raises FileExistsError if `out_dir` already exists.
    """
    with atomic_dir(Path(out_dir)) as tmp_dir:
        model.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=model.config.bos_token_id,
        )
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        for name, text in (extra_files or {}).items():
            (tmp_dir / name).write_text(text)
    return Path(out_dir)


def make_random_reward_model_dir(out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Saves a randomly initialised tiny Qwen2 sequence classifier with one output (a reward model) and the char
    tokenizer. For tests and examples of `type: model` reward sources; it scores nothing meaningful."""
    from transformers import Qwen2ForSequenceClassification

    tokenizer = build_char_tokenizer()
    config = tiny_qwen2_config(vocab_size=len(tokenizer))
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
    return save_model_dir(model, tokenizer, out_dir)


def make_random_process_reward_model_dir(out_dir: str | os.PathLike[str], seed: int = 0, num_labels: int = 1) -> Path:
    """Saves a randomly initialised tiny Qwen2 token classifier (a process reward model: its output at a step's
    end token scores the step; `num_labels` 1 or 2, as Qwen2.5-Math-PRM) and the char tokenizer. For tests and
    examples of `type: model` sources with `level: steps`; it scores nothing meaningful."""
    from transformers import Qwen2ForTokenClassification

    tokenizer = build_char_tokenizer()
    config = tiny_qwen2_config(vocab_size=len(tokenizer))
    config.num_labels = num_labels
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForTokenClassification(config)
    return save_model_dir(model, tokenizer, out_dir)


def make_random_model_dir(out_dir: str | os.PathLike[str], seed: int = 0, **config_kwargs: object) -> Path:
    """Saves a randomly initialised tiny Qwen2 (`tiny_qwen2_config(**config_kwargs)`) and the char tokenizer.

    For tests that need a real model directory and nothing learned.
    """
    tokenizer = build_char_tokenizer()
    config = tiny_qwen2_config(vocab_size=len(tokenizer), **config_kwargs)  # type: ignore[arg-type]
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream alone
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return save_model_dir(model, tokenizer, out_dir)


@dataclass(frozen=True)
class WarmupRecipe:
    """Shape, problems, warm-up and calibration of a demo model; a change that alters the weights bumps its name
    (`DEMO_MODEL_NAME` for the defaults, `CHAIN_MODEL_NAME` for `CHAIN_RECIPE`).

    Two deterministic rules replace hand-picked step counts, so a slightly different CPU still lands on target:
    train until greedy accuracy on the validation problems reaches `target_greedy_accuracy`, then scale the
    output layer so that sampling at T=1 on them is right `target_sampled_accuracy` of the time.
    """

    # Qwen2 shape: head_dim 32 (vLLM's CPU attention needs >= 32), ~0.3M parameters.
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    # AdamW, linear warm-up then cosine decay over max_steps; stops earlier once the greedy target is reached.
    max_steps: int = 1500
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    label_smoothing: float = 0.1  # over digits and <eos> only: keeps errors plausible (wrong digits, early stop)
    eval_every: int = 25
    target_greedy_accuracy: float = 0.97
    # Output-layer scale found by bisection in [0, max_output_scale]; greedy decoding does not depend on it.
    target_sampled_accuracy: float = 0.25
    max_output_scale: float = 2.0
    calibration_iterations: int = 10
    # Function-preserving: final-norm gain x k, output layer / k (see `_fold_output_gain`).
    output_gain: float = 32.0
    # Problems excluded from training: validation (the two rules above) and held-out (the report).
    num_val_problems: int = 512
    val_seed: int = 999
    num_eval_problems: int = 512
    eval_seed: int = 12345
    max_new_tokens: int = 5  # longest answer "198" + <eos> is 4 tokens
    # The problems: operands in [min_operand, max_operand]; `num_terms` of them for chain_sum (arithmetic has 2).
    min_operand: int = 0
    max_operand: int = 99
    num_terms: int = 3
    answer_characters: str = "0123456789"  # label smoothing spreads over these and <eos>


# Chained sums of 3 terms in 0..99 (2 steps), on the arithmetic model's shape: ~1100 steps, ~1.5 min on this
# recipe's one thread. Answers are up to "198 297" + <eos>, 8 tokens (rollout.max_new_tokens' default).
CHAIN_RECIPE = WarmupRecipe(
    max_steps=2000,
    eval_every=50,
    target_greedy_accuracy=0.93,
    max_new_tokens=8,
    min_operand=0,
    max_operand=99,
    num_terms=3,
    answer_characters="0123456789 ",  # the space too: a wrong answer may have a step too few or too many
)


@dataclass(frozen=True)
class CalcRecipe(WarmupRecipe):
    """The calc task's recipe (`37*48=`, multi-turn with the `Calculator` tool; cluster/demo/calc.py).

    Warm-up sequences take the tool form (`[37*48]`, the tool's `1776 `, `1776<eos>`) with probability
    `tool_fraction`, else the direct form (`1776<eos>`, which the model cannot compute): the model then calls the
    tool on about `tool_fraction` of its first turns, and copies the call and the tool's answer right when it does.
    Its start is set by `tool_fraction` alone, not by scaling the output layer: T=1 accuracy is about tool use x
    copying accuracy, and a scale below 1 would break the copying while one above 1 would push tool use down to
    greedy's rate (~10%: the likeliest first digit usually beats `[`), so accuracy is not monotonic in the scale and
    bisecting it is neither sound nor needed. RL then has one thing to learn, to call the tool. Training stops once
    the teacher-forced probability of the right tool episode after `[` (`call_probabilities`) reaches
    `target_call_accuracy` on the validation problems. No label smoothing: it would make the copying err. The
    output gain is folded as for the other tasks (`_fold_output_gain`): RL needs it to move the first token's odds.
    """

    tool_fraction: float = 0.25  # ~ the T=1 tool-use rate of the built model (0.18-0.26 over seeds 0-3)
    target_call_accuracy: float = 0.95  # teacher-forced; its T=1 accuracy given a call came out 0.94-0.99
    max_calls: int = 2  # `Calculator(max_calls)` in the report's episodes
    max_turns: int = 3
    characters: str = CALC_CHARACTERS
    # Overridden defaults: two-digit operands; "[99*99]" is 7 tokens, "9801" + <eos> 5, per turn.
    min_operand: int = 10
    max_operand: int = 99
    label_smoothing: float = 0.0
    max_new_tokens: int = 8
    max_steps: int = 800  # the cosine schedule's length; the target is reached after ~400-450 steps
    num_val_problems: int = 256
    num_eval_problems: int = 512


CALC_RECIPE = CalcRecipe()
_RECIPES = {"arithmetic": WarmupRecipe(), "chain_sum": CHAIN_RECIPE, "calc": CALC_RECIPE}


def draw_warmup_problems(task: str, recipe: WarmupRecipe, rng: random.Random, n: int) -> list[Problem]:
    """`n` problems of `task` ("arithmetic", "chain_sum" or "calc") with the recipe's operands and terms."""
    if demo_task(task) == "chain_sum":
        return make_chain_problems(rng, n, recipe.num_terms, recipe.min_operand, recipe.max_operand)
    if demo_task(task) == "calc":
        return make_calc_problems(rng, n, recipe.min_operand, recipe.max_operand)
    return make_problems(rng, n, recipe.min_operand, recipe.max_operand)


def _encode_batch(tokenizer: PreTrainedTokenizerFast, problems: Sequence[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `prompt + label + <eos>` ids, and labels that are -100 except on the answer and `<eos>`.

    Right padding keeps positions starting at 0 as in the engines, and pads come after every real token, so
    the causal mask alone keeps them from the loss positions. Returns input_ids, labels: both [B, T].
    """
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompt_ids = [tokenizer.encode(p.prompt) for p in problems]
    answer_ids = [tokenizer.encode(p.label) + [eos_id] for p in problems]
    width = max(len(p) + len(a) for p, a in zip(prompt_ids, answer_ids))
    input_ids = torch.full((len(problems), width), pad_id, dtype=torch.long)
    labels = torch.full((len(problems), width), -100, dtype=torch.long)
    for row, (prompt, answer) in enumerate(zip(prompt_ids, answer_ids)):
        end = len(prompt) + len(answer)
        input_ids[row, :end] = torch.tensor(prompt + answer)
        labels[row, len(prompt) : end] = torch.tensor(answer)
    return input_ids, labels


def _smoothed_answer_loss(
    logits: torch.Tensor, labels: torch.Tensor, smoothing: float, answer_ids: torch.Tensor
) -> torch.Tensor:
    """Cross-entropy against (1 - smoothing) * one-hot + smoothing * uniform over `answer_ids` (Szegedy et al. 2016).

    Smoothing over the digits and `<eos>` only keeps the model's doubt on *which* answer rather than on
    emitting `+` or `<pad>`. logits: [B, T, V]; labels: [B, T], -100 where there is no loss; answer_ids: [A].
    """
    mask = labels != -100
    logprobs = torch.log_softmax(logits[mask], dim=-1)  # [N, V]
    nll = -logprobs.gather(1, labels[mask].unsqueeze(1)).squeeze(1)  # [N]
    uniform = -logprobs[:, answer_ids].mean(dim=-1)  # [N]
    return ((1.0 - smoothing) * nll + smoothing * uniform).mean()


def _train_warmup(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    recipe: WarmupRecipe,
    val_problems: Sequence[Problem],
    excluded_prompts: set[str],
    seed: int,
    task: str = "arithmetic",
) -> int:
    """Supervised warm-up until the validation target is reached (or `max_steps`); returns the steps taken.

    The target: greedy accuracy `target_greedy_accuracy`, or for calc `target_call_accuracy` (`_reached_target`).
    """
    rng = random.Random(seed)
    answer_ids = torch.tensor(tokenizer.encode(recipe.answer_characters) + [tokenizer.eos_token_id])
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / recipe.warmup_steps) * 0.5 * (1.0 + math.cos(math.pi * step / recipe.max_steps))
        ),
    )
    for step in range(1, recipe.max_steps + 1):
        model.train()
        drawn = draw_warmup_problems(task, recipe, rng, recipe.batch_size)
        problems = [p for p in drawn if p.prompt not in excluded_prompts]
        if isinstance(recipe, CalcRecipe):  # one rng.random() per problem after the draw: the sequence's form
            sequences = draw_calc_sequences(problems, recipe.tool_fraction, rng, tokenizer.eos_token)
            input_ids, labels = encode_segments(tokenizer, sequences)
        else:
            input_ids, labels = _encode_batch(tokenizer, problems)
        logits = model(input_ids=input_ids).logits[:, :-1]  # [B, T-1, V]: position t predicts token t+1
        loss = _smoothed_answer_loss(logits, labels[:, 1:], recipe.label_smoothing, answer_ids)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % recipe.eval_every == 0 and _reached_target(model, tokenizer, recipe, val_problems):
            break
    model.eval()
    return step


def _reached_target(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, recipe: WarmupRecipe, val_problems: Sequence[Problem]
) -> bool:
    """Greedy accuracy >= `target_greedy_accuracy`; for a `CalcRecipe`, the teacher-forced probability of the right
    tool episode after `[` >= `target_call_accuracy` (one forward pass, no sampling)."""
    if isinstance(recipe, CalcRecipe):
        return call_probabilities(model, tokenizer, val_problems)[1] >= recipe.target_call_accuracy
    greedy = evaluate_accuracy(model, tokenizer, val_problems, 0.0, recipe.max_new_tokens)
    return greedy >= recipe.target_greedy_accuracy


@torch.no_grad()
def _calibrate_output_scale(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    recipe: WarmupRecipe,
    val_problems: Sequence[Problem],
    seed: int,
) -> float:
    """Multiplies the output layer by the scale whose T=1 validation accuracy is nearest the target; returns it.

    Scaling logits by c is sampling at temperature 1/c, baked into the weights: argmax (greedy) is unchanged.
    Bisection assumes accuracy grows with c, which holds for a model that is mostly right greedily.
    """
    weight = model.lm_head.weight.detach().clone()
    low, high = 0.0, recipe.max_output_scale
    for _ in range(recipe.calibration_iterations):
        scale = (low + high) / 2
        model.lm_head.weight.copy_(weight * scale)
        sampled = evaluate_accuracy(model, tokenizer, val_problems, 1.0, recipe.max_new_tokens, seed=seed)
        low, high = (scale, high) if sampled < recipe.target_sampled_accuracy else (low, scale)
    scale = (low + high) / 2
    model.lm_head.weight.copy_(weight * scale)
    return scale


@torch.no_grad()
def _fold_output_gain(model: Qwen2ForCausalLM, gain: float) -> None:
    """Multiplies the final RMSNorm weight by `gain` and divides the output layer by it: same logits.

    logits = W (g * rmsnorm(h)) = (W / k)(k g * rmsnorm(h)). The small output layer (as muP's output
    multiplier, Yang et al. 2021) makes Adam's roughly lr-sized steps k times larger relative to it, so RL can
    sharpen the flat T=1 distribution without moving the rest of the network much. Unfolded, RL learns far slower
    and larger learning rates overshoot (docs/benchmarks.md, why the demo model looks the way it does).
    """
    model.model.norm.weight.mul_(gain)
    model.lm_head.weight.div_(gain)


def build_demo_model(
    out_dir: str | os.PathLike[str], seed: int = 0, recipe: WarmupRecipe | None = None, task: str = "arithmetic"
) -> dict[str, object]:
    """Builds, warms up, calibrates, evaluates and atomically saves the demo model of `task`; returns the report.

    `recipe` None: the task's own (`WarmupRecipe()` for arithmetic and a dataset, `CHAIN_RECIPE` for chain_sum,
    `CALC_RECIPE` for calc). The report (also saved as `relay_demo_report.json` in the directory) gives params,
    steps, seconds and the greedy and T=1 sampled accuracy on held-out problems: for one-turn tasks of whole answers
    and single steps (`step_accuracy`), for calc of episodes with the tool (`_calc_report`).
    Deterministic for a seed, recipe and task on one machine.
    """
    task = demo_task(task)
    recipe = _RECIPES[task] if recipe is None else recipe
    if (task == "calc") != isinstance(recipe, CalcRecipe):
        raise ValueError(f"task {task!r} with a {type(recipe).__name__}: calc takes a CalcRecipe, the others do not")
    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    # One thread: the weights then do not depend on the core count, and a 2-core machine that is busy elsewhere
    # slows the build far less (two threads spin-wait for a descheduled peer at every op).
    torch.set_num_threads(BUILD_THREADS)
    try:
        tokenizer = build_char_tokenizer(characters=recipe.characters if task == "calc" else CHARACTERS)
        config = tiny_qwen2_config(
            vocab_size=len(tokenizer),
            hidden_size=recipe.hidden_size,
            num_layers=recipe.num_layers,
            num_heads=recipe.num_heads,
            num_kv_heads=recipe.num_kv_heads,
            intermediate_size=recipe.intermediate_size,
        )
        val_problems = draw_warmup_problems(task, recipe, random.Random(recipe.val_seed), recipe.num_val_problems)
        held_out = draw_warmup_problems(task, recipe, random.Random(recipe.eval_seed), recipe.num_eval_problems)
        excluded = {p.prompt for p in val_problems} | {p.prompt for p in held_out}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen2ForCausalLM(config)
            steps = _train_warmup(model, tokenizer, recipe, val_problems, excluded, seed, task)
        report: dict[str, object] = {
            "name": MODEL_NAMES[task],
            "task": task,
            "seed": seed,
            "params": sum(p.numel() for p in model.parameters()),
            "steps": steps,
            "num_eval_problems": len(held_out),
        }
        if isinstance(recipe, CalcRecipe):
            _fold_output_gain(model, recipe.output_gain)
            report |= _calc_report(model, tokenizer, recipe, held_out, seed)
        else:
            report |= _one_turn_report(model, tokenizer, recipe, val_problems, held_out, seed)
        report["recipe"] = asdict(recipe)
        report["seconds"] = round(time.perf_counter() - started, 2)
        save_model_dir(model, tokenizer, out_dir, extra_files={REPORT_FILE: json.dumps(report, indent=2) + "\n"})
        return report
    finally:
        torch.set_num_threads(previous_threads)


def _one_turn_report(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, recipe: WarmupRecipe,
                     val_problems: Sequence[Problem], held_out: Sequence[Problem], seed: int) -> dict[str, object]:
    """A one-turn model's output scale, calibrated on `val_problems` (its gain then folded in), and its greedy and T=1
    accuracy on `held_out`: whole answers and single steps."""
    report: dict[str, object] = {"output_scale": _calibrate_output_scale(model, tokenizer, recipe, val_problems, seed)}
    _fold_output_gain(model, recipe.output_gain)
    greedy = generate_completions(model, tokenizer, held_out, 0.0, recipe.max_new_tokens)
    sampled = generate_completions(model, tokenizer, held_out, 1.0, recipe.max_new_tokens, seed=seed + 1)
    report["greedy_accuracy"] = exact_match_rate(held_out, greedy)
    report["sampled_accuracy"] = exact_match_rate(held_out, sampled)
    report["greedy_step_accuracy"] = step_accuracy(held_out, greedy)
    report["sampled_step_accuracy"] = step_accuracy(held_out, sampled)
    return report


def _calc_report(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, recipe: CalcRecipe, held_out: Sequence[Problem],
    seed: int,
) -> dict[str, float]:
    """Greedy and T=1 sampled episodes with the tool on `held_out` (`run_calc_episodes`): `greedy_accuracy`,
    `sampled_accuracy`, and each `summarize_episodes` metric prefixed `greedy_` or `sampled_`."""
    report = {}
    for prefix, temperature, episodes_seed in (("greedy", 0.0, 0), ("sampled", 1.0, seed + 1)):
        episodes = run_calc_episodes(model, tokenizer, held_out, temperature, recipe.max_new_tokens, recipe.max_turns,
                                     recipe.max_calls, seed=episodes_seed)
        metrics = summarize_episodes(episodes)
        report[f"{prefix}_accuracy"] = metrics.pop("accuracy")
        report |= {f"{prefix}_{name}": value for name, value in metrics.items()}
    return report


def demo_recipe(task: str = "arithmetic") -> WarmupRecipe:
    """The warm-up recipe `task`'s demo model is built with (`WarmupRecipe()`, `CHAIN_RECIPE` or `CALC_RECIPE`)."""
    return _RECIPES[demo_task(task)]

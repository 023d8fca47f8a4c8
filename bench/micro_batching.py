"""How a step's sequences are cut into forward/backward passes, timed on one model: rows in batch order (the old
fixed row count), rows sorted by length under a token budget (relay's `MicroBatching`), packed rows (several
sequences in one row, attention kept within each by position ids, transformers' packed-sequence mask), relay's
packed passes (`learner.pack_sequences`: a pass's rows as one sequence of their real tokens, attention gathered per
row, `learner.passes.packing`), and shared prompts (relay's `SharedPrompts`: each group's prompt run once, each row's
pass its own tokens on the prompt's cached states, the passes cut by those tokens), padded or packed; and a PPO value
model's passes (`--ways critic`: the same backbone with a one-label token-classification head, `learner.critic`'s
`value_pass`), sorted under a padded-token budget against packed under a real-token one.

Usage: python bench/micro_batching.py [--size 25M|demo] [--repeats 3] [--budgets 1024 2048 4096] [--prompt-extra N]
                                      [--ways order sorted packed relay-packed shared shared-packed critic]
The sequences mimic the 25M benchmark of bench/vs_trl.py: 256 = 32 prompts x 8, prompts of 4 to 6 tokens (plus
`--prompt-extra`), responses of ~16 tokens on average (geometric, at most 64). Each way is timed without gradients
(the reference's and the old-logprobs passes) and with the backward pass (the training forward); the table gives the
median of `--repeats` runs and the padded tokens each way computes. Packed rows are checked against one sequence
alone first, shared prompts' logprobs against whole rows, and the value model's packed values against its padded
pass: a way that computes something else stops the script.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.demo.model import tiny_qwen2_config  # noqa: E402
from learner.passes.micro_batches import MicroBatching  # noqa: E402
from learner.passes.sequences import (  # noqa: E402
    SharedPrompts,
    pad_sequences,
    sequence_logprobs,
    tail_lengths,
)

SHAPES = {  # the model shapes of bench/weight_sync.py and the demo's
    "25M": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1536},
    "demo": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 256},
}
VOCAB = 17  # the character tokenizer's


def make_sequences(count: int, seed: int = 0, prompt_extra: int = 0) -> tuple[list[torch.Tensor], list[int]]:
    """`count` prompt + response token rows: groups of 8 sharing a prompt of 4-6 tokens (+ `prompt_extra`),
    responses geometric with mean ~16, at most 64 tokens; and each row's prompt length."""
    generator = torch.Generator().manual_seed(seed)
    rows, prompt_lengths = [], []
    for _ in range(count // 8):
        size = int(torch.randint(4, 7, (1,), generator=generator)) + prompt_extra
        prompt = torch.randint(2, VOCAB, (size,), generator=generator)
        for _ in range(8):
            length = min(64, 1 + int(torch.empty(1).geometric_(1 / 16, generator=generator)))
            rows.append(torch.cat([prompt, torch.randint(2, VOCAB, (length,), generator=generator)]))
            prompt_lengths.append(size)
    return rows, prompt_lengths


def padded_pass(model: torch.nn.Module, rows: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Logits of right-padded rows; returns them and the padded tokens computed."""
    length = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids.numel()


def packed_pass(model: torch.nn.Module, rows: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Logits of rows packed into one: positions restart at 0 for each sequence and no attention mask, from which
    transformers builds a block-diagonal causal mask."""
    ids = torch.cat(rows)[None]
    positions = torch.cat([torch.arange(len(row)) for row in rows])[None]
    return model(input_ids=ids, position_ids=positions, use_cache=False).logits, ids.numel()


def check_packing(model: torch.nn.Module, rows: list[torch.Tensor]) -> None:
    """The second sequence of a packed row must get the logits it gets alone."""
    with torch.no_grad():
        packed, _ = packed_pass(model, rows[:3])
        alone = model(input_ids=rows[1][None], use_cache=False).logits
    start = len(rows[0])
    gap = float((packed[0, start : start + len(rows[1])] - alone[0]).abs().max())
    if gap > 1e-4:
        raise SystemExit(f"packed sequences see each other (logit gap {gap:.3g}): the packed timing would be wrong")


def cut_packed(rows: list[torch.Tensor], budget: int) -> list[list[int]]:
    """Consecutive rows into packs of at most `budget` tokens (a longer row alone)."""
    packs, current, tokens = [], [], 0
    for i, row in enumerate(rows):
        if current and tokens + len(row) > budget:
            packs.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += len(row)
    return packs + ([current] if current else [])


def time_way(model: torch.nn.Module, rows: list[torch.Tensor], passes: list[list[int]], packed: bool,
             grad: bool) -> tuple[float, int]:
    """Seconds for every pass (forward, and backward of a scalar of the float32 log-softmax when `grad`), and the
    tokens computed."""
    run = packed_pass if packed else padded_pass
    start, computed = time.perf_counter(), 0
    for part in passes:
        with torch.set_grad_enabled(grad):
            logits, tokens = run(model, [rows[i] for i in part])
            if grad:
                logits.float().log_softmax(-1).mean().backward()
        computed += tokens
    return time.perf_counter() - start, computed


def time_relay(model: torch.nn.Module, batch, batching: MicroBatching, grad: bool,
               value_model: bool = False) -> tuple[float, int, int]:
    """Seconds for relay's passes under `batching` (shared prompts: the prompts' passes, then the rows' passes; with
    `grad`, each pass's backward and the prompts' own), the tokens computed and the passes (prompt passes
    included). `value_model`: `model` is one, its passes `learner.critic.value_pass`'s."""
    from learner.critic import value_pass

    ran = []
    hook = model.register_forward_hook(lambda m, args, kwargs, out: ran.append(kwargs["input_ids"].numel()),
                                       with_kwargs=True)
    start = time.perf_counter()
    try:
        with torch.set_grad_enabled(grad):
            prompts = SharedPrompts(model, batch, grad, batching) if batching.share_prompts else None
            for rows in batching.split(tail_lengths(batch) if prompts is not None else batch.lengths):
                part = batch.select(rows)
                scores = (value_pass(model, part, batching.pack) if value_model
                          else sequence_logprobs(model, part, prompts=prompts, pack=batching.pack))
                if grad:
                    (scores * part.response_mask).sum().backward()
            if grad and prompts is not None:
                prompts.backward()
    finally:
        hook.remove()
    return time.perf_counter() - start, sum(ran), len(ran)


def check_shared(model: torch.nn.Module, batch) -> None:
    """Shared prompts and packed passes (each, and both) must give every response token the logprob of its whole
    padded row."""
    response = batch.response_mask.bool()
    with torch.no_grad():
        whole = sequence_logprobs(model, batch)
        for share, pack in ((True, False), (False, True), (True, True)):
            prompts = SharedPrompts(model, batch, batching=MicroBatching(pack=pack)) if share else None
            ours = sequence_logprobs(model, batch, prompts=prompts, pack=pack)
            gap = float((whole[response] - ours[response]).abs().max())
            if gap > 1e-4:
                raise SystemExit(f"shared prompts {share}, packed {pack} change the logprobs (gap {gap:.3g}): the "
                                 "timing would be wrong")


def check_critic(model: torch.nn.Module, batch) -> None:
    """The value model's packed pass must give every real token's state the value of its whole padded row."""
    from learner.critic import value_pass

    real = batch.attention_mask[:, :-1].bool()
    with torch.no_grad():
        whole, packed = value_pass(model, batch), value_pass(model, batch, pack=True)
    gap = float((whole[real] - packed[real]).abs().max()) / max(float(whole[real].abs().max()), 1e-6)
    if gap > 1e-4 or not torch.all(packed[~real] == 0):
        raise SystemExit(f"the value model's packed pass changes its values (relative gap {gap:.3g}): the timing would "
                         "be wrong")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SHAPES), default="25M")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-extra", type=int, default=0, help="tokens added to every prompt")
    choices = ["order", "sorted", "packed", "relay-packed", "shared", "shared-packed", "critic"]
    parser.add_argument("--ways", nargs="+", choices=choices, default=choices, help="which ways to time")
    args = parser.parse_args()

    from transformers import Qwen2ForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = tiny_qwen2_config(VOCAB, max_position_embeddings=128, **SHAPES[args.size])
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config).eval()
    rows, prompt_lengths = make_sequences(256, prompt_extra=args.prompt_extra)
    batch = pad_sequences([row[:n].tolist() for row, n in zip(rows, prompt_lengths)],
                          [row[n:].tolist() for row, n in zip(rows, prompt_lengths)])
    check_packing(model, rows)
    check_shared(model, batch)
    lengths = torch.tensor([len(row) for row in rows])
    ways: dict[str, tuple[list[list[int]], bool]] = {}
    if "order" in args.ways:
        ways["batch order, 64 rows per pass"] = (
            [list(range(i, min(i + 64, len(rows)))) for i in range(0, len(rows), 64)], False)
    for budget in args.budgets if "sorted" in args.ways else []:
        ways[f"sorted, {budget} padded tokens per pass"] = (
            [part.tolist() for part in MicroBatching(max_tokens=budget).split(lengths)], False)
    for budget in args.budgets if "packed" in args.ways else []:
        ways[f"packed, {budget} tokens per row"] = (cut_packed(rows, budget), True)

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch "
          f"{torch.__version__}, {args.threads} threads; model {args.size} "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M), {len(rows)} sequences, "
          f"{int(lengths.sum())} real tokens")
    print("| way | passes | tokens computed | forward s | forward + backward s |")
    print("|---|---|---|---|---|")
    for name, (passes, packed) in ways.items():
        time_way(model, rows, passes[:1], packed, grad=True)  # warm-up: allocator, kernels
        forward = [time_way(model, rows, passes, packed, grad=False) for _ in range(args.repeats)]
        backward = [time_way(model, rows, passes, packed, grad=True) for _ in range(args.repeats)]
        model.zero_grad(set_to_none=True)
        print(f"| {name} | {len(passes)} | {forward[0][1]} | {statistics.median(t for t, _ in forward):.2f} | "
              f"{statistics.median(t for t, _ in backward):.2f} |", flush=True)
    relay_ways = {"relay-packed": ("packed passes (relay), {} real tokens per pass", False, True),
                  "shared": ("shared prompts, sorted, {} padded tokens per pass", True, False),
                  "shared-packed": ("shared prompts, packed passes, {} real tokens per pass", True, True)}
    for way, (label, share, pack) in relay_ways.items():
        for budget in args.budgets if way in args.ways else []:
            batching = MicroBatching(max_tokens=budget, share_prompts=share, pack=pack)
            time_relay(model, batch, batching, grad=True)  # warm-up
            forward = [time_relay(model, batch, batching, grad=False) for _ in range(args.repeats)]
            backward = [time_relay(model, batch, batching, grad=True) for _ in range(args.repeats)]
            model.zero_grad(set_to_none=True)
            print(f"| {label.format(budget)} | {forward[0][2]} | {forward[0][1]} | "
                  f"{statistics.median(t for t, *_ in forward):.2f} | "
                  f"{statistics.median(t for t, *_ in backward):.2f} |", flush=True)
    if "critic" in args.ways:
        from transformers import Qwen2ForTokenClassification

        from learner.passes.packing import packable

        torch.manual_seed(0)
        critic_config = tiny_qwen2_config(VOCAB, max_position_embeddings=128, **SHAPES[args.size])
        critic_config.num_labels = 1
        critic = Qwen2ForTokenClassification(critic_config).eval()
        critic.set_attn_implementation("sdpa")
        assert packable(critic)
        check_critic(critic, batch)
        for budget in args.budgets:
            for pack in (False, True):
                batching = MicroBatching(max_tokens=budget, pack=pack)
                time_relay(critic, batch, batching, grad=True, value_model=True)  # warm-up
                forward = [time_relay(critic, batch, batching, False, True) for _ in range(args.repeats)]
                backward = [time_relay(critic, batch, batching, True, True) for _ in range(args.repeats)]
                critic.zero_grad(set_to_none=True)
                label = (f"value model, packed passes, {budget} real tokens per pass" if pack
                         else f"value model, sorted, {budget} padded tokens per pass")
                print(f"| {label} | {forward[0][2]} | {forward[0][1]} | "
                      f"{statistics.median(t for t, *_ in forward):.2f} | "
                      f"{statistics.median(t for t, *_ in backward):.2f} |", flush=True)


if __name__ == "__main__":
    main()

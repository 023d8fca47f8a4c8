"""The sync probe's noise floor in bfloat16, on a random model whose logits have a trained LM's scale: the probe's
gap and tolerance before issue 43 (the largest token gap of one seeded draw, 5x it, at least 2^-5) against now
(`sync.verify`: the root mean square of the token gaps, 3x the largest of 8 draws, at least 2^-3 in bfloat16).

Usage: python bench/probe_noise.py [--logit-stds 3 10] [--dtypes bfloat16 float32] [--lrs 1e-6 1e-5 1e-4]
       [--draws 20] [--probe-tokens N] [--float32-scales 10]
For each logit scale, a random Qwen2 (4 layers, hidden 256, 4 heads of 64, 2 KV heads, MLP 1024, a vocabulary of the
demo's characters and 3,844 two-letter tokens) whose output layer is scaled until its logits' standard deviation over
the vocabulary is the scale: 3 leaves them flat (sampled tokens unlikely), 10 makes them peaked as a trained LM's
(the top logit far above the mean, sampled tokens about a nat). A real vLLM engine in this process and a learner
(`model.dtype`; bfloat16 on float32 master weights) score `--draws` seeded probes of the default prompt
(`sync.probe_tokens` tokens) on the weights both start from (the noise); then per learning rate the learner takes one
GRPO step (random 0/1 rewards, `warmup_steps=0`) and the same seeds are probed on the engine that did not load it
(stale: what a skipped load shows) and after the load (fresh: what a later correct load shows).

Any draw can be a run's first probe (a run's probe is seeded, but which tokens it samples depends on the model and
the machine), so the old rule is evaluated with each draw as the floor, the new one with each window of 8 consecutive
draws (cyclically), and every count is over those choices. First table: the gap of one draw on the initial weights,
median [min, max]; the first probes that stop the run (a floor above 0.25: "not numerics"); the tolerance; the fresh
probes after the step that exceed it (a correct load refused: the run stops). Second table, per learning rate: the
stale gap and the stale engines the gap catches, by each rule; the stale engines the repeat rule catches
(`stale_probe`: the engine repeats its probe bit for bit while the learner's logprobs of those tokens moved beyond
the noise floor, old or new), and its false alarms on the engines that did load the step.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
# The rule before issue 43: the largest token gap of the first probe's one draw, 5x it, at least 2^-5 in bfloat16.
OLD_FACTOR, OLD_MIN = 5.0, {"float32": 1e-4, "bfloat16": 2.0**-5}


class Draw(NamedTuple):
    """One seeded probe: its tokens, the engine's logprobs of them, the learner's."""

    ids: tuple[int, ...]
    engine: tuple[float, ...]
    learner: tuple[float, ...]


def build_model(out_dir: Path, logit_std: float, seed: int = 0) -> dict[str, float]:
    """A random Qwen2 with the demo's characters and two-letter tokens, its output layer scaled so that its logits'
    standard deviation over the vocabulary is `logit_std` on the probe prompt; returns the logits' shape."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    from cluster.demo.model import save_model_dir, tiny_qwen2_config
    from cluster.demo.tokenizer import CHARACTERS, EOS_TOKEN, PAD_TOKEN
    from sync.config import SyncConfig

    # Two-letter tokens are never produced by encoding (no merges) but are sampled and decoded like any other.
    vocab = {PAD_TOKEN: 0, EOS_TOKEN: 1} | {("Ġ" if c == " " else c): 2 + i for i, c in enumerate(CHARACTERS)}
    for pair in (a + b for a in ALNUM for b in ALNUM):
        vocab.setdefault(pair, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(PAD_TOKEN, special=True), AddedToken(EOS_TOKEN, special=True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                        unk_token=None, clean_up_tokenization_spaces=False, model_max_length=256)
    config = tiny_qwen2_config(len(vocab), hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                               intermediate_size=1024, max_position_embeddings=256)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        ids = torch.tensor([tokenizer.encode(SyncConfig().probe_prompt)])
        model.lm_head.weight.mul_(logit_std / model(ids).logits[0].std(dim=-1).mean())
        logits = model(ids).logits[0]
    save_model_dir(model, tokenizer, out_dir)
    return {"std": logits.std(dim=-1).mean().item(),
            "top": (logits.max(dim=-1).values - logits.mean(dim=-1)).mean().item()}


def measure(model_path: str, dtype: str, lrs: list[float], seeds: list[int], probe_tokens: int) -> dict:
    """Per-token (engine, learner) logprobs of each seed's probe: on the initial weights, and per learning rate after
    one step, from the engine that did not load it and from the engine that did."""
    from actors.engine import EngineSettings
    from actors.rollout import RolloutWorker, SamplingSettings
    from learner.batch import TrainBatch
    from learner.config import LearnerConfig
    from learner.learner import Learner
    from sync.config import SyncConfig

    sync = SyncConfig()
    sampling = SamplingSettings(group_size=4, max_new_tokens=16)
    prompts = [f"{a}+{b}=" for a, b in [(37, 45), (1, 2), (60, 39), (8, 8), (12, 71), (99, 1), (5, 40), (23, 23)]]
    bucket_bytes = int(sync.bucket_mb * 2**20)
    worker = RolloutWorker(EngineSettings(model_path=model_path, dtype=dtype, max_model_len=128))

    def draws(learner) -> list[Draw]:
        out = []
        for seed in seeds:
            prompt_ids, response_ids, engine, *_ = worker.probe(sync.probe_prompt, probe_tokens, 1.0, seed)
            [learner_lps] = learner.compute_logprobs([prompt_ids], [response_ids])
            out.append(Draw(tuple(response_ids), tuple(engine), tuple(learner_lps)))
        return out

    result: dict = {"steps": {}}
    try:
        for lr in lrs:
            learner = Learner(model_path, LearnerConfig(lr=lr, warmup_steps=0, kl_coef=0.0, num_threads=2),
                              dtype=dtype)
            worker.load_weights(0, *learner.export_weights(bucket_bytes))  # every lr starts from the same weights
            if "initial" not in result:
                result["initial"] = draws(learner)
            groups = worker.generate(prompts, list(range(100, 100 + len(prompts))), sampling)
            flat = [r for group in groups for r in group]
            rng = random.Random(0)  # the same rewards for every lr
            learner.train_step(TrainBatch([r.prompt_ids for r in flat], [r.response_ids for r in flat],
                                          [r.behavior_logprobs for r in flat], [rng.choice([0.0, 1.0]) for _ in flat],
                                          sampling.group_size))
            stale = draws(learner)
            worker.load_weights(1, *learner.export_weights(bucket_bytes))
            result["steps"][lr] = {"stale": stale, "fresh": draws(learner)}
    finally:
        worker.shutdown()
    return result


def old_gap(engine: tuple[float, ...], learner: tuple[float, ...]) -> float:
    """The probe's gap before issue 43: the largest |engine - learner| logprob of its tokens."""
    return max((abs(e - le) for e, le in zip(engine, learner)), default=0.0)


def repeat_rule(before: Draw, after: Draw, floor: float) -> bool:
    """Whether the repeat rule (`stale_probe`) flags an engine whose probe was `before` on the initial weights and is
    `after` once the learner took its step."""
    from sync.verify import ProbeRecord, stale_probe

    earlier = ProbeRecord(0, "initial", *before)
    return stale_probe(earlier, ProbeRecord(1, "stepped", *after), floor) is not None


def rules(initial: list, dtype: str) -> dict[str, list[tuple[float | None, float]]]:
    """Per rule, per possible first probe: (tolerance, or None if the run stops at start; the repeat rule's floor)."""
    from sync.verify import PROBE_NOISE_CEILING, PROBE_NOISE_SEEDS, SyncError, probe_noise, probe_tolerance_from

    old, new, k = [], [], len(PROBE_NOISE_SEEDS)
    for first in range(len(initial)):
        floor = old_gap(initial[first].engine, initial[first].learner)
        old.append((max(OLD_MIN[dtype], OLD_FACTOR * floor) if floor <= PROBE_NOISE_CEILING else None, floor))
        noise = probe_noise([initial[(first + i) % len(initial)][1:] for i in range(k)])
        try:
            new.append((probe_tolerance_from(noise, ["the engine"], dtype), noise))
        except SyncError:
            new.append((None, noise))
    return {"old: largest token gap, 1 draw, 5x": old, "new: root mean square, 8 draws, 3x": new}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2g} [{min(values):.2g}, {max(values):.2g}]" if values else "-"


def tables_for(scale: str, dtype: str, data: dict) -> tuple[list[str], list[str]]:
    """(rows of the noise table, rows of the stale table) of one model and dtype, old rule and new."""
    from sync.verify import probe_gap

    noise_rows, stale_rows, initial = [], [], data["initial"]
    gaps = {"old": old_gap, "new": probe_gap}
    per_lr: dict[float, dict[str, list[str]]] = {lr: {} for lr in data["steps"]}
    for (name, per_first), short in zip(rules(initial, dtype).items(), gaps):
        gap = gaps[short]
        running = [(t, floor) for t, floor in per_first if t is not None]
        fresh = [gap(d.engine, d.learner) for step in data["steps"].values() for d in step["fresh"]]
        refused = sum(g > t for t, _ in running for g in fresh)
        noise_rows.append(f"| {scale} | {dtype} | {name} | {spread([gap(d.engine, d.learner) for d in initial])} | "
                          f"{len(per_first) - len(running)}/{len(per_first)} | {spread([t for t, _ in running])} | "
                          f"{refused}/{len(running) * len(fresh)} |")
        for lr, step in data["steps"].items():
            if any(d.engine != before.engine for d, before in zip(step["stale"], initial)):
                raise RuntimeError("an engine that did not load gave another probe than before: bench premise broken")
            stale = [gap(d.engine, d.learner) for d in step["stale"]]
            pairs = f"/{len(running) * len(stale)}"

            def flagged(after: list[Draw]) -> str:
                return f"{sum(repeat_rule(a, b, floor) for _, floor in running for a, b in zip(initial, after))}{pairs}"

            caught = sum(g > t for t, _ in running for g in stale)
            per_lr[lr][short] = [spread(stale), f"{caught}{pairs}", flagged(step["stale"]), flagged(step["fresh"])]
    for lr, cells in per_lr.items():
        (old_stale, old_caught, old_repeat, old_alarms), (new_stale, new_caught, new_repeat, new_alarms) = (
            cells["old"], cells["new"])
        stale_rows.append(f"| {scale} | {dtype} | {lr:g} | {old_stale} | {old_caught} | {new_stale} | {new_caught} | "
                          f"{old_repeat} | {new_repeat} | {old_alarms}, {new_alarms} |")
    return noise_rows, stale_rows


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logit-stds", nargs="+", type=float, default=[3.0, 10.0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-6, 1e-5, 1e-4])
    parser.add_argument("--draws", type=int, default=20, help="seeded probes per measurement")
    parser.add_argument("--probe-tokens", type=int, default=None, help="default: sync.probe_tokens")
    parser.add_argument("--float32-scales", nargs="+", type=float, default=[10.0],
                        help="logit scales measured in float32 too (float32 is far from its tolerance at any)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout, where the table goes
    import torch

    from sync.config import SyncConfig

    probe_tokens = args.probe_tokens or SyncConfig().probe_tokens
    started = time.time()
    noise_rows, stale_rows = [], []
    with tempfile.TemporaryDirectory(prefix="probe_noise_") as tmp:
        for logit_std in args.logit_stds:
            path = Path(tmp) / f"std{logit_std:g}"
            shape = build_model(path, logit_std)
            for dtype in args.dtypes:
                if dtype == "float32" and logit_std not in args.float32_scales:
                    continue
                data = measure(str(path), dtype, args.lrs, list(range(args.draws)), probe_tokens)
                nll = statistics.fmean(-lp for draw in data["initial"] for lp in draw.learner)
                scale = f"{shape['std']:.0f}, +{shape['top']:.0f}, {nll:.1f}"
                noise, stale = tables_for(scale, dtype, data)
                noise_rows += noise
                stale_rows += stale
                print(f"  logit std {logit_std:g} {dtype}: {time.time() - started:.0f} s", file=sys.stderr)

    print(f"\n{platform.node()}: {os.cpu_count()} CPUs, {cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{time.strftime('%Y-%m-%d')}; {args.draws} draws of up to {probe_tokens} tokens per measurement, "
          f"{time.time() - started:.0f} s\n")
    logits = "logits: std, top above mean, sampled tokens' nats"
    print(f"| {logits} | dtype | gap, floor, tolerance | gap of one draw, initial weights | first probes that stop the "
          "run | tolerance | fresh probes over the tolerance |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(noise_rows))
    print(f"\n| {logits} | dtype | lr | stale gap, old | caught, old | stale gap, new | caught, new | repeat rule, "
          "old floor | repeat rule, new floor | repeat rule's false alarms on fresh engines, old, new |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(stale_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""LoRA against full fine-tuning: `configs/grpo_lora.yaml` and `configs/grpo.yaml`, one after the other, through the
real loop (real Ray, real vLLM engines).

Usage: python bench/lora.py [--shapes demo 25M] [--steps N] [--steps-25m N] [dotted.key=value ...]
- `demo` (`--steps`, default 150): the built-in demo task and model. Reports the steps until the 10-step mean reward
  first reaches 0.9 ("-" if never).
- `25M` (`--steps-25m`, default 6): bench/vs_trl.py's random-init Qwen2 of relay's 25M shape (hidden 512, 8 layers),
  64 new tokens. A random model learns nothing in a few steps: only time, bytes and memory are compared.
Per run: trained parameters, median s/step and train s (step 1 excluded: one-off kernel builds), the bytes each sync
moves to every engine (`sync/bytes`) and the sync's seconds (`time/sync`: exporting and, on-policy, the engines'
loads inside the next request show in `time/generate`), the learner process's peak RSS and its growth over the process
before any model (`memory/learner_peak_mb` - `memory/learner_base_mb`: the model, gradients, AdamW state,
activations), whether a reference worker ran (LoRA's reference is the learner's base), and the steps to 0.9.
Overrides after the options go to every run.

Also printed, for the demo: the most probability any hidden state can give each answer token (digits, `<eos>`) through
the demo model's frozen final norm and output layer, which adapters on the decoder blocks cannot change (the bound of
adapters alone: the preset also trains those two layers, `learner.lora.modules_to_save`):
max over unit u of softmax(W_out (g * sqrt(d) u))_c, found by gradient ascent on u (the norm's output has RMS 1, so
its length is sqrt(d); `output_ceiling`). An answer's probability at temperature 1 is at most the product of its
tokens' ceilings.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import steps_to_target  # noqa: E402

PRESETS = {"full": "grpo", "lora": "grpo_lora"}
TARGET, WINDOW = 0.9, 10


def run(shape: str, kind: str, steps: int, overrides: list[str], tmp: str) -> dict:
    from bench.vs_trl import relay_overrides
    from cluster.config import load_config
    from cluster.run.launch import run_training

    model_path, shape_overrides = relay_overrides(shape, steps, overrides)
    run_dir = Path(tmp) / f"{shape}-{kind}"
    config = load_config(ROOT / "configs" / f"{PRESETS[kind]}.yaml",
                         [*shape_overrides, f"model.path={model_path}", f"run_dir={run_dir}"])
    started = time.perf_counter()
    records = run_training(config, run_dir, str(model_path), display=False)
    wall = time.perf_counter() - started
    timed = records[1:] if len(records) > 1 else records
    hit = steps_to_target([r["reward/mean"] for r in records], TARGET, WINDOW) if shape == "demo" else None
    return {
        "shape": shape, "kind": kind, "wall": wall, "reference": config.uses_reference,
        "trained": trained_parameters(model_path, config),
        "step": statistics.median(r["time/step"] for r in timed),
        "train": statistics.median(r["time/train"] for r in timed),
        "sync": statistics.median(r["time/sync"] for r in timed),
        "bytes": records[-1]["sync/bytes"],
        "peak_mb": max(r["memory/learner_peak_mb"] for r in records),
        "base_mb": records[0]["memory/learner_base_mb"],
        "hit": hit, "last10": statistics.fmean(r["reward/mean"] for r in records[-WINDOW:]),
    }


def trained_parameters(model_path: Path, config) -> int:
    """The policy's trained parameters under `config.learner` (the adapters with LoRA), counted on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from learner.lora import add_adapters

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        if config.learner.lora.enabled:
            model = add_adapters(model, config.learner.lora)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def output_ceiling(model_path: Path, tokens: str = "0123456789") -> dict[str, float]:
    """For each of `tokens` and `<eos>`: the largest probability the model's final RMSNorm (weight g) and output
    layer W can give it, over every hidden state (`__doc__`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    head = (model.lm_head.weight * model.model.norm.weight).detach()  # W diag(g): [V, d]
    d = head.shape[1]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tokens} | {"<eos>": model.config.eos_token_id}
    ceiling = {}
    for name, token in ids.items():
        best = 0.0
        for seed in range(3):  # a few starts: the objective is not concave in u
            u = torch.randn(d, generator=torch.Generator().manual_seed(seed)).requires_grad_()
            optimizer = torch.optim.Adam([u], lr=0.05)
            for _ in range(400):
                logprob = torch.log_softmax(head @ (u / u.norm() * d ** 0.5), 0)[token]
                optimizer.zero_grad()
                (-logprob).backward()
                optimizer.step()
            best = max(best, float(logprob.detach().exp()))
        ceiling[name] = best
    return ceiling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["demo", "25M"], choices=["demo", "25M"])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--steps-25m", type=int, default=6)
    parser.add_argument("overrides", nargs="*", help="dotted.key=value applied to every run")
    args = parser.parse_args()

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            for kind in PRESETS:
                results.append(run(shape, kind, args.steps if shape == "demo" else args.steps_25m, args.overrides,
                                   tmp))
    if "demo" in args.shapes:
        from cluster.demo.cache import ensure_demo_model

        ceiling = output_ceiling(ensure_demo_model())
        print("demo model, the most probability any hidden state gives each token through the frozen norm and output "
              "layer: " + ", ".join(f"{t} {p:.3f}" for t, p in ceiling.items()))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; commit {commit.strip()}; medians exclude step 1")
    print(f"| shape | run | trained params | reference worker | s/step | train s | sync s | sync bytes | "
          f"learner peak RSS MiB (growth) | steps to {TARGET} | last-10 reward |")
    print("|---" * 11 + "|")
    for r in results:
        print(f"| {r['shape']} | {r['kind']} ({PRESETS[r['kind']]}) | {r['trained']:,} | "
              f"{'yes' if r['reference'] else 'no'} | {r['step']:.3f} | {r['train']:.3f} | {r['sync']:.4f} | "
              f"{r['bytes'] / 1e6:.3f} MB | {r['peak_mb']:.0f} ({r['peak_mb'] - r['base_mb']:+.0f}) | "
              f"{r['hit'] or ('-' if r['shape'] == 'demo' else 'n/a')} | {r['last10']:.3f} |")


if __name__ == "__main__":
    main()

"""tinker-cookbook's `rl_loop` and `sl_loop` recipes, unmodified, trained through `relay serve` with a local model and
local data (docs/tinker.md, "tinker-cookbook").

Usage: python bench/cookbook_recipes.py [--dir DIR] [--steps 4] [--batch 8] [--group 4] [dotted.key=value ...]
Prepares DIR (a temporary directory by default): a tiny chat model at DIR/Qwen/Qwen3-8B-Base and the two datasets at
DIR/openai/gsm8k and DIR/HuggingFaceH4/no_robots (`prepare`). The recipes name their model and data by their hub
names; from DIR as the working directory those names are local directories, which transformers and datasets read
first, so nothing is downloaded and the cookbook picks its renderer for that name (`role_colon`). Then
`relay serve model.path=Qwen/Qwen3-8B-Base` (the overrides go to it) and, against it, each recipe as its README runs it:
`python -m tinker_cookbook.recipes.rl_loop base_url=... model_name=Qwen/Qwen3-8B-Base loss_fn=importance_sampling`,
then `sl_loop`. Prints a table: steps, the first and last step's reward (rl) or mean NLL (sl), seconds per step.

The model: a random-init Qwen2 with one token per byte (any text), warmed up for `WARMUP_STEPS` steps on rl_loop's own
prompts to answer in its format (` \\boxed{N}` then the stop sequence) with a number that is right sometimes: a group's
rewards then differ, and rl_loop trains (a model that never answered in the format would skip every step).
The data: one-digit sums, `What is 3+4?` (gsm8k's columns, the answer after `####`; no_robots' `messages`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.tinker_grpo import served  # noqa: E402

MODEL_NAME = "Qwen/Qwen3-8B-Base"  # a name the cookbook knows (renderer `role_colon`); a local directory here
WARMUP_STEPS = 120
QUESTION_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."  # rl_loop's
RL_PREFIX = [  # rl_loop's one-shot example, so that the warm-up sees the prompts rl_loop samples from
    {"role": "user", "content": "How many r's are in strawberry?" + QUESTION_SUFFIX},
    {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w "
     "6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}"},
]


def sums(seed: int, n: int) -> list[tuple[str, int]]:
    """`n` questions `What is a+b?` with one-digit a, b, and their answers."""
    rng = random.Random(seed)
    pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(n)]
    return [(f"What is {a}+{b}?", a + b) for a, b in pairs]


def write_datasets(root: Path, n: int = 512) -> None:
    """gsm8k's `main` config and no_robots' train split, as parquet files in their hub repositories' layout."""
    import datasets

    gsm8k = root / "openai" / "gsm8k"
    (gsm8k / "main").mkdir(parents=True)
    rows = sums(1, n)
    datasets.Dataset.from_dict({"question": [q for q, _ in rows],
                                "answer": [f"{q[8:-1]}={a}\n#### {a}" for q, a in rows]}
                               ).to_parquet(gsm8k / "main" / "train-00000-of-00001.parquet")
    (gsm8k / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
                                     "    path: main/train-*\n---\n")
    no_robots = root / "HuggingFaceH4" / "no_robots"
    (no_robots / "data").mkdir(parents=True)
    rows = sums(2, n)
    messages = [[{"role": "user", "content": q}, {"role": "assistant", "content": f"{q[8:-1]} = {a}."}]
                for q, a in rows]
    datasets.Dataset.from_dict({"prompt": [q for q, _ in rows], "prompt_id": [str(i) for i in range(n)],
                                "messages": messages, "category": ["Math"] * n}
                               ).to_parquet(no_robots / "data" / "train-00000-of-00001.parquet")


def build_chat_model(out_dir: Path, seed: int = 0, steps: int = WARMUP_STEPS) -> Path:
    """A tiny Qwen2 (one token per byte, 1024 positions) warmed up on rl_loop's prompts, saved to `out_dir`."""
    import torch
    from tinker_cookbook import renderers
    from transformers import Qwen2ForCausalLM

    from cluster.demo.model import save_model_dir, tiny_qwen2_config
    from cluster.demo.tokenizer import build_byte_tokenizer

    tokenizer = build_byte_tokenizer(model_max_length=1024)
    renderer = renderers.get_renderer("role_colon", tokenizer)
    config = tiny_qwen2_config(vocab_size=len(tokenizer), hidden_size=64, num_heads=2, num_kv_heads=1,
                               max_position_embeddings=1024)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        rng = random.Random(seed)
        for _ in range(steps):
            rows = []
            for question, answer in sums(rng.randrange(1 << 30), 16):
                wrong = answer + rng.choice([-1, 1])  # half the answers off by one: right ~half the time at T=1
                convo = [*RL_PREFIX, {"role": "user", "content": question + QUESTION_SUFFIX},
                         {"role": "assistant", "content": f"\\boxed{{{rng.choice([answer, wrong])}}}"}]
                model_input, weights = renderer.build_supervised_example(convo)
                rows.append((model_input.to_ints(), weights))
            width = max(len(ids) for ids, _ in rows)
            ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in rows])
            weights = torch.stack([torch.nn.functional.pad(w, (0, width - len(w))) for _, w in rows])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), dim=-1)
            picked = logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1)
            loss = -(picked * weights[:, 1:]).sum() / weights[:, 1:].sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return save_model_dir(model.eval(), tokenizer, out_dir)


def prepare(root: Path) -> Path:
    """The model and the datasets under `root` (once: an existing model directory is kept)."""
    if not (root / MODEL_NAME).exists():
        write_datasets(root)
        build_chat_model(root / MODEL_NAME)
    return root


def run_recipe(recipe: str, root: Path, base_url: str, key: str, args: list[str], timeout: float = 600
               ) -> list[dict[str, Any]]:
    """`python -m tinker_cookbook.recipes.<recipe> base_url=... model_name=... ARGS` from `root`, offline; the
    recipe's metrics.jsonl records (its log_path is root/<recipe>)."""
    log_path = root / recipe
    env = {**os.environ, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(root / ".hf"), "PYTHONPATH": ""}
    command = [sys.executable, "-m", f"tinker_cookbook.recipes.{recipe}", f"base_url={base_url}",
               f"model_name={MODEL_NAME}", f"log_path={log_path}", *args]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{recipe} exited with {done.returncode}: {done.stderr[-4000:]}")
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def recipes(root: Path, steps: int, batch: int, group: int, overrides: list[str], rl_lr: float = 1e-4,
            key: str = "tml-relay-cookbook") -> dict[str, list[dict[str, Any]]]:
    """Both recipes against one `relay serve` of the model prepared under `root`; their metrics records."""
    log = root / "serve.txt"
    common = [f"max_steps={steps}", f"batch_size={batch}", "lora_rank=8", "save_every=0"]
    with served([f"model.path={MODEL_NAME}", "ray.num_cpus=4", "learner.num_threads=1", "rollout.num_workers=1",
                 f"run_dir={root / 'serve'}", *overrides], key, log, cwd=root) as url:
        rl = run_recipe("rl_loop", root, url, key, [*common, f"group_size={group}", "max_tokens=20",
                                                    "loss_fn=importance_sampling", f"learning_rate={rl_lr}"])
        sl = run_recipe("sl_loop", root, url, key, [*common, "learning_rate=1e-3"])
    return {"rl_loop": rl, "sl_loop": sl}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="where the model, data and logs go (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="questions (rl) or conversations (sl) a step")
    parser.add_argument("--group", type=int, default=4, help="rl_loop's samples per question")
    parser.add_argument("--rl-lr", type=float, default=1e-4, help="rl_loop's learning rate")
    args, overrides = parser.parse_known_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="relay-cookbook-"))
    started = time.monotonic()
    prepare(root)
    print(f"prepared {root} in {time.monotonic() - started:.0f} s")
    records = recipes(root, args.steps, args.batch, args.group, overrides, args.rl_lr)
    print(f"{'recipe':8} | {'steps':>5} | {'first':>7} | {'last':>7} | {'s/step':>6}")
    for recipe, metric, seconds in (("rl_loop", "reward/total", "time/total"), ("sl_loop", "train_mean_nll",
                                                                                  "time_total")):
        rows = [r for r in records[recipe] if metric in r]
        print(f"{recipe:8} | {len(rows):5d} | {rows[0][metric]:7.3f} | {rows[-1][metric]:7.3f} | "
              f"{sorted(r[seconds] for r in rows)[len(rows) // 2]:6.2f}")


if __name__ == "__main__":
    main()

"""GRPO on the demo task written against the tinker SDK, trained through `relay serve` (docs/tinker.md): a user's own
loop driving relay's learner and vLLM engines, as tinker-cookbook's `rl_loop` does. Then `relay train` on the same
task and settings, for the seconds per step and where the difference goes (docs/benchmarks.md).

Usage: python bench/tinker_grpo.py [--steps 40] [--loss importance_sampling|ppo|cispo] [dotted.key=value ...]
Starts `relay serve configs/grpo_lora.yaml` on a free port (the overrides go to both it and `relay train`), runs
`grpo_loop` for `--steps` steps, then `relay train configs/grpo_lora.yaml max_steps=<steps>` with one rollout worker
and no reference (the loop's KL is 0, as tinker-cookbook's default), and prints a table: the reward over the first
and last 5 steps, seconds per step (median), and the loop's phases (sampling, forward_backward + optim_step, the
weights' save and sync).

The loop, per step: 32 demo prompts (`a+b=`, relay's own prompt stream and seed), 8 samples each from the newest
sampling client (`max_tokens` 8, temperature 1, a seed per prompt and step); each sample's reward is exact match;
advantages are group-relative (reward minus the group's mean; groups whose samples all scored the same are dropped);
one `forward_backward` on every kept sample's datum (prompt and completion as `model_input`, the completion's tokens
as targets with the sampler's logprobs and the advantage on each), one `optim_step` (AdamW, learning rate 2e-4, as
configs/grpo_lora.yaml), then `save_weights_and_get_sampling_client` for the next step's samples.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SCRIPT = Path(sys.executable).parent / "relay"
RELAY = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "cluster.cli"]
CONFIG = ROOT / "configs" / "grpo_lora.yaml"
BASE_MODEL = "relay-demo"  # what `relay serve` calls its demo model (get_server_capabilities)


def grpo_loop(base_url: str, api_key: str, steps: int, loss: str = "importance_sampling", rank: int = 16,
              learning_rate: float = 2e-4, prompts_per_step: int = 32, group_size: int = 8, max_tokens: int = 8,
              seed: int = 0, log: Any = None) -> list[dict[str, float]]:
    """Train a LoRA model of the served demo for `steps` GRPO steps through the tinker SDK; one record per step:
    `reward` (the mean over every sample), `seconds` and the phases' seconds (`sample`, `train`, `save`), `datums`."""
    import tinker
    from transformers import AutoTokenizer

    from cluster.data_config import DataConfig
    from cluster.demo.cache import ensure_demo_model
    from cluster.run.data import ArithmeticPrompts
    from rewards.verifiers import exact_match

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_demo_model(log=lambda _: None)))
    prompts = ArithmeticPrompts(DataConfig(prompts_per_step=prompts_per_step), seed)
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=rank, seed=seed)
    sampler = training.save_weights_and_get_sampling_client().result()
    adam = tinker.AdamParams(learning_rate=learning_rate)
    records = []
    for step in range(steps):
        started = time.monotonic()
        batch = prompts.next_batch()
        asked = []
        for i, problem in enumerate(batch):
            ids = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
            params = tinker.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=step * prompts_per_step + i)
            asked.append((ids, problem.label, sampler.sample(tinker.ModelInput.from_ints(ids), num_samples=group_size,
                                                             sampling_params=params)))
        datums, rewards = [], []
        for ids, label, future in asked:
            sequences = future.result().sequences
            scores = [exact_match(tokenizer.decode(s.tokens, skip_special_tokens=True), label) for s in sequences]
            rewards += scores
            mean = statistics.fmean(scores)
            if all(score == mean for score in scores):
                continue  # no signal in this group
            for seq, score in zip(sequences, scores):
                tokens, width = ids + list(seq.tokens), len(ids) - 1
                datums.append(tinker.Datum(
                    model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:],
                                    "logprobs": [0.0] * width + list(seq.logprobs),
                                    "advantages": [0.0] * width + [score - mean] * len(seq.tokens)}))
        sampled = time.monotonic()
        if datums:
            backward = training.forward_backward(datums, loss)
            optim = training.optim_step(adam)  # sent at once: the server runs a model's requests in order
            backward.result(), optim.result()
        trained = time.monotonic()
        sampler = training.save_weights_and_get_sampling_client().result()
        done = time.monotonic()
        records.append({"step": step + 1, "reward": statistics.fmean(rewards), "seconds": done - started,
                        "sample": sampled - started, "train": trained - sampled, "save": done - trained,
                        "datums": len(datums)})
        if log is not None:
            log(f"step {step + 1}: reward {records[-1]['reward']:.3f}, {len(datums)} datums, "
                f"{records[-1]['seconds']:.2f} s")
    return records


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def served(args: list[str], key: str, log: Path, timeout: float = 180, cwd: Path = ROOT):
    """`relay serve ARGS` (a config and overrides) from `cwd` on a free port with API key `key` (or several,
    comma-separated: a tenant each; its stderr to `log`), once it answers its health check within `timeout` s; yields
    its base URL, stops it after."""
    import httpx

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"PYTHONPATH": str(ROOT), "RELAY_SERVE_KEY": key})
    with log.open("w") as err:
        process = subprocess.Popen([*RELAY, "serve", *args, "--port", str(port), "--key-env", "RELAY_SERVE_KEY"],
                                   cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"relay serve exited with {process.returncode}: {log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/api/v1/healthz", headers={"X-API-Key": key.split(",")[0]},
                             timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"relay serve did not answer in {timeout:.0f} s: {log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def relay_train(steps: int, overrides: list[str], run_dir: Path) -> list[dict[str, Any]]:
    """`relay train configs/grpo_lora.yaml` for `steps` steps with one rollout worker, no KL (the loop's); its
    records."""
    subprocess.run([*RELAY, "train", str(CONFIG), f"max_steps={steps}", f"run_dir={run_dir}", "--quiet",
                    "rollout.num_workers=1", "learner.kl_coef=0", *overrides], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--loss", default="importance_sampling", choices=["importance_sampling", "ppo", "cispo"])
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for relay serve and relay train")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    with tempfile.TemporaryDirectory() as tmp:
        serve = [str(CONFIG), "rollout.num_workers=1", *args.overrides]  # as relay_train's
        with served(serve, "tml-bench", Path(tmp) / "serve.log") as url:
            loop = grpo_loop(url, "tml-bench", args.steps, args.loss, log=lambda line: print(line, file=sys.stderr))
        train = relay_train(args.steps, args.overrides, Path(tmp) / "train")
    rows = [("reward, first 5 steps", statistics.fmean(r["reward"] for r in loop[:5]),
             statistics.fmean(r["reward/mean"] for r in train[:5])),
            ("reward, last 5 steps", statistics.fmean(r["reward"] for r in loop[-5:]),
             statistics.fmean(r["reward/mean"] for r in train[-5:])),
            ("s/step (median, steps 2-)", statistics.median(r["seconds"] for r in loop[1:]),
             statistics.median(r["time/step"] for r in train[1:]))]
    for phase, key in (("sample", "time/generate"), ("train", "time/train"), ("save", "time/sync")):
        rows.append((f"  {phase} (loop) / {key} (relay train)", statistics.median(r[phase] for r in loop[1:]),
                     statistics.median(r.get(key, 0.0) for r in train[1:])))
    print(f"{args.steps} steps, loss {args.loss}\n\n| | SDK loop through relay serve | relay train |\n|---|---|---|")
    for name, a, b in rows:
        print(f"| {name} | {a:.3f} | {b:.3f} |")


if __name__ == "__main__":
    main()

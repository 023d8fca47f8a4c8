"""A CPU engine's linear kernels (`rollout.cpu_linear`): seconds per weight load and per request, oneDNN's against
torch's, on one model.

Usage: python bench/engine_kernels.py [--size demo|25M] [--repeats 30] [--kernels onednn torch]
Each kernel runs in a fresh process (the kernel is picked when the engine starts): one engine in-process (what a
rollout worker holds), then `--repeats` times a load of a whole state dict followed by one request of 16 prompts x 8
(up to 8 new tokens on the demo model, 64 on the 25M one), after two untimed rounds. The loads alternate between two
weight sets (the model's and a perturbed copy), and after every load the engine's prompt logprobs of a fixed text
must be the loaded set's (transformers' forward, 1e-4 in float32) and not the other's, so a load that delivered
nothing stops the script. Prints a Markdown table of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEXT = "12+34=46 and 56+78=134"


def model_dir(size: str) -> str:
    """The demo's model, or bench/vs_trl.py's 25M one (built once)."""
    if size == "demo":
        from cluster.demo.cache import ensure_demo_model

        return str(ensure_demo_model(log=lambda _: None))
    from bench.vs_trl import model_25m_dir

    return str(model_25m_dir())


def hf_prompt_logprobs(model, ids: list[int]):
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def one(size: str, kernel: str, repeats: int) -> dict:
    """Time one kernel in this process; returns the medians."""
    import torch
    from transformers import AutoModelForCausalLM

    from actors.engine import EngineSettings, VllmEngine

    path = model_dir(size)
    engine = VllmEngine(EngineSettings(model_path=path, cpu_linear=kernel, max_model_len=128 if size != "demo" else 64,
                                       kv_cache_bytes=256 * 2**20))
    models = [AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32) for _ in range(2)]
    with torch.no_grad():
        for p in models[1].parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
    states = [[(name, t.detach().clone()) for name, t in m.state_dict().items()] for m in models]
    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    expected = [hf_prompt_logprobs(m, ids) for m in models]
    rng = random.Random(0)
    prompts = [engine.tokenizer.encode(f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=", add_special_tokens=False)
               for _ in range(16)]
    new_tokens = 8 if size == "demo" else 64
    loads, requests = [], []
    for i in range(repeats + 2):
        which = i % 2
        started = time.perf_counter()
        engine.load_weights(states[which])
        loaded = time.perf_counter() - started
        served = torch.tensor(engine.score(ids))
        gap, other = (float((served - expected[w]).abs().max()) for w in (which, 1 - which))
        if gap > 1e-4 or other < 1e-3:
            raise SystemExit(f"{kernel}: after load {i} the engine serves the wrong weights (gap to the loaded set "
                             f"{gap:.3g}, to the other {other:.3g})")
        started = time.perf_counter()
        engine.generate(prompts, 8, 1.0, 1.0, new_tokens, [1000 + j for j in range(16)])
        if i >= 2:
            loads.append(loaded)
            requests.append(time.perf_counter() - started)
    result = {"kernel": kernel, "in_place": engine.direct_loads, "load": statistics.median(loads),
              "request": statistics.median(requests)}
    engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="demo", choices=["demo", "25M"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--kernels", nargs="+", default=["onednn", "torch"], choices=["onednn", "torch"])
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: time this kernel here, print JSON
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.size, args.one, args.repeats)), flush=True)
        return
    rows = []
    for kernel in args.kernels:
        out = subprocess.run([sys.executable, __file__, "--size", args.size, "--repeats", str(args.repeats),
                              "--one", kernel], capture_output=True, text=True, env=os.environ)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode or not lines:
            raise SystemExit(f"{kernel}: failed\n{out.stderr[-3000:]}{out.stdout[-1000:]}")
        rows.append(json.loads(lines[-1][len("RESULT "):]))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{args.size} model, medians of {args.repeats}")
    print("| kernel | loads in place | load s | request s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {'yes' if r['in_place'] else 'no (vLLM reload)'} | {r['load']:.4f} | "
              f"{r['request']:.4f} |")


if __name__ == "__main__":
    main()

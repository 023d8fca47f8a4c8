"""README step 5 as a user types it: `relay train model.path=... data.task=dataset data.path=data/train.jsonl
reward.sources.correct.verifier=mypkg.rewards:score`, in a directory holding `mypkg/rewards.py` and the data, with
relay installed (`pip install -e .`) and nothing on PYTHONPATH. The model is a tiny random Qwen2 whose config says 128
positions: the run takes max_model_len 128 from it (not the demo's 64), says so in one line, scores with the user's
function."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # a real run: Ray, two engines, the learner (about 3 minutes on 2 cores)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "relay"  # the console script `pip install -e .` made


def readme_step_5() -> list[str]:
    """The README's `relay train model.path=...` command of step 5, as its words (the line continuation joined)."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("relay train model.path="))
    return line.split("#")[0].split()[2:]


def test_readme_step_5_runs_on_a_local_model_and_a_verifier_module_in_the_current_directory(tmp_path):
    from cluster.demo.model import make_random_model_dir

    words = readme_step_5()
    assert words[0] == "model.path=/models/my-model" and "reward.sources.correct.verifier=mypkg.rewards:score" in words
    model = make_random_model_dir(tmp_path / "my-model", seed=0, max_position_embeddings=128)
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "rewards.py").write_text("def score(completion, label):\n    return 0.25\n")
    (tmp_path / "data").mkdir()
    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(10, 30) for b in range(10, 12)]
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # as a user's shell has it
    command = [str(SCRIPT), "train", *[w.replace("/models/my-model", str(model)) for w in words],
               "max_steps=2", "run_dir=runs/mine", "--quiet"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    derived = [line for line in done.stderr.splitlines() if line.startswith("relay: from the model in")]
    assert derived == [f"relay: from the model in {model}: rollout.max_model_len=128, rollout.max_new_tokens=16, "
                       f"rollout.kv_cache_bytes={64 * 2**20}, model.dtype=float32 (set any of them to override)"]
    run_dir = tmp_path / "runs" / "mine"
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (resolved["rollout"]["max_model_len"], resolved["rollout"]["max_new_tokens"]) == (128, 16)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["reward/mean"] == 0.25 for r in records)
    assert all(r["response_length/mean"] <= 16 for r in records)
    # A random model ends a completion with 1 token in 17, so about (16/17)^16 = 38% of them run to max_new_tokens:
    # the warning (over half of a step's) comes when, and only once, a step's share crosses it.
    cut = any(r["response/truncated_fraction"] > 0.5 for r in records)
    assert len(re.findall(r"completions were cut at rollout\.max_new_tokens=16", done.stderr)) == int(cut)

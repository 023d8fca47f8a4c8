"""Reward sources through the real loop: the demo's verifier served by `relay verifier serve` gives exactly the
in-process run, a reward model and a rule verifier combine by weight, remote failures follow the configured policy,
and the GSM8K-format config runs on a tiny local dataset."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cluster.config import load_config
from cluster.run.launch import run_training
from sync.calls import RunError
from tests.fleets import POOL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def verifier_service():
    """`relay verifier serve --verifier exact_match` as a user starts it, on a free loopback port."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "cluster.cli", "verifier", "serve", "--verifier", "exact_match",
                                "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
                if reply.status == 200:
                    break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"verifier service did not start: {process.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
    yield url
    process.terminate()
    process.wait(timeout=30)


def run(tmp_path, model_dir, name, *overrides, config_file=None):
    config = load_config(config_file, [f"run_dir={tmp_path / name}", f"model.path={model_dir}", "max_steps=4",
                                       "data.prompts_per_step=8", "rollout.num_workers=1", *overrides])
    return run_training(config, tmp_path / name, str(model_dir), display=False, pool=POOL)


def test_remote_verifier_gives_exactly_the_in_process_run(ray_local, tmp_path, demo_model_dir, verifier_service):
    local = run(tmp_path, demo_model_dir, "local")
    remote = run(tmp_path, demo_model_dir, "remote", "reward.sources.correct.type=remote",
                 f"reward.sources.correct.urls=[{verifier_service}]")
    # Same seed, same rewards: the whole run is the same, step by step.
    assert [r["reward/mean"] for r in remote] == [r["reward/mean"] for r in local]
    assert [r["reward/correct"] for r in remote] == [r["reward/mean"] for r in local]
    assert all(r["verifier/failures"] == 0 and r["verifier/retries"] == 0 for r in remote)
    assert all(r["verifier/correct/latency_mean_s"] > 0 for r in remote)
    assert 0 < sum(r["reward/mean"] for r in local) < len(local)  # neither all wrong nor all right: a real check


def test_reward_model_and_rule_verifier_combine_by_weight(ray_local, tmp_path, demo_model_dir, tiny_reward_model_dir):
    records = run(tmp_path, demo_model_dir, "combined", "reward.sources.correct.type=rule",
                  "reward.sources.correct.verifier=exact_match", "reward.sources.rm.type=model",
                  f"reward.sources.rm.path={tiny_reward_model_dir}", "reward.sources.rm.weight=0.1")
    for record in records:
        assert record["reward/mean"] == pytest.approx(record["reward/correct"] + 0.1 * record["reward/rm"], abs=1e-6)
        assert record["reward/rm"] != 0 and record["grad_norm"] > 0


def test_unreachable_service_fails_the_run_naming_it(ray_local, tmp_path, demo_model_dir):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(RunError, match=f"verifier 'judge' at {url}"):
        run(tmp_path, demo_model_dir, "fail", "reward.sources.judge.type=remote", f"reward.sources.judge.urls=[{url}]",
            "reward.sources.judge.max_retries=2", "reward.sources.judge.backoff=0.05", "reward.sources.judge.timeout=2")
    assert time.monotonic() - started < 120
    assert not (tmp_path / "fail" / "metrics.jsonl").read_text()  # no step was recorded as if it had a reward


def test_unreachable_service_with_a_default_reward_is_counted(ray_local, tmp_path, demo_model_dir):
    url = f"http://127.0.0.1:{free_port()}"
    records = run(tmp_path, demo_model_dir, "default", "max_steps=2", "reward.sources.correct.type=rule",
                  "reward.sources.judge.type=remote", f"reward.sources.judge.urls=[{url}]",
                  "reward.sources.judge.max_retries=1", "reward.sources.judge.backoff=0.05",
                  "reward.sources.judge.on_failure=default", "reward.sources.judge.default_reward=-1")
    for record in records:
        assert record["verifier/failures"] == 64 and record["verifier/retries"] > 0  # 8 prompts x 8 samples
        assert record["reward/judge"] == -1
        assert record["reward/mean"] == pytest.approx(record["reward/correct"] - 1)


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """The tiny model with a chat template (the character tokenizer knows digits and `+-*= ` only, so the template
    keeps just the user's text; the system prompt goes through it and is dropped)."""
    from transformers import AutoTokenizer

    from cluster.demo.model import make_random_model_dir

    path = make_random_model_dir(tmp_path_factory.mktemp("models") / "chat", seed=3)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}"
                               "{% endfor %}")
    tokenizer.save_pretrained(path)
    return path


def test_gsm8k_config_runs_on_a_tiny_local_dataset(ray_local, tmp_path, chat_model_dir):
    data = tmp_path / "gsm8k.jsonl"
    rows = [{"question": f"{a}+{a + 1}=", "answer": f"{a} plus {a + 1} is {2 * a + 1}.\n#### {2 * a + 1}"}
            for a in range(20)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    # The config as a GPU user runs it, scaled down to this machine and the tiny model.
    records = run(tmp_path, chat_model_dir, "gsm8k", f"data.path={data}", "model.dtype=float32", "max_steps=2",
                  "data.prompts_per_step=4", "rollout.num_gpus=0", "rollout.num_cpus=0.5", "rollout.num_threads=1",
                  "rollout.max_new_tokens=8", "rollout.max_model_len=64", "rollout.enforce_eager=true",
                  "reference.num_gpus=0", "reference.num_cpus=0.5", "learner.num_gpus=0", "learner.num_cpus=0.5",
                  "learner.num_minibatches=1", "data.max_prompt_tokens=32", "sync.probe_tolerance=1e-4",
                  config_file=ROOT / "configs" / "gsm8k_grpo.yaml")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert "reward/correct" in record and record["data/filtered_prompts"] == 0
    assert records[-1]["data/epoch"] == pytest.approx(8 / 20)

"""A GRPO loop written against the real tinker SDK (bench/tinker_grpo.py's `grpo_loop`: sample groups from the newest
sampling client, score them with exact match, group-relative advantages, one `forward_backward` + `optim_step` a step,
save the weights for the next step's sampler) trains the demo task through `relay serve configs/grpo_lora.yaml`: the
reward rises from about 0.25 to 0.9, with the SDK's `importance_sampling` loss and with `ppo`, in float32 with one
rollout worker, and with `importance_sampling` in bfloat16 with two."""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
KEY = "tml-relay-loop-key"

from bench.tinker_grpo import CONFIG, grpo_loop, served  # noqa: E402


@pytest.fixture(scope="module")
def url(request, tmp_path_factory):
    """`relay serve configs/grpo_lora.yaml` with `request.param`: "dtype,rollout workers per model"."""
    os.environ["TINKER_TELEMETRY"] = "0"
    log = tmp_path_factory.mktemp("serve") / "stderr.txt"
    dtype, workers = request.param.split(",")
    with served([str(CONFIG), "ray.num_cpus=2", "learner.num_threads=1", f"model.dtype={dtype}",
                 f"rollout.num_workers={workers}", f"run_dir={log.parent}"], KEY, log) as base_url:
        yield base_url


# bfloat16 with two rollout workers: each step's prompts are shared out among both engines (cluster/tinker/sampling.py).
@pytest.mark.parametrize("url, loss", [("float32,1", "importance_sampling"), ("float32,1", "ppo"),
                                       ("bfloat16,2", "importance_sampling")], indirect=["url"])
def test_an_sdk_grpo_loop_learns_the_demo_through_relay_serve(url, loss):
    records = grpo_loop(url, KEY, steps=30, loss=loss)
    rewards = [r["reward"] for r in records]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-5:])
    assert 0.1 < first < 0.45, rewards  # the demo model before training: about 0.25
    assert last >= 0.85, rewards

"""The calculator agent learns against an OpenEnv server (issue 42's acceptance): `relay train
configs/agent_calc.yaml env.protocol=openenv env.urls=[...] env.spec=null env.params=null`, with the calculator
served by openenv-core's own `create_app` (tests/openenv_envs.py), learns as it learns in-process: in float32 step for
step the in-process run (accuracy 0.30 -> 0.63 over 12 steps: the first 3 steps' mean -> the last 3's), and in
bfloat16 too. A server with too few sessions for the run stops it with the fix in one line (`env.on_failure=fail`),
once its capacity retries are spent.

The server runs on a thread of this process; the rollout workers (Ray actors) reach it over loopback.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from openenv.core.env_server.http_server import create_app

from cluster.config import load_config
from cluster.run.launch import run_training
from rewards.service import run_in_thread
from sync.calls import RunError
from tests.fleets import POOL
from tests.openenv_envs import Calculator, TextAction, TextObservation

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STEPS, PROMPTS = 12, 32
SESSIONS = 8 * PROMPTS  # G = 8 episodes per prompt, on one rollout worker
SAME = ("reward/mean", "reward/env", "env/turns/mean", "env/calls", "env/invalid_calls", "response_length/mean",
        "loss/policy", "grad_norm", "kl/mean")


def run(tmp_path: Path, name: str, model_dir: Path, *overrides: str, steps: int = STEPS) -> list[dict]:
    """agent_calc, `steps` steps of PROMPTS prompts on one rollout worker."""
    cfg = load_config(CONFIGS / "agent_calc.yaml", [f"run_dir={tmp_path / name}", f"model.path={model_dir}",
                                                     f"max_steps={steps}", f"data.prompts_per_step={PROMPTS}",
                                                     "rollout.num_workers=1", *overrides])
    return run_training(cfg, tmp_path / name, str(model_dir), display=False, pool=POOL)


def openenv(url: str) -> list[str]:
    """The acceptance's overrides: the YAML's in-process calculator replaced by the OpenEnv server at `url`; a session
    for each of a step's episodes at once (else they run `env.max_concurrency` at a time, in waves)."""
    return ["env.protocol=openenv", f"env.urls=[{url}]", "env.spec=null", "env.params=null",
            f"env.max_concurrency={SESSIONS}"]


def learned(records: list[dict]) -> tuple[float, float]:
    """Mean accuracy of the first and of the last 3 steps."""
    rewards = [r["reward/mean"] for r in records]
    return sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3


@pytest.fixture(scope="module")
def server_url():
    app = create_app(Calculator, TextAction, TextObservation, max_concurrent_envs=SESSIONS)
    with run_in_thread(app) as url:
        yield url


def test_the_agent_learns_against_openenvs_server_as_in_process(ray_local, tmp_path, calc_model_dir, server_url):
    Calculator.resets.clear()
    theirs = run(tmp_path, "openenv", calc_model_dir, *openenv(server_url))
    # The same episodes as in-process, so the same run: step for step over the first 3 (a run is deterministic, and
    # max_steps changes nothing before the last step), which stands for the rest.
    ours = run(tmp_path, "in_process", calc_model_dir, steps=3)
    for mine, other in zip(ours, theirs[:3], strict=True):
        for key in SAME:
            assert mine[key] == other[key], key
    for record in theirs:
        assert record["env/failures"] == 0 and record["logprob/mismatch"] < 1e-4
    # Every episode's reset reached the server with its prompt and label (G = 8 episodes per prompt).
    assert len(Calculator.resets) == 8 * PROMPTS * STEPS
    assert all(prompt.endswith("=") and str(label).isdigit() for prompt, label in Calculator.resets)
    first, last = learned(theirs)
    assert last > first + 0.2, f"no learning against the OpenEnv server: accuracy {first:.3f} -> {last:.3f}"


def test_the_agent_learns_against_openenvs_server_in_bfloat16(ray_local, tmp_path, calc_model_dir, server_url):
    records = run(tmp_path, "bf16", calc_model_dir, "model.dtype=bfloat16", *openenv(server_url))
    for record in records:
        assert record["env/failures"] == 0 and record["logprob/mismatch"] < 0.05
        assert math.isfinite(record["loss/policy"])
    first, last = learned(records)
    assert last > first + 0.2, f"no learning in bfloat16 against the OpenEnv server: {first:.3f} -> {last:.3f}"


def test_a_server_with_too_few_sessions_stops_the_run_naming_the_fix(ray_local, tmp_path, calc_model_dir):
    with run_in_thread(create_app(Calculator, TextAction, TextObservation, max_concurrent_envs=4)) as url:
        with pytest.raises(RunError) as raised:
            run(tmp_path, "full", calc_model_dir, *openenv(url), steps=1)
    message = str(raised.value)
    assert "\n" not in message and " episode(s) failed in the environment, the first: environment 'env' at " in message
    assert ("reset failed: 3 retries exhausted: the server answered error CAPACITY_REACHED: Server at capacity: 4/4 "
            "sessions active. Cannot accept new connections. (the server's max_concurrent_envs is reached: keep "
            "env.max_concurrency times the rollout workers within it, or raise it) (env.on_failure=fail") in message

"""The `relay` command as a user runs it: help, bad input (exit 2, one line, nothing written), a short demo run read
back from metrics.jsonl and TensorBoard and plotted with `relay plot`, and the demo's run learning in bfloat16."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "relay"  # the console script `pip install -e .` made
RELAY = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "cluster.cli"]


def relay(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*RELAY, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_help_lists_every_command():
    result = relay("--help")
    assert result.returncode == 0
    for command in ("train", "plan", "verifier", "build-demo-model"):
        assert command in result.stdout
    train_help = relay("train", "--help")
    assert train_help.returncode == 0 and "dotted" in train_help.stdout


def test_plan_prints_a_gpu_preset_as_written_and_refuses_gpus_too_small_in_one_line():
    fits = relay("plan", "configs/gpu_gsm8k_single.yaml", "--gpu-memory", "80GB")
    assert fits.returncode == 0, fits.stderr
    assert "learner rank 0 " in fits.stdout and "master weights" in fits.stdout and "KV cache" in fits.stdout
    small = relay("plan", "configs/gpu_gsm8k_single.yaml", "--gpu-memory", "24GiB")
    assert small.returncode == 2 and small.stderr.count("\n") == 1
    assert small.stderr.startswith("relay: config error: a learner rank needs about")


@pytest.mark.parametrize("args, message", [
    (["learner.lrr=1"], "unknown config key 'learner.lrr'"),
    (["rollout.num_workers=0"], "rollout.num_workers"),
    (["missing.yaml"], "cannot read config file 'missing.yaml'"),
    (["model.path=/nonexistent"], "model.path '/nonexistent' is not a Hugging Face model directory"),
    (["data.task=dataset", "data.path=/nonexistent.jsonl"], "/nonexistent.jsonl"),
    (["data.task=dataset", "data.path={bad_jsonl}"], "line 2"),
    (["reward.sources.c.verifier=nope"], "reward.sources.c: "),
    (["reward.sources.c.verifier=no_such_module:score"], "no_such_module"),
    (["reward.sources.c.type=remote", "reward.sources.c.urls=[http://127.0.0.1:9]",
      "reward.sources.c.token_env=RELAY_UNSET_TOKEN"],
     "RELAY_UNSET_TOKEN"),
    (["reward.sources.rm.type=model", "reward.sources.rm.path=/nonexistent"], "reward.sources.rm.path '/nonexistent'"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, args, message):
    run_dir = tmp_path / "run"
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": 3, "label": "4"}\n')  # line 2: prompt not text
    result = relay("train", *[a.format(bad_jsonl=bad_jsonl) for a in args], f"run_dir={run_dir}")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr
    assert "Traceback" not in result.stderr and not run_dir.exists()


def closed_port() -> int:
    import socket

    with socket.socket() as sock:  # bound, never listening: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("address, code, message", [
    ("not-an-address", 2, "relay: config error: ray.address='not-an-address': Invalid address format"),
    ("127.0.0.1:{port}", 1, "relay: run stopped: cannot reach a Ray cluster at ray.address=127.0.0.1:{port}"),
])
def test_a_wrong_ray_address_is_one_line_and_leaves_nothing_behind(tmp_path, address, code, message):
    # Checked before the run directory, the metrics writers or the demo model exist (nothing to leave open), and
    # within seconds: Ray itself retries a closed GCS port for minutes.
    port = closed_port()
    run_dir = tmp_path / "run"
    result = relay("train", f"ray.address={address.format(port=port)}", f"run_dir={run_dir}", "--quiet",
                   timeout=120)
    assert result.returncode == code, result.stderr[-2000:]
    assert result.stderr.startswith(message.format(port=port)), result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert not run_dir.exists()


def check_startup(stderr: str, records: list[dict]) -> None:
    """The console (stderr, not a terminal: one line per change) showed start-up's phases in order from Ray's start,
    each actor's states up to ready, and the first record alone holds the phases' seconds, adding up to the whole."""
    lines = [line for line in stderr.splitlines() if line.startswith("relay: start-up ")]
    phases = [line.split(": ")[2].split("  ")[0] for line in lines]
    assert list(dict.fromkeys(phases)) == ["ray", "registry", "actors", "probe", "first step"], lines
    shown = "\n".join(lines)
    for state in ("rollout worker 0 importing", "rollout worker 0 loading the model", "rollout worker 0 ready",
                  "learner ready", "reference ready"):
        assert state in shown, shown
    first = {k: v for k, v in records[0].items() if k.startswith("time/startup/")}
    parts = ("imports", "checks", "ray", "registry", "actors", "probe", "first_step")
    assert {f"time/startup/{p}" for p in (*parts, "total", "engine", "rollout_worker_0/load")} <= first.keys()
    assert sum(first[f"time/startup/{p}"] for p in parts) == pytest.approx(first["time/startup/total"], abs=1e-6)
    assert 0 < first["time/startup/engine"] < first["time/startup/actors"] < first["time/startup/total"]
    assert not any(k.startswith("time/startup/") for k in records[1])


@pytest.mark.slow
def test_demo_trains_writes_metrics_and_plots(tmp_path, demo_model_dir):
    """`relay train` then `relay plot` as a user runs them: the start prints the Ray dashboard's address (asked for)
    and start-up's phases with each actor's state, the run directory holds metrics.jsonl (the first record with
    start-up's `time/startup/*`), the resolved config and TensorBoard events, and the PNG has every panel."""
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cluster.cli.plot import PANELS, load_run, plot_figure

    run_dir = tmp_path / "run"
    result = relay("train", "max_steps=2", f"run_dir={run_dir}", "data.prompts_per_step=16", "rollout.num_workers=1",
                   "ray.dashboard=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Ray dashboard: http://127.0.0.1:" in result.stdout + result.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["logprob/mismatch"] < 1e-4 and r["weights/version"] == r["step"] for r in records)
    assert "max_steps: 2" in (run_dir / "config.yaml").read_text()
    check_startup(result.stderr, records)
    again = relay("train", "max_steps=2", f"run_dir={run_dir}")  # an existing run is never overwritten
    assert again.returncode == 2 and "already holds a run" in again.stderr

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2]
    assert {"time/generate", "time/train", "logprob/mismatch"} <= set(events.Tags()["scalars"])

    plotted = relay("plot", str(run_dir))
    assert plotted.returncode == 0, plotted.stderr[-3000:]
    png = Path(plotted.stdout.strip())
    assert png == run_dir / "plots.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    with Image.open(png) as image:
        assert image.text["Description"] == "panels: " + "; ".join(PANELS)
    figure = plot_figure(load_run(run_dir))
    assert [ax.get_title() for ax in figure.axes] == list(PANELS)
    assert all(ax.has_data() for ax in figure.axes)  # every panel drew the real run's values

    bad = relay("plot", str(tmp_path / "missing"))
    assert bad.returncode == 2 and bad.stderr.startswith("relay: config error: ") and bad.stderr.count("\n") == 1


@pytest.mark.slow
def test_demo_learns_in_bfloat16(tmp_path, demo_model_dir, fleets, capsys):
    """The run `relay train model.dtype=bfloat16` makes (here in the test's process, on the session's fleets) clears
    the float32 demo's bar (mean reward of 10 steps >= 0.9; here within 50 steps, where both reach it at ~42):
    engines and reference in bfloat16, the learner's forward in bfloat16 on float32 master weights, the probe's
    tolerance derived from the bfloat16 noise floor. The final checkpoint serves bfloat16 and resumes from float32."""
    import torch

    from cluster.config import load_config
    from cluster.run.launch import run_training

    run_dir = tmp_path / "run"
    config = load_config(None, ["model.dtype=bfloat16", "max_steps=50", f"run_dir={run_dir}"])
    run_training(config, run_dir, str(demo_model_dir), display=False, pool=fleets)
    tolerance = float(capsys.readouterr().err.split("relay: sync probe tolerance ")[1].split()[0])
    assert 2.0**-5 <= tolerance < 0.25  # 5x a bfloat16 noise floor, at least bfloat16's minimum (float32's: 1e-4)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in records]
    means = [sum(rewards[i - 10:i]) / 10 for i in range(10, len(rewards) + 1)]
    assert max(means) >= 0.9, f"bfloat16 demo did not reach 0.9: best 10-step mean {max(means):.3f}"
    assert all(r["sync/probe_max_diff"] <= tolerance and r["weights/version"] == r["step"] for r in records)
    assert all(0 <= r["mismatch/kl"] < 1e-2 for r in records)  # numerics, not another policy
    final = run_dir / "checkpoints" / "step_50"
    assert json.loads((final / "policy" / "config.json").read_text())["dtype"] == "bfloat16"
    master = torch.load(final / "learner_state.pt", weights_only=True)["master_weights"]
    assert {t.dtype for t in master.values()} == {torch.float32}

"""`relay train` then `relay plot` as a user runs them: the run directory holds TensorBoard events, the start prints
the Ray dashboard's address, and the PNG has every panel."""

from __future__ import annotations

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


@pytest.mark.slow
def test_train_then_plot(tmp_path, demo_model_dir):
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cluster.cli.plot import PANELS, load_run, plot_figure

    run_dir = tmp_path / "run"
    result = relay("train", "max_steps=3", "rollout.num_workers=1", "data.prompts_per_step=8", f"run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Ray dashboard: http://127.0.0.1:" in result.stdout + result.stderr

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3]
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

"""What a run records and shows: metrics.jsonl and TensorBoard written per step, resume without duplicated steps,
W&B through its API (faked) or a one-line error when it is missing, the console line's phase times, the dashboard
line, and `relay plot`'s PNG."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from rich.console import Console

from cluster.cli.commands import main
from cluster.cli.plot import PANELS, load_run, plot_figure, plot_run
from cluster.run.metrics import (
    WANDB_ID_FILE,
    MetricsRecorder,
    ProgressDisplay,
    check_logging,
    dashboard_line,
    read_records,
)
from cluster.run_sections import LoggingConfig

ROOT = Path(__file__).resolve().parents[2]
NO_TB = LoggingConfig(tensorboard=False)


def record(step: int, reward: float = 0.5, **extra) -> dict:
    """A metrics line shaped like the driver's; values are exact in float32 so TensorBoard returns them as given."""
    return {"step": step, "reward/mean": reward, "reward/std": 0.25, "reward/correct": reward, "kl/mean": 0.125,
            "response_length/mean": 6.5, "logprob/mismatch": 1.5e-7, "sync/probe_max_diff": float("nan"),
            "time/generate": 1.25, "time/score": 0.5, "time/reference": 0.25, "time/train": 2.0, "time/sync": 0.75,
            "time/step": 5.0, "weights/version": step, **extra}


def tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def scalar_tags(log_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return set(events.Tags()["scalars"])


def next_second() -> None:
    """Event files are named by the second they were opened and read in name order: keep two writers' files apart."""
    time.sleep(1.01 - time.time() % 1)


def test_recorder_writes_jsonl_and_tensorboard_every_step(tmp_path):
    recorder = MetricsRecorder(tmp_path, LoggingConfig(), config={"seed": 0})
    for step, reward in [(1, 0.25), (2, 0.5), (3, 0.75)]:
        recorder.write(record(step, reward))
    # Not closed yet: each step was flushed, so a killed run keeps it.
    assert [r["reward/mean"] for r in read_records(tmp_path / "metrics.jsonl")] == [0.25, 0.5, 0.75]
    assert tensorboard_scalars(tmp_path / "tensorboard", "reward/mean") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    recorder.close()
    assert tensorboard_scalars(tmp_path / "tensorboard", "time/train") == [(1, 2.0), (2, 2.0), (3, 2.0)]
    # A value that does not apply (NaN: the probe was off) is null in metrics.jsonl, which strict JSON readers take
    # (bare NaN is not JSON), and no point in TensorBoard.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    def refuse(name):
        pytest.fail(f"bare {name} in metrics.jsonl")

    strict = [json.loads(line, parse_constant=refuse) for line in lines]
    assert strict[0] == {**record(1, 0.25), "sync/probe_max_diff": None}
    assert "sync/probe_max_diff" not in scalar_tags(tmp_path / "tensorboard")
    assert [r["sync/probe_max_diff"] for r in read_records(tmp_path / "metrics.jsonl")] == [None] * 3


def test_non_finite_values_are_null_in_the_file_and_left_out_of_tensorboard(tmp_path):
    recorder = MetricsRecorder(tmp_path, LoggingConfig(), config={})
    recorder.write({"step": 1, "a": float("inf"), "b": float("-inf"), "c": float("nan"), "d": 1.5, "e": 2})
    recorder.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert line == '{"step": 1, "a": null, "b": null, "c": null, "d": 1.5, "e": 2}\n'
    assert scalar_tags(tmp_path / "tensorboard") == {"d", "e"}


def test_a_killed_run_keeps_every_finished_step(tmp_path):
    script = (f"import os; from pathlib import Path; from cluster.run_sections import LoggingConfig; "
              f"from cluster.run.metrics import MetricsRecorder\n"
              f"r = MetricsRecorder(Path({str(tmp_path)!r}), LoggingConfig(), config={{}})\n"
              f"for step in (1, 2, 3): r.write({{'step': step, 'reward/mean': step / 4}})\n"
              f"os._exit(1)  # no close, no atexit: as if killed\n")
    subprocess.run([sys.executable, "-c", script], check=False, timeout=120, cwd=ROOT)
    assert len(read_records(tmp_path / "metrics.jsonl")) == 3
    assert tensorboard_scalars(tmp_path / "tensorboard", "reward/mean") == [(1, 0.25), (2, 0.5), (3, 0.75)]


def test_tensorboard_off_writes_no_event_files(tmp_path):
    with MetricsRecorder(tmp_path, NO_TB, config={}) as recorder:
        recorder.write(record(1))
    assert not (tmp_path / "tensorboard").exists()
    assert len(read_records(tmp_path / "metrics.jsonl")) == 1


def test_resume_replaces_the_steps_after_the_checkpoint(tmp_path):
    crashed = MetricsRecorder(tmp_path, LoggingConfig(), config={})
    for step in range(1, 6):  # checkpoint at step 3, killed after step 5 while writing step 6
        crashed.write(record(step, reward=0.25))
    crashed.log._file.write('{"step": 6, "rew')
    crashed.close()
    next_second()
    with MetricsRecorder(tmp_path, LoggingConfig(), config={}, resume_step=3) as resumed:
        for step in range(4, 7):
            resumed.write(record(step, reward=0.75))
    rewards = [(r["step"], r["reward/mean"]) for r in read_records(tmp_path / "metrics.jsonl")]
    assert rewards == [(1, 0.25), (2, 0.25), (3, 0.25), (4, 0.75), (5, 0.75), (6, 0.75)]
    # TensorBoard hides the crashed attempt's steps 4 and 5 (purge at step 4): each step once, the new values.
    assert tensorboard_scalars(tmp_path / "tensorboard", "reward/mean") == rewards


def test_resume_without_a_checkpoint_starts_the_file_over(tmp_path):
    with MetricsRecorder(tmp_path, NO_TB, config={}) as first:
        first.write(record(1))
    with MetricsRecorder(tmp_path, NO_TB, config={}, resume_step=0) as again:
        again.write(record(1, reward=1.0))
    assert [r["reward/mean"] for r in read_records(tmp_path / "metrics.jsonl")] == [1.0]


def test_a_corrupt_line_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(record(1)) + "\nnot json\n" + json.dumps(record(2)) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2 is not JSON"):
        read_records(path)


def test_wandb_enabled_but_missing_is_one_line_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    logging = LoggingConfig(wandb=True)
    with pytest.raises(ValueError) as err:
        check_logging(logging)
    message = str(err.value)
    assert "pip install wandb" in message and "logging.wandb=false" in message and "\n" not in message
    with pytest.raises(ValueError, match="pip install wandb"):
        MetricsRecorder(tmp_path, logging, config={})
    assert list(tmp_path.iterdir()) == []


class FakeWandbRun:
    def __init__(self, **kwargs):
        self.init = kwargs
        self.logged: list[tuple[dict, int]] = []
        self.exit_code = None

    def log(self, data: dict, step: int) -> None:
        self.logged.append((data, step))

    def finish(self, exit_code: int = 0) -> None:
        self.exit_code = exit_code


@pytest.fixture
def fake_wandb(monkeypatch):
    module = types.ModuleType("wandb")
    module.runs = []
    module.init = lambda **kwargs: module.runs.append(FakeWandbRun(**kwargs)) or module.runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_wandb_gets_the_config_each_step_and_the_same_run_on_resume(tmp_path, fake_wandb):
    logging = LoggingConfig(tensorboard=False, wandb=True, wandb_project="proj")
    with MetricsRecorder(tmp_path, logging, config={"seed": 3}) as recorder:
        recorder.write(record(1))
        recorder.write(record(2))
    run = fake_wandb.runs[0]
    assert run.init["project"] == "proj" and run.init["name"] == tmp_path.name
    assert run.init["config"] == {"seed": 3} and run.init["dir"] == str(tmp_path)
    assert [step for _, step in run.logged] == [1, 2]
    assert "step" not in run.logged[0][0] and run.logged[0][0]["reward/mean"] == 0.5
    assert run.exit_code == 0
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == run.init["id"]

    named = logging.model_copy(update={"wandb_run_name": "try2"})
    with pytest.raises(RuntimeError):
        with MetricsRecorder(tmp_path, named, config={}, resume_step=2):
            raise RuntimeError("the run failed")
    resumed = fake_wandb.runs[1]
    assert resumed.init["id"] == run.init["id"] and resumed.init["resume"] == "allow"
    assert resumed.init["name"] == "try2" and resumed.exit_code == 1


def test_progress_line_shows_each_phase_and_the_summary_their_means():
    out = io.StringIO()
    display = ProgressDisplay(3, console=Console(file=out, width=200, color_system=None))
    with display:
        display.update(record(1))
        display.update({k: v for k, v in record(2).items() if k != "kl/mean"})
    display.summary()
    lines = out.getvalue().splitlines()
    step_lines = [line for line in lines if line.startswith("step ")]
    assert len(step_lines) == 2
    assert "gen 1.25 score 0.50 ref 0.25 train 2.00 sync 0.75 s" in step_lines[0]
    assert "kl 0.1250" in step_lines[0] and "kl off" in step_lines[1]
    assert any("time/train (mean s)" in line and "2.000" in line for line in lines)


@pytest.mark.parametrize("url, line", [
    ("127.0.0.1:8265", "Ray dashboard: http://127.0.0.1:8265"),
    ("http://10.0.0.2:8265", "Ray dashboard: http://10.0.0.2:8265"),
    ("", None),
    (None, None),
])
def test_dashboard_line(url, line):
    assert dashboard_line(types.SimpleNamespace(dashboard_url=url)) == line


def synthetic_run(run_dir: Path, steps: int = 40, kl: bool = True) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "metrics.jsonl").open("w") as f:
        for step in range(1, steps + 1):
            line = record(step, reward=min(0.95, 0.25 + 0.02 * step), **{"reward/fmt": 0.9,
                                                                          "logprob/mismatch": 1e-7 * (1 + step % 3)})
            if not kl:
                del line["kl/mean"]
            f.write(json.dumps(line) + "\n")
    return run_dir


def test_plot_run_writes_a_png_with_every_panel(tmp_path):
    from PIL import Image

    run_dir = synthetic_run(tmp_path / "run")
    path = plot_run(run_dir)
    assert path == run_dir / "plots.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    with Image.open(path) as image:
        assert image.size[0] >= 1000 and image.text["Description"] == "panels: " + "; ".join(PANELS)
    figure = plot_figure(load_run(run_dir))
    assert [ax.get_title() for ax in figure.axes] == list(PANELS)
    reward, kl, length, mismatch, phases = figure.axes
    assert {line.get_label() for line in reward.get_lines()} == {"reward/mean", "reward/correct", "reward/fmt"}
    assert mismatch.get_yscale() == "log"
    assert {t.get_text() for t in phases.get_legend().get_texts()} >= {"generate", "score", "reference", "train",
                                                                       "sync"}
    assert all(ax.get_xlabel() == "step" and ax.has_data() for ax in figure.axes)


def test_plot_says_kl_off_and_keeps_the_last_record_of_a_step(tmp_path):
    run_dir = synthetic_run(tmp_path / "run", steps=3, kl=False)
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(record(3, reward=0.0)) + "\n")
    records = load_run(run_dir)
    assert [(r["step"], r["reward/mean"]) for r in records][-1] == (3, 0.0) and len(records) == 3
    kl_axes = plot_figure(load_run(synthetic_run(tmp_path / "nokl", steps=3, kl=False))).axes[1]
    assert [t.get_text() for t in kl_axes.texts][0].startswith("KL off") and not kl_axes.get_lines()
    out = plot_run(run_dir, tmp_path / "charts" / "run.png")
    assert out.is_file()


@pytest.mark.parametrize("make, expected", [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: (p / "file").write_text("") or p / "file", "is not a directory"),
    (lambda p: p, "holds no metrics.jsonl"),
    (lambda p: (p / "metrics.jsonl").write_text("") or p, "has no records yet"),
])
def test_plot_errors_name_the_path_and_the_fix(tmp_path, capsys, make, expected):
    target = make(tmp_path)
    with pytest.raises(ValueError, match=expected) as err:
        plot_run(target)
    assert str(target) in str(err.value) and "\n" not in str(err.value)
    assert main(["plot", str(target)]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("relay: config error: ") and stderr.count("\n") == 1 and expected in stderr


def test_relay_plot_prints_the_path_it_wrote(tmp_path, capsys):
    run_dir = synthetic_run(tmp_path / "run", steps=2)
    assert main(["plot", str(run_dir), "--out", str(tmp_path / "out.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out.png")
    assert (tmp_path / "out.png").stat().st_size > 20_000
    assert main(["plot", str(run_dir), "--out", str(tmp_path / "out.pdf")]) == 2
    assert "must end in .png" in capsys.readouterr().err

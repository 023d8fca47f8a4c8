"""What a run shows and records: `metrics.jsonl` (one JSON object per step), TensorBoard event files, Weights &
Biases and Prometheus (when enabled), the console display, and the Ray dashboard line printed at start.

Owns: the metrics file's format (its keys: docs/operations.md), fanning each step's record out to every sink
(`MetricsRecorder`), dropping records past the checkpoint on resume, the progress display (rich) and the final
summary; the step's record itself (`step_record`: what it holds besides the parts' own metrics) and the phases'
times (`Timings`). Does not own: the parts' metrics (the learner's, the data's, the fleet's), the charts
(cluster/cli/plot.py), or Prometheus' names and server (cluster/run/prometheus.py). TensorBoard, wandb and
prometheus_client are imported only when a run writes to them.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from cluster.run.prometheus import PrometheusExporter, check_prometheus

if TYPE_CHECKING:
    from cluster.config import RunConfig
    from cluster.run_sections import LoggingConfig

WANDB_ID_FILE = "wandb_run_id"  # in run_dir: the W&B run id, so a resumed run logs to the same W&B run


class MetricsLog:
    """Appends one JSON object per step to `metrics.jsonl`, flushed so a crash loses at most the current step.

    With `resume_step`, records of later steps (written by the attempt that crashed after that checkpoint) are
    dropped first, so the resumed steps are not in the file twice."""

    def __init__(self, run_dir: Path, resume_step: int | None = None):
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_records(self.path) if r["step"] <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(_json_line(r) for r in kept))
            os.replace(tmp, self.path)  # atomic: a crash here leaves the old file or the new one
        self._file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(_json_line(record))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _json_line(record: dict[str, Any]) -> str:
    """One line of strict JSON: a value that does not apply (NaN) or overflowed (inf) is written as null, which
    every JSON reader accepts (bare NaN is not JSON)."""
    return json.dumps(applicable(record), allow_nan=False) + "\n"


def applicable(record: dict[str, Any]) -> dict[str, Any]:
    """The record with every non-finite number replaced by None (what `metrics.jsonl` holds)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a `metrics.jsonl`. A torn last line (the process was killed mid-write) is ignored; any other
    line that is not a JSON object with a `step` raises ValueError naming the file and line."""
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path} line {number} is not JSON; remove the line or the file") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path} line {number} is not a metrics record (no integer 'step'); remove the line")
        records.append(record)
    return records


class TensorBoardWriter:
    """Every numeric value of a record as a TensorBoard scalar at global step `step`, flushed after each step.

    Uses tensorboard's own event writer (no torch, no TensorFlow). `purge_step=N` writes a SessionLog.START event
    at step N, which tells TensorBoard to hide every event of an earlier file with step >= N: how a resumed run
    replaces the steps the crashed attempt logged after its last checkpoint (the same mechanism as
    `torch.utils.tensorboard.SummaryWriter(purge_step=N)`)."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self.log_dir = log_dir
        self._writer = EventFileWriter(str(log_dir))
        if purge_step is not None:
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=purge_step, session_log=start))
            self._writer.flush()

    def write(self, step: int, record: dict[str, Any]) -> None:
        """Every finite number of `record` (values that do not apply, NaN or None, are left out)."""
        values = [self._summary_pb2.Summary.Value(tag=key, simple_value=float(value))
                  for key, value in record.items() if key != "step" and _is_number(value)]
        summary = self._summary_pb2.Summary(value=values)
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()  # a killed run keeps every finished step

    def close(self) -> None:
        self._writer.close()


def check_logging(logging: LoggingConfig) -> None:
    """Raise ValueError (one line: what is missing and how to fix it) if an enabled sink's library is not installed,
    or the Prometheus server's address cannot be bound. Cheap enough to call before anything starts."""
    if logging.tensorboard:
        _import_tensorboard()
    if logging.wandb:
        _import_wandb()
    check_prometheus(logging.prometheus_host, logging.prometheus_port)


class MetricsRecorder:
    """Fans each step's record out to `metrics.jsonl` (always), TensorBoard (`run_dir/tensorboard/`, when
    `logging.tensorboard`), Weights & Biases (when `logging.wandb`) and Prometheus (served from this process, labelled
    `run=<run_dir's name>`, when `logging.prometheus_port` is set), and closes them.

    `config` is the resolved run config as a plain dict (W&B shows it with the run). `resume_step` is the step of
    the checkpoint a resumed run continues from (0: it had none), None for a new run: records after it are dropped
    from `metrics.jsonl`, hidden in TensorBoard, and the same W&B run is continued. Raises ValueError when an
    enabled sink is not installed or the Prometheus port cannot be bound."""

    def __init__(self, run_dir: Path, logging: LoggingConfig, config: dict[str, Any],
                 resume_step: int | None = None):
        check_logging(logging)
        self.log = MetricsLog(run_dir, resume_step)
        self.tensorboard: TensorBoardWriter | None = None
        self.wandb_run: Any = None
        self.prometheus: PrometheusExporter | None = None
        try:
            if logging.tensorboard:
                purge_step = None if resume_step is None else resume_step + 1
                self.tensorboard = TensorBoardWriter(run_dir / "tensorboard", purge_step)
            if logging.wandb:
                self.wandb_run = _start_wandb(run_dir, logging, config, resuming=resume_step is not None)
            if logging.prometheus_port is not None:
                self.prometheus = PrometheusExporter(logging.prometheus_host, logging.prometheus_port,
                                                     run_dir.resolve().name)
                print(f"relay: Prometheus metrics at {self.prometheus.url}", file=sys.stderr, flush=True)
        except BaseException:
            self.close(failed=True)
            raise

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        self.log.write(record)
        if self.tensorboard is not None:
            self.tensorboard.write(step, record)
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step" and _is_number(v)}, step=step)
        if self.prometheus is not None:
            self.prometheus.update(record)

    def close(self, failed: bool = False) -> None:
        """Close every sink; `failed` marks the W&B run as failed (exit code 1)."""
        if self.prometheus is not None:
            self.prometheus.close()
            self.prometheus = None
        self.log.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=1 if failed else 0)
            self.wandb_run = None

    def __enter__(self) -> MetricsRecorder:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)


def _start_wandb(run_dir: Path, logging: LoggingConfig, config: dict[str, Any], resuming: bool) -> Any:
    """A W&B run in `run_dir/wandb/`; its id is kept in `run_dir/wandb_run_id` so a resumed run continues it."""
    wandb = _import_wandb()
    id_file = run_dir / WANDB_ID_FILE
    if resuming and id_file.exists():
        run_id = id_file.read_text().strip()
    else:
        run_id = uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
    return wandb.init(project=logging.wandb_project, name=logging.wandb_run_name or run_dir.name, id=run_id,
                      resume="allow", config=config, dir=str(run_dir))


def _import_tensorboard() -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ValueError("logging.tensorboard=true needs the tensorboard package: pip install tensorboard, or set "
                         "logging.tensorboard=false") from None


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ValueError("logging.wandb=true needs the wandb package: pip install wandb (or pip install -e "
                         "'.[wandb]' in a relay checkout), or set logging.wandb=false") from None
    return wandb


def _is_number(value: Any) -> bool:
    """A finite int or float (bools too: 0/1); NaN and inf (values that do not apply), None, strings and lists are
    not charted."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def dashboard_line(context: Any) -> str | None:
    """`Ray dashboard: http://127.0.0.1:8265` from what `ray.init` returned, or None when there is no dashboard."""
    url = getattr(context, "dashboard_url", None)
    if not url:
        return None
    return f"Ray dashboard: {url if '://' in url else 'http://' + url}"


class ProgressDisplay:
    """A progress bar with step, reward, KL, step time and ETA, plus one line per step (readable in logs too) with
    the seconds of each phase."""

    def __init__(self, total_steps: int, console: Console | None = None, start_step: int = 0):
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=self.console, transient=True)
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="starting")
        self.history: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def __enter__(self) -> ProgressDisplay:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        kl = f"kl {record['kl/mean']:.4f}" if "kl/mean" in record else "kl off"
        status = f"reward {record['reward/mean']:.3f}  {kl}  {record['time/step']:.2f} s/step"
        if "distill/reverse_kl" in record:  # on-policy distillation: how far the policy still is from its teacher
            status = status.replace(f"  {kl}", f"  {kl}  rkl {record['distill/reverse_kl']:.4f}")
        if record.get("eval/reward/mean") is not None:  # a held-out evaluation of this step's weights
            status += f"  eval {record['eval/reward/mean']:.3f} pass@1 {record.get('eval/pass@1', math.nan):.3f}"
        self.progress.update(self.task, advance=1, status=status)
        self.progress.console.print(f"step {record['step']:>4}  {status}  "
                                    f"mismatch {record.get('logprob/mismatch', math.nan):.1e}  "
                                    f"[dim]{phase_breakdown(record)}{idle_breakdown(record)}[/dim]",
                                    soft_wrap=True)  # one line in logs

    def summary(self) -> None:
        """A final table: reward at the start and the end, mean step time and its phases."""
        if not self.history:
            return
        first, last = self.history[0], self.history[-1]
        tail = self.history[-10:]
        table = Table(title="relay: run summary", show_header=False)
        table.add_row("steps", str(last["step"]))
        table.add_row("wall time", f"{time.monotonic() - self.started:.0f} s")
        table.add_row(f"reward, step {first['step']}", f"{first['reward/mean']:.3f}")
        table.add_row(f"reward, mean of last {len(tail)}", f"{_mean([r['reward/mean'] for r in tail]):.3f}")
        evaluated = [r for r in self.history if r.get("eval/reward/mean") is not None]
        for record in evaluated[:1] + evaluated[1:][-1:]:  # the first and the last evaluation
            table.add_row(f"eval reward (pass@1), step {record['eval/step']}",
                          f"{record['eval/reward/mean']:.3f} ({record.get('eval/pass@1', math.nan):.3f})")
        for key in ("time/step", *PHASES):
            if any(key in r for r in self.history):  # time/eval: only in the steps that evaluated
                table.add_row(f"{key} (mean s)", f"{_mean([r.get(key, math.nan) for r in self.history]):.3f}")
        self.console.print(table)


PHASES = ("time/generate", "time/score", "time/reference", "time/teacher", "time/train", "time/sync", "time/eval")
_PHASE_LABELS = {"time/generate": "gen", "time/score": "score", "time/reference": "ref", "time/teacher": "teacher",
                 "time/train": "train", "time/sync": "sync", "time/eval": "eval"}


def phase_breakdown(record: dict[str, Any]) -> str:
    """`gen 1.20 score 0.05 ref 0.31 train 2.10 sync 0.40 s`: the step's seconds per phase (missing phases left
    out)."""
    parts = [f"{_PHASE_LABELS[key]} {record[key]:.2f}" for key in PHASES if key in record]
    return " ".join(parts) + " s" if parts else ""


def idle_breakdown(record: dict[str, Any]) -> str:
    """`  v3 stale 1  wait 0.01 idle 0.02 s`: the version the batch was sampled with, how many versions behind the
    learner it was, and the seconds the learner waited for it and the engines waited between requests (empty for a
    record without them)."""
    if "time/learner_wait" not in record:
        return ""
    return (f"  v{record.get('rollout/version', 0)} stale {record.get('async/staleness', 0)}  "
            f"wait {record['time/learner_wait']:.2f} idle {record.get('time/rollout_idle', 0.0):.2f} s")


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


class Timings(dict):
    """`time/<phase>` -> seconds; `timed(phase)` adds a block's wall time (a phase may run several times a step)."""

    @contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        yield
        key = f"time/{phase}"
        self[key] = self.get(key, 0.0) + time.perf_counter() - start


def version_stats(config: RunConfig, groups: list[list[Any]], fresh: int, sampled_with: int, version: int,
                  in_flight_loads: int | None) -> dict[str, float]:
    """The version that sampled the batch (`sampled_with`) and its staleness against the update that made `version`;
    with in-flight updates, that of its fresh groups' tokens and the loads made during requests."""
    stats = {"rollout/version": sampled_with, "async/staleness": version - 1 - sampled_with}
    if config.rollout.in_flight_updates:  # tokens sampled by versions newer than the batch's (fresh groups)
        tokens = np.concatenate([np.asarray(r.versions, np.float64) for g in groups[:fresh] for r in g])
        stats.update({"async/token_staleness": version - 1 - float(tokens.mean()),
                      "rollout/in_flight_loads": in_flight_loads})
    return stats


def episode_stats(rollouts: list[Any]) -> dict[str, float]:
    """Multi-turn: what the episodes trained on did (failures: every one scored)."""
    infos = [r.episode for r in rollouts if r.episode is not None]
    return {"env/turns/mean": statistics.fmean(e.turns for e in infos) if infos else 0.0,
            "env/calls": float(sum(e.calls for e in infos)),
            "env/invalid_calls": float(sum(e.invalid_calls for e in infos)),
            "env/truncated_observations": float(sum(e.truncated_observations for e in infos)),
            "env/episode_seconds": statistics.fmean(e.env_seconds for e in infos) if infos else 0.0,
            "response_length/model_tokens": statistics.fmean(
                float(np.sum(r.model_mask)) if r.model_mask is not None else len(r.response_ids) for r in rollouts)}


def step_record(config: RunConfig, step: int, rollouts: list[Any], sampling: dict[str, Any],
                parts: list[dict[str, Any]], timings: dict[str, float], step_seconds: float) -> dict[str, Any]:
    """One metrics line. `sampling`: the step's scoring and sampling stats (`reward/*` cover every completion scored
    this step, dropped groups too: they show how the policy does); `parts`: the learner's, the data's, the weights
    version, the fleet's; the rest covers the completions trained on."""
    lengths = [len(r.response_ids) for r in rollouts]
    record = {"step": step, **sampling, "rollout/completions": len(rollouts),
              "response_length/mean": statistics.fmean(lengths),
              "response/truncated_fraction": statistics.fmean(r.finish_reason == "length" for r in rollouts),
              **(episode_stats(rollouts) if config.env.enabled else {})}
    for part in parts:
        record.update(part)
    return {**record, **timings, "time/step": step_seconds, "throughput/tokens_per_s": sum(lengths) / step_seconds}

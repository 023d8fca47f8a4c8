"""What a run shows and records: `metrics.jsonl` (one JSON object per step) and the console display.

Owns: the metrics file's format (see DESIGN.md's contract), the progress display (rich) and the final summary.
Does not own: computing metrics (the driver and the learner do).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


class MetricsLog:
    """Appends one JSON object per step to `metrics.jsonl`, flushed so a crash loses at most the current step."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ProgressDisplay:
    """A progress bar with step, reward, KL, step time and ETA, plus one line per step (readable in logs too)."""

    def __init__(self, total_steps: int, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=self.console, transient=True)
        self.task = self.progress.add_task("train", total=total_steps, status="starting")
        self.history: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def __enter__(self) -> ProgressDisplay:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        status = (f"reward {record['reward/mean']:.3f}  kl {record.get('kl/mean', 0.0):.4f}  "
                  f"{record['time/step']:.2f} s/step")
        self.progress.update(self.task, advance=1, status=status)
        phases = " ".join(f"{k[5:]} {record[k]:.2f}" for k in _PHASES)
        self.progress.console.print(f"step {record['step']:>4}  {status}  mismatch {record['logprob/mismatch']:.1e}  "
                                    f"[dim]{phases}[/dim]")

    def summary(self) -> None:
        """A final table: reward at the start and the end, mean step time and its phases."""
        if not self.history:
            return
        first, last = self.history[0], self.history[-1]
        tail = self.history[-10:]
        table = Table(title="relay: run summary", show_header=False)
        table.add_row("steps", str(last["step"]))
        table.add_row("wall time", f"{time.monotonic() - self.started:.0f} s")
        table.add_row("reward, first step", f"{first['reward/mean']:.3f}")
        table.add_row(f"reward, mean of last {len(tail)}", f"{_mean([r['reward/mean'] for r in tail]):.3f}")
        for key in ("time/step", *_PHASES):
            table.add_row(f"{key} (mean s)", f"{_mean([r[key] for r in self.history]):.3f}")
        self.console.print(table)


_PHASES = ("time/generate", "time/score", "time/reference", "time/train", "time/sync")


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")

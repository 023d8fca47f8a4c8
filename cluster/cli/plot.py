"""`relay plot RUN_DIR`: a run's charts, drawn from its `metrics.jsonl` into one PNG.

Owns: reading a run directory's records for charts, the panels (`PANELS`) and their layout. Does not own: the
metrics (cluster/run/metrics.py writes them) or live dashboards (TensorBoard, W&B). matplotlib is imported only when a
chart is drawn, and only through `matplotlib.figure.Figure` (the Agg canvas: no display, no pyplot global state).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from cluster.run.metrics import PHASES, read_records

PANELS = ("Reward", "KL to the reference", "Response length", "Logprob mismatch, engine vs learner",
          "Seconds per phase, per step")
"""The panel titles, in drawing order (also written in the PNG's Description text chunk)."""

_REWARD_STATS = ("reward/mean", "reward/std")
_MARKER_BELOW = 40  # steps: with fewer points, each one gets a marker (a 1-step run still shows something)


def load_run(run_dir: Path) -> list[dict[str, Any]]:
    """The records of `run_dir/metrics.jsonl`, one per step in step order (the last record of a step wins).
    Raises ValueError (one line naming the path and the fix) when there is nothing to plot."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ValueError(f"run directory '{run_dir}' does not exist; pass the run_dir of a relay run")
    if not run_dir.is_dir():
        raise ValueError(f"'{run_dir}' is not a directory; pass the run_dir of a relay run (it holds metrics.jsonl)")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"'{run_dir}' holds no metrics.jsonl; pass the run_dir of a relay run (relay train "
                         "run_dir=PATH)")
    by_step = {record["step"]: record for record in read_records(path)}
    if not by_step:
        raise ValueError(f"'{path}' has no records yet; plot again once the run has finished a step")
    return [by_step[step] for step in sorted(by_step)]


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Draw the run's charts (`PANELS`) into a PNG, by default `run_dir/plots.png`; returns the path written."""
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / "plots.png"
    if out.suffix.lower() != ".png":
        raise ValueError(f"output file '{out}' must end in .png")
    records = load_run(run_dir)
    figure = plot_figure(records, title=f"relay: {run_dir.resolve().name}")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=110,
                   metadata={"Title": figure.get_suptitle(), "Description": "panels: " + "; ".join(PANELS)})
    return out


def plot_figure(records: list[dict[str, Any]], title: str = "relay run") -> Any:
    """A matplotlib Figure with one axes per entry of `PANELS`, in that order (the phases span the bottom row)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(13, 11), layout="constrained")
    grid = figure.add_gridspec(3, 2)
    axes = [figure.add_subplot(grid[0, 0]), figure.add_subplot(grid[0, 1]), figure.add_subplot(grid[1, 0]),
            figure.add_subplot(grid[1, 1]), figure.add_subplot(grid[2, :])]
    steps = [r["step"] for r in records]
    style = {"marker": "o", "markersize": 3} if len(steps) < _MARKER_BELOW else {}
    for ax, panel_title, draw in zip(axes, PANELS, (_reward, _kl, _length, _mismatch, _phases)):
        draw(ax, steps, records, style)
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    figure.suptitle(f"{title}: {len(steps)} steps ({steps[0]}-{steps[-1]})")
    return figure


def _series(records: list[dict[str, Any]], key: str) -> list[float]:
    """One value per record; NaN where the record lacks the key (matplotlib leaves a gap)."""
    return [math.nan if r.get(key) is None else float(r[key]) for r in records]  # null: not applicable


def _has(records: list[dict[str, Any]], key: str) -> bool:
    return any(not math.isnan(v) for v in _series(records, key))


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="gray", wrap=True)


def _reward(ax, steps, records, style) -> None:
    mean, std = _series(records, "reward/mean"), _series(records, "reward/std")
    ax.plot(steps, mean, label="reward/mean", color="C0", **style)
    if _has(records, "reward/std"):
        ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], color="C0",
                        alpha=0.2, label="mean +/- std")
    sources = sorted({k for r in records for k in r if k.startswith("reward/") and k not in _REWARD_STATS})
    for key in sources:
        ax.plot(steps, _series(records, key), label=key, linestyle="--", **style)
    evaluated = [r for r in records if r.get("eval/reward/mean") is not None]  # held-out evaluations (`eval.every`)
    for key, color in (("eval/reward/mean", "C3"), ("eval/pass@1", "C4")):
        points = [(r["eval/step"], r[key]) for r in evaluated if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), label=key, color=color, marker="s", markersize=4, linestyle=":")
    ax.set_ylabel("reward")
    ax.legend(loc="best", fontsize="small")


def _kl(ax, steps, records, style) -> None:
    if not _has(records, "kl/mean"):
        _note(ax, "KL off (no kl/mean: learner.kl_coef and learner.kl_reward_coef are 0)")
        return
    ax.plot(steps, _series(records, "kl/mean"), label="kl/mean", color="C3", **style)
    ax.set_ylabel("KL, token mean")
    ax.legend(loc="best", fontsize="small")


def _length(ax, steps, records, style) -> None:
    ax.plot(steps, _series(records, "response_length/mean"), label="response_length/mean", color="C2", **style)
    ax.set_ylabel("tokens")
    ax.legend(loc="best", fontsize="small")


def _mismatch(ax, steps, records, style) -> None:
    drawn = False
    for key, label in (("logprob/mismatch", "logprob/mismatch (token mean)"),
                       ("sync/probe_max_diff", "sync/probe_max_diff (probe, max)")):
        values = [v if v > 0 else math.nan for v in _series(records, key)]  # log scale: 0 cannot be drawn
        if any(not math.isnan(v) for v in values):
            ax.plot(steps, values, label=label, **style)
            drawn = True
    if not drawn:
        _note(ax, "no positive logprob/mismatch values to draw on a log scale")
        return
    ax.set_yscale("log")
    ax.axhline(1e-4, color="gray", linestyle=":", label="1e-4 (float32 expectation: below)")
    ax.set_ylabel("|logprob difference| (log scale)")
    ax.legend(loc="best", fontsize="small")


def _phases(ax, steps, records, style) -> None:
    present = [key for key in PHASES if _has(records, key)]
    if not present:
        _note(ax, "no time/* metrics")
        return
    # Stacked: the top edge is the phases' sum; the gap to time/step is the driver's own overhead.
    stacks = [[0.0 if math.isnan(v) else v for v in _series(records, key)] for key in present]
    labels = [key.removeprefix("time/") for key in present]
    if len(steps) < _MARKER_BELOW:  # few steps: stacked bars (an area over one step has no width)
        bottom = [0.0] * len(steps)
        for values, label in zip(stacks, labels):
            ax.bar(steps, values, bottom=bottom, label=label, alpha=0.8)
            bottom = [b + v for b, v in zip(bottom, values)]
    else:
        ax.stackplot(steps, stacks, labels=labels, alpha=0.8)
    top = max(sum(column) for column in zip(*stacks))
    if _has(records, "time/step"):
        totals = _series(records, "time/step")
        ax.plot(steps, totals, color="black", label="time/step (whole step)", **style)
        top = max(top, max(v for v in totals if not math.isnan(v)))
    ax.set_ylim(0, top * 1.3 or 1.0)  # headroom for the legend
    ax.set_ylabel("seconds")
    ax.legend(loc="upper left", fontsize="small", ncol=len(present) + 1)

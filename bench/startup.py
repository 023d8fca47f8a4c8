"""Where a run's start goes: `relay train max_steps=1` as a user runs it, broken into start-up's phases.

Usage: python bench/startup.py [--shapes demo 25M] [--workers 1 2] [--runs N] [dotted.key=value ...]
Each configuration (shape x rollout workers) runs `--runs` times (default 5) as a whole `relay train` process; the table
shows the median of each phase, read from the run's own first record (`time/startup/*`, cluster/run/startup.py: the
driver times its phases from the process's start, each actor marks when its process started, began importing, loading
and warming up, and was ready), and the process's wall time to its exit. Phases, in order: the CLI's imports, the
input checks, Ray's start, the run directory and registry, the actors' start (to every actor ready), the sync probe's
calibration (noise floor), the first step; per actor: its process's start after the driver asked for it, Ray's worker
start in it (boot), its imports, its model's load and (engines) warm-up. `25M` is bench/vs_trl.py's random-init Qwen2
of relay's 25M shape, 64 new tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ["imports", "checks", "ray", "registry", "actors", "probe", "first_step", "total"]
ACTORS = ["learner", "reference", "rollout_worker_0", "rollout_worker_1"]
PARTS = ["process", "boot", "imports", "load", "warm_up"]
SCRIPT = Path(sys.executable).parent / "relay"
RELAY = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "cluster.cli"]


def one_run(overrides: list[str], tmp: Path) -> dict[str, float]:
    """One `relay train max_steps=1` process: its first record's `time/startup/*` (without the prefix) and `wall`."""
    run_dir = tmp / f"run-{time.time_ns()}"
    started = time.time()
    result = subprocess.run([*RELAY, "train", "max_steps=1", f"run_dir={run_dir}", "--quiet", *overrides],
                            capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.time() - started
    if result.returncode != 0:
        raise SystemExit(f"relay train failed ({result.returncode}): {result.stderr[-2000:]}")
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    return {**{k.removeprefix("time/startup/"): v for k, v in first.items() if k.startswith("time/startup/")},
            "wall": wall}


def configuration(shape: str, workers: int, extra: list[str]) -> list[str]:
    """The overrides of one configuration (run_dir and max_steps apart)."""
    if shape == "demo":
        return [f"rollout.num_workers={workers}", *extra]
    from bench.vs_trl import relay_overrides

    _, overrides = relay_overrides("25M", 1, [f"rollout.num_workers={workers}", *extra])
    return [o for o in overrides if not o.startswith("max_steps=")]


def table(results: dict[str, list[dict[str, float]]]) -> str:
    """Markdown: one row per phase (and per actor's part), one column per configuration, median seconds."""
    names = list(results)
    rows = [f"| phase | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]

    def row(label: str, key: str) -> None:
        values = [[r[key] for r in runs if key in r] for runs in results.values()]
        if any(values):
            cells = [f"{statistics.median(v):.1f}" if v else "-" for v in values]
            rows.append(f"| {label} | {' | '.join(cells)} |")

    for phase in PHASES:
        row(f"**{phase}**" if phase == "total" else phase, phase)
    row("engine (slowest load + warm-up)", "engine")
    for actor in ACTORS:
        for part in PARTS:
            row(f"{actor.replace('_', ' ')}: {part}", f"{actor}/{part}")
    row("process wall time (to exit)", "wall")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["demo"], choices=["demo", "25M"])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--label", help="the configurations' column names start with it (e.g. the commit)")
    parser.add_argument("--save", metavar="FILE.jsonl", help="also append each run's figures to FILE, a line each")
    parser.add_argument("--table", metavar="FILE.jsonl", help="run nothing: the table of the runs saved in FILE "
                                                              "(runs of one column made in several calls, "
                                                              "interleaved with another's, as the machine drifts)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value applied to every run")
    args = parser.parse_args()

    results: dict[str, list[dict[str, float]]] = {}
    if args.table:
        for line in Path(args.table).read_text().splitlines():
            run = json.loads(line)
            results.setdefault(run.pop("configuration"), []).append(run)
        print(table(results))
        return
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            for workers in args.workers:
                name = f"{args.label + ': ' if args.label else ''}{shape}, {workers} worker{'s' if workers > 1 else ''}"
                overrides = configuration(shape, workers, args.overrides)
                results[name] = []
                for i in range(args.runs):
                    results[name].append(one_run(overrides, Path(tmp)))
                    print(f"startup: {name}, run {i + 1}: first step at {results[name][-1]['total']:.1f} s, "
                          f"exit at {results[name][-1]['wall']:.1f} s", file=sys.stderr, flush=True)
                    if args.save:
                        with open(args.save, "a") as saved:
                            saved.write(json.dumps({"configuration": name, **results[name][-1]}) + "\n")
    load = os.getloadavg()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average at the end "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; median of {args.runs} runs, seconds\n")
    print(table(results))


if __name__ == "__main__":
    main()

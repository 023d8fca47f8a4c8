"""Chaos: SIGKILL one of relay's processes at a seeded random moment of a demo run, and check what the run lost.

Usage: python bench/chaos.py [--faults 8] [--steps 6] [--seed 0] [--kinds rollout reference learner driver]
                             [dotted.key=value ...]
Each fault is one `relay train` run (the demo config, `--steps` steps, a checkpoint every 2 steps) of a seeded draw
of: the process kind (`--kinds`), the number of rollout workers (1-3), on-policy or asynchronous
(`rollout.max_staleness=1`), the step after whose record the kill comes (1 .. steps-2) and a delay (0-0.2 s).
The kill is a SIGKILL of that process, as an OOM kill or a lost node would: a rollout worker (`ray::RolloutWorker`), the
reference (`ray::ReferenceWorker`), the learner (`ray::Learner`), or the driver (the `relay train` process itself).
The run goes on by itself, or stops, and is then continued with `relay train run_dir=... resume=auto`, as a user
would (at most twice). Per fault: whether it finished, how, the steps recorded (each once: 1..steps), the prompts
lost (completions missing from a step's record, / G), whether every step's reward, KL and loss equal those of the
same settings' run without the fault (exact: what docs/operations.md promises for these faults), and the longest
step. Runs of one settings share one fault-free run.
Not killed here yet: reward models, environment and verifier servers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "relay"
RELAY = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "cluster.cli"]
KINDS = {"rollout": "ray::RolloutWorker", "reference": "ray::ReferenceWorker", "learner": "ray::Learner",
         "driver": None}
COMPARED = ("reward/mean", "kl/mean", "loss/policy", "response_length/mean")


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train(run_dir: Path, args: list[str], resume: bool = False, kill: Any = None, timeout: float = 900) -> int:
    """`relay train` with `args` into `run_dir` (or `resume=auto` of it); `kill(process)`, given, runs in a thread
    beside it. Its exit code."""
    command = [*RELAY, "train", f"run_dir={run_dir}", "--quiet", *args, *(["resume=auto"] if resume else [])]
    with open(run_dir.parent / f"{run_dir.name}.log", "a") as log:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own, which dies with it
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log, env={**env, "PYTHONPATH": str(ROOT)})
        killer = threading.Thread(target=kill, args=(process,), daemon=True) if kill else None
        if killer:
            killer.start()
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        if killer:
            killer.join(timeout=60)
    return code


def killer(kind: str, run_dir: Path, after_step: int, delay: float, killed: list[int]) -> Any:
    """A `train` kill: once step `after_step` is recorded and `delay` s more have passed, SIGKILL the `kind` process
    (the pids go to `killed`)."""
    import psutil

    def kill(process: subprocess.Popen) -> None:
        while process.poll() is None and len(records(run_dir)) < after_step:
            time.sleep(0.02)
        time.sleep(delay)
        if process.poll() is not None:
            return
        if KINDS[kind] is None:
            process.kill()
            killed.append(process.pid)
            return
        for proc in psutil.Process(process.pid).children(recursive=True):  # its Ray's processes: this run's
            try:
                if any(part.startswith(KINDS[kind]) for part in proc.cmdline()):
                    proc.kill()
                    killed.append(proc.pid)
                    return
            except psutil.Error:
                continue

    return kill


def settings_args(workers: int, asynchronous: bool, steps: int, overrides: list[str]) -> list[str]:
    return [f"max_steps={steps}", f"rollout.num_workers={workers}", f"rollout.max_staleness={int(asynchronous)}",
            "checkpoint.every=2", "ray.num_cpus=4", *overrides]  # Ray's logical CPUs: room for 3 workers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--dir", type=Path, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--only", type=int, nargs="+", help="run only these faults (the draws stay the seed's)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = args.dir or Path(tempfile.mkdtemp(prefix="relay-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    # The kill: after a step's record, within the next step (a demo step takes 0.2-0.4 s here; a kill that comes
    # after the run's end is reported as not killed).
    draws = [(args.kinds[i % len(args.kinds)], rng.randint(1, 3), rng.random() < 0.5, rng.randint(1, args.steps - 2),
              rng.uniform(0.0, 0.2)) for i in range(args.faults)]
    clean: dict[tuple[int, bool], list[dict[str, Any]]] = {}
    rows = []
    for n, (kind, workers, asynchronous, after_step, delay) in enumerate(draws):
        if args.only and n not in args.only:
            continue
        run_args = settings_args(workers, asynchronous, args.steps, args.overrides)
        if (workers, asynchronous) not in clean:
            clean_dir = root / f"clean-{workers}-{int(asynchronous)}"
            train(clean_dir, run_args)
            clean[workers, asynchronous] = records(clean_dir)
        run_dir, killed = root / f"fault-{n}", []
        started = time.monotonic()
        codes = [train(run_dir, run_args, kill=killer(kind, run_dir, after_step, delay, killed))]
        while codes[-1] != 0 and len(codes) < 3:  # stopped: continue it as a user would
            codes.append(train(run_dir, run_args, resume=True))
        got, expected = records(run_dir), clean[workers, asynchronous]
        done = {r["step"]: r.get("rollout/completions", 0) for r in got}
        group = 8  # the demo's rollout.group_size
        steps_once = [r["step"] for r in got] == list(range(1, args.steps + 1))
        rows.append({
            "fault": n, "kind": kind, "workers": workers, "mode": "async" if asynchronous else "on-policy",
            "after": after_step, "killed": bool(killed), "finished": codes[-1] == 0,
            "how": "by itself" if len(codes) == 1 else f"resume=auto x{len(codes) - 1}",
            "steps": steps_once,
            "lost": sum(e["rollout/completions"] - done.get(e["step"], 0) for e in expected) / group,
            "exact": steps_once and all([r.get(k) for r in got] == [r.get(k) for r in expected] for k in COMPARED),
            "longest": max((r.get("time/step", 0.0) for r in got), default=float("nan")),
            "wall": time.monotonic() - started})
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; demo config, "
          f"{args.steps} steps, checkpoint every 2; seed {args.seed}; runs in {root}")
    print("| fault | process | workers | mode | after step | killed | finished | how | steps 1..N once | "
          "prompts lost | exact | longest step s | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fault']} | {r['kind']} | {r['workers']} | {r['mode']} | {r['after']} | "
              f"{'yes' if r['killed'] else 'no'} | {'yes' if r['finished'] else 'NO'} | {r['how']} | "
              f"{'yes' if r['steps'] else 'NO'} | {r['lost']:.0f} | {'yes' if r['exact'] else 'no'} | "
              f"{r['longest']:.2f} | {r['wall']:.0f} |")
    print("\n| process | faults | killed | finished | of them by resume=auto | steps 1..N once | prompts lost | "
          "exact |\n|---|---|---|---|---|---|---|---|")
    for kind in dict.fromkeys(r["kind"] for r in rows):
        some = [r for r in rows if r["kind"] == kind]
        print(f"| {kind} | {len(some)} | {sum(r['killed'] for r in some)} | {sum(r['finished'] for r in some)} | "
              f"{sum(r['how'] != 'by itself' for r in some)} | {sum(r['steps'] for r in some)} | "
              f"{sum(r['lost'] for r in some):.0f} | {sum(r['exact'] for r in some)} |")


if __name__ == "__main__":
    main()

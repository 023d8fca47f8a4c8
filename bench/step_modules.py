"""Which of relay's modules one training step runs, in every process of a default demo run.

Usage: python bench/step_modules.py [--steps 8] [--first 3] [--last 7] [--git REF] [--functions] [key=value ...]
Runs `relay train` (the demo's defaults, `--steps` steps) with a profile hook in every Python process of the run (a
`sitecustomize` on PYTHONPATH, which Ray's workers inherit): each call of a function defined in one of relay's files
is noted with its time (0.1 s buckets), and the driver notes when `Trainer.step` starts and ends. A module counts when
one of its functions ran between the start of step `--first` and the end of step `--last`, in any process. Printed:
the count (config modules, whose properties every process reads, left out: cluster/config.py, rewards/config.py and
the sections they compose), then the modules by process kind. `--git REF` counts a checkout of REF instead (a
worktree in a temporary directory), so two trees are counted the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG_MODULES = {"cluster/config.py", "rewards/config.py", "cluster/run_sections.py", "cluster/data_config.py",
                  "learner/config.py", "sync/config.py", "actors/config.py"}
TRACER = '''
import atexit, json, os, sys, threading, time
_root, _out = os.environ["RELAY_TRACE_ROOT"] + "/", os.environ["RELAY_TRACE_DIR"]
_seen, _steps, _lock = set(), [], threading.Lock()

def _note(frame, event, arg):
    if event != "call":
        return
    name = frame.f_code.co_filename
    if not name.startswith(_root) or "/.venv/" in name:
        return
    _seen.add((name[len(_root):], frame.f_code.co_name, int(time.time() * 10)))
    if frame.f_code.co_name == "step" and name.endswith("cluster/run/trainer.py"):
        _steps.append((frame.f_locals.get("step"), time.time()))

def _dump():
    with _lock:
        path = os.path.join(_out, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"argv": sys.argv[:3], "seen": sorted(_seen), "steps": _steps, "end": time.time()}, f)
        os.replace(path + ".tmp", path)

def _loop():
    while True:
        time.sleep(1.0)
        _dump()

sys.setprofile(_note)
threading.setprofile(_note)
threading.Thread(target=_loop, daemon=True).start()
atexit.register(_dump)
'''


def trace(tree: Path, out: Path, steps: int, overrides: list[str]) -> None:
    """Run the demo in `tree` with the tracer; its files land in `out`."""
    hook = out / "hook"
    hook.mkdir(parents=True)
    (hook / "sitecustomize.py").write_text(TRACER)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=f"{hook}:{tree}", RELAY_TRACE_ROOT=str(tree), RELAY_TRACE_DIR=str(out))
    command = [sys.executable, "-m", "cluster.cli", "train", f"run_dir={out / 'run'}", "--quiet",
               f"max_steps={steps}", *overrides]
    subprocess.run(command, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kind_of(argv: list[str], seen: set[str]) -> str:
    """Which process of the run a trace is: the driver, or the actor whose module ran in it."""
    if any("cluster.cli" in a or "cluster/cli" in a or a.endswith("relay") for a in argv):
        return "driver"
    for module, kind in (("actors/rollout.py", "rollout worker"), ("learner/learner.py", "learner"),
                         ("actors/reference.py", "reference"), ("cluster/fleet/control.py", "run registry")):
        if module in seen:
            return kind
    return "other"


def count(out: Path, first: int, last: int) -> dict[str, set[tuple[str, str]]]:
    """(module, function) pairs by process kind that ran between the start of step `first` and the end of step
    `last`."""
    traces = [json.loads(p.read_text()) for p in out.glob("*.json")]
    starts = [(s, t) for trace in traces for s, t in trace["steps"]]
    step_starts = sorted(t for s, t in starts if s == first)
    after = sorted(t for s, t in starts if s == last + 1)
    if not step_starts or not after:
        raise SystemExit(f"steps {first} and {last + 1} were not both traced: run more steps")
    begin, end = step_starts[0], after[0]  # the end of step `last` is the start of the next
    modules: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for trace in traces:
        ran = {(name, function) for name, function, bucket in trace["seen"]
               if begin * 10 - 1 <= bucket <= end * 10 + 1 and name not in CONFIG_MODULES
               and not name.startswith(("tests/", "bench/"))}
        if ran:
            modules[kind_of(trace["argv"], {name for name, _ in ran})] |= ran
    return modules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--first", type=int, default=3)
    parser.add_argument("--last", type=int, default=7)
    parser.add_argument("--git", help="count a checkout of this git ref instead of the working tree")
    parser.add_argument("--functions", action="store_true", help="list the functions that ran in each module")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tree = ROOT
        if args.git:
            tree = Path(tmp) / "tree"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.git], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            trace(tree, Path(tmp) / "trace", args.steps, args.overrides)
            modules = count(Path(tmp) / "trace", args.first, args.last)
        finally:
            if args.git:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    every = {name for ran in modules.values() for name, _ in ran}
    print(f"{len(every)} modules ran in steps {args.first}-{args.last} ({args.git or 'working tree'}), config "
          "modules left out")
    for kind, ran in sorted(modules.items()):
        names = sorted({name for name, _ in ran})
        print(f"- {kind} ({len(names)}): {', '.join(names)}")
        if args.functions:
            for name in names:
                print(f"    {name}: {', '.join(sorted(f for n, f in ran if n == name))}")


if __name__ == "__main__":
    main()

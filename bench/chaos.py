"""Chaos: SIGKILL one of relay's processes at a seeded moment of a demo run, and check what the run lost.

Usage: python bench/chaos.py [--faults 35] [--steps 6] [--seed 0] [--kinds ...] [dotted.key=value ...]
Each fault is one `relay train` run (`--steps` steps, a checkpoint every 2) of a seeded draw: the process killed, 1-3
rollout workers, on-policy or asynchronous (`rollout.max_staleness=1`), the step after whose record the kill comes,
a delay, and for a server the delay before it starts again on its port and the client's `on_failure` (fail, drop).
Processes: rollout worker, reference, learner, driver (the demo), a frozen reward model (the demo with a tiny one),
the verifier server (`relay verifier serve`, scoring the demo) and the environment server (`relay env serve`,
configs/agent_calc.yaml); a stopped run is continued with `resume=auto`, as a user would (at most twice). Per fault:
finished, steps recorded once each, groups dropped (counted in the record), prompts lost (missing and not counted),
exact (reward, KL, loss, length equal those of the same settings' fault-free run), the longest step. Exits 1 unless
every run finished, recorded each step once, lost nothing and is exact or counted what it dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "relay"
RELAY = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "cluster.cli"]
# The process each kind kills: a Ray actor's (its name), the driver (None), or a served service (the setup's).
KINDS = {"rollout": "ray::RolloutWorker", "reference": "ray::ReferenceWorker", "reward_model": "ray::RewardModelWorker",
         "env_server": "service", "verifier_server": "service", "learner": "ray::Learner", "driver": None}
SETUP = {"reward_model": "reward_model", "env_server": "env", "verifier_server": "verifier"}  # else the demo
COMPARED = ("reward/mean", "kl/mean", "loss/policy", "response_length/mean")
DROPS = ("verifier/dropped_groups", "env/dropped_groups")
# A client's retries that span a service's restart of a few seconds: up to 8, from 0.5 s doubling to 4 s, full
# jitter (12 s on average); the defaults (3 from 0.25 s) wait at most 1.75 s in all.
RETRIES = ("max_retries=8", "backoff=0.5", "backoff_max=4")


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own, which dies with it
    return {**env, "PYTHONPATH": str(ROOT)}


def train(run_dir: Path, args: list[str], resume: bool = False, kill: Any = None, timeout: float = 900) -> int:
    """`relay train` with `args` (a config file first, if any) into `run_dir` (or `resume=auto` of it); `kill(process)`,
    given, runs in a thread beside it. Its exit code."""
    command = [*RELAY, "train", *args, f"run_dir={run_dir}", "--quiet", *(["resume=auto"] if resume else [])]
    with open(run_dir.parent / f"{run_dir.name}.log", "a") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log, env=child_env())
        killer = threading.Thread(target=kill, args=(process,), daemon=True) if kill else None
        if killer:
            killer.start()
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        if killer:
            killer.join(timeout=120)  # a server's restart included: a resumed run finds it up
    return code


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Service:
    """A `relay verifier serve` or `relay env serve` (`args`) on a fixed port, run as a user's supervisor would: killed,
    it is started again on the same port."""

    args: list[str]
    log: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        """Start it and wait until `/health` answers 200."""
        with open(self.log, "a") as log:
            self.process = subprocess.Popen([*RELAY, *self.args, "--port", str(self.port)], cwd=ROOT, stdout=log,
                                            stderr=log, env=child_env())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{' '.join(self.args)} did not start on port {self.port}: see {self.log}")

    def kill(self) -> int:
        """SIGKILL it (as an OOM kill or a lost machine would); its pid."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()
        return self.process.pid

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


def killer(kind: str, run_dir: Path, after_step: int, delay: float, killed: list[int], service: Service | None = None,
           restart_after: float = 0.0) -> Any:
    """A `train` kill: once step `after_step` is recorded and `delay` s more have passed, SIGKILL the `kind` process
    (the pids go to `killed`); a service is started again `restart_after` s later, on its port."""

    def kill(process: subprocess.Popen) -> None:
        while process.poll() is None and len(records(run_dir)) < after_step:
            time.sleep(0.02)
        time.sleep(delay)
        if process.poll() is not None:
            return
        if KINDS[kind] is None:
            process.kill()
            killed.append(process.pid)
        elif KINDS[kind] == "service":
            assert service is not None, f"{kind}: give its service"
            killed.append(service.kill())
            time.sleep(restart_after)
            service.start()
        else:
            kill_actor(process.pid, KINDS[kind], killed)

    return kill


def kill_actor(driver: int, name: str, killed: list[int]) -> None:
    """SIGKILL the first process under `driver` (its Ray's: this run's) whose command line starts with `name`."""
    import psutil

    for proc in psutil.Process(driver).children(recursive=True):
        try:
            if any(part.startswith(name) for part in proc.cmdline()):
                proc.kill()
                killed.append(proc.pid)
                return
        except psutil.Error:
            continue


def settings_args(workers: int, asynchronous: bool, steps: int, overrides: list[str]) -> list[str]:
    return [f"max_steps={steps}", f"rollout.num_workers={workers}", f"rollout.max_staleness={int(asynchronous)}",
            "checkpoint.every=2", "ray.num_cpus=4", *overrides]  # Ray's logical CPUs: room for 3 workers


class Setups:
    """Each kind's run config (`args`) and the services it runs against, started once and kept for every run."""

    def __init__(self, root: Path):
        self.root = root
        self.services: dict[str, Service] = {}
        self.rm_dir: Path | None = None

    def service(self, setup: str) -> Service | None:
        if setup not in ("verifier", "env"):
            return None
        if setup not in self.services:
            args = (["verifier", "serve", "--verifier", "exact_match"] if setup == "verifier" else
                    ["env", "serve", "--env", "rewards.environments.examples:Calculator", "--param", "max_calls=2"])
            self.services[setup] = Service(args, self.root / f"{setup}-service.log")
            self.services[setup].start()
        return self.services[setup]

    def args(self, setup: str, on_failure: str) -> list[str]:
        """The overrides (a config file first) of `setup`'s runs, its clients failing with `on_failure`."""
        if setup == "reward_model":
            return ["reward.sources.correct.verifier=exact_match", "reward.sources.rm.type=model",
                    f"reward.sources.rm.path={self.reward_model()}", "reward.sources.rm.weight=0.1"]
        if setup == "verifier":
            judge = "reward.sources.judge"
            return [f"{judge}.type=remote", f"{judge}.urls=[{self.service(setup).url}]",
                    f"{judge}.on_failure={on_failure}", *(f"{judge}.{r}" for r in RETRIES)]
        if setup == "env":
            return ["configs/agent_calc.yaml", "env.spec=null", "env.params=null",
                    f"env.urls=[{self.service(setup).url}]", f"env.on_failure={on_failure}",
                    *(f"env.{r}" for r in RETRIES)]
        return []

    def reward_model(self) -> Path:
        """A tiny random reward model (one scalar head; what it scores does not matter here), made once."""
        if self.rm_dir is None:
            from cluster.demo.model import make_random_reward_model_dir

            self.rm_dir = make_random_reward_model_dir(self.root / "reward-model", seed=2)
        return self.rm_dir

    def close(self) -> None:
        for service in self.services.values():
            service.stop()


@dataclass(frozen=True)
class Fault:
    n: int
    kind: str
    workers: int
    asynchronous: bool
    after_step: int
    delay: float
    restart_after: float
    on_failure: str

    @property
    def setup(self) -> str:
        return SETUP.get(self.kind, "demo")


def draw(kinds: list[str], faults: int, steps: int, seed: int) -> list[Fault]:
    """The seed's faults: kinds in turn; the kill within the step after `after_step`'s record (a demo step is short;
    a kill that would come after the run's end is reported as not killed)."""
    rng = random.Random(seed)
    return [Fault(i, kinds[i % len(kinds)], rng.randint(1, 3), rng.random() < 0.5, rng.randint(1, steps - 2),
                  rng.uniform(0.0, 0.2), rng.uniform(0.0, 2.0), rng.choice(("fail", "drop"))) for i in range(faults)]


def run_fault(fault: Fault, setups: Setups, steps: int, overrides: list[str],
              clean: dict[tuple[str, int, bool], list[dict[str, Any]]]) -> dict[str, Any]:
    """Run `fault` (and, first, its settings' fault-free run, once), continue it if it stopped; its row."""
    root, server = setups.root, KINDS[fault.kind] == "service"
    base = settings_args(fault.workers, fault.asynchronous, steps, overrides)
    key = (fault.setup, fault.workers, fault.asynchronous)
    if key not in clean:
        clean[key] = fault_free(root / f"clean-{fault.setup}-{fault.workers}-{int(fault.asynchronous)}",
                                [*setups.args(fault.setup, "fail"), *base])
    run_args = [*setups.args(fault.setup, fault.on_failure), *base]
    run_dir, killed = root / f"fault-{fault.n}", []
    started = time.monotonic()
    kill = killer(fault.kind, run_dir, fault.after_step, fault.delay, killed, setups.service(fault.setup) if server
                  else None, fault.restart_after)
    codes = [train(run_dir, run_args, kill=kill)]
    while codes[-1] != 0 and len(codes) < 3:  # stopped: continue it as a user would
        codes.append(train(run_dir, run_args, resume=True))
    return {"fault": fault.n, "kind": fault.kind, "workers": fault.workers,
            "mode": "async" if fault.asynchronous else "on-policy", "after": fault.after_step,
            "on_failure": fault.on_failure if server else "-", "killed": bool(killed), "finished": codes[-1] == 0,
            "how": "by itself" if len(codes) == 1 else f"resume=auto x{len(codes) - 1}",
            **compare(records(run_dir), clean[key], steps, group_size(run_dir)), "wall": time.monotonic() - started}


def fault_free(run_dir: Path, args: list[str]) -> list[dict[str, Any]]:
    """The records of a run without a fault; run once more from scratch if it fails (something else on the machine
    may have killed one of its processes), then given up."""
    for _ in range(2):
        shutil.rmtree(run_dir, ignore_errors=True)
        if train(run_dir, args) == 0:
            return records(run_dir)
    raise SystemExit(f"the fault-free run failed twice: see {run_dir}.log")


def group_size(run_dir: Path) -> int:
    import yaml

    return int(yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"]["group_size"])


def compare(got: list[dict[str, Any]], expected: list[dict[str, Any]], steps: int, group: int) -> dict[str, Any]:
    """A run's records against its settings' fault-free run: steps recorded once each, groups dropped and counted
    (`DROPS`), prompts lost (missing from a step's record and not counted), exact, the longest step."""
    done = {r["step"]: r.get("rollout/completions", 0) for r in got}
    once = [r["step"] for r in got] == list(range(1, steps + 1))
    missing = sum(e["rollout/completions"] - done.get(e["step"], 0) for e in expected) / group
    dropped = sum(r.get(k, 0.0) for r in got for k in DROPS)
    return {"steps": once, "dropped": dropped, "lost": missing - dropped,
            "exact": once and all([r.get(k) for r in got] == [r.get(k) for r in expected] for k in COMPARED),
            "longest": max((r.get("time/step", 0.0) for r in got), default=float("nan"))}


def passed(row: dict[str, Any]) -> bool:
    """What the docs promise: the run finishes, records each step once, loses nothing, and is the fault-free run
    unless it dropped groups under `on_failure=drop` (and counted them)."""
    return row["finished"] and row["steps"] and row["lost"] == 0 and (row["exact"] or row["dropped"] > 0)


def print_tables(rows: list[dict[str, Any]]) -> None:
    print("| fault | process | workers | mode | on_failure | after step | killed | finished | how | steps 1..N once | "
          "groups dropped, counted | prompts lost | exact | longest step s | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fault']} | {r['kind']} | {r['workers']} | {r['mode']} | {r['on_failure']} | {r['after']} | "
              f"{'yes' if r['killed'] else 'no'} | {'yes' if r['finished'] else 'NO'} | {r['how']} | "
              f"{'yes' if r['steps'] else 'NO'} | {r['dropped']:.0f} | {r['lost']:.0f} | "
              f"{'yes' if r['exact'] else 'no'} | {r['longest']:.2f} | {r['wall']:.0f} |")
    print("\n| process | faults | killed | finished | of them by resume=auto | steps 1..N once | groups dropped, "
          "counted | prompts lost | exact |\n|---|---|---|---|---|---|---|---|---|")
    for kind in dict.fromkeys(r["kind"] for r in rows):
        some = [r for r in rows if r["kind"] == kind]
        print(f"| {kind} | {len(some)} | {sum(r['killed'] for r in some)} | {sum(r['finished'] for r in some)} | "
              f"{sum(r['how'] != 'by itself' for r in some)} | {sum(r['steps'] for r in some)} | "
              f"{sum(r['dropped'] for r in some):.0f} | {sum(r['lost'] for r in some):.0f} | "
              f"{sum(r['exact'] for r in some)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=35)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--dir", type=Path, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--only", type=int, nargs="+", help="run only these faults (the draws stay the seed's)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="relay-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    setups, clean, rows = Setups(root), {}, []
    try:
        for fault in draw(args.kinds, args.faults, args.steps, args.seed):
            if not args.only or fault.n in args.only:
                rows.append(run_fault(fault, setups, args.steps, args.overrides, clean))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress, for a long run
    finally:
        setups.close()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; {args.steps} steps, "
          f"checkpoint every 2; seed {args.seed}; runs in {root}")
    print_tables(rows)
    failed = [r["fault"] for r in rows if not passed(r)]
    print(f"\nfailed: faults {failed}" if failed else "\nevery fault: finished, each step once, nothing lost, exact or "
          "its drops counted")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

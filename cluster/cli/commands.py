"""The `relay` command line: train, plan, eval, export, submit/jobs/stop (Ray jobs), scale/status (a running run),
plot, build-demo-model, verifier serve, env serve, serve (the Tinker API).

Owns: argument parsing, turning user errors into one line on stderr with exit code 2 (nothing written), and the
import of heavy libraries only once a command needs them, so `relay --help` is instant.
Does not own: the run itself (cluster/run/launch.py), the Ray Jobs client (cluster/cli/jobs.py), the charts
(cluster/cli/plot.py), the plan (cluster/cli/plan.py), the services' commands (cluster/cli/services.py) or the
cluster's run registry (cluster/fleet/control.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cluster.cli.plan import add_plan_command, run_plan
from cluster.cli.services import add_env_commands, add_verifier_commands, run_env_serve, run_verifier_serve
from cluster.config import ConfigError, load_config
from cluster.tinker.command import add_serve_command, run_serve

TRAIN_HELP = """\
Train a policy. With no CONFIG, runs the built-in demo: GRPO on `a+b=` arithmetic with a small local model,
2 vLLM rollout workers, a reference worker for the KL penalty and a learner, on a local Ray instance.

Overrides are dotted keys, e.g.:  relay train max_steps=20 learner.lr=5e-4 rollout.num_workers=3
Algorithm presets (on the demo tasks): configs/{ppo,grpo,dr_grpo,dapo,rloo,reinforce_pp,gspo,reinforce,grpo_process,
  iterative_grpo,grpo_lora,distill}.yaml, e.g.
  relay train configs/ppo.yaml critic.lr=5e-5          (docs/algorithms.md)
A tool-using agent (multi-turn episodes with an environment):  relay train configs/agent_calc.yaml
  (env.spec=module:Class or env.urls=[...], rollout.max_turns, rollout.stop; docs/environments.md)
Outputs go to run_dir (default runs/<time>): config.yaml, metrics.jsonl, tensorboard/, checkpoints/step_N/.
A killed or failed run continues exactly with:  relay train [CONFIG.yaml] run_dir=PATH resume=auto
Charts of a run:  relay plot RUN_DIR        (docs/operations.md)
"""


EVAL_HELP = """\
Evaluate a checkpoint, or the base model, on held-out prompts with the run's evaluation (the `eval` section: eval.data,
eval.num_samples, eval.temperature, eval.max_prompts, eval.sources; docs/operations.md). With checkpoint=PATH and no
CONFIG, the checkpoint's own config is used, so the numbers are those the run logged at that step.
Prints a table and writes DIR/eval.json (run_dir=DIR; default runs/eval-<time>) with the metrics' own keys.
  relay eval checkpoint=runs/demo/checkpoints/step_40
  relay eval data.held_out=0.1                  (the demo's base model on the demo task's held-out problems)
"""


EXPORT_HELP = """\
Write a checkpoint's policy as a standalone Hugging Face directory. A full fine-tuning checkpoint's weights are copied
as they are. A LoRA checkpoint (learner.lora) holds adapters: with --merge they are merged into the base model's
weights (in float32, saved in the run's model.dtype; with learner.lora.modules_to_save, the trained layers too) and
the directory loads in transformers and vLLM like any model; without it, the adapters are written in peft's format
with the base's tokenizer (PeftModel.from_pretrained, or vLLM's LoRA serving on the base when there are no
modules_to_save).
  relay export runs/lora/checkpoints/step_40 --merge --out exported/lora-40
"""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Options may come anywhere among a run's overrides (`relay train a=1 --quiet b=2`): argparse stops the
    # positional list at the first option, so the overrides after it come back here, in order.
    if extra and getattr(args, "items", None) is not None and not any(e.startswith("-") for e in extra):
        args.items += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # The user's own verifiers, environments and tools (`mypkg.rewards:score`) import from the current directory, as
    # with `python -m`: the `relay` script's own directory is on the path instead. Ray's workers add it themselves.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return _run(args)
    except ConfigError as err:
        print(f"relay: config error: {err}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    """Every command's arguments and help, in the order `relay --help` lists them."""
    parser = argparse.ArgumentParser(prog="relay", description="relay: RL fine-tuning of language models on Ray.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    train = commands.add_parser("train", help="train a policy (no CONFIG: the built-in demo)", description=TRAIN_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                       help="an optional YAML config file, then dotted overrides")
    train.add_argument("--quiet", action="store_true", help="no progress display (metrics.jsonl is still written)")
    add_plan_command(commands)
    evaluate = commands.add_parser("eval", help="evaluate a checkpoint or the base model on held-out prompts",
                                   description=EVAL_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    evaluate.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [checkpoint=PATH] [run_dir=DIR] [key=value ...]",
                          help="an optional YAML config file, the checkpoint, the output directory, then overrides")
    export = commands.add_parser("export", help="write a checkpoint's policy as a Hugging Face model directory",
                                 description=EXPORT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="a run_dir/checkpoints/step_<N> directory")
    export.add_argument("--out", metavar="DIR", required=True, help="where to write it (a new or empty directory)")
    export.add_argument("--merge", action="store_true",
                        help="merge LoRA adapters into the base model's weights (one model vLLM and transformers load)")
    export.add_argument("--base", metavar="DIR", help="the LoRA base model, if it moved since the run")
    build = commands.add_parser("build-demo-model", help="build the demo's base model into the cache (once)",
                                description="Build the demo's small Qwen2 base model (character tokenizer, short "
                                            "supervised warm-up) from its recipe into $RELAY_CACHE_DIR or "
                                            "~/.cache/relay, instead of the copy relay ships (what `relay train` "
                                            "uses when the cache has none).")
    build.add_argument("--force", action="store_true", help="rebuild even if the cache holds it")
    build.add_argument("--task", choices=["arithmetic", "chain_sum", "calc"], default="arithmetic",
                       help="which demo task's model: arithmetic (a+b=), chain_sum (12+34+56= -> 46 102) or calc "
                            "(37*48= with a calculator tool)")
    add_verifier_commands(commands)
    add_env_commands(commands)
    add_serve_command(commands)
    plot = commands.add_parser("plot", help="draw a run's charts from its metrics.jsonl into a PNG",
                               description="Draw reward, KL, response length, logprob mismatch and seconds per "
                                           "phase per step from RUN_DIR/metrics.jsonl into one PNG "
                                           "(docs/operations.md).")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="a relay run directory (holds metrics.jsonl)")
    plot.add_argument("--out", metavar="FILE.png", help="where to write the PNG (default: RUN_DIR/plots.png)")
    _add_job_commands(commands)
    _add_control_commands(commands)
    return parser


def _run(args: argparse.Namespace) -> int:
    """Run the command `args` name; its exit code."""
    if args.command == "train":
        return _train(args.items, quiet=args.quiet)
    if args.command == "plan":
        return run_plan(args)
    if args.command == "eval":
        return _eval(args.items)
    if args.command == "export":
        from cluster.run.export import export_checkpoint

        what = export_checkpoint(Path(args.checkpoint), Path(args.out), args.merge,
                                 Path(args.base) if args.base else None)
        print(f"relay: exported {what} to {args.out}")
        return 0
    if args.command == "verifier":
        return run_verifier_serve(args)
    if args.command == "env":
        return run_env_serve(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "plot":
        return _plot(Path(args.run_dir), Path(args.out) if args.out else None)
    if args.command in ("submit", "jobs", "stop"):
        return _jobs_command(args)
    if args.command in ("scale", "status"):
        return _control_command(args)
    return _build_demo_model(force=args.force, task=args.task)


def _train(items: list[str], quiet: bool) -> int:
    path = items[0] if items and "=" not in items[0] else None
    overrides = items[1:] if path else items
    config = load_config(path, overrides)
    from cluster.run.launch import resolve_run_dir

    run_dir = resolve_run_dir(config)
    from cluster.run.launch import RunFinished, RunInterrupted, run_training
    from sync.calls import RunError
    from sync.startup import process_start_time

    try:
        # checks every input before it builds or starts anything; start-up counts from this process's start
        run_training(config, run_dir, display=not quiet, started=process_start_time())
    except RunFinished as done:
        print(f"relay: {done}", file=sys.stderr)
        return 0
    except RunError as err:
        print(f"relay: run stopped: {err}", file=sys.stderr)
        return 130 if isinstance(err, RunInterrupted) else 1
    print(f"relay: run finished; metrics in {run_dir / 'metrics.jsonl'}")
    return 0


def _eval(items: list[str]) -> int:
    """`relay eval`: the checkpoint's own config (its config.yaml) unless a CONFIG is given, then the overrides."""
    import datetime

    named = {key: value for key, _, value in (item.partition("=") for item in items)
             if key in ("checkpoint", "run_dir")}
    rest = [item for item in items if item.partition("=")[0] not in named]
    path = rest[0] if rest and "=" not in rest[0] else None
    checkpoint = Path(named["checkpoint"]) if named.get("checkpoint") else None
    if path is None and checkpoint is not None and (checkpoint / "config.yaml").is_file():
        path = str(checkpoint / "config.yaml")
    config = load_config(path, rest[1:] if rest and rest[0] == path else rest)
    out_dir = Path(named.get("run_dir") or Path("runs") / datetime.datetime.now().strftime("eval-%Y%m%d-%H%M%S"))
    if (out_dir / "eval.json").exists():
        raise ConfigError(f"run_dir '{out_dir}' already holds an eval.json; pass another run_dir=DIR or remove it")
    from cluster.run.launch import run_evaluation
    from sync.calls import RunError

    try:
        metrics = run_evaluation(config, out_dir, checkpoint)
    except RunError as err:
        print(f"relay: evaluation stopped: {err}", file=sys.stderr)
        return 1
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"relay eval: {checkpoint or 'the base model'}", show_header=False)
    for key, value in metrics.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)
    print(f"relay: metrics in {out_dir / 'eval.json'}")
    return 0


def _plot(run_dir: Path, out: Path | None) -> int:
    from cluster.cli.plot import plot_run

    try:
        path = plot_run(run_dir, out)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    print(path)
    return 0


ADDRESS_HELP = ("the cluster's Jobs API (its dashboard), e.g. http://127.0.0.1:8265; default: $RAY_ADDRESS. Ray 2.60 "
                "clusters need their token: $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, which is sent "
                "only over https or to loopback (e.g. a tunnel: ssh -L 8265:127.0.0.1:8265 HEAD)")


def _add_job_commands(commands) -> None:
    submit = commands.add_parser(
        "submit", help="submit a training run to a Ray cluster as a Ray job and stream its logs",
        description="Validate the config here, then run `relay train` on the cluster as a Ray job (relay's code and "
                    "the resolved config are its working_dir). run_dir must be an absolute path on the cluster.")
    submit.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    submit.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help=ADDRESS_HELP)
    submit.add_argument("--no-wait", action="store_true", help="print the job id and return without streaming logs")
    jobs = commands.add_parser("jobs", help="list a Ray cluster's jobs")
    jobs.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help=ADDRESS_HELP)
    stop = commands.add_parser("stop", help="stop a Ray job")
    stop.add_argument("job_id", metavar="JOB")
    stop.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help=ADDRESS_HELP)
    for sub in (submit, jobs, stop):
        sub.add_argument("--allow-insecure-token", action="store_true",
                         help="send the Ray token over plain http to a non-loopback --address anyway (anyone on "
                              "the network path can read it)")


def _jobs_command(args) -> int:
    if not args.address or not args.address.startswith(("http://", "https://")):
        raise ConfigError(f"--address {args.address!r} is not the cluster's Jobs API URL; pass e.g. "
                          "--address http://127.0.0.1:8265 (or set RAY_ADDRESS)")
    from cluster.cli import jobs

    try:  # before the config is loaded or anything is sent: the token must not cross the network in clear text
        jobs.check_token_transport(args.address, allow_insecure=args.allow_insecure_token)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        if args.command == "submit":
            path = args.items[0] if args.items and "=" not in args.items[0] else None
            config = load_config(path, args.items[1:] if path else args.items)
            if not config.run_dir or not Path(config.run_dir).is_absolute():
                given = f"run_dir '{config.run_dir}' is relative" if config.run_dir else "no run_dir is given"
                raise ConfigError(f"relay submit needs run_dir=ABSOLUTE_PATH on storage the cluster's nodes share "
                                  f"({given}, and the job runs in a temporary directory on the head), e.g. "
                                  "run_dir=/shared/runs/NAME; model.path and data.path too are paths there")
            job_id = jobs.submit(config, args.address)
            print(f"relay: submitted job {job_id}; logs: relay jobs --address {args.address}", file=sys.stderr)
            if args.no_wait:
                print(job_id)
                return 0
            status = jobs.follow(args.address, job_id, sys.stdout)
            print(f"relay: job {job_id} {status}", file=sys.stderr)
            return 0 if status.endswith("SUCCEEDED") else 1
        if args.command == "jobs":
            for row in jobs.list_jobs(args.address):
                print(f"{row['id']}\t{row['status']}\t{row['entrypoint']}")
            return 0
        stopped = jobs.stop(args.address, args.job_id)
        print(f"relay: {'stopping' if stopped else 'already ended:'} job {args.job_id}", file=sys.stderr)
        return 0
    except ConnectionError as err:
        raise ConfigError(f"cannot reach the Ray Jobs API at {args.address}: {str(err).splitlines()[0]}") from None
    except jobs.JobsError as err:
        print(f"relay: {err}", file=sys.stderr)
        return 1


CONTROL_ADDRESS_HELP = ("the Ray cluster the run is on: `auto` (default: the cluster this machine belongs to, e.g. on "
                        "the head node), HOST:6379 (its GCS) or ray://HOST:10001 (Ray Client)")


def _add_control_commands(commands) -> None:
    scale = commands.add_parser(
        "scale", help="grow or shrink a running run's rollout fleet",
        description="Ask a running run for N rollout workers and/or to remove given workers. The run takes the "
                    "request at the start of its next step: removed workers go then (they hold no prompts between "
                    "steps); new workers are placed and started in the background while training goes on, and each "
                    "joins at the first step after its engine is up, with the current weights (probe-checked) before "
                    "its first request. `relay status` shows the fleet (worker ids and nodes) and the workers still "
                    "on their way in (`workers_pending`).")
    scale.add_argument("--rollout-workers", type=int, metavar="N", help="the fleet size wanted")
    scale.add_argument("--remove-worker", type=int, action="append", default=[], metavar="ID",
                       help="remove this worker (an id from `relay status`, e.g. one on a node to drain); repeatable")
    status = commands.add_parser("status", help="show a running run's step and rollout fleet, or during its "
                                                "start-up the phase and each actor's state (JSON)")
    for sub in (scale, status):
        sub.add_argument("--run", metavar="NAME", help="the run's run_dir name (needed when several runs are going)")
        sub.add_argument("--address", default="auto", help=CONTROL_ADDRESS_HELP)


def _control_command(args) -> int:
    import json

    from cluster.fleet import control

    if args.command == "scale" and args.rollout_workers is None and not args.remove_worker:
        raise ConfigError("relay scale needs --rollout-workers N and/or --remove-worker ID")
    try:
        control.connect(args.address)
        run = control.find_run(args.run)
        if args.command == "status":
            print(json.dumps(control.call(run.status()), indent=1))
            return 0
        reply = control.call(run.request_scale(args.rollout_workers, args.remove_worker))
    except control.ControlError as err:
        print(f"relay: {err}", file=sys.stderr)
        return 2
    removed = f", removing workers {reply['remove']}" if reply["remove"] else ""
    print(f"relay: {reply['run_dir']}: {reply['workers_now']} -> {reply['num_workers']} rollout workers{removed}; "
          "taken at the next step, new workers join once started (relay status)", file=sys.stderr)
    return 0


def _build_demo_model(force: bool, task: str = "arithmetic") -> int:
    import shutil

    from cluster.demo.cache import demo_model_dir, ensure_demo_model

    if force and demo_model_dir(task).exists():
        shutil.rmtree(demo_model_dir(task))
    print(ensure_demo_model(task=task, build=True))
    return 0

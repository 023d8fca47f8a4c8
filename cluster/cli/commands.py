"""The `relay` command line: train, plan, eval, export, submit/jobs/stop (Ray jobs), scale/status (a running run),
plot, build-demo-model, verifier serve, env serve, serve (the Tinker API).

Owns: argument parsing, turning user errors into one line on stderr with exit code 2 (nothing written), and the
import of heavy libraries only once a command needs them, so `relay --help` is instant.
Does not own: the run itself (cluster/run/launch.py), the Ray Jobs client (cluster/cli/jobs.py), the charts
(cluster/cli/plot.py), the plan (cluster/cli/plan.py) or the cluster's run registry (cluster/fleet/control.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cluster.cli.plan import add_plan_command, run_plan
from cluster.config import ConfigError, load_config, parse_overrides
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
    _add_verifier_commands(commands)
    _add_env_commands(commands)
    add_serve_command(commands)
    plot = commands.add_parser("plot", help="draw a run's charts from its metrics.jsonl into a PNG",
                               description="Draw reward, KL, response length, logprob mismatch and seconds per "
                                           "phase per step from RUN_DIR/metrics.jsonl into one PNG "
                                           "(docs/operations.md).")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="a relay run directory (holds metrics.jsonl)")
    plot.add_argument("--out", metavar="FILE.png", help="where to write the PNG (default: RUN_DIR/plots.png)")
    _add_job_commands(commands)
    _add_control_commands(commands)
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
            return _verifier_serve(args)
        if args.command == "env":
            return _env_serve(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "plot":
            return _plot(Path(args.run_dir), Path(args.out) if args.out else None)
        if args.command in ("submit", "jobs", "stop"):
            return _jobs_command(args)
        if args.command in ("scale", "status"):
            return _control_command(args)
        return _build_demo_model(force=args.force, task=args.task)
    except ConfigError as err:
        print(f"relay: config error: {err}", file=sys.stderr)
        return 2


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


VERIFIER_SERVE_HELP = """\
Serve a verifier over HTTP (GET /health; docs/verifiers.md) with two protocols:
  POST /verify       relay's, for `reward.sources.<name>: {type: remote, urls: [http://HOST:PORT]}`
  POST /get_reward   OpenRLHF's, for its `--reward.remote_url http://HOST:PORT/get_reward`: each query's completion
                     is the text after its prompt, with the special tokens of --tokenizer removed (default: a fixed
                     list of common ones, docs/verifiers.md)
Binds 127.0.0.1 unless --host says otherwise.

  relay verifier serve --verifier exact_match --port 8000
  relay verifier serve --verifier format --param "tags=[think, answer]"
  JUDGE_TOKEN=... relay verifier serve --verifier mypkg.judge:score --host 0.0.0.0 --token-env JUDGE_TOKEN
  relay verifier serve --step-verifier mypkg.judge:score_steps     # process supervision: `level: steps`
  relay verifier serve --verifier math_verify --tokenizer Qwen/Qwen2.5-1.5B-Instruct --port 5000   # for OpenRLHF

Give --verifier, --step-verifier or both: samples sent with steps go to the step verifier, the others to --verifier.
"""


def _add_verifier_commands(commands) -> None:
    verifier = commands.add_parser("verifier", help="verifier services (`relay verifier serve`)",
                                   description="Verifier services speaking the remote verifier protocol.")
    actions = verifier.add_subparsers(dest="action", metavar="ACTION", required=True)
    serve = actions.add_parser("serve", help="serve a verifier over HTTP", description=VERIFIER_SERVE_HELP,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--verifier", metavar="NAME|module:function",
                       help="exact_match, numeric_match, math_verify, format, or package.module:function")
    serve.add_argument("--step-verifier", metavar="NAME|module:function",
                       help="scores each step of a sample sent with steps: step_match, or package.module:function "
                            "taking (steps, label) and returning one reward per step")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    serve.add_argument("--workers", type=int, default=4, help="threads scoring samples in parallel (default: 4)")
    serve.add_argument("--max-batch", type=int, default=1024, help="most samples per request (default: 1024)")
    serve.add_argument("--sample-timeout", type=float, default=30.0,
                       help="seconds one sample may take before it gets an error result (default: 30)")
    serve.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                       help="keyword argument for the verifier, value read as YAML (e.g. --param pattern='.*'); "
                            "repeatable")
    serve.add_argument("--step-param", action="append", default=[], metavar="KEY=VALUE",
                       help="keyword argument for the step verifier, as --param; repeatable")
    serve.add_argument("--token-env", metavar="VAR", help="require the bearer token held in environment variable VAR")
    _add_allow_origin(serve)
    serve.add_argument("--tokenizer", metavar="PATH",
                       help="/get_reward (OpenRLHF) removes this tokenizer's special tokens from each completion: the "
                            "policy's directory or Hugging Face name (default: common ones, docs/verifiers.md)")


def _verifier_serve(args: argparse.Namespace) -> int:
    for flag, value in (("--workers", args.workers), ("--max-batch", args.max_batch)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {value})")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535 (got {args.port})")
    if not args.sample_timeout > 0:
        raise ConfigError(f"--sample-timeout must be positive (got {args.sample_timeout})")
    if args.verifier is None and args.step_verifier is None:
        raise ConfigError("give --verifier, --step-verifier, or both (e.g. --verifier exact_match)")
    if args.param and args.verifier is None:
        raise ConfigError("--param binds arguments of --verifier, which is not given; use --step-param for the "
                          "step verifier")
    if args.step_param and args.step_verifier is None:
        raise ConfigError("--step-param binds arguments of --step-verifier, which is not given")
    params, step_params = _serve_params("--param", args.param), _serve_params("--step-param", args.step_param)
    from rewards.service import app_from_spec, run_app

    try:
        app = app_from_spec(args.verifier, params=params, step_spec=args.step_verifier, step_params=step_params,
                            token_env=args.token_env, workers=args.workers, max_batch=args.max_batch,
                            sample_timeout=args.sample_timeout, tokenizer=args.tokenizer,
                            allow_origins=args.allow_origin)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    run_app(app, args.host, args.port)
    return 0


ENV_SERVE_HELP = """\
Serve an environment class over HTTP (GET /health; docs/environments.md), one instance of the class per episode,
with two protocols:
  relay's    POST /reset, /step, /close: sticky sessions, idempotent steps by turn (a run config's `env.urls`)
  OpenEnv's  WebSocket /ws (one session per connection), the stateless POST /reset, /step and GET /state, GET
             /schema, /metadata, POST /mcp; actions {"message": text}, observations {"text": ..., "info": {...}};
             for OpenEnv's clients (GenericEnvClient) and `openenv validate --url http://HOST:PORT`
Both protocols share --max-sessions and the token. Binds 127.0.0.1 unless --host says otherwise.

  relay env serve --env rewards.environments.examples:GuessNumber --param max_turns=4
  ENV_TOKEN=... relay env serve --env mypkg.envs:Shell --host 0.0.0.0 --token-env ENV_TOKEN --workers 16
"""


def _add_env_commands(commands) -> None:
    env = commands.add_parser("env", help="environment services (`relay env serve`)",
                              description="Environment services speaking relay's and OpenEnv's protocols.")
    actions = env.add_subparsers(dest="action", metavar="ACTION", required=True)
    serve = actions.add_parser("serve", help="serve an environment over HTTP", description=ENV_SERVE_HELP,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--env", metavar="module:Class",
                       help="the environment class, package.module:Class (on PYTHONPATH), with reset and step")
    serve.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                       help="keyword argument for the class's constructor, value read as YAML; repeatable")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    serve.add_argument("--token-env", metavar="VAR", help="require the bearer token held in environment variable VAR "
                       "(a WebSocket without it is refused: HTTP 403)")
    serve.add_argument("--max-sessions", type=int, default=1024, metavar="N",
                       help="sessions open at once, WebSockets included; a reset beyond that gets 503, a WebSocket "
                            "OpenEnv's CAPACITY_REACHED (default: 1024)")
    serve.add_argument("--session-ttl", type=float, default=600.0, metavar="S",
                       help="seconds a session may stay idle before it expires (default: 600)")
    serve.add_argument("--step-timeout", type=float, default=30.0, metavar="S",
                       help="seconds a reply waits for its reset or step call before it is a 504 (default: 30)")
    serve.add_argument("--workers", type=int, default=8, metavar="N",
                       help="threads running environment calls (default: 8)")
    _add_allow_origin(serve)


def _add_allow_origin(serve) -> None:
    serve.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                       help="a web page (scheme://host[:port]) allowed to call the service from a browser; other "
                            "Origins are refused (docs/operations.md, Security); repeatable")


def _env_serve(args: argparse.Namespace) -> int:
    if args.env is None:
        raise ConfigError("give --env package.module:Class (e.g. --env rewards.environments.examples:GuessNumber)")
    for flag, value in (("--workers", args.workers), ("--max-sessions", args.max_sessions)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {value})")
    for flag, value in (("--step-timeout", args.step_timeout), ("--session-ttl", args.session_ttl)):
        if not value > 0:
            raise ConfigError(f"{flag} must be positive (got {value})")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535 (got {args.port})")
    params = _serve_params("--param", args.param)
    from rewards.environments.service import app_from_spec
    from rewards.service import run_app

    try:
        app = app_from_spec(args.env, params=params, token_env=args.token_env, max_sessions=args.max_sessions,
                            session_ttl=args.session_ttl, step_timeout=args.step_timeout, workers=args.workers,
                            allow_origins=args.allow_origin)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    run_app(app, args.host, args.port)
    return 0


def _serve_params(flag: str, items: list[str]) -> dict:
    """`KEY=VALUE` items as keyword arguments, each value read as YAML."""
    params = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"{flag} '{item}' is not of the form KEY=VALUE (e.g. {flag} tolerance=0.01)")
        params[key] = parse_overrides([f"value={raw}"])["value"]
    return params


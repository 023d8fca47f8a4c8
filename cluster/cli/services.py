"""`relay verifier serve` and `relay env serve`: their arguments, help and checks (one line, exit code 2), and the
services started with them (imported only then, so `relay --help` stays instant).
Does not own: the services themselves (rewards/service.py, rewards/environments/service.py) or the other commands
(cluster/cli/commands.py).
"""

from __future__ import annotations

import argparse

from cluster.config import ConfigError, parse_overrides

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


def add_verifier_commands(commands) -> None:
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


def run_verifier_serve(args: argparse.Namespace) -> int:
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


def add_env_commands(commands) -> None:
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


def run_env_serve(args: argparse.Namespace) -> int:
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


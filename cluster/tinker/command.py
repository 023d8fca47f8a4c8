"""`relay serve`'s command line: its arguments and help, the config and overrides read, then the service started
(cluster/tinker/service.py, imported only then, so that `relay --help` stays instant).
"""

from __future__ import annotations

from typing import Any

SERVE_HELP = """\
Serve the Tinker API (the `tinker` SDK's REST protocol, docs/tinker.md) for the config's model: a training loop
written against the SDK drives relay's learner. Each create_model is its own LoRA training run (a learner actor).
Starts a local Ray, or joins ray.address. Binds 127.0.0.1 unless --host says otherwise (then an API key is required).

  relay serve --port 8000                                   # the demo model, served as 'relay-demo'
  relay serve model.path=/models/my-model learner.num_cpus=4
  TINKER_API_KEY=tml-... relay serve --host 0.0.0.0 --key-env TINKER_API_KEY
  RELAY_KEYS=tml-alice,tml-bob relay serve --key-env RELAY_KEYS         # two tenants
"""


def add_serve_command(commands: Any) -> None:
    """`relay serve`'s arguments."""
    import argparse

    serve_parser = commands.add_parser("serve", help="serve the Tinker API on relay's actors (docs/tinker.md)",
                                       description=SERVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve_parser.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                              help="an optional YAML config file, then dotted overrides (model.path, learner.*)")
    serve_parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve_parser.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    serve_parser.add_argument("--key-env", metavar="VAR", help="require the API key held in environment variable VAR "
                              "(clients send it as TINKER_API_KEY; it starts with tml-); several, comma-separated, "
                              "are tenants: each reaches only the models it made")
    serve_parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                              help="a web page (scheme://host[:port]) allowed to call the service; repeatable")


def run_serve(args: Any) -> int:
    """`relay serve`: the config and overrides, then `serve`; a one-line ConfigError for a bad argument."""
    from cluster.config import ConfigError, load_config

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535 (got {args.port})")
    items = list(args.items)
    path = items[0] if items and "=" not in items[0] else None
    config = load_config(path, items[1:] if path else items)
    from cluster.tinker.service import serve

    try:
        serve(config, args.host, args.port, args.key_env, args.allow_origin)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return 0

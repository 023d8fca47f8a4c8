"""The `relay` command line: `relay train`, `relay build-demo-model`.

Owns: argument parsing, turning user errors into one line on stderr with exit code 2 (nothing written), and the
import of heavy libraries only once a command needs them, so `relay --help` is instant.
Does not own: the run itself (cluster/driver.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster.config import ConfigError, load_config

TRAIN_HELP = """\
Train a policy. With no CONFIG, runs the built-in demo: GRPO on `a+b=` arithmetic with a small local model,
2 vLLM rollout workers, a reference worker for the KL penalty and a learner, on a local Ray instance.

Overrides are dotted keys, e.g.:  relay train max_steps=20 learner.lr=5e-4 rollout.num_workers=3
Algorithm presets (on the demo task): configs/{ppo,grpo,dr_grpo,dapo,rloo,reinforce_pp,gspo}.yaml, e.g.
  relay train configs/ppo.yaml critic.lr=5e-5          (docs/algorithms.md)
Outputs go to run_dir (default runs/<time>): config.yaml, metrics.jsonl.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relay", description="relay: RL fine-tuning of language models on Ray.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    train = commands.add_parser("train", help="train a policy (no CONFIG: the built-in demo)", description=TRAIN_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                       help="an optional YAML config file, then dotted overrides")
    train.add_argument("--quiet", action="store_true", help="no progress display (metrics.jsonl is still written)")
    build = commands.add_parser("build-demo-model", help="build the demo's base model into the cache (once)",
                                description="Build the demo's small Qwen2 base model (character tokenizer, short "
                                            "supervised warm-up) into $RELAY_CACHE_DIR or ~/.cache/relay.")
    build.add_argument("--force", action="store_true", help="rebuild even if the cache holds it")
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return _train(args.items, quiet=args.quiet)
        return _build_demo_model(force=args.force)
    except ConfigError as err:
        print(f"relay: config error: {err}", file=sys.stderr)
        return 2


def _train(items: list[str], quiet: bool) -> int:
    path = items[0] if items and "=" not in items[0] else None
    overrides = items[1:] if path else items
    config = load_config(path, overrides)
    from cluster.driver import resolve_run_dir

    run_dir = resolve_run_dir(config)
    if config.model.path is None:
        from cluster.demo_model import ensure_demo_model

        model_path = str(ensure_demo_model())
    else:
        model_path = config.model.path
        if not (Path(model_path) / "config.json").is_file():
            raise ConfigError(f"model.path '{model_path}' is not a Hugging Face model directory (no config.json); "
                              "pass model.path=DIR or leave it empty for the demo model")
    from cluster.driver import run_training
    from cluster.remote import RunError

    try:
        run_training(config, run_dir, model_path, display=not quiet)
    except RunError as err:
        print(f"relay: run stopped: {err}", file=sys.stderr)
        return 1
    print(f"relay: run finished; metrics in {run_dir / 'metrics.jsonl'}")
    return 0


def _build_demo_model(force: bool) -> int:
    import shutil

    from cluster.demo_model import demo_model_dir, ensure_demo_model

    if force and demo_model_dir().exists():
        shutil.rmtree(demo_model_dir())
    print(ensure_demo_model())
    return 0


if __name__ == "__main__":
    sys.exit(main())

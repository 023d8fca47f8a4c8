"""`relay plan`: print where a run's actors go and the memory each needs, and refuse a run its GPUs cannot hold.

Owns: the command's arguments (`add_plan_command`), reading the GPU size to plan for (`--gpu-memory`, else the GPUs
on this machine), and the printed plan (`format_plan`). Does not own the estimate or the fit rule (cluster/plan.py).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from cluster.config import ConfigError, RunConfig, load_config

PLAN_HELP = """\
Print a run's plan without starting it: Ray's placement groups (CPUs and GPUs per actor) and the memory each actor
needs (the learner's weights, gradients, AdamW state, activations at its token budget, logits; the engines' weights
and KV cache), from the config and the model's config.json alone: no Ray, no GPU, no weights. Exits 2 with one line
when the GPUs cannot hold the run (what `relay train` refuses before any actor starts).
The GPU size is --gpu-memory, else the smallest GPU on this machine; without either, memory is printed unchecked.
With a GPU learner it also prints the largest learner token budget that fits, which
`learner.max_tokens_per_micro_batch=auto` takes (printed first).
  relay plan configs/gpu_gsm8k_single.yaml model.path=configs/model_shapes/Qwen2.5-1.5B-Instruct --gpu-memory 80GiB
configs/model_shapes/ holds the config.json of Qwen2.5-0.5B, 1.5B and 7B Instruct (docs/gpu.md, "Memory"): a
model.path that is not here but ends in one of their names (the GPU presets' placeholders) is planned on it.
"""
SHAPES = Path(__file__).resolve().parents[2] / "configs" / "model_shapes"  # config.json alone, by model name
UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
         "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def add_plan_command(commands) -> None:
    plan = commands.add_parser("plan", help="print where a run's actors go and the GPU memory each needs (no Ray)",
                               description=PLAN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                      help="the run's YAML config file, then dotted overrides (as `relay train` takes them)")
    plan.add_argument("--gpu-memory", metavar="SIZE", help="each GPU's memory, e.g. 24GiB, 80GB (default: the "
                      "smallest GPU on this machine)")


def parse_size(text: str) -> int:
    """'24GiB', '80 GB', '141e9' -> bytes; ConfigError (one line) for anything else."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"--gpu-memory {text!r} is not a size; give e.g. 24GiB, 80GB or 141e9 (bytes)")
    return int(float(match.group(1)) * UNITS[match.group(2)])


def run_plan(args: argparse.Namespace) -> int:
    """`relay plan`: the plan on stdout; 2 with one line on stderr when the GPUs cannot hold it."""
    from cluster.plan import fit_problems, gpu_memory, plan_run, resolve_token_budget

    path = args.items[0] if args.items and "=" not in args.items[0] else None
    config = load_config(path, args.items[1:] if path else args.items)
    found = None if args.gpu_memory else gpu_memory()
    gpu_bytes = parse_size(args.gpu_memory) if args.gpu_memory else found
    source = "--gpu-memory" if args.gpu_memory else "the smallest GPU on this machine" if found else None
    shape, where = model_shape(config)
    config, budget = resolve_token_budget(config, gpu_bytes, shape)
    if budget:
        print(budget)
    actors = plan_run(config, shape, gpu_bytes, other_shapes(config))
    print(format_plan(config, path, shape, where, actors, gpu_bytes, source))
    if gpu_bytes and config.learner.num_gpus:
        print(budget_line(config, shape, gpu_bytes))
    problems = fit_problems(actors, gpu_bytes) if gpu_bytes else []
    if problems:
        raise ConfigError(problems[0])
    return 0


def budget_line(config: RunConfig, shape, gpu_bytes: int) -> str:
    """The largest learner token budget this GPU holds (`fitting_token_budget`), against the configured one."""
    from cluster.plan import fitting_token_budget

    budget = fitting_token_budget(config, shape, gpu_bytes)
    fits = f"at most {budget} fit" if budget else "not even 1024 fit"
    return (f"Learner passes: learner.max_tokens_per_micro_batch={config.learner.max_tokens_per_micro_batch}; "
            f"{fits} in 90% of the learner's GPU share (larger passes launch fewer kernels per token)")


def model_shape(config: RunConfig):
    """The policy's shape and where it was read: model.path's config.json, or the shipped demo model's. A model.path
    that is not on this machine but names a model of `SHAPES` (the GPU presets' placeholders) is planned on that
    shape."""
    from cluster.demo.cache import shipped_demo_model
    from cluster.plan import ModelShape

    directory = Path(config.model.path) if config.model.path else shipped_demo_model(config.data.task)
    where = str(directory)
    if not (directory / "config.json").is_file() and (SHAPES / directory.name / "config.json").is_file():
        where = f"{directory} (not on this machine: the shape in configs/model_shapes/{directory.name})"
        directory = SHAPES / directory.name
    try:
        return ModelShape.read(directory), where
    except ValueError as err:
        raise ConfigError(str(err)) from None


def other_shapes(config: RunConfig) -> dict:
    """The shapes of the teacher and of reward models that name their own directory, by path."""
    from cluster.plan import ModelShape

    paths = [config.teacher.path] if config.uses_teacher and config.teacher.path != "demo" else []
    paths += [s.path for s in config.reward.sources.values() if getattr(s, "type", "") == "model" and s.path]
    try:
        return {str(p): ModelShape.read(p) for p in paths}
    except ValueError as err:
        raise ConfigError(str(err)) from None


def format_plan(config: RunConfig, path: str | None, shape, where: str, actors: list, gpu_bytes: int | None,
                source: str | None) -> str:
    """The plan as `relay plan` prints it: the model, the placement groups, each actor's memory by what holds it."""
    from cluster.plan import CUDA_OVERHEAD_BYTES, GIB, core_bundles, rollout_bundles

    ro = config.rollout
    count = shape.parameters
    size = f"{count / 1e9:.2f}B" if count >= 10**8 else f"{count / 1e6:.2f}M"
    lines = [f"relay plan: {path or 'the built-in demo'}; model {where}: {size} parameters "
             f"({shape.layers} layers, hidden {shape.hidden}, vocabulary {shape.vocab}), model.dtype "
             f"{config.model.dtype}, learner.master_dtype {config.learner.master_dtype}",
             f"GPU memory: {gpu_bytes / GIB:.1f} GiB per GPU ({source})" if gpu_bytes else
             "GPU memory: no GPU found and no --gpu-memory: memory is not checked", "",
             "Placement (Ray placement groups; the driver takes no GPU):",
             "  learner, reference, teacher, reward models: one group (PACK, as few nodes as fit)"]
    core = core_bundles(config)
    lines += [f"    {name:<24} {_bundle_text(b)}" for name, b in core]
    shards = rollout_bundles(config)
    lines.append(f"  rollout workers: {ro.num_workers} groups (STRICT_PACK: one node each) of {len(shards)} bundle(s) "
                 f"{_bundle_text(shards[0])}")
    if ro.node_labels or ro.placement == "spread":
        labels = ", ".join(f"{k}={v}" for k, v in ro.node_labels.items())
        lines.append(f"    on nodes labelled {labels or '(any)'}; {ro.placement} (rollout.node_labels, "
                     "rollout.placement)")
    cpus = sum(b["CPU"] for _, b in core) + ro.num_workers * sum(b["CPU"] for b in shards)
    gpus = sum(b.get("GPU", 0) for _, b in core) + ro.num_workers * sum(b.get("GPU", 0) for b in shards)
    lines += [f"  in all: {cpus:g} CPUs, {gpus:g} GPUs", "",
              "Memory per actor, GiB (on its GPU; host memory for an actor without one):"]
    for actor in actors:
        device = f"{actor.gpus:g} GPU" if actor.gpus else "CPU"
        extra = CUDA_OVERHEAD_BYTES if actor.gpus and actor.engine_share is None else 0
        total = (f"gpu_memory_utilization {actor.engine_share:g} x the GPU" if actor.engine_share is not None and
                 gpu_bytes else f"{(actor.total + extra) / GIB:.2f}" + (" with CUDA's overhead" if extra else ""))
        lines.append(f"  {actor.name} (x{actor.count}, {device} each): {total}")
        lines += [f"      {name:<44} {value / GIB:8.2f}" for name, value in actor.memory.items()]
        if extra:
            lines.append(f"      {'CUDA context and allocator (allowance)':<44} {extra / GIB:8.2f}")
        lines += [f"      {note}" for note in actor.notes]
    return "\n".join(lines)


def _bundle_text(bundle: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:g}" for key, value in bundle.items())

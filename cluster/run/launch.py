"""Starting and ending a run: every input checked first, Ray, the run's registry entry and the fleet started, the step
loop, checkpoints written, and everything cleaned up however the run ends (`run_training`).

Owns: the checks made before anything starts or is written (`check_inputs`: model and dataset paths, datasets read and
validated, logging, reward sources, the environment, the CPUs asked of a local Ray), what the user's model sets
(`model_settings`: `model.dtype` from the hardware, the one line naming every value the model set, and the learner's
token budget where it is `auto`), the run
directory, joining or starting Ray, and the loop over `Trainer.step` with its checkpoints (and the warning when many
completions are cut at `rollout.max_new_tokens`).
Does not own: the step (cluster/run/trainer.py), placement (cluster/fleet/placement.py), checkpoint files
(cluster/run/checkpoint.py), which checkpoint to resume from (cluster/run/resume.py).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import ray

from cluster.config import ConfigError, RunConfig, dump_config
from cluster.fleet.control import start_control
from cluster.fleet.placement import (
    RAY_SYSTEM_CONFIG,
    Fleet,
    FleetPool,
    check_reachable,
    lora_targets,
    start_fleet,
    stop_fleet,
    teacher_path,
)
from cluster.plan import check_gpu_fit, cpus_asked, resolve_token_budget
from cluster.run import checkpoint, resume
from cluster.run.evaluation import evaluation_inputs
from cluster.run.metrics import MetricsRecorder, ProgressDisplay, check_logging, dashboard_line
from cluster.run.scoring import Scorer
from cluster.run.startup import Startup, fleet_actors
from cluster.run.trainer import Trainer
from rewards.config import ModelSource
from sync.calls import RunError

TRUNCATED_WARNING = 0.5  # a step whose completions are cut at rollout.max_new_tokens in more than this share warns


class RunFinished(Exception):
    """`resume` named a run that already reached `max_steps`: nothing to do (not an error)."""


def resolve_run_dir(config: RunConfig) -> Path:
    """The run directory. A new run refuses one that already holds a run; `resume` needs the run's directory
    (nothing is written here)."""
    if config.resume == "auto" and not config.run_dir:
        raise ConfigError("resume=auto continues the run in run_dir: pass run_dir=PATH of that run")
    if config.run_dir:
        run_dir = Path(config.run_dir)
    else:
        run_dir = resume.run_dir_for(config) or Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    if not config.resume and ((run_dir / "metrics.jsonl").exists() or (run_dir / "config.yaml").exists()):
        raise ConfigError(f"run_dir '{run_dir}' already holds a run; pass a new run_dir=PATH, remove it, or continue "
                          "it with resume=auto")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir '{run_dir}' is a file; pass run_dir=PATH naming a directory")
    return run_dir


def check_inputs(config: RunConfig, model_path: str | None) -> tuple[Any, Scorer]:
    """Check every user input that can be checked before anything starts or is built, and load what the driver
    itself needs: the prompt source (dataset files are read and validated here) and the reward sources (verifiers
    imported, remote clients configured). `model_path` None is the demo model, not built yet: datasets are checked with
    its tokenizer, made in memory. Raises ConfigError (one line, nothing written) on bad input."""
    from cluster.run.data import make_prompt_source
    from cluster.run.prompt_format import DataError

    check_model_paths(config, model_path)
    ro = config.rollout
    max_prompt_tokens = config.data.max_prompt_tokens or max(1, ro.max_model_len - ro.max_new_tokens)
    try:
        data = make_prompt_source(config.data, config.seed, config.data.prompts_per_step, model_path,
                                  max_prompt_tokens)
    except DataError as err:
        raise ConfigError(str(err)) from None
    try:
        check_logging(config.logging)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        scorer = Scorer(config.reward, config.timeouts.reward, config.env)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_environment(config)
    if config.uses_teacher:
        check_teacher(config, model_path)
    if config.learner.lora.enabled:
        try:
            lora_targets(config.learner, model_path)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    check_local_cpus(config)
    if ro.top_p < 1:
        print(f"relay: warning: rollout.top_p={ro.top_p:g} < 1: the engines' logprobs are renormalised over the "
              "nucleus and the learner's are not, so logprob/mismatch also measures that renormalisation "
              "(docs/operations.md)", file=sys.stderr, flush=True)
    return data, scorer


def check_model_paths(config: RunConfig, model_path: str | None) -> None:
    """The policy's and the reward models' directories hold a Hugging Face model, and the GPUs can hold the run
    (`relay plan`'s fit check), before anything loads."""
    if model_path is not None and not (Path(model_path) / "config.json").is_file():
        raise ConfigError(f"model.path '{model_path}' is not a Hugging Face model directory (no config.json); "
                          "download one, e.g. huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir "
                          "models/Qwen2.5-0.5B-Instruct, and pass model.path=DIR, or leave it empty for the demo model")
    check_gpu_fit(config, model_path)  # a run its GPUs cannot hold stops here
    for name, source in config.reward.sources.items():
        if isinstance(source, ModelSource) and source.path is not None and \
                not (Path(source.path) / "config.json").is_file():
            raise ConfigError(f"reward.sources.{name}.path '{source.path}' is not a Hugging Face model directory "
                              "(no config.json)")


def check_local_cpus(config: RunConfig) -> None:
    """A run that starts its own Ray books no more CPUs than the instance has; warned about when, asynchronously, its
    actors' threads outnumber the cores twice over."""
    ro = config.rollout
    local = config.ray.address is None and not os.environ.get("RAY_ADDRESS")  # this run starts its own Ray
    cpus, asked = config.ray.num_cpus or os.cpu_count() or 1, cpus_asked(config)
    if local and not ray.is_initialized() and sum(asked.values()) > cpus + 1e-9:
        parts = " + ".join(f"{name} {value:g}" for name, value in asked.items() if value)
        raise ConfigError(f"the run asks Ray for {sum(asked.values()):g} CPUs ({parts}) but the local Ray instance has "
                          f"{cpus}: lower those num_cpus (fractions are fine: they only book Ray's CPUs, the threads "
                          "are set by num_threads) or set ray.num_cpus")
    # Asynchronously the engines, the learner and the reference compute at once: more threads than cores makes the
    # step slower than the synchronous loop's (docs/operations.md). (Asynchronously every learner and reference
    # thread count is set: `RunConfig._threads_for_overlap`.)
    if ro.max_staleness and local:
        threads = (config.learner.num_threads * config.learner.num_ranks + ro.num_workers * ro.num_threads
                   + (config.reference.num_threads if config.uses_reference else 0)
                   + ((config.teacher.num_threads or config.reference.num_threads) if config.uses_teacher else 0))
        if threads > 2 * (os.cpu_count() or 1):
            print(f"relay: warning: rollout.max_staleness={ro.max_staleness} runs the engines, the reference and the "
                  f"learner at once, and this local run gives them {threads} threads on {os.cpu_count()} cores: they "
                  "will slow each other down more than the overlap gains; lower learner/rollout/reference.num_threads "
                  "(docs/operations.md)", file=sys.stderr, flush=True)


def model_settings(config: RunConfig) -> RunConfig:
    """`config` with what the user's model (`model.path`) sets where the user did not, and one line on stderr naming
    every such value: the rollout sizes (set when the config was built: `RunConfig.from_model`) and `model.dtype`,
    bfloat16 for a model stored in 16 bits (its config.json's `torch_dtype`) where the hardware computes bfloat16
    natively (`native_bfloat16`), else float32 (a model stored in float32, like the demo's, stays float32); then
    `learner.max_tokens_per_micro_batch=auto` made a number (`resolve_token_budget`), in one line too."""
    path = config.model.path
    own = bool(path) and (Path(path) / "config.json").is_file()
    derived = dict(config.from_model) if own else {}
    if own and "dtype" not in config.model.model_fields_set:
        stored = json.loads((Path(path) / "config.json").read_text())
        sixteen = (stored.get("torch_dtype") or stored.get("dtype")) in ("bfloat16", "float16")
        dtype = "bfloat16" if sixteen and native_bfloat16(config) else "float32"
        config = config.model_copy(update={"model": config.model.model_copy(update={"dtype": dtype})})
        derived["model.dtype"] = dtype
    if derived:
        shown = ", ".join(f"{key}={value}" for key, value in derived.items())
        print(f"relay: from the model in {path}: {shown} (set any of them to override)", file=sys.stderr, flush=True)
    config, budget = resolve_token_budget(config)
    if budget:
        print(f"relay: {budget}", file=sys.stderr, flush=True)
    return config


def native_bfloat16(config: RunConfig) -> bool:
    """Whether the run's hardware computes bfloat16 natively. A run that asks for GPUs (`num_gpus` > 0): CUDA's own
    check where this driver sees a GPU, else yes (a CPU head node; the GPUs docs/gpu.md covers compute it). On CPU: the
    AVX512_BF16 or AMX-BF16 instructions in /proc/cpuinfo's flags (without them bfloat16 is emulated, and slower)."""
    if config.rollout.num_gpus or config.learner.num_gpus:
        import torch

        return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def check_teacher(config: RunConfig, model_path: str | None) -> None:
    """The teacher (`teacher.path`) is a model directory whose tokenizer is the policy's (`model_path`, None: the demo
    model's, shipped): distillation compares the two models' logprobs of the same token ids. ConfigError, one line."""
    from transformers import AutoTokenizer

    from cluster.demo.cache import shipped_demo_model

    path = teacher_path(config.teacher.path)
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"teacher.path '{config.teacher.path}' is not a Hugging Face model directory (no "
                          "config.json); pass teacher.path=DIR or demo")
    policy = model_path or str(shipped_demo_model(config.data.task))
    difference = tokenizer_difference(AutoTokenizer.from_pretrained(policy), AutoTokenizer.from_pretrained(path))
    if difference:
        raise ConfigError(f"teacher.path '{config.teacher.path}' has another tokenizer than the policy's "
                          f"({difference}): distillation compares both models' logprobs of the same token ids, so "
                          "the teacher must share the policy's tokenizer (another size of the same family)")


def tokenizer_difference(mine: Any, theirs: Any) -> str:
    """How two tokenizers differ in what distillation needs equal, in a few words: the id of every token, and the
    special tokens' ids; empty when they agree."""
    vocab, other = mine.get_vocab(), theirs.get_vocab()
    differing = sorted(token for token in vocab.keys() | other.keys() if vocab.get(token) != other.get(token))
    parts = []
    if differing:
        token = differing[0]
        parts.append(f"{len(differing)} of {len(vocab.keys() | other.keys())} tokens have other ids, e.g. {token!r} is "
                     f"{vocab.get(token, 'absent')} in the policy's and {other.get(token, 'absent')} in the teacher's")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(mine, name) != getattr(theirs, name):
            parts.append(f"{name} {getattr(mine, name)} against the teacher's {getattr(theirs, name)}")
    return "; ".join(parts)


def check_environment(config: RunConfig) -> None:
    """The `env` section's class imports and takes its params (the workers load it again); raises ConfigError (one
    line, naming the key) before anything starts."""
    env = config.env
    if env.spec is not None:
        from rewards.environments.interface import load_environment

        try:
            load_environment(env.spec, env.params)
        except ValueError as err:
            raise ConfigError(f"env.spec: {err}") from None
    if env.urls and env.token_env and not os.environ.get(env.token_env):
        print(f"relay: warning: env.token_env={env.token_env} is not set here; the rollout workers read it from their "
              "own environment (set it on every node, or in the job's runtime_env)", file=sys.stderr, flush=True)


def run_training(config: RunConfig, run_dir: Path, model_path: str | None = None, display: bool = True,
                 rollout_cls: type | None = None, pool: FleetPool | None = None,
                 started: float | None = None) -> list[dict[str, Any]]:
    """Check the inputs, start Ray (unless connected already), ensure the demo model (shipped copy) if `model_path` and
    `model.path` are empty, start the fleet, run the steps up to `max_steps` (from the checkpoint `resume` names, if
    any), write checkpoints, and clean up; returns this attempt's records. With `pool` (`FleetPool`), the fleet is the
    one the pool gives, if any, and is offered back to it when the run ends (not when this call started Ray, which it
    then shuts down).

    Raises ConfigError (nothing written or built) on bad input, RunFinished when resuming a finished run, RunError
    when the run cannot go on (with the checkpoint to resume from) or Ray cannot be reached (nothing written).
    `started`: the process's start (epoch s), where start-up's phases count from (cluster/run/startup.py)."""
    startup = Startup(started, show=display)
    startup.begin("checks")
    config = model_settings(config)  # before comparing with a checkpoint's config, which holds the derived values
    point = _resume_point(config, run_dir)
    model_path = model_path or config.model.path
    data, scorer = check_inputs(config, model_path)
    evaluation = evaluation_inputs(config, model_path, data) if config.eval.every else None
    records: list[dict[str, Any]] = []
    finished = False
    with ExitStack() as cleanup:  # undoes whatever was started, in reverse order, however the run ends
        cleanup.callback(startup.close)
        cleanup.callback(scorer.close)
        if evaluation is not None:
            cleanup.callback(evaluation[1].close)
        startup.begin("ray")
        started_ray = _init_ray(config)
        if started_ray:
            cleanup.callback(ray.shutdown)
        startup.begin("registry")
        model_path = model_path or _demo_model(config)
        resolved_config, resolved = _write_config(config, run_dir)
        recorder = MetricsRecorder(run_dir, config.logging, resolved_config.model_dump(mode="json"),
                                   resume_step=point.step if point else 0 if config.resume else None)
        cleanup.callback(lambda: recorder.close(failed=not finished))
        try:
            control = start_control(str(run_dir))
            cleanup.callback(control.leave)
            startup.attach(control)  # `relay status` shows start-up's phase and actors
            fleet = _start_fleet(startup, config, model_path, rollout_cls, pool)

            cleanup.callback(lambda: _release(fleet, pool, started_ray, failed=not finished))
            trainer = Trainer(config, fleet, data, scorer, control, evaluation)
            cleanup.callback(trainer.close)  # the collective transport leaves its group
            if config.sync.probe:
                # Engines and learner agree on the weights they start from (the model's, also when resuming: before
                # the checkpoint loads), which is where the probe's noise floor and tolerance come from.
                startup.begin("probe")
                trainer.rollouts.probe_all()
            first = trainer.restore(point) + 1 if point else 1
            startup.begin("first_step")
            records = train(trainer, recorder, run_dir, resolved, first, display, startup)
            finished = True
        except RunError as err:
            latest = checkpoint.latest(run_dir)
            hint = (f"; resume from {latest.name} with: relay train run_dir={run_dir} resume=auto" if latest
                    else "; no checkpoint was written yet")
            raise type(err)(f"{err}{hint}") from err
    return records


def _resume_point(config: RunConfig, run_dir: Path) -> resume.ResumePoint | None:
    """The checkpoint the run resumes from (`resume`), if any; RunFinished when it is at `max_steps` already."""
    point = resume.find(config, run_dir)
    if point is not None and point.step >= config.max_steps:
        raise RunFinished(f"the run in {run_dir} already finished: its checkpoint {point.path.name} is at step "
                          f"{point.step} and max_steps={config.max_steps}; raise max_steps to train further")
    return point


def _write_config(config: RunConfig, run_dir: Path) -> tuple[RunConfig, str]:
    """The run's resolved config (its `run_dir` set), written to `run_dir/config.yaml`, and as YAML."""
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved_config = config.model_copy(update={"run_dir": str(run_dir)})
    resolved = dump_config(resolved_config)
    (run_dir / "config.yaml").write_text(resolved)
    return resolved_config, resolved


def _start_fleet(startup: Startup, config: RunConfig, model_path: str, rollout_cls: type | None,
                 pool: FleetPool | None) -> Fleet:
    """`start_fleet` as start-up's `actors` phase; a start that fails names the log of each actor that did not start."""
    startup.begin("actors", fleet_actors(config))
    try:
        return start_fleet(config, model_path, rollout_cls, pool)
    except RunError as err:
        raise type(err)(f"{err}{startup.logs(err)}") from err


def _release(fleet: Fleet, pool: FleetPool | None, started_ray: bool, failed: bool) -> None:
    """Stop `fleet`, or park it in `pool` for the next run (only when this run joined a Ray it did not start)."""
    if pool is None or started_ray or not pool.park(fleet, failed=failed):
        stop_fleet(fleet)


def run_evaluation(config: RunConfig, out_dir: Path, checkpoint_path: Path | None = None,
                   pool: FleetPool | None = None) -> dict[str, Any]:
    """`relay eval`: evaluate the weights of a checkpoint (`checkpoint_path`, loaded by the learner and synced to the
    engines as in the run), or the base model, with the run's evaluation (`eval`, cluster/run/evaluation.py); write
    `out_dir/eval.json` (the metrics by their own keys, at full precision) and return the metrics. With the run's
    config and fleet size, a checkpoint gives the numbers the run logged at its step. No reference or teacher is
    started.
    Raises ConfigError on bad input (nothing written), RunError when the fleet fails."""
    step, config = 0, model_settings(config)
    if checkpoint_path is not None:
        try:
            checkpoint.validate(checkpoint_path)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        step = int(checkpoint.read_driver_state(checkpoint_path)["step"])
    config = config.model_copy(update={"reference": config.reference.model_copy(update={"enabled": False}),
                                       "learner": config.learner.model_copy(update={"kl_coef": 0.0,
                                                                                    "kl_reward_coef": 0.0,
                                                                                    "distill_coef": 0.0})})
    model_path = config.model.path
    data, scorer = check_inputs(config, model_path)
    evaluation = evaluation_inputs(config, model_path, data)
    finished = False
    with ExitStack() as cleanup:
        cleanup.callback(scorer.close)
        cleanup.callback(evaluation[1].close)
        started_ray = _init_ray(config)
        if started_ray:
            cleanup.callback(ray.shutdown)
        fleet = start_fleet(config, model_path or _demo_model(config), None, pool)
        cleanup.callback(lambda: _release(fleet, pool, started_ray, failed=not finished))
        trainer = Trainer(config, fleet, data, scorer, None, evaluation)
        cleanup.callback(trainer.close)
        if config.sync.probe:
            trainer.rollouts.probe_all()
        version = 0
        if checkpoint_path is not None:
            version = fleet.learner_group.load_checkpoint(str(checkpoint_path))
            trainer.rollouts.restored(version)
            trainer.rollouts.export(version)
        trainer.evaluation.dispatch(step, version)
        metrics = trainer.evaluation.collect()
        finished = True
    out_dir.mkdir(parents=True, exist_ok=True)
    source = {"checkpoint": str(checkpoint_path) if checkpoint_path else None, "model": config.model.path}
    (out_dir / "eval.json").write_text(json.dumps({**source, **metrics}, indent=2) + "\n")
    return metrics


def train(trainer: Trainer, recorder: MetricsRecorder, run_dir: Path, resolved: str, first: int, display: bool,
          startup: Startup | None = None) -> list[dict[str, Any]]:
    """The steps from `first` to `max_steps`, each recorded and published, checkpoints written; their records (the
    first with `startup`'s `time/startup/*`)."""
    config, records, warned = trainer.config, [], False
    trainer.publish({"step": first - 1})
    progress = ProgressDisplay(config.max_steps, start_step=first - 1) if display else None

    def write(record: dict[str, Any]) -> None:
        nonlocal warned, startup
        if startup is not None:  # the first record only
            record, startup = startup.stamp(record), None
        recorder.write(record)
        records.append(record)
        trainer.publish(record)
        if progress:
            progress.update(record)
        warned = warned or _warn_truncated(record, config.rollout.max_new_tokens)

    with progress or nullcontext(), _stop_on_interrupt() as interrupted:
        for step in range(first, config.max_steps + 1):
            if interrupted:  # the record a step holds for its evaluation (`Trainer.held`) is written, not lost
                for record in trainer.release_held():
                    write(record)
                raise RunInterrupted(f"interrupted (Ctrl-C) after step {step - 1}")
            for record in trainer.step(step):
                write(record)
            every = config.checkpoint.every
            if step == config.max_steps or (every and step % every == 0):
                trainer.save_checkpoint(run_dir, step, resolved)
    if progress:
        progress.summary()
    return records


def _warn_truncated(record: dict[str, Any], max_new_tokens: int) -> bool:
    """Print one warning if more than TRUNCATED_WARNING of a step's completions were cut at `max_new_tokens`; whether
    it did (the run warns once)."""
    cut = record.get("response/truncated_fraction", 0.0)
    if cut <= TRUNCATED_WARNING:
        return False
    print(f"relay: warning: step {record.get('step')}: {cut:.0%} of the completions were cut at "
          f"rollout.max_new_tokens={max_new_tokens} (response/truncated_fraction); raise rollout.max_new_tokens (and "
          "rollout.max_model_len) if the answers need more tokens", file=sys.stderr, flush=True)
    return True


class RunInterrupted(RunError):
    """Ctrl-C (SIGINT) stopped the run between two steps."""


@contextmanager
def _stop_on_interrupt() -> Iterator[list[int]]:
    """While the steps run (in the main thread), a first Ctrl-C asks the loop to stop before the next step (the list
    it yields becomes non-empty), so the run ends between two steps and cleans up as after any failure, instead of
    being interrupted inside a remote call; a second one interrupts at once (KeyboardInterrupt)."""
    asked: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield asked
        return

    def ask(signum: int, _frame: Any) -> None:
        asked.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print("relay: stopping after this step (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, ask)
    try:
        yield asked
    finally:
        signal.signal(signal.SIGINT, previous)


def _demo_model(config: RunConfig) -> str:
    """The demo model's directory for `data.task` (the shipped copy, else built now)."""
    from cluster.demo.cache import ensure_demo_model

    return str(ensure_demo_model(log=lambda line: print(f"relay: {line}", file=sys.stderr), task=config.data.task))


def _init_ray(config: RunConfig) -> bool:
    """Start a local Ray instance or join the cluster at `ray.address` (or $RAY_ADDRESS, as in a Ray job); returns
    whether this call did (so the run shuts it down). A malformed address is a ConfigError; a cluster that cannot be
    reached a RunError, found within seconds (Ray itself would retry a closed GCS port for minutes)."""
    if ray.is_initialized():
        return False
    rc = config.ray
    starts = rc.address is None and not os.environ.get("RAY_ADDRESS")  # else it joins a cluster (relay submit)
    address = rc.address or os.environ.get("RAY_ADDRESS")
    try:
        check_reachable(address)
        context = ray.init(address=rc.address, num_cpus=rc.num_cpus if rc.address is None else None,
                           include_dashboard=rc.dashboard, dashboard_host="127.0.0.1", log_to_driver=rc.log_to_driver,
                           configure_logging=True, logging_level="WARNING",
                           **({"_system_config": RAY_SYSTEM_CONFIG} if starts else {}))
    except ValueError as err:  # Ray's own check of the address's form
        raise ConfigError(f"ray.address={address!r}: {str(err).splitlines()[0]}") from None
    except ConnectionError as err:
        raise RunError(f"cannot reach a Ray cluster at ray.address={address}: {str(err).splitlines()[0]}") from None
    line = dashboard_line(context)
    if line:
        print(line, file=sys.stderr, flush=True)
    return True

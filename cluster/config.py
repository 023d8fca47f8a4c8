"""The one configuration tree of a relay run, its loading from YAML and dotted overrides, and its errors.

Owns: every user-settable knob (pydantic models that forbid unknown keys, with bounds and a docstring per field),
`load_config(path, overrides)`, and `ConfigError` whose message is one line naming the key and the fix.
Does not own: what the knobs do. This module imports nothing heavier than pydantic and yaml, so `relay --help`
and config validation are instant and need neither torch nor vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A user's configuration is invalid; the message is one line naming the key and how to fix it."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ModelConfig(_Section):
    path: str | None = None
    """Hugging Face model directory of the initial policy; empty means the built-in demo model (built on first use)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype for the learner, the reference and the engines (float32 on CPU keeps the sync check tight)."""


class DataConfig(_Section):
    task: Literal["arithmetic"] = "arithmetic"
    """Prompt source: `arithmetic` draws `a+b=` prompts whose label is the sum."""
    min_operand: int = Field(0, ge=0, le=10**6)
    """Smallest operand of the arithmetic task."""
    max_operand: int = Field(99, ge=0, le=10**6)
    """Largest operand of the arithmetic task."""
    prompts_per_step: int = Field(32, ge=1, le=1_000_000)
    """Prompts drawn per step (B); each gets `rollout.group_size` completions."""

    @model_validator(mode="after")
    def _operands_ordered(self) -> DataConfig:
        if self.min_operand > self.max_operand:
            raise ValueError(
                f"min_operand ({self.min_operand}) must not exceed max_operand ({self.max_operand}); swap them"
            )
        return self


class RolloutConfig(_Section):
    num_workers: int = Field(2, ge=1, le=4096)
    """Rollout workers, each one Ray actor owning one vLLM engine; scaled independently of the learner."""
    num_cpus: float = Field(0.5, gt=0, le=1024)
    """CPUs Ray reserves for each rollout worker (scheduling only)."""
    num_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves for each rollout worker (0 on CPU machines)."""
    num_threads: int = Field(1, ge=1, le=1024)
    """Compute threads each engine uses; keep the sum over workers at or below the cores of a node."""
    group_size: int = Field(8, ge=1, le=1024)
    """Completions sampled per prompt (G)."""
    max_new_tokens: int = Field(8, ge=1, le=1_000_000)
    """Maximum response tokens per completion."""
    temperature: float = Field(1.0, gt=0, le=10)
    """Sampling temperature; the learner scores with the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (1 keeps the full distribution, which the learner's logprobs assume)."""
    max_model_len: int = Field(64, ge=8, le=1_048_576)
    """Longest prompt+response the engine accepts."""
    kv_cache_bytes: int = Field(64 * 2**20, ge=2**20)
    """KV-cache memory per engine, in bytes (needed on CPU, where vLLM cannot measure free memory)."""
    enforce_eager: bool = True
    """Skip torch.compile and graph capture (saves ~1 minute of start-up on CPU)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of GPU memory the engine may take (GPU only)."""


class ReferenceConfig(_Section):
    enabled: bool = True
    """Run a frozen reference policy for the KL penalty (required when `learner.kl_coef` > 0)."""
    num_cpus: float = Field(0.5, gt=0, le=1024)
    """CPUs Ray reserves for the reference worker."""
    num_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves for the reference worker."""
    num_threads: int = Field(2, ge=1, le=1024)
    """Torch threads of the reference worker (phases run in turn, so it may use every core)."""
    micro_batch_size: int = Field(64, ge=1, le=1_000_000)
    """Sequences per reference forward pass."""


class LearnerConfig(_Section):
    num_cpus: float = Field(0.5, gt=0, le=1024)
    """CPUs Ray reserves for the learner."""
    num_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves for the learner."""
    num_threads: int = Field(2, ge=1, le=1024)
    """Torch threads of the learner (phases run in turn, so it may use every core)."""
    advantage: Literal["grpo", "rloo", "reinforce_pp"] = "grpo"
    """Advantage estimator: `grpo` ((r - group mean) / (group std + 1e-6)), `rloo` (leave-one-out baseline) or
    `reinforce_pp` (REINFORCE++: group mean subtracted, then whitened over the batch)."""
    lr: float = Field(5e-5, gt=0, le=1)
    """AdamW learning rate."""
    warmup_steps: int = Field(10, ge=0, le=10_000_000)
    """Optimizer steps over which the learning rate rises linearly from 0 to `lr` (lets Adam's moment estimates
    settle before full-size steps: its first steps are sign-like and move every weight by about `lr`)."""
    weight_decay: float = Field(0.0, ge=0, le=1)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping threshold (global L2 norm)."""
    ppo_epochs: int = Field(1, ge=1, le=100)
    """Passes over each step's batch."""
    num_minibatches: int = Field(1, ge=1, le=100_000)
    """Optimizer steps per epoch; the batch is shuffled and split into this many minibatches."""
    micro_batch_size: int = Field(64, ge=1, le=1_000_000)
    """Sequences per forward/backward pass; gradients accumulate over a minibatch's micro-batches."""
    clip_low: float = Field(0.2, ge=0, le=1)
    """PPO ratio clip below 1: ratios under 1 - clip_low stop contributing gradient."""
    clip_high: float = Field(0.2, ge=0, le=10)
    """PPO ratio clip above 1 (DAPO's clip-higher when larger than clip_low)."""
    kl_coef: float = Field(0.01, ge=0, le=100)
    """Coefficient of the k3 KL penalty to the reference policy, added to the loss; 0 turns KL off."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator used in the loss."""
    max_nonfinite_steps: int = Field(3, ge=1, le=1000)
    """Consecutive updates skipped for a non-finite loss or gradient before the run stops."""


class SyncConfig(_Section):
    transport: Literal["object_store"] = "object_store"
    """How weights reach the engines: `object_store` puts them once (numpy, zero-copy) for every worker to read."""
    bucket_mb: float = Field(256.0, gt=0, le=65536)
    """Size of each weight bucket put in the object store, in MB."""
    probe: bool = True
    """After every sync, compare each engine's logprobs on a fixed probe sequence with the learner's."""
    probe_tolerance: float = Field(1e-4, gt=0)
    """Largest allowed max |engine - learner| logprob on the probe (1e-4 is safe in float32; ~5e-2 for bfloat16)."""
    probe_tokens: int = Field(8, ge=1, le=1024)
    """Tokens the probe samples from its fixed prompt."""
    probe_prompt: str = Field("1+1=2 2+2=4 3+3=6 4+4=8 5+5=10 6+6=12 7+7=14 ", min_length=1)
    """Fixed probe prompt; longer than one KV block (32 tokens) so a missed prefix-cache reset shows up."""


class RewardConfig(_Section):
    verifier: Literal["exact_match"] = "exact_match"
    """Rule verifier scoring each completion against its label: `exact_match` gives 1.0 iff they are equal."""


class TimeoutConfig(_Section):
    start: float = Field(600.0, gt=0)
    """Seconds for every actor to start (engines load their model here)."""
    generate: float = Field(300.0, gt=0)
    """Seconds for one worker's generate call."""
    reference: float = Field(300.0, gt=0)
    """Seconds for the reference worker's logprobs call."""
    train: float = Field(1800.0, gt=0)
    """Seconds for the learner's train step."""
    sync: float = Field(300.0, gt=0)
    """Seconds for exporting and loading weights on every worker, probe included."""


class RayConfig(_Section):
    address: str | None = None
    """Ray cluster address (`auto`, `ray://host:10001`); empty starts a local Ray instance for this run."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs a local Ray instance advertises (default: every core)."""
    dashboard: bool = False
    """Start the Ray dashboard (bound to 127.0.0.1) with a local instance."""
    log_to_driver: bool = False
    """Echo every actor's log (vLLM's included) on the console; otherwise they stay in Ray's session logs."""


class RunConfig(_Section):
    """A whole training run. `relay train CONFIG.yaml key.sub=value ...` builds one of these."""

    run_dir: str | None = None
    """Directory for config.yaml, metrics.jsonl and checkpoints; must not already hold a run. Empty: runs/<time>."""
    max_steps: int = Field(80, ge=1, le=10_000_000)
    """Training steps to run."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed for prompts, sampling and shuffling."""
    model: ModelConfig = ModelConfig()
    """The initial policy (also the reference)."""
    data: DataConfig = DataConfig()
    """Where prompts come from and how many per step."""
    rollout: RolloutConfig = RolloutConfig()
    """The rollout fleet (vLLM engines) and sampling."""
    reference: ReferenceConfig = ReferenceConfig()
    """The frozen reference policy for the KL penalty."""
    reward: RewardConfig = RewardConfig()
    """How completions are scored."""
    learner: LearnerConfig = LearnerConfig()
    """The trained policy, its optimizer and the objective."""
    sync: SyncConfig = SyncConfig()
    """Weight sync to the engines after every step, and its verification."""
    timeouts: TimeoutConfig = TimeoutConfig()
    """A deadline for every remote call."""
    ray: RayConfig = RayConfig()
    """The Ray cluster to run on."""

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.learner.kl_coef > 0 and not self.reference.enabled:
            raise ValueError("learner.kl_coef > 0 needs a reference policy: set reference.enabled=true or kl_coef=0")
        batch = self.data.prompts_per_step * self.rollout.group_size
        if batch % self.learner.num_minibatches:
            raise ValueError(
                f"learner.num_minibatches ({self.learner.num_minibatches}) must divide the batch of "
                f"data.prompts_per_step x rollout.group_size = {batch} completions"
            )
        if self.learner.advantage == "rloo" and self.rollout.group_size < 2:
            raise ValueError("learner.advantage=rloo needs rollout.group_size >= 2")
        return self


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        allowed = _allowed_keys(tuple(first["loc"][:-1]))
        return f"unknown config key '{key}'; allowed here: {', '.join(allowed)}"
    value = first.get("input")
    shown = "" if isinstance(value, dict) else f" (got {value!r})"
    msg = first["msg"].removeprefix("Value error, ")
    return f"{key}: {msg}{shown}" if key else msg


def _allowed_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = RunConfig
    for part in loc:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn `["a.b=1", "c=x"]` into a nested dict; values are parsed as YAML scalars (`1` -> int, `true` -> bool)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override '{item}' is not of the form dotted.key=value (e.g. learner.lr=1e-4)")
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError:
            value = raw
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{item}' conflicts with an earlier override of '{part}'")
            node = child
        node[leaf] = value
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Build the run config from an optional YAML file plus dotted overrides; raise ConfigError on bad input."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ConfigError(f"cannot read config file '{path}': {err.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"config file '{path}'{where} is not valid YAML") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of keys, not {type(data).__name__}")
    data = _merge(data, parse_overrides(list(overrides)))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML, loadable again by `load_config`."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def config_reference() -> str:
    """Every key with its default and docstring, as Markdown (docs/configuration.md is this text)."""
    lines = ["# Configuration reference", "",
             "Generated from `cluster/config.py` by `python -m cluster.config > docs/configuration.md`; a test keeps",
             "the two equal. Set keys in a YAML file or as `dotted.key=value` overrides on the command line.", ""]

    def walk(model: type[BaseModel], prefix: str) -> None:
        rows = []
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.")
                continue
            default = field.default
            rows.append(f"| `{prefix}{name}` | `{default!r}` | {field.description} |")
        if rows:
            title = prefix.rstrip(".") or "top level"
            lines.extend([f"## {title}", "", "| key | default | meaning |", "|---|---|---|", *rows, ""])

    walk(RunConfig, "")
    return "\n".join(lines)


if __name__ == "__main__":
    print(config_reference(), end="")

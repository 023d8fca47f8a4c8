"""The one configuration tree of a relay run, its loading from YAML and dotted overrides, and its errors.

Owns: `RunConfig`, which composes the sections each package owns (`actors/config.py`: rollout, reference and teacher;
`learner/config.py`: learner and critic; `rewards/config.py`: reward; `sync/config.py`: sync) with the run's own
(model, data, checkpoint, logging, timeouts, ray); the checks across sections; `load_config(path, overrides)`; and
`ConfigError`, whose message is one line naming the key and the fix. Every section is a pydantic model that forbids
unknown keys, with bounds and a docstring per field.
Does not own: what the knobs do. This module imports nothing heavier than pydantic and yaml, so `relay --help`
and config validation are instant and need neither torch nor vLLM.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from actors.config import ReferenceConfig, RolloutConfig, TeacherConfig, sizes_for_model
from cluster.data_config import DataConfig, EvalConfig, ReasoningGymConfig, ReasoningGymDataset  # noqa: F401
from cluster.run_sections import CheckpointConfig, LoggingConfig, ModelConfig, RayConfig, TimeoutConfig
from learner.config import CriticConfig, LearnerConfig
from rewards.config import SOURCE_TYPES, EnvironmentConfig, RewardConfig
from sync.config import SyncConfig


class ConfigError(ValueError):
    """A user's configuration is invalid; the message is one line naming the key and how to fix it."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _given(section: Any, name: str, default: Any) -> Any:
    """A field of a config section not validated yet: a dict's entry, or an already-built section's attribute."""
    return section.get(name, default) if isinstance(section, dict) else getattr(section, name, default)


def _unset_to(data: dict, section: str, name: str, value: Any) -> dict:
    """Raw config `data` with `section.name` set to `value` where the user did not set it (a section given already
    built is left as it is)."""
    given = data.get(section)
    if given is None:
        return {**data, section: {name: value}}
    if isinstance(given, dict) and name not in given:
        return {**data, section: {**given, name: value}}
    return data


def _asynchronous(data: dict) -> bool:
    """Whether raw config `data` asks for asynchronous training (a malformed value is left to the field's check)."""
    staleness = _given(data.get("rollout"), "max_staleness", 0)
    return isinstance(staleness, int) and staleness >= 1


class RunConfig(_Section):
    """A whole training run. `relay train CONFIG.yaml key.sub=value ...` builds one of these."""

    run_dir: str | None = None
    """Directory for config.yaml, metrics.jsonl and checkpoints; must not already hold a run. Empty: runs/<time>."""
    max_steps: int = Field(80, ge=1, le=10_000_000)
    """Training steps to run."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed for prompts, sampling and shuffling."""
    resume: str | None = None
    """`auto`: continue the run in `run_dir` from its latest complete checkpoint (or start it if it has none);
    a path: continue from that checkpoint directory. Empty: a new run (`run_dir` must not hold one)."""
    model: ModelConfig = ModelConfig()
    """The initial policy (also the reference)."""
    data: DataConfig = DataConfig()
    """Where prompts come from and how many per step."""
    eval: EvalConfig = EvalConfig()
    """Evaluation on held-out prompts while training (and `relay eval`)."""
    rollout: RolloutConfig = RolloutConfig()
    """The rollout fleet (vLLM engines) and sampling."""
    reference: ReferenceConfig = ReferenceConfig()
    """The frozen reference policy for the KL penalty."""
    teacher: TeacherConfig = TeacherConfig()
    """On-policy distillation's teacher, which scores every token the policy samples (`learner.distill_coef`)."""
    reward: RewardConfig = RewardConfig()
    """How completions are scored."""
    env: EnvironmentConfig = EnvironmentConfig()
    """Multi-turn episodes with an environment (in-process or a service), and how its rewards count."""
    learner: LearnerConfig = LearnerConfig()
    """The trained policy, its optimizer and the objective."""
    critic: CriticConfig = CriticConfig()
    """The value model of PPO, trained in the learner actor."""
    sync: SyncConfig = SyncConfig()
    """Weight sync to the engines after every step, and its verification."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Periodic checkpoints for resuming."""
    logging: LoggingConfig = LoggingConfig()
    """Where metrics go besides `metrics.jsonl`."""
    timeouts: TimeoutConfig = TimeoutConfig()
    """A deadline for every remote call."""
    ray: RayConfig = RayConfig()
    """The Ray cluster to run on."""
    _from_model: tuple[str, ...] = PrivateAttr(default=())  # the keys `_sized_by_the_model` set

    @property
    def from_model(self) -> dict[str, Any]:
        """The keys the model in `model.path` set because the user did not (`rollout.max_model_len`, ...): values."""
        return {f"rollout.{name}": getattr(self.rollout, name) for name in self._from_model}

    @property
    def scores_steps(self) -> bool:
        """Whether the learner gets step rewards: a reward source of level steps, or `env.turn_rewards=steps`."""
        return self.reward.scores_steps or (self.env.enabled and self.env.turn_rewards == "steps")

    @property
    def uses_reference(self) -> bool:
        """Whether the run starts a reference worker: only when some KL penalty reads its logprobs, and the learner
        does not compute them itself (with LoRA the reference is the base: the learner's policy with its adapters
        disabled)."""
        return (self.reference.enabled and (self.learner.kl_coef > 0 or self.learner.kl_reward_coef > 0)
                and not self.learner.lora.enabled)

    @property
    def uses_teacher(self) -> bool:
        """Whether the run starts a teacher worker (on-policy distillation)."""
        return self.learner.distill_coef > 0

    @model_validator(mode="before")
    @classmethod
    def _decoupled_by_default(cls, data: Any) -> Any:
        """Off-policy batches are corrected for their stale behaviour policy unless told otherwise: with
        `rollout.max_staleness` >= 1 (asynchronous training) or `data.replay_fraction` > 0 (replayed groups) an unset
        `learner.rollout_correction` is `tis` (decoupled PPO)."""
        if not isinstance(data, dict):
            return data
        replay = _given(data.get("data"), "replay_fraction", 0)
        replayed = isinstance(replay, (int, float)) and not isinstance(replay, bool) and replay > 0
        return _unset_to(data, "learner", "rollout_correction", "tis") if _asynchronous(data) or replayed else data

    @model_validator(mode="wrap")
    @classmethod
    def _sized_by_the_model(cls, data: Any, handler: Any) -> RunConfig:
        """With `model.path`, the rollout sizes the demo tuned for its own model (`max_model_len`, `max_new_tokens`,
        `kv_cache_bytes`) come from that model's config.json where the user did not set them
        (`actors.config.sizes_for_model`)."""
        rollout = data.get("rollout", {}) if isinstance(data, dict) else None
        sizes = sizes_for_model(_given(data.get("model") or {}, "path", None), rollout.get("max_model_len")) \
            if isinstance(rollout, dict) else {}
        unset = {name: value for name, value in sizes.items() if name not in rollout}
        if not unset:
            return handler(data)
        config = handler({**data, "rollout": {**rollout, **unset}})
        config._from_model = tuple(unset)
        return config

    @model_validator(mode="before")
    @classmethod
    def _reasoning_gym_verifier_by_default(cls, data: Any) -> Any:
        """reasoning-gym tasks are scored by their own datasets: with `data.task=reasoning_gym` and no
        `reward.sources` given, the reward is `{correct: {type: rule, verifier: reasoning_gym}}` (exact_match, the
        other tasks' default, would compare a completion with a whole entry and score 0)."""
        if not isinstance(data, dict) or _given(data.get("data"), "task", None) != "reasoning_gym":
            return data
        return _unset_to(data, "reward", "sources", {"correct": {"type": "rule", "verifier": "reasoning_gym"}})

    @model_validator(mode="before")
    @classmethod
    def _threads_for_overlap(cls, data: Any) -> Any:
        """In an asynchronous run (`rollout.max_staleness` >= 1) the engines generate while the learner and the
        reference compute, so an unset `learner.num_threads` or `reference.num_threads` is 1, whatever the model's
        size (unset on-policy, it is set by the size when the fleet starts:
        `learner.passes.device.default_threads`): two threads each beside the engines oversubscribe a small machine's
        cores (the demo's step took 1.6-2.8x the synchronous one's on 2 cores)."""
        if not isinstance(data, dict) or not _asynchronous(data):
            return data
        return _unset_to(_unset_to(data, "learner", "num_threads", 1), "reference", "num_threads", 1)

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        for problem in _inconsistencies(self):
            raise ValueError(problem)  # the first one; fixing it shows the next
        return self


def replayed_groups(prompts_per_step: int, fraction: float) -> int:
    """Groups iterative GRPO's replay mixes into each step once its buffer holds that many: the share `fraction` of
    the whole batch, round(prompts_per_step x f / (1 - f))."""
    return round(prompts_per_step * fraction / (1 - fraction)) if fraction > 0 else 0


def _inconsistencies(config: RunConfig):
    """Yield one message per invalid combination of keys, each saying how to fix it; independent rules of two to four
    lines each, in groups by what they concern, always in this order (`RunConfig._consistent` raises the first)."""
    for rules in (_policy_rules, _batch_rules, _advantage_rules, _length_and_data_rules,
                  _lora_and_pipeline_rules, _reward_rules, _eval_and_sampling_rules):
        yield from rules(config)


def _policy_rules(config: RunConfig):
    """The model's dtypes, the KL's reference and on-policy distillation's teacher."""
    learner = config.learner
    if learner.master_dtype == "bfloat16" and config.model.dtype != "bfloat16":
        yield ("learner.master_dtype=bfloat16 needs model.dtype=bfloat16 (master weights are never coarser than the "
               "compute dtype); set learner.master_dtype=float32")
    if learner.kl_coef > 0 and learner.kl_reward_coef > 0:
        yield ("KL is in the loss (learner.kl_coef) and in the reward (learner.kl_reward_coef) at once; "
               "set one of them to 0")
    if (learner.kl_coef > 0 or learner.kl_reward_coef > 0) and not config.reference.enabled:
        yield ("a KL penalty (learner.kl_coef or learner.kl_reward_coef > 0) needs a reference policy: set "
               "reference.enabled=true or both coefficients to 0")
    if learner.distill_coef > 0 and not config.teacher.path:
        yield ("learner.distill_coef > 0 needs a teacher: set teacher.path (a model directory with the policy's "
               "tokenizer, or demo) or learner.distill_coef=0")
    if learner.advantage == "distill" and learner.distill_coef == 0:
        yield ("learner.advantage=distill trains on the teacher's advantage alone: set learner.distill_coef > 0 "
               "(e.g. 1) and teacher.path")
    if config.teacher.path and learner.distill_coef == 0:
        yield ("teacher.path is set but learner.distill_coef is 0, so nothing would read the teacher: set "
               "learner.distill_coef > 0 (e.g. 1) or leave teacher.path empty")


def _batch_rules(config: RunConfig):
    """The minibatches against the batch, with and without replay; groups the advantage needs."""
    learner, rollout = config.learner, config.rollout
    batch = config.data.prompts_per_step * rollout.group_size
    if batch % learner.num_minibatches:
        yield (f"learner.num_minibatches ({learner.num_minibatches}) must divide the batch of "
               f"data.prompts_per_step x rollout.group_size = {batch} completions")
    replayed = min(replayed_groups(config.data.prompts_per_step, config.data.replay_fraction),
                   config.data.replay_buffer_size) * rollout.group_size
    if replayed and (batch + replayed) % learner.num_minibatches:
        yield (f"learner.num_minibatches ({learner.num_minibatches}) must also divide the batch with replay, {batch} "
               f"fresh + {replayed} replayed = {batch + replayed} completions (data.replay_fraction), or the "
               "minibatches would be ragged: choose one that divides both, or another replay_fraction")
    if learner.advantage == "rloo" and rollout.group_size < 2:
        yield "learner.advantage=rloo needs rollout.group_size >= 2"


def _advantage_rules(config: RunConfig):
    """The value model, the baseline and group scale of each advantage, the dual clip, the rollout correction."""
    learner = config.learner
    if learner.advantage == "gae" and not config.critic.enabled:
        yield "learner.advantage=gae needs a value model: set critic.enabled=true (or pick grpo, rloo, reinforce_pp)"
    if learner.advantage == "reinforce" and learner.uses_value_model and not config.critic.enabled:
        yield ("learner.baseline=value needs a value model: set critic.enabled=true (or pick baseline none, "
               "batch_mean or group_mean)")
    if config.critic.enabled and not learner.uses_value_model:
        yield (f"critic.enabled=true but learner.advantage={learner.advantage} does not use a value model; "
               "set learner.advantage=gae (or reinforce with baseline=value) or critic.enabled=false")
    if learner.baseline != "none" and learner.advantage != "reinforce":
        yield "learner.baseline applies to advantage=reinforce only; remove it or set learner.advantage=reinforce"
    if learner.group_scale != "std" and learner.advantage != "grpo":
        yield "learner.group_scale applies to advantage=grpo only; remove it or set learner.advantage=grpo"
    if learner.clip_c is not None and learner.policy_loss != "ppo":
        yield f"learner.clip_c (dual clip) is not defined for policy_loss={learner.policy_loss}; remove clip_c"
    low, high = learner.rollout_correction_low, learner.rollout_correction_high
    if low >= high:
        yield (f"learner.rollout_correction_low ({low:g}) must be below learner.rollout_correction_high ({high:g}): "
               "icepop and seq_mask_tis mask the ratios outside [low, high]")
    elif not low <= 1 <= high:
        yield (f"learner.rollout_correction_low ({low:g}) and rollout_correction_high ({high:g}) must hold 1 between "
               "them (the ratio where engine and learner agree), or icepop and seq_mask_tis mask nearly every token")
    if learner.rollout_correction in ("icepop", "seq_mask_tis") and learner.rollout_correction_level != "token":
        yield ("learner.rollout_correction_level=sequence applies to tis and mis; "
               f"rollout_correction={learner.rollout_correction} defines its own level: remove it")


def _length_and_data_rules(config: RunConfig):
    """The completions' lengths, and where the prompts come from."""
    rollout = config.rollout
    if rollout.max_new_tokens >= rollout.max_model_len:
        yield (f"rollout.max_new_tokens ({rollout.max_new_tokens}) must be below rollout.max_model_len "
               f"({rollout.max_model_len}), which holds the prompt and the completion: lower one or raise the other")
    if config.reward.overlong_buffer >= rollout.max_new_tokens:
        yield (f"reward.overlong_buffer ({config.reward.overlong_buffer}) must be below rollout.max_new_tokens "
               f"({rollout.max_new_tokens}); the penalty ramps over the last overlong_buffer tokens")
    if config.data.task == "dataset" and not config.data.path:
        yield "data.task=dataset needs data.path (a .jsonl or .parquet file, or a datasets directory)"
    if config.data.task == "reasoning_gym" and not config.data.reasoning_gym.datasets:
        yield ("data.task=reasoning_gym needs data.reasoning_gym.datasets: name at least one, e.g. "
               "data.reasoning_gym.datasets.basic_arithmetic.weight=1")
    if config.data.task != "reasoning_gym" and config.data.reasoning_gym.datasets:
        yield (f"data.reasoning_gym is read only with data.task=reasoning_gym (not {config.data.task}); set the task "
               "or remove data.reasoning_gym")
    if config.data.task != "dataset" and config.data.label_format != "value":
        yield "data.label_format applies to data.task=dataset (labels read from data.path); remove it"


def _lora_and_pipeline_rules(config: RunConfig):
    """LoRA against the strategy, the transport and the reference; the asynchronous pipeline's needs."""
    learner, rollout = config.learner, config.rollout
    lora = learner.lora
    if lora.enabled and learner.num_ranks > 1 and learner.strategy == "fsdp2":
        yield ("learner.lora with learner.strategy=fsdp2 is not supported (the base is frozen and the adapters are "
               "small: ddp replicates them cheaply); set learner.strategy=ddp")
    if lora.enabled and config.sync.transport == "collective":
        yield ("learner.lora with sync.transport=collective is not supported (the collective broadcast loads whole "
               "weights into the engines, not adapters); set sync.transport=object_store")
    if lora.enabled and config.reference.refresh_every:
        yield ("learner.lora with reference.refresh_every is not supported: the reference is the base, computed by "
               "the learner with the adapters disabled; set reference.refresh_every=0")
    if not lora.enabled and (lora.alpha is not None or lora.dropout or lora.target_modules != "all-linear"
                             or lora.modules_to_save or lora.modules_lr is not None):
        yield ("learner.lora.alpha, dropout, target_modules, modules_to_save and modules_lr apply with "
               "learner.lora.rank > 0; set a rank or remove them")
    if config.reference.refresh_every and not config.uses_reference and not lora.enabled:
        yield ("reference.refresh_every needs a reference policy in use: set learner.kl_coef or "
               "learner.kl_reward_coef > 0 (and reference.enabled=true), or refresh_every=0")
    if rollout.in_flight_updates and not rollout.max_staleness:
        yield ("rollout.in_flight_updates=true needs asynchronous training: set rollout.max_staleness >= 1 (new "
               "weights reach an engine while it still samples the batches queued on it), or in_flight_updates=false")
    if rollout.max_staleness and config.sync.transport != "object_store":
        yield ("rollout.max_staleness >= 1 needs sync.transport=object_store (each engine loads the weights between "
               "its own requests; the collective transport loads every engine at once); set it or max_staleness=0")


def _reward_rules(config: RunConfig):
    """Step rewards, the environment and its turns, the nucleus against the rollout correction."""
    learner, rollout = config.learner, config.rollout
    if config.reward.scores_steps and learner.advantage in ("rloo", "reinforce_pp"):
        yield (f"step rewards (a reward source with level=steps) need learner.advantage grpo (DeepSeekMath's process "
               f"supervision), gae or reinforce; {learner.advantage} reads one reward per sequence")
    if config.reward.scores_steps and learner.advantage == "grpo" and learner.kl_reward_coef > 0:
        yield ("step rewards with advantage=grpo normalise the rewards at step ends only, so a per-token KL in the "
               "reward would be lost: put the KL in the loss (learner.kl_coef) and set learner.kl_reward_coef=0")
    env = config.env
    if not config.reward.sources and not env.enabled:
        yield "reward.sources is empty and no environment gives rewards: add a source or set env.spec or env.urls"
    if env.enabled and "env" in config.reward.sources:
        yield "reward source name 'env' would hide the environment's metric reward/env; choose another name"
    if rollout.stop and not env.enabled:
        yield "rollout.stop ends a model turn of an episode: set env.spec or env.urls, or remove rollout.stop"
    if env.enabled and rollout.in_flight_updates:
        yield "env episodes and rollout.in_flight_updates are not supported together; set in_flight_updates=false"
    env_steps = env.enabled and env.turn_rewards == "steps"
    if env_steps and config.reward.scores_steps:
        yield ("env.turn_rewards=steps and a reward source with level=steps both give step rewards; keep one "
               "(env.turn_rewards=outcome, or the source at level=outcome)")
    if env_steps and learner.advantage in ("rloo", "reinforce_pp"):
        yield (f"env.turn_rewards=steps needs learner.advantage grpo, gae or reinforce; {learner.advantage} reads "
               "one reward per sequence (or set env.turn_rewards=outcome)")
    if env_steps and learner.advantage == "grpo" and learner.kl_reward_coef > 0:
        yield ("env.turn_rewards=steps with advantage=grpo normalises the rewards at turn ends only, so a per-token "
               "KL in the reward would be lost: put the KL in the loss (learner.kl_coef) and set "
               "learner.kl_reward_coef=0")
    if rollout.top_p < 1 and learner.rollout_correction != "none":
        why = ("asynchronous training and replay set it by default; " if rollout.max_staleness
               or config.data.replay_fraction else "")
        yield (f"rollout.top_p={rollout.top_p:g} with learner.rollout_correction={learner.rollout_correction} "
               "(" + why + "the learner's logprobs are not renormalised over the nucleus as the engines' are, so the "
               "importance weights would be biased below 1): set rollout.top_p=1, or learner.rollout_correction=none")


def _eval_and_sampling_rules(config: RunConfig):
    """Evaluation while training, and dynamic sampling."""
    rollout = config.rollout
    ev = config.eval
    if ev.every and ev.data is None and not config.data.held_out:
        yield ("eval.every > 0 evaluates on the training data's held-out problems, and data.held_out is 0: set "
               "data.held_out (e.g. 0.1: training then skips those problems) or give eval.data")
    for name in ev.sources or []:
        if name not in config.reward.sources:
            yield (f"eval.sources names '{name}', which is not in reward.sources ({', '.join(config.reward.sources)})"
                   "; name training sources, or leave eval.sources empty for all of them")
    if ev.every and rollout.in_flight_updates:
        yield ("eval.every > 0 with rollout.in_flight_updates: an evaluation samples with one weights version, and "
               "in-flight updates change an engine's weights during its requests; set one of them off")
    if ev.max_new_tokens is not None and ev.max_new_tokens >= rollout.max_model_len:
        yield (f"eval.max_new_tokens ({ev.max_new_tokens}) must be below rollout.max_model_len "
               f"({rollout.max_model_len}), which holds the prompt and the completion")
    if rollout.dynamic_sampling and rollout.group_size < 2:
        yield "rollout.dynamic_sampling needs rollout.group_size >= 2 (it drops groups whose rewards are all equal)"
    if rollout.dynamic_sampling and config.learner.distill_coef > 0:
        yield ("rollout.dynamic_sampling with learner.distill_coef > 0 would drop groups the teacher's advantage "
               "trains on (every token has one, whatever the rewards): set rollout.dynamic_sampling=false or "
               "learner.distill_coef=0")


# The fields' patterns, said as sentences (pydantic's message shows the regular expression).
_PATTERNS = {r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$": "must be 'package.module:Name', a module then a colon and the "
             "class or function in it (e.g. mypkg.envs:Game), importable from the current directory or PYTHONPATH",
             r"^[A-Za-z_][A-Za-z0-9_]*$": "must be a name of letters, digits and _, not starting with a digit"}


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    # A reward source's location holds its union tag (`reward.sources.judge.remote.urls`): drop it.
    loc = [p for i, p in enumerate(first["loc"]) if not (i >= 2 and first["loc"][i - 2] == "sources")]
    key = ".".join(str(p) for p in loc)
    if first["type"] == "extra_forbidden":
        allowed = _allowed_keys(tuple(first["loc"][:-1]))
        close = difflib.get_close_matches(str(first["loc"][-1]), allowed, n=1)
        hint = f"did you mean '{'.'.join([*key.split('.')[:-1], close[0]])}'? " if close else ""
        return f"unknown config key '{key}'; {hint}allowed here: {', '.join(allowed)}"
    if first["type"] == "union_tag_invalid":
        return f"{key}.type: must be one of {', '.join(SOURCE_TYPES)} (got {first['ctx']['tag']!r})"
    value = first.get("input")
    shown = "" if isinstance(value, dict) else f" (got {value!r})"
    msg = _PATTERNS.get(first.get("ctx", {}).get("pattern"), first["msg"].removeprefix("Value error, "))
    if loc and _union_member(loc[-1]):  # a value no member of a union takes (`int | "auto"`): each member's message
        members = [e for e in err.errors() if len(e["loc"]) == len(first["loc"]) and e["loc"][:-1] == first["loc"][:-1]]
        key, msg = ".".join(str(p) for p in loc[:-1]), "; or ".join(dict.fromkeys(e["msg"] for e in members))
    return f"{key}: {msg}{shown}" if key else msg


def _union_member(part: object) -> bool:
    """A location part that is a union member's tag (pydantic's `constrained-int`, `literal['auto']`, `bool`)."""
    return isinstance(part, str) and (not part.isidentifier() or part in ("int", "float", "bool", "str", "none"))


def _allowed_keys(loc: tuple) -> list[str]:
    if loc[:2] == ("reward", "sources") and len(loc) == 4 and loc[3] in SOURCE_TYPES:
        return list(SOURCE_TYPES[loc[3]].model_fields)  # (reward, sources, <name>, <tag>)
    if loc[:3] == ("data", "reasoning_gym", "datasets") and len(loc) == 4:
        return list(ReasoningGymDataset.model_fields)  # (data, reasoning_gym, datasets, <name>)
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

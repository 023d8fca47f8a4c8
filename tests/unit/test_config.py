"""The config tree: overrides, YAML files, one-line errors naming the key, and registries matching the names."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from cluster.config import ConfigError, RunConfig, dump_config, load_config, parse_overrides
from learner.algo.advantages import ADVANTAGE_ESTIMATORS
from learner.algo.losses import AGGREGATION_MODES, KL_ESTIMATORS, POLICY_LOSSES
from learner.config import LearnerConfig
from rewards.config import RuleSource
from rewards.registry import RULE_VERIFIERS


def allowed(model, field) -> set[str]:
    return set(typing.get_args(model.model_fields[field].annotation))


def test_registries_match_the_config_names():
    assert set(ADVANTAGE_ESTIMATORS) == allowed(LearnerConfig, "advantage")
    assert set(KL_ESTIMATORS) == allowed(LearnerConfig, "kl_estimator")
    assert set(POLICY_LOSSES) == allowed(LearnerConfig, "policy_loss")
    assert set(AGGREGATION_MODES) == allowed(LearnerConfig, "loss_agg")
    # rule verifiers are named by a free string (a registry name or module:function): the field's doc lists them
    doc = RuleSource.model_fields["verifier"].description
    assert set(RULE_VERIFIERS) == set(re.findall(r"`(\w+)`", doc))


def test_overrides_are_typed_and_nested():
    assert parse_overrides(["a.b=1", "a.c=true", "d=x", "e=1e-4"]) == {"a": {"b": 1, "c": True}, "d": "x", "e": "1e-4"}
    config = load_config(None, ["learner.lr=5e-4", "max_steps=7", "rollout.num_workers=3", "run_dir=/tmp/x"])
    assert (config.learner.lr, config.max_steps, config.rollout.num_workers, config.run_dir) == (5e-4, 7, 3, "/tmp/x")


def test_yaml_file_then_overrides_win(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_steps: 5\nlearner:\n  lr: 0.1\n  kl_coef: 0.0\n")
    config = load_config(path, ["learner.lr=0.2"])
    assert (config.max_steps, config.learner.lr, config.learner.kl_coef) == (5, 0.2, 0.0)


def test_dump_round_trips(tmp_path):
    config = load_config(None, ["learner.lr=5e-4", "sync.probe=false"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


def test_every_field_is_documented():
    def walk(model):
        for name, field in model.model_fields.items():
            annotation = field.annotation
            assert field.description, f"{model.__name__}.{name} has no docstring"
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation)
    walk(RunConfig)


BAD = [
    (["learner.lrr=1"], "unknown config key 'learner.lrr'; did you mean 'learner.lr'? allowed here: num_cpus"),
    (["nope=1"], "unknown config key 'nope'"),
    (["learner.baseline=group_mean"], "learner.baseline applies to advantage=reinforce only"),
    (["learner.advantage=reinforce", "learner.baseline=value"], "learner.baseline=value needs a value model: set "
                                                                 "critic.enabled=true"),
    (["learner.policy_loss=vanilla", "learner.clip_c=3"], "clip_c (dual clip) is not defined for policy_loss=vanilla"),
    (["rollout.in_flight_updates=true"], "rollout.in_flight_updates=true needs asynchronous training: set "
                                         "rollout.max_staleness >= 1"),
    (["rollout.num_workers=0"], "rollout.num_workers: Input should be greater than or equal to 1 (got 0)"),
    (["learner.advantage=ppo"],
     "learner.advantage: Input should be 'grpo', 'rloo', 'reinforce_pp', 'gae', 'reinforce' or 'distill' (got 'ppo')"),
    (["learner.lr=abc"], "learner.lr: Input should be a valid number"),
    (["max_steps=-1"], "max_steps: Input should be greater than or equal to 1"),
    (["rollout.top_p=1.5"], "rollout.top_p: Input should be less than or equal to 1"),
    (["rollout.top_p=0.9", "learner.rollout_correction=tis"], "rollout.top_p=0.9 with learner.rollout_correction=tis "
                                                              "(the learner's logprobs are not renormalised"),
    (["rollout.top_p=0.9", "rollout.max_staleness=1"], "rollout.top_p=0.9 with learner.rollout_correction=tis "
                                                       "(asynchronous training and replay set it by default;"),
    (["learner.kl_coef=0.1", "reference.enabled=false"], "needs a reference policy: set reference.enabled=true"),
    (["data.min_operand=9", "data.max_operand=2"], "min_operand (9) must not exceed max_operand (2)"),
    (["learner.num_minibatches=3"], "learner.num_minibatches (3) must divide the batch"),
    (["data.replay_fraction=0.1", "learner.num_minibatches=64"], "learner.num_minibatches (64) must also divide the "
                                                                  "batch with replay, 256 fresh + 32 replayed = 288"),
    (["learnerlr"], "override 'learnerlr' is not of the form dotted.key=value"),
    (["learner..lr=1"], "is not of the form dotted.key=value"),
    (["sync.transport=nccl"], "sync.transport: Input should be 'object_store'"),
    # invalid combinations of the algorithm keys
    (["learner.advantage=gae"], "learner.advantage=gae needs a value model: set critic.enabled=true"),
    (["critic.enabled=true"], "critic.enabled=true but learner.advantage=grpo does not use a value model"),
    (["learner.kl_reward_coef=0.05"], "KL is in the loss (learner.kl_coef) and in the reward"),
    (["learner.kl_coef=0", "learner.kl_reward_coef=0.1", "reference.enabled=false"], "needs a reference policy"),
    (["learner.advantage=rloo", "learner.group_scale=none"], "learner.group_scale applies to advantage=grpo only"),
    (["learner.policy_loss=gspo", "learner.clip_c=3"], "clip_c (dual clip) is not defined for policy_loss=gspo"),
    (["learner.clip_c=0.5"], "learner.clip_c: Input should be greater than 1"),
    (["learner.loss_agg=sum"], "learner.loss_agg: Input should be 'token-mean'"),
    # A value no member of a union takes: the key, then each member's message.
    (["learner.max_tokens_per_micro_batch=0"], "learner.max_tokens_per_micro_batch: Input should be greater than or "
                                               "equal to 1; or Input should be 'auto' (got 0)"),
    (["learner.overlap_reference=maybe"], "learner.overlap_reference: Input should be 'auto'; or Input should be a "
                                          "valid boolean"),
    (["reward.overlong_buffer=8"], "reward.overlong_buffer (8) must be below rollout.max_new_tokens (8)"),
    (["rollout.dynamic_sampling=true", "rollout.group_size=1"], "rollout.dynamic_sampling needs rollout.group_size"),
    # Distillation gives every token the teacher's advantage: a group of equal rewards still teaches.
    (["rollout.dynamic_sampling=true", "learner.distill_coef=1", "teacher.path=demo"],
     "rollout.dynamic_sampling with learner.distill_coef > 0 would drop groups the teacher's advantage trains on"),
    (["rollout.dynamic_sampling=true", "learner.advantage=distill", "learner.distill_coef=1", "teacher.path=demo"],
     "rollout.dynamic_sampling with learner.distill_coef > 0 would drop groups"),
    (["learner.advantage=rloo", "rollout.group_size=1"], "learner.advantage=rloo needs rollout.group_size >= 2"),
    (["reward.sources={}"], "reward.sources is empty and no environment gives rewards"),
    (["rollout.stop=[']']"], "rollout.stop ends a model turn of an episode: set env.spec or env.urls"),
    (["env.spec=a.b:C", "env.urls=[http://h:1]"], "env: spec (an in-process environment) and urls (a service) are "
                                                   "both set; keep one"),
    (["env.params={x: 1}"], "params are the constructor arguments of an in-process environment: set spec too"),
    (["env.urls=[ftp://h]"], "url 'ftp://h' is not of the form http(s)://host[:port]"),
    (["env.spec=nocolon"], "env.spec: must be 'package.module:Name'"),
    (["env.spec=a.b:C", "reward.sources={env: {verifier: exact_match}}"], "reward source name 'env' would hide"),
    (["env.spec=a.b:C", "rollout.max_staleness=1", "rollout.in_flight_updates=true"],
     "env episodes and rollout.in_flight_updates are not supported together"),
    (["env.spec=a.b:C", "env.turn_rewards=steps", "learner.advantage=rloo"],
     "env.turn_rewards=steps needs learner.advantage grpo, gae or reinforce; rloo"),
    (["env.spec=a.b:C", "env.turn_rewards=steps", "learner.kl_coef=0", "learner.kl_reward_coef=0.1"],
     "env.turn_rewards=steps with advantage=grpo normalises the rewards at turn ends only"),
    (["env.spec=a.b:C", "env.turn_rewards=steps", "reward.steps.delimiter=' '",
      "reward.sources={s: {verifier: step_match, level: steps}}"], "env.turn_rewards=steps and a reward source with "
                                                                   "level=steps both give step rewards"),
]


@pytest.mark.parametrize("overrides, message", BAD)
def test_bad_input_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("learner: [1,\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")


CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRESETS = ["ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo", "reinforce"]


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_is_valid_and_selects_its_algorithm(name):
    config = load_config(CONFIGS / f"{name}.yaml")
    learner = config.learner
    expected = {
        "ppo": (learner.advantage, config.critic.enabled, learner.kl_reward_coef > 0) == ("gae", True, True),
        "grpo": (learner.advantage, learner.group_scale, learner.kl_coef > 0) == ("grpo", "std", True),
        "dr_grpo": (learner.group_scale, learner.loss_agg) == ("none", "seq-mean-token-sum-norm"),
        "dapo": (config.rollout.dynamic_sampling, learner.clip_high > learner.clip_low,
                 config.reward.overlong_buffer > 0) == (True, True, True),
        "rloo": learner.advantage == "rloo",
        "reinforce_pp": learner.advantage == "reinforce_pp",
        "gspo": learner.policy_loss == "gspo",
        "reinforce": (learner.advantage, learner.baseline, learner.policy_loss) == ("reinforce", "group_mean",
                                                                                   "vanilla"),
    }
    assert expected[name]


def test_every_algorithm_preset_exists():
    assert set(PRESETS) <= {p.stem for p in CONFIGS.glob("*.yaml")}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_keeps_float32_master_weights_unless_it_says_otherwise(path):
    """AdamW on bfloat16 parameters rounds away most updates at the learning rates real runs use: no shipped config
    may get there by default. The bfloat16 ones also correct for the engine/learner mismatch."""
    import yaml

    config = load_config(path)
    asked = (yaml.safe_load(path.read_text()).get("learner") or {}).get("master_dtype")
    assert config.learner.master_dtype == (asked or "float32")
    assert asked != "bfloat16", f"{path.name}: bfloat16 master weights are lossy; keep float32"
    if config.model.dtype == "bfloat16":
        assert config.learner.rollout_correction != "none", f"{path.name}: bfloat16 without rollout correction"


def test_bfloat16_master_weights_need_bfloat16_compute():
    with pytest.raises(ConfigError, match="learner.master_dtype=bfloat16 needs model.dtype=bfloat16"):
        load_config(None, ["learner.master_dtype=bfloat16"])
    assert load_config(None, ["learner.master_dtype=bfloat16", "model.dtype=bfloat16"]).learner.master_dtype == (
        "bfloat16")


def test_every_reward_model_loss_the_config_names_exists():
    from actors.reward_model import REWARD_MODEL_LOSSES
    from rewards.config import RewardModelTraining

    assert set(typing.get_args(RewardModelTraining.model_fields["loss"].annotation)) == set(REWARD_MODEL_LOSSES)


def test_replay_defaults_the_rollout_correction_to_tis_and_a_trained_reward_model_needs_a_verifier_label():
    assert load_config(None, ["data.replay_fraction=0.1"]).learner.rollout_correction == "tis"
    assert load_config(None, ["data.replay_fraction=0.1", "learner.rollout_correction=none"]
                       ).learner.rollout_correction == "none"
    with pytest.raises(ConfigError, match="label_source 'judge' must name an outcome source"):
        load_config(None, ["reward.sources.rm.type=model", "reward.sources.rm.train.every=2",
                           "reward.sources.rm.train.label_source=judge"])
    with pytest.raises(ConfigError, match="needs train"):
        load_config(None, ["reward.sources.rm.type=model"])
    with pytest.raises(ConfigError, match="data.replay_fraction"):
        load_config(None, ["data.replay_fraction=0.6"])


def test_an_asynchronous_run_gives_the_learner_and_the_reference_one_thread_unless_told(tmp_path):
    def threads(*overrides: str) -> tuple[int, int]:
        config = load_config(None, list(overrides))
        return config.learner.num_threads, config.reference.num_threads

    assert threads() == (None, None)  # phases take turns: set by the model's size when the fleet starts (below)
    assert threads("rollout.max_staleness=1") == (1, 1)  # the engines generate meanwhile
    assert threads("rollout.max_staleness=2", "learner.num_threads=2") == (2, 1)
    assert threads("rollout.max_staleness=1", "reference.num_threads=3") == (1, 3)
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  max_staleness: 1\nlearner:\n  lr: 0.001\n")
    config = load_config(str(path), [])
    assert (config.learner.num_threads, config.reference.num_threads, config.learner.lr) == (1, 1, 0.001)


def test_an_unset_thread_count_follows_the_models_size(tiny_model_dir, tmp_path):
    """On-policy, an unset `learner.num_threads` or `reference.num_threads` is 1 for a policy under 1M parameters
    (counted from its safetensors headers: every parameter the model has), else 2, and 2 when the size is unknown;
    the fleet starts with them set, and given values stay."""
    from transformers import AutoModelForCausalLM

    from cluster.fleet.placement import with_default_threads
    from learner.passes.device import count_parameters, default_threads

    count = count_parameters(str(tiny_model_dir))
    assert count == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert count_parameters(str(tmp_path)) is None
    assert [default_threads(n) for n in (count, 999_999, 1_000_000, 25_000_000, None)] == [1, 1, 2, 2, 2]

    def threads(model_dir: Path, *overrides: str) -> tuple[int, int]:
        config = with_default_threads(load_config(None, list(overrides)), str(model_dir))
        return config.learner.num_threads, config.reference.num_threads

    assert threads(tiny_model_dir) == (1, 1)
    assert threads(tmp_path) == (2, 2)
    assert threads(tiny_model_dir, "learner.num_threads=3") == (3, 1)
    assert threads(tmp_path, "reference.num_threads=1") == (2, 1)


def test_the_distill_preset_runs_grpo_with_the_shipped_teacher_of_the_demo_models_tokenizer():
    import json

    from transformers import AutoTokenizer

    from cluster.demo.cache import shipped_demo_model
    from cluster.fleet.placement import teacher_path
    from cluster.run.launch import tokenizer_difference

    config = load_config(CONFIGS / "distill.yaml")
    assert config.uses_teacher and not config.uses_reference and config.learner.advantage == "grpo"
    teacher = Path(teacher_path(config.teacher.path))
    report = json.loads((teacher / "relay_demo_report.json").read_text())
    assert (report["recipe"], report["steps"]) == ("configs/grpo.yaml", 150) and report["reward_mean_last_10"] > 0.9
    mine, theirs = (AutoTokenizer.from_pretrained(path) for path in (shipped_demo_model("arithmetic"), teacher))
    assert tokenizer_difference(mine, theirs) == ""
    other = AutoTokenizer.from_pretrained(shipped_demo_model("calc"))  # another character set
    assert tokenizer_difference(mine, other).startswith("2 of 19 tokens have other ids")

"""A first run on one's own model: the sizes the demo tuned for its 300K-parameter model come from the model's
config.json where the user did not set them (`actors.config.sizes_for_model`), the dtype from the model and the
hardware (`cluster.run.launch.model_settings`), the run says so in one line, and the config's errors say what to do.

Model directories are written by transformers itself (`Qwen2Config.save_pretrained`, the tiny Qwen2 of the demo's
recipe); no weights are needed to read a config."""

from __future__ import annotations

import pytest
import yaml

from cluster.config import ConfigError, dump_config, load_config
from cluster.demo.model import tiny_qwen2_config

MiB = 2**20


def model_dir(tmp_path, name: str = "model", dtype: str = "float32", **kwargs) -> str:
    """A directory holding a tiny Qwen2's config.json (hidden 64, 2 layers, 1 KV head of 32) stored in `dtype`."""
    config = tiny_qwen2_config(vocab_size=32, **kwargs)
    config.torch_dtype = dtype
    config.save_pretrained(tmp_path / name)
    return str(tmp_path / name)


def test_a_model_with_a_128_token_context_sets_the_engines_sizes(tmp_path):
    path = model_dir(tmp_path, max_position_embeddings=128)
    config = load_config(None, [f"model.path={path}"])
    assert config.rollout.max_model_len == 128  # the demo's default is 64
    assert config.rollout.max_new_tokens == 16  # an eighth: 128 / 8
    assert config.rollout.kv_cache_bytes == 64 * MiB  # 8 x 128 tokens x 2 x 2 layers x 32 x 4 bytes is far below
    assert config.from_model == {"rollout.max_model_len": 128, "rollout.max_new_tokens": 16,
                                 "rollout.kv_cache_bytes": 64 * MiB}


def test_a_long_context_is_capped_and_sizes_the_kv_cache(tmp_path):
    path = model_dir(tmp_path, max_position_embeddings=32768, num_layers=24, num_kv_heads=2)
    rollout = load_config(None, [f"model.path={path}"]).rollout
    assert (rollout.max_model_len, rollout.max_new_tokens) == (4096, 512)
    # 8 sequences x 4096 tokens x (keys and values: 2) x 24 layers x 2 KV heads x head_dim 32 x 4 bytes
    assert rollout.kv_cache_bytes == 8 * 4096 * 2 * 24 * 2 * 32 * 4 == 384 * MiB


def test_what_the_user_sets_wins_on_the_command_line_and_in_a_preset(tmp_path):
    path = model_dir(tmp_path, max_position_embeddings=128)
    given = load_config(None, [f"model.path={path}", "rollout.max_model_len=96", "rollout.kv_cache_bytes=2097152"])
    assert (given.rollout.max_model_len, given.rollout.kv_cache_bytes) == (96, 2 * MiB)
    assert given.rollout.max_new_tokens == 12  # an eighth of the user's max_model_len, not of the model's context
    assert given.from_model == {"rollout.max_new_tokens": 12}
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml.safe_dump({"model": {"path": path}, "rollout": {"max_new_tokens": 40}}))
    from_preset = load_config(preset)
    assert (from_preset.rollout.max_model_len, from_preset.rollout.max_new_tokens) == (128, 40)


def test_the_demo_and_a_resumed_runs_config_keep_their_values(tmp_path):
    assert load_config(None, []).from_model == {}  # no model.path: the demo's own sizes
    path = model_dir(tmp_path, max_position_embeddings=128)
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_config(load_config(None, [f"model.path={path}"])))
    again = load_config(saved)
    assert (again.rollout.max_model_len, again.rollout.max_new_tokens, again.from_model) == (128, 16, {})


def test_max_new_tokens_must_leave_room_for_the_prompt():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.max_new_tokens=64"])  # max_model_len 64
    assert str(err.value) == ("rollout.max_new_tokens (64) must be below rollout.max_model_len (64), which holds the "
                              "prompt and the completion: lower one or raise the other")


def test_an_unknown_key_gets_the_nearest_allowed_one():
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.max_new_token'; did you mean "
                                          r"'rollout.max_new_tokens'\? allowed here: "):
        load_config(None, ["rollout.max_new_token=5"])
    with pytest.raises(ConfigError, match="did you mean 'learner.lr'"):
        load_config(None, ["learner.lrr=1e-5"])
    with pytest.raises(ConfigError) as err:
        load_config(None, ["zzzz=1"])
    assert "did you mean" not in str(err.value)


@pytest.mark.parametrize("stored, native, expected", [("bfloat16", True, "bfloat16"), ("float16", True, "bfloat16"),
                                                      ("bfloat16", False, "float32"), ("float32", True, "float32")])
def test_the_dtype_is_bfloat16_for_a_16_bit_model_where_the_hardware_computes_it(tmp_path, monkeypatch, capsys,
                                                                                 stored, native, expected):
    from cluster.run import launch

    monkeypatch.setattr(launch, "native_bfloat16", lambda config: native)
    path = model_dir(tmp_path, dtype=stored, max_position_embeddings=128)
    config = launch.model_settings(load_config(None, [f"model.path={path}"]))
    assert config.model.dtype == expected
    line = capsys.readouterr().err
    assert line == (f"relay: from the model in {path}: rollout.max_model_len=128, rollout.max_new_tokens=16, "
                    f"rollout.kv_cache_bytes={64 * MiB}, model.dtype={expected} (set any of them to override)\n")
    assert launch.model_settings(load_config(None, [f"model.path={path}", "model.dtype=float32",
                                                    "rollout.max_model_len=128", "rollout.max_new_tokens=16",
                                                    "rollout.kv_cache_bytes=2097152"])).model.dtype == "float32"
    assert capsys.readouterr().err == ""  # nothing derived, nothing printed


def test_native_bfloat16_reads_the_cpus_flags(monkeypatch, tmp_path):
    from cluster.run import launch

    cpuinfo = tmp_path / "cpuinfo"
    real_path = launch.Path
    monkeypatch.setattr(launch, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
    config = load_config(None, [])
    for flags, expected in (("fpu avx2 avx512f", False), ("fpu avx512f avx512_bf16", True), ("amx_bf16 fpu", True)):
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert launch.native_bfloat16(config) is expected


def test_a_missing_model_directory_says_how_to_get_one(tmp_path):
    from cluster.run.launch import check_inputs

    with pytest.raises(ConfigError) as err:
        check_inputs(load_config(None, [f"model.path={tmp_path}/nowhere"]), f"{tmp_path}/nowhere")
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir" in str(err.value)
    assert "leave it empty for the demo model" in str(err.value)


class StepsWithCuts:
    """Stands in for the run's `Trainer` in `launch.train`: steps whose records carry the given truncated shares."""

    def __init__(self, config, shares: list[float]):
        self.config, self.shares = config, shares

    def publish(self, record) -> None:
        pass

    def step(self, step: int):
        yield {"step": step, "response/truncated_fraction": self.shares[step - 1]}

    def save_checkpoint(self, *args) -> None:
        pass


class Recorder:
    def write(self, record) -> None:
        pass


def test_many_cut_completions_warn_once(tmp_path, capsys):
    from cluster.run.launch import train

    config = load_config(None, ["max_steps=4", "rollout.max_new_tokens=16"])
    train(StepsWithCuts(config, [0.5, 0.0, 0.75, 1.0]), Recorder(), tmp_path, "", 1, display=False)
    err = capsys.readouterr().err
    assert err.count("relay: warning:") == 1  # step 2 had 0.5: not more than half; step 4 is not said again
    assert "step 3: 75% of the completions were cut at rollout.max_new_tokens=16" in err
    train(StepsWithCuts(config, [0.5, 0.25, 0.0, 0.5]), Recorder(), tmp_path, "", 1, display=False)
    assert capsys.readouterr().err == ""


def test_a_malformed_spec_gets_a_sentence_not_a_regular_expression():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["env.spec=mypkg.envs.Game"])
    assert str(err.value) == ("env.spec: must be 'package.module:Name', a module then a colon and the class or "
                              "function in it (e.g. mypkg.envs:Game), importable from the current directory or "
                              "PYTHONPATH (got 'mypkg.envs.Game')")
    with pytest.raises(ConfigError, match=r"^env.action_field: must be a name of letters, digits and _"):
        load_config(None, ["env.spec=mypkg.envs:Game", "env.action_field=a-b"])


def test_every_preset_for_a_real_model_says_first_how_to_get_the_model_and_the_data():
    """A preset that names a model directory (a placeholder) says in its first comment lines how to download one, and,
    with a data file, how to make it."""
    from pathlib import Path

    configs = Path(__file__).resolve().parents[2] / "configs"
    checked = []
    for preset in sorted(configs.glob("*.yaml")):
        text = preset.read_text()
        config = yaml.safe_load(text)
        if not (config.get("model") or {}).get("path"):
            continue  # a demo preset: its model ships with relay
        header = text[:text.index("\n" + next(iter(config)) + ":")]
        assert "download Qwen/" in header, f"{preset.name} does not say how to get its model"
        if (config.get("data") or {}).get("path"):
            assert "load_dataset('openai/gsm8k'" in header, f"{preset.name} does not say how to get its data"
        checked.append(preset.name)
    assert checked == ["gpu_gsm8k_multinode.yaml", "gpu_gsm8k_single.yaml", "gsm8k_grpo.yaml",
                       "reasoning_gym_grpo.yaml"]

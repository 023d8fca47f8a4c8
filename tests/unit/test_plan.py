"""`relay plan` (cluster/plan.py, cluster/cli/plan.py): the model's shape against transformers' own models, the
learner's per-token activation bytes against what torch saves for the backward of relay's real pass, the estimate of
the one GPU measurement (bench/gpu_learner.py's 0.5B shape, docs/benchmarks.md), the GPU presets' plans, and the
one-line refusals of `relay plan` and `relay train` on GPUs too small. No Ray, no GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.cli.commands import main
from cluster.cli.plan import parse_size
from cluster.config import ConfigError, load_config
from cluster.plan import GIB, ModelShape, layer_bytes, learner_memory, pass_saved_bytes

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "configs" / "model_shapes"
SINGLE = ROOT / "configs" / "gpu_gsm8k_single.yaml"
MULTINODE = ROOT / "configs" / "gpu_gsm8k_multinode.yaml"


@pytest.mark.parametrize("name, billions", [("Qwen2.5-0.5B-Instruct", 0.494), ("Qwen2.5-1.5B-Instruct", 1.544),
                                            ("Qwen2.5-7B-Instruct", 7.616)])
def test_a_shape_counts_the_parameters_of_the_model_transformers_builds_from_it(name, billions):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # the real architecture, no memory
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(SHAPES / name))
    shape = ModelShape.read(SHAPES / name)
    assert shape.parameters == sum(p.numel() for p in model.parameters())  # tied heads counted once
    assert round(shape.parameters / 1e9, 3) == billions


def tiny_model(layers: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=160, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).eval(), ModelShape(64, layers, 4, 2, 16, 160, 96, True, True, 128)


def test_adapter_parameters_are_the_ones_relays_lora_trains():
    from learner.config import LoraConfig
    from learner.lora import add_adapters

    model, shape = tiny_model(2)
    model = add_adapters(model, LoraConfig(rank=4))
    assert shape.adapter_parameters(4, "all-linear") == sum(p.numel() for p in model.parameters() if p.requires_grad)


def saved_bytes(model, dtype: torch.dtype, rows: int, width: int) -> int:
    """Bytes torch saves for the backward of relay's packed training pass over `rows` rows of `width` tokens (the
    learner's `sequence_logprobs_and_entropy` in its compute context), parameters and their casts left out."""
    from learner.passes.device import compute_in
    from learner.passes.sequences import pad_sequences, sequence_logprobs_and_entropy

    batch = pad_sequences([[1, 2]] * rows, [[3 + i % 50 for i in range(width - 2)]] * rows, 0)
    weights = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and tuple(tensor.shape) not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        with compute_in(torch.device("cpu"), dtype, torch.float32):
            sequence_logprobs_and_entropy(model, batch, 1.0, False, None, True)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_bytes_are_what_torch_saves_for_a_qwen2_block_in_relays_pass(dtype):
    rows, width = 4, 32
    tokens, compute = rows * width, dtype.itemsize
    one, _ = tiny_model(1)
    two, shape = tiny_model(2)
    per_block = saved_bytes(two, dtype, rows, width) - saved_bytes(one, dtype, rows, width)
    # one block: layer_bytes per token, and its attention mask [rows, 1, width, width] in the compute dtype
    assert per_block == tokens * layer_bytes(shape, compute, dtype != torch.float32) + rows * width * width * compute
    # the whole pass, with the logits and what the model saves outside its blocks, within a few per cent
    assert pass_saved_bytes(shape, tokens, width, compute, dtype != torch.float32) == \
        pytest.approx(saved_bytes(two, dtype, rows, width), rel=0.05)


def bench_config(lora: int):
    """bench/gpu_learner.py's 0.5B run as a relay config: 8 prompts of 256 tokens x 8 completions of up to 2048,
    one minibatch, passes of 8192 tokens, bfloat16 on float32 master weights, packed, prompts shared, on a GPU."""
    return load_config(None, ["model.dtype=bfloat16", "data.prompts_per_step=8", "rollout.group_size=8",
                              "data.max_prompt_tokens=256", "rollout.max_new_tokens=2048", "rollout.max_model_len=2304",
                              "learner.num_minibatches=1", "learner.max_tokens_per_micro_batch=8192",
                              f"learner.lora.rank={lora}", "learner.lr=1e-6", "learner.num_gpus=1"])


@pytest.mark.parametrize("lora, measured_gib", [(0, 33.92), (32, 27.24)])
def test_the_learners_estimate_is_near_the_peak_measured_on_one_h200(lora, measured_gib):
    # docs/benchmarks.md, "GPU learner": torch.cuda.max_memory_allocated of bench/gpu_learner.py's full and LoRA
    # packed variants at 0.5B; docs/gpu.md states the gap
    memory, _ = learner_memory(bench_config(lora), ModelShape.read(SHAPES / "Qwen2.5-0.5B-Instruct"))
    assert sum(memory.values()) / GIB == pytest.approx(measured_gib, rel=0.05)


@pytest.mark.parametrize("preset, model, gpu", [(SINGLE, "Qwen2.5-1.5B-Instruct", "80GB"),
                                                (MULTINODE, "Qwen2.5-1.5B-Instruct", "24GB")])
def test_relay_plan_prints_where_the_gpu_presets_actors_go_and_their_memory(preset, model, gpu, capsys):
    assert main(["plan", str(preset), f"model.path={SHAPES / model}", "--gpu-memory", gpu]) == 0
    out = capsys.readouterr().out
    config = load_config(preset)
    assert f"rollout workers: {config.rollout.num_workers} groups" in out
    for rank in range(config.learner.num_ranks):
        assert f"learner rank {rank} " in out
    for held in ("master weights", "gradients", "AdamW moments", "activations (", "logits", "KV cache"):
        assert held in out


def test_relay_plan_refuses_a_gpu_too_small_in_one_line(capsys):
    code = main(["plan", str(SINGLE), f"model.path={SHAPES / 'Qwen2.5-1.5B-Instruct'}", "--gpu-memory", "24GiB"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("relay: config error: a learner rank needs about")
    assert "learner.num_gpus=1 of a 24.0 GiB GPU" in err


def test_relay_train_on_gpus_too_small_refuses_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("cluster.plan.gpu_memory", lambda: 8 * GIB)  # the GPUs this machine would have

    def no_ray(config):
        raise AssertionError("Ray was started (or joined) for a config that cannot fit")

    monkeypatch.setattr("cluster.run.launch._init_ray", no_ray)  # the suite's own Ray may be up: watch the call
    run_dir = tmp_path / "run"
    code = main(["train", str(SINGLE), f"model.path={SHAPES / 'Qwen2.5-0.5B-Instruct'}", f"run_dir={run_dir}"])
    lines = capsys.readouterr().err.splitlines()  # (after the values the model directory set, if any)
    assert code == 2 and lines[-1].startswith("relay: config error: a learner rank needs about")
    assert "of a 8.0 GiB GPU" in lines[-1] and sum("error" in line for line in lines) == 1
    assert not run_dir.exists()


@pytest.mark.parametrize("text, size", [("24GiB", 24 * 2**30), ("80 GB", 80 * 10**9), ("141e9", 141 * 10**9),
                                        ("1.5gib", 3 * 2**29)])
def test_gpu_memory_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["24 GiBs", "-3GB", "lots"])
def test_a_bad_gpu_memory_size_is_one_line_naming_the_option(text):
    with pytest.raises(ConfigError, match="--gpu-memory"):
        parse_size(text)


@pytest.mark.parametrize("preset, gpu", [(SINGLE, "80GB"), (MULTINODE, "24GB")])
def test_the_presets_as_written_are_planned_on_the_shape_their_placeholder_names(preset, gpu, capsys):
    # model.path is /models/... or /shared/models/...: not on this machine, named after a shape in configs/model_shapes
    assert main(["plan", str(preset), "--gpu-memory", gpu]) == 0
    out = capsys.readouterr().out
    assert "(not on this machine: the shape in configs/model_shapes/Qwen2.5-1.5B-Instruct)" in out
    assert "1.54B parameters" in out and "learner rank 0 " in out


@pytest.mark.parametrize("gpu_gib", [80, 139.8])
def test_the_fitting_token_budget_is_the_largest_step_multiple_the_estimate_holds(gpu_gib):
    from cluster.plan import CUDA_OVERHEAD_BYTES, fitting_token_budget

    shape, config = ModelShape.read(SHAPES / "Qwen2.5-0.5B-Instruct"), bench_config(0)
    gpu_bytes = int(gpu_gib * GIB)

    def need(budget: int, fast: dict | None = None) -> int:
        learner = config.learner.model_copy(update={"max_tokens_per_micro_batch": budget, **(fast or {})})
        return sum(learner_memory(config.model_copy(update={"learner": learner}), shape)[0].values())

    budget = fitting_token_budget(config, shape, gpu_bytes)
    assert budget % 1024 == 0 and need(budget) + CUDA_OVERHEAD_BYTES <= 0.9 * gpu_bytes
    assert need(budget + 1024) + CUDA_OVERHEAD_BYTES > 0.9 * gpu_bytes
    # the head in chunks holds one chunk's logits, not the pass's: larger passes fit
    chunked = config.model_copy(update={"learner": config.learner.model_copy(update={
        "fast_paths": config.learner.fast_paths.model_copy(update={"head_chunk_tokens": 4096})})})
    assert fitting_token_budget(chunked, shape, gpu_bytes) > budget


def test_relay_plan_prints_the_largest_learner_budget_that_fits(capsys):
    assert main(["plan", str(SINGLE), f"model.path={SHAPES / 'Qwen2.5-0.5B-Instruct'}", "--gpu-memory", "80GiB"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("Learner passes: learner.max_tokens_per_micro_batch=") and " fit in 90% " in line


def test_an_auto_token_budget_is_the_fitting_one_on_a_gpu_and_1024_on_a_cpu(monkeypatch):
    from cluster.plan import fitting_token_budget, resolve_token_budget

    shape, config = ModelShape.read(SHAPES / "Qwen2.5-0.5B-Instruct"), bench_config(0)
    learner = config.learner.model_copy(update={"max_tokens_per_micro_batch": "auto"})
    auto = config.model_copy(update={"learner": learner})
    resolved, line = resolve_token_budget(auto, 80 * GIB, shape)
    budget = resolved.learner.max_tokens_per_micro_batch
    assert budget == fitting_token_budget(config, shape, 80 * GIB) and budget > 8192
    assert line.startswith(f"learner.max_tokens_per_micro_batch=auto: {budget}, ") and "80.0 GiB" in line
    assert resolve_token_budget(config, 80 * GIB, shape) == (config, None)  # a number is the user's
    monkeypatch.setattr("cluster.plan.gpu_memory", lambda: 80 * GIB)  # this machine's GPU, when none is given
    assert resolve_token_budget(auto, shape=shape)[0] == resolved
    cpu = auto.model_copy(update={"learner": auto.learner.model_copy(update={"num_gpus": 0.0})})
    assert resolve_token_budget(cpu)[0].learner.max_tokens_per_micro_batch == 1024
    monkeypatch.setattr("cluster.plan.gpu_memory", lambda: None)
    with pytest.raises(ConfigError, match=r"this machine has none: run `relay plan --gpu-memory SIZE`"):
        resolve_token_budget(auto, shape=shape)
    with pytest.raises(ConfigError, match="not even 1024-token passes fit"):
        resolve_token_budget(auto, 4 * GIB, shape)


def test_relay_plan_and_train_make_an_auto_budget_a_number_and_say_which(monkeypatch, capsys):
    from cluster.run.launch import model_settings
    from learner.passes.micro_batches import MicroBatching

    model = f"model.path={SHAPES / 'Qwen2.5-0.5B-Instruct'}"
    assert main(["plan", str(SINGLE), model, "learner.max_tokens_per_micro_batch=auto", "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    budget = int(out.splitlines()[0].removeprefix("learner.max_tokens_per_micro_batch=auto: ").split(",")[0])
    assert f"passes of {budget} tokens (learner.max_tokens_per_micro_batch)" in out
    monkeypatch.setattr("cluster.plan.gpu_memory", lambda: None)  # no GPU here, and none given: one line
    assert main(["plan", str(SINGLE), model, "learner.max_tokens_per_micro_batch=auto"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "relay plan --gpu-memory SIZE" in err
    config = model_settings(load_config(None, ["learner.max_tokens_per_micro_batch=auto"]))  # the demo: a CPU learner
    assert config.learner.max_tokens_per_micro_batch == 1024
    assert "relay: learner.max_tokens_per_micro_batch=auto: 1024, " in capsys.readouterr().err
    with pytest.raises(ValueError, match="reached the learner unresolved"):
        MicroBatching(None, "auto")

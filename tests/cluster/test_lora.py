"""LoRA runs (`configs/grpo_lora.yaml`) on a real local Ray with real vLLM engines serving the adapters on their
base, in float32 (on-policy, two data-parallel learner ranks) and bfloat16 (asynchronous): every sync moves only the
adapters and the engines serve them (the sync probe compares the engines' logprobs with the learner's at every load:
an engine serving the base alone fails it), the reference is the base (no reference worker), a resumed run repeats
the original bit for bit, and the merged export, served by vLLM as a plain model, evaluates as the run logged it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cluster.config import load_config
from cluster.run.export import export_checkpoint
from cluster.run.launch import run_evaluation, run_training
from tests.fleets import POOL
from tests.resume import assert_resume_repeats

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleets")]  # runs share fleets (tests/fleets.py)

MODES = {
    "float32": ["learner.num_ranks=2", "rollout.num_workers=1"],  # data-parallel ranks, on-policy
    "bfloat16": ["rollout.max_staleness=1"],  # asynchronous: batches sampled by the previous adapters
}
PRESET = Path(__file__).resolve().parents[2] / "configs" / "grpo_lora.yaml"  # the preset, run here
TOLERANCE = {"float32": 1e-4, "bfloat16": 2 ** -3}  # the sync probe's floors (docs/operations.md)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_lora_run_syncs_only_the_adapters_resumes_exactly_and_exports_a_model_vllm_serves(
        ray_local, tmp_path, demo_model_dir, dtype):
    evaluation = [f"model.dtype={dtype}", "data.held_out=0.1", "eval.every=4", "eval.max_prompts=8"]
    overrides = [f"model.path={demo_model_dir}", "max_steps=4", "data.prompts_per_step=8", "checkpoint.every=2",
                 *evaluation, *MODES[dtype]]
    config = load_config(PRESET, [f"run_dir={tmp_path / 'run'}", *overrides])
    assert config.learner.lora.rank > 0
    assert not config.uses_reference  # the learner computes the base's logprobs: no reference worker starts
    records = run_training(config, tmp_path / "run", display=False, pool=POOL)

    assert [r["step"] for r in records] == [1, 2, 3, 4]
    step_4 = tmp_path / "run" / "checkpoints" / "step_4"
    adapters = load_file(step_4 / "policy" / "adapter_model.safetensors")
    trained = sum(t.numel() for t in adapters.values())
    itemsize = 4 if dtype == "float32" else 2
    assert all(r["sync/bytes"] == trained * itemsize for r in records)  # the adapters in model.dtype, nothing more
    base_bytes = (demo_model_dir / "model.safetensors").stat().st_size
    assert trained * itemsize < base_bytes / 4
    probes = [r["sync/probe_max_diff"] for r in records if math.isfinite(r["sync/probe_max_diff"] or math.nan)]
    assert len(probes) >= 3 and max(probes) <= TOLERANCE[dtype]  # the engines serve the adapters they were sent
    assert records[-1]["kl/mean"] > 0  # against the base: the adapters moved the policy away from it
    assert all(r["train/skipped_updates"] == 0 for r in records)

    # Resumed from step 2's checkpoint, the run repeats steps 3 and 4 bit for bit.
    resumed = assert_resume_repeats(PRESET, tmp_path / "run", overrides, records)
    again = load_file(resumed / "checkpoints" / "step_4" / "policy" / "adapter_model.safetensors")
    assert again.keys() == adapters.keys()
    for name, tensor in again.items():
        assert tensor.equal(adapters[name]), name

    # The merged export is a plain model: vLLM serves it, and its evaluation (greedy, the same held-out prompts and
    # seeds) is the one the run logged at step 4 with the adapters on the base.
    export_checkpoint(step_4, tmp_path / "merged", merge=True)
    workers = [o for o in MODES[dtype] if o.startswith("rollout.num_workers")]  # the same engine batches
    plain = load_config(None, [*evaluation, *workers, f"model.path={tmp_path / 'merged'}"])  # no adapters
    metrics = run_evaluation(plain, tmp_path / "eval", None, pool=POOL)
    logged = records[-1]
    assert logged["eval/step"] == 4 and metrics["eval/prompts"] == logged["eval/prompts"] == 8
    if dtype == "float32":
        assert metrics["eval/reward/mean"] == logged["eval/reward/mean"]
        assert metrics["eval/pass@1"] == logged["eval/pass@1"]
    else:  # the merged weights cast to bfloat16 round differently from base + adapters: a near tie may flip
        assert abs(metrics["eval/reward/mean"] - logged["eval/reward/mean"]) <= 2 / 8


def test_the_lora_preset_learns_the_demo_syncing_under_a_third_of_the_full_models_bytes(ray_local, tmp_path,
                                                                                       demo_model_dir):
    """A user's first LoRA run learns: `configs/grpo_lora.yaml` as it is (adapters, plus the output layer and the final
    norm trained whole, `learner.lora.modules_to_save`) reaches a 10-step mean reward of 0.9 on the demo within 40
    steps (step 27 on the AVX-512 EPYC, docs/benchmarks.md), each sync moving under a third of the model's bytes."""
    config = load_config(PRESET, [f"run_dir={tmp_path / 'run'}", "max_steps=40", "checkpoint.every=0"])
    records = run_training(config, tmp_path / "run", display=False, pool=POOL)
    rewards = [r["reward/mean"] for r in records]
    best = max(sum(rewards[i - 10:i]) / 10 for i in range(10, len(rewards) + 1))
    assert best >= 0.9, f"the LoRA preset did not learn the demo: best 10-step mean reward {best:.3f}"
    base_bytes = (demo_model_dir / "model.safetensors").stat().st_size
    assert 0 < max(r["sync/bytes"] for r in records) < base_bytes / 3

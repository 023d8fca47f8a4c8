"""GPU readiness, on a machine with CUDA GPUs (`pytest -m gpu`; excluded from the default run). The same loop as on
CPU, with the settings a GPU run uses: bfloat16, the engine's GPU memory fraction, one GPU per actor (Ray sets
CUDA_VISIBLE_DEVICES per actor), the collective (NCCL) weight transport, and tensor parallelism when there are
enough GPUs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_run(tmp_path, model_dir, *overrides):
    from cluster.config import load_config
    from cluster.driver import run_training

    config = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={model_dir}", "max_steps=3",
                                "model.dtype=bfloat16", "sync.probe_tolerance=0.05", "data.prompts_per_step=16",
                                "rollout.num_gpus=1", "rollout.gpu_memory_utilization=0.3", "rollout.num_cpus=1",
                                "learner.num_gpus=1", "learner.num_cpus=1", "reference.num_gpus=0.25",
                                *overrides])
    return run_training(config, tmp_path / "run", str(model_dir), display=False)


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_bf16_loop_on_gpus_keeps_engines_in_sync(ray_local, tmp_path, tiny_model_dir, transport):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: one for the learner, one for a rollout worker")
    records = gpu_run(tmp_path, tiny_model_dir, "rollout.num_workers=1", f"sync.transport={transport}")
    assert [r["weights/version"] for r in records] == [1, 2, 3]
    assert all(r["sync/probe_max_diff"] < 0.05 and r["logprob/mismatch"] < 0.05 for r in records)


def test_tensor_parallel_engine_serves_the_learners_weights(ray_local, tmp_path, tiny_model_dir):
    if torch.cuda.device_count() < 3:
        pytest.skip("needs 3 GPUs: one for the learner, two for a tensor-parallel rollout worker")
    records = gpu_run(tmp_path, tiny_model_dir, "rollout.num_workers=1", "rollout.tensor_parallel_size=2")
    assert records[-1]["weights/version"] == 3 and records[-1]["sync/probe_max_diff"] < 0.05

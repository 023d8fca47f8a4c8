"""GPU readiness, on a machine with CUDA GPUs (`pytest -m gpu`; excluded from the default run). The same loop as on
CPU, with the settings a GPU run uses: bfloat16, the engine's GPU memory fraction, one GPU per actor (Ray sets
CUDA_VISIBLE_DEVICES per actor), the collective (NCCL) weight transport, and tensor parallelism when there are
enough GPUs. And the torch-side actors (learner, value model, reference, reward model) in-process on `cuda:0`
against the same actors on the CPU."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_run(tmp_path, model_dir, *overrides):
    from cluster.config import load_config
    from cluster.run.launch import run_training

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


# The torch-side actors on cuda:0 (pick_device) against the same actors forced onto the CPU. Tolerances, absolute on
# logprobs and scores, relative on the step's metrics: float32 differs only in summation order (~1e-6: CUDA matmuls
# do not use TF32 unless asked); bfloat16 by its 8-bit mantissa, as in the engines' sync probe (sync.probe_tolerance).
TOLERANCES = {"float32": 1e-4, "bfloat16": 5e-2}
PROMPTS = [[5, 9, 12, 6, 7, 15]] * 2 + [[3, 12, 4, 15]] * 2  # "37+45=" x2, "1+2=" x2 (char ids)
RESPONSES = [[12, 2, 1], [4, 4, 1], [5, 1], [9, 1]]


def on_cpu(monkeypatch) -> None:
    """Make every torch-side actor built from now on pick the CPU."""
    import actors.reference
    import actors.reward_model
    import learner.critic
    import learner.learner

    for module in (learner.learner, learner.critic, actors.reference, actors.reward_model):
        monkeypatch.setattr(module, "pick_device", lambda: torch.device("cpu"))


def max_diff(a: list, b: list) -> float:
    """Largest absolute difference between two equally shaped (ragged) lists of floats."""
    flat = lambda rows: [v for row in rows for v in (row if isinstance(row, list) else [row])]  # noqa: E731
    x, y = flat(a), flat(b)
    assert len(x) == len(y)
    return max(abs(p - q) for p, q in zip(x, y))


def make_learner(model_dir, dtype: str, advantage: str, **overrides):
    from learner.config import CriticConfig, LearnerConfig
    from learner.learner import Learner

    config = LearnerConfig(lr=1e-2, num_threads=1, advantage=advantage, micro_batch_size=2, num_minibatches=2,
                           entropy_coef=0.01, **overrides)
    critic = CriticConfig(enabled=True, lr=1e-2) if advantage == "gae" else None
    learner = Learner(str(model_dir), config, dtype=dtype, seed=0, critic=critic, norm_length=4)
    # SGD: Adam turns float noise in near-zero gradients into lr-sized steps, which would hide the comparison.
    for owner in (learner, learner.critic) if learner.critic else (learner,):
        owner.optimizer = torch.optim.SGD(owner.model.parameters(), lr=0.1)
        owner.scheduler = torch.optim.lr_scheduler.LambdaLR(owner.optimizer, lambda n: 1.0)
    return learner


def two_steps(learner, ref) -> tuple[list[dict[str, float]], list[list[float]]]:
    from learner.batch import TrainBatch

    metrics = []
    for rewards in ([1.0, 0.0, 0.5, 1.0], [0.0, 1.0, 1.0, 0.0]):
        behavior = learner.compute_logprobs(PROMPTS, RESPONSES)
        metrics.append(learner.train_step(TrainBatch(PROMPTS, RESPONSES, behavior, rewards, 2, ref)))
    return metrics, learner.compute_logprobs(PROMPTS, RESPONSES)


# The step's continuous metrics; counts like clip_fraction may flip a borderline token in bfloat16.
COMPARED_METRICS = ("loss/policy", "grad_norm", "entropy/mean", "kl/mean", "advantage/mean_abs", "loss/value",
                    "critic/grad_norm", "value/mean", "returns/mean")


def assert_metrics_close(gpu: dict[str, float], cpu: dict[str, float], tol: float) -> None:
    assert gpu.keys() == cpu.keys()
    for name in set(COMPARED_METRICS) & cpu.keys():
        assert math.isclose(gpu[name], cpu[name], rel_tol=tol, abs_tol=tol / 10), (name, gpu[name], cpu[name])


@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_reference_and_reward_model_on_cuda_match_the_cpu(tiny_model_dir, tiny_reward_model_dir, monkeypatch,
                                                          dtype):
    from actors.reference import ReferenceWorker
    from actors.reward_model import RewardModelWorker
    from learner.passes.micro_batches import MicroBatching

    texts = (["37+45=", "1+2=", "99+99="], ["82", "3", "198 and some more"])
    gpu_ref = ReferenceWorker(str(tiny_model_dir), dtype=dtype, batching=MicroBatching(3))
    gpu_rm = RewardModelWorker(str(tiny_reward_model_dir), dtype=dtype, batching=MicroBatching(2))
    assert gpu_ref.device.type == "cuda" and next(gpu_rm.model.parameters()).is_cuda
    on_cpu(monkeypatch)
    cpu_ref = ReferenceWorker(str(tiny_model_dir), dtype=dtype, batching=MicroBatching(3))
    cpu_rm = RewardModelWorker(str(tiny_reward_model_dir), dtype=dtype, batching=MicroBatching(2))
    assert max_diff(gpu_ref.compute_logprobs(PROMPTS, RESPONSES),
                    cpu_ref.compute_logprobs(PROMPTS, RESPONSES)) < TOLERANCES[dtype]
    assert max_diff(gpu_rm.score(*texts), cpu_rm.score(*texts)) < TOLERANCES[dtype]


KL_PLACES = [("grpo", {"kl_coef": 0.1}), ("gae", {"kl_coef": 0.0, "kl_reward_coef": 0.1})]  # in the loss, in the reward


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("advantage, kl", KL_PLACES)
def test_learner_on_cuda_matches_the_cpu(tiny_model_dir, monkeypatch, dtype, advantage, kl):
    from actors.reference import ReferenceWorker

    ref = ReferenceWorker(str(tiny_model_dir)).compute_logprobs(PROMPTS, RESPONSES)
    gpu = make_learner(tiny_model_dir, dtype, advantage, **kl)
    assert all(p.is_cuda for p in gpu.model.parameters())
    assert gpu.critic is None or all(p.is_cuda for p in gpu.critic.model.parameters())
    gpu_metrics, gpu_after = two_steps(gpu, ref)
    on_cpu(monkeypatch)
    cpu_metrics, cpu_after = two_steps(make_learner(tiny_model_dir, dtype, advantage, **kl), ref)
    for gpu_step, cpu_step in zip(gpu_metrics, cpu_metrics):
        assert_metrics_close(gpu_step, cpu_step, TOLERANCES[dtype])
    assert max_diff(gpu_after, cpu_after) < TOLERANCES[dtype]
    # What goes back to the driver is in host memory: numpy arrays, or CPU tensors for bfloat16.
    exported = [value for bucket in gpu.export_weights(1 << 20) for _, value in bucket]
    assert all(not isinstance(v, torch.Tensor) or (v.device.type == "cpu" and v.dtype == torch.bfloat16)
               for v in exported)
    # The shared-memory buffer takes the weights straight from the GPU, in their dtype.
    from sync.shared_memory import read_shared

    with read_shared(gpu.share_weights(version=1)) as named:
        state = gpu.model.state_dict()
        assert all(t.dtype == state[n].dtype and torch.equal(t, state[n].cpu()) for n, t in named)


def test_a_gpu_checkpoint_holds_host_tensors_and_resumes_on_either_device(tiny_model_dir, tmp_path, monkeypatch):
    from learner.config import CriticConfig, LearnerConfig
    from learner.learner import LEARNER_STATE_FILE, Learner

    def adam_learner() -> Learner:  # the real optimizers: their state is what a checkpoint carries
        config = LearnerConfig(lr=1e-3, num_threads=1, advantage="gae", kl_coef=0.0, micro_batch_size=2)
        return Learner(str(tiny_model_dir), config, seed=0, critic=CriticConfig(enabled=True, lr=1e-3))

    def devices(value):
        if isinstance(value, torch.Tensor):
            yield value.device.type
        elif isinstance(value, (dict, list, tuple)):
            for item in value.values() if isinstance(value, dict) else value:
                yield from devices(item)

    def optimizer_state_follows_the_parameters(learner: Learner) -> bool:
        optimizers = [learner.optimizer, learner.critic.optimizer]
        return all(value.device == param.device for optimizer in optimizers for param, values in optimizer.state.items()
                   for key, value in values.items() if key != "step")  # AdamW keeps `step` on the CPU by design

    gpu = adam_learner()
    two_steps(gpu, None)
    gpu.save_checkpoint(str(tmp_path))
    assert set(devices(torch.load(tmp_path / LEARNER_STATE_FILE, weights_only=True))) == {"cpu"}  # as written
    resumed_gpu = adam_learner()
    resumed_gpu.load_checkpoint(str(tmp_path))
    on_cpu(monkeypatch)
    resumed_cpu = adam_learner()
    assert resumed_cpu.load_checkpoint(str(tmp_path)) == 2
    assert gpu.optimizer.state
    assert all(optimizer_state_follows_the_parameters(learner) for learner in (gpu, resumed_gpu, resumed_cpu))
    assert resumed_gpu.device.type == "cuda" and resumed_cpu.device.type == "cpu"
    results = [two_steps(learner, None) for learner in (gpu, resumed_gpu, resumed_cpu)]
    for metrics, after in results[1:]:
        # The first step's metrics are measured before its update: the restored weights, to float32's tolerance.
        assert_metrics_close(metrics[0], results[0][0][0], TOLERANCES["float32"])
        # After two AdamW updates, float noise in near-zero gradients may move a weight by up to ~lr: looser.
        assert max_diff(after, results[0][1]) < 1e-2

"""The `collective` transport's two ends in one process, without Ray: a `Learner` (rank 0) broadcasts its weights to a
`RolloutWorker` whose real vLLM engine receives them inside its worker extension, on a tied-embeddings model (the
head must be re-packed after every reload) and through the cached probe prompt (the prefix cache must be reset)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from actors.engine import EngineSettings
from actors.rollout import RolloutWorker
from learner.config import LearnerConfig
from learner.learner import Learner

pytestmark = pytest.mark.slow

PROBE = "1+1=2 2+2=4 3+3=6 4+4=8 5+5=10 6+6=12 7+7=14 "  # 44 tokens: fills one 32-token KV block


def perturb(model, seed: int, scale: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def probe_gap(worker: RolloutWorker, learner: Learner) -> float:
    prompt_ids, response_ids, logprobs, *_ = worker.probe(PROBE, 6, 1.0, seed=1)
    [ours] = learner.compute_logprobs([prompt_ids], [response_ids])
    return max(abs(a - b) for a, b in zip(logprobs, ours))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_broadcast_loads_the_learners_weights_into_the_engine(tiny_tied_model_dir, dtype):
    """bfloat16: the learner keeps float32 master weights and broadcasts them cast to the engine's bfloat16. Its
    perturbations are 25x smaller: bfloat16's engine-learner noise grows with the weights (on this random model,
    measured: 1.5e-3 at the start, 1.5e-2 after two perturbations of 0.05, 7e-2 after one of 0.5; the same through
    the object store), so larger ones would leave the noise floor the tolerance was derived from."""
    from sync.verify import probe_tolerance_from

    learner = Learner(str(tiny_tied_model_dir), LearnerConfig(kl_coef=0.0, num_threads=1), dtype=dtype)
    worker = RolloutWorker(EngineSettings(model_path=str(tiny_tied_model_dir), dtype=dtype))
    background = ThreadPoolExecutor(1)  # rank 0's side of each collective
    scale = 0.5 if dtype == "float32" else 0.02

    def form_group(timeout: float = 30):
        # 4 KiB buckets: the tiny model travels in several, so packing overlaps sending.
        spec = learner.open_weight_group("127.0.0.1", 1 + worker.weight_group_ranks(), 4096, timeout)
        joined = background.submit(learner.join_weight_group)
        worker.join_weight_group(spec, first_rank=1)
        joined.result(timeout=timeout)
        return spec

    def broadcast(version: int) -> None:
        sent = background.submit(learner.broadcast_weights)
        loaded = worker.receive_weights(version)
        assert sent.result(timeout=30)["bytes"] > 0
        # what the engine's process received, in the engine's dtype, is bit for bit what the learner's weights cast
        # to it are (and not what they were before the last perturbation)
        assert loaded.version == version and loaded.fingerprints == (learner.weights_fingerprint(),)
        assert loaded.fingerprints != (before,)

    try:
        # Both start from the model directory (the probe prompt is cached): the gap is the noise floor, and the
        # tolerance is derived from it as a run derives it (float32: 1e-4).
        tolerance = probe_tolerance_from(probe_gap(worker, learner), ["the engine"], dtype)
        assert tolerance == 1e-4 or dtype == "bfloat16"
        first = form_group()
        assert len(first.layout) > 1 and {s.dtype for b in first.layout for s in b.slots} == {dtype}
        assert {p.dtype for p in learner.model.parameters()} == {torch.float32}
        for version in (1, 2):  # the same group, twice
            before = learner.weights_fingerprint()
            perturb(learner.model, seed=version, scale=scale)
            assert probe_gap(worker, learner) > 2 * tolerance  # the engine still serves the old weights
            broadcast(version)
            assert probe_gap(worker, learner) < tolerance  # a stale head or stale cached KV gives 0.2-1.7
        second = form_group()  # re-formed: a new group on a new port
        assert second.port != first.port
        before = learner.weights_fingerprint()
        perturb(learner.model, seed=3, scale=scale)
        broadcast(3)
        assert probe_gap(worker, learner) < tolerance and worker.weights_version == 3
        assert worker.last_load["receive_s"] > 0 and worker.last_load["reload_s"] > 0
    finally:
        learner.leave_weight_group()
        worker.shutdown()
        background.shutdown()

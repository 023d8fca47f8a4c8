"""RolloutWorker: one vLLM engine that samples G completions per prompt and takes new weights in place.

Owns: the engine's lifetime, turning text prompts into token ids, the weights version the engine serves, the
fingerprints of the weights it hands its engine (sync/fingerprint.py), and the sync probe (a seeded sample from a
fixed prompt whose logprobs the driver compares with the learner's; asynchronously, a sample the learner made,
scored), and in-flight updates (weights offered while a request runs, loaded between two engine steps).
With `episodes` (the run's `env`), every completion is a multi-turn episode against the run's environment
(actors/episodes.py). Does not own: which prompts it gets, rewards, or where weights come from. A plain class: Ray
wraps it in `cluster/`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from actors.engine import EngineSettings, Request, SampledCompletion, VllmEngine
from actors.episodes import EpisodeRunner, EpisodeSettings
from actors.rollout_types import (  # noqa: F401  (this module's API)
    EpisodePrompt,
    Rollout,
    RolloutGroups,
    SampleProbe,
    SamplingSettings,
)
from sync.group import GroupSpec
from sync.receive import Loaded, Weights, fingerprints, received
from sync.startup import mark


class ProbeSample(NamedTuple):
    """One seeded completion of the sync probe's prompt, as the engine served it."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # the engine's, per response token
    weights_version: int  # the version the worker says it serves
    cached_prompt_tokens: int | None  # prompt tokens taken from the prefix cache: 0 right after a load (reset)
    learner_logprobs: Sequence[float] = ()  # the learner's of the same tokens, filled in by WeightSync.scored


class RolloutWorker:
    """Owns one vLLM engine; `generate` samples, `load_weights` updates it in place. With `fingerprint`, every load
    reports the fingerprints of the tensors handed to the engine (`sync.fingerprint`)."""

    def __init__(self, settings: EngineSettings, num_threads: int = 1, fingerprint: bool = True,
                 episodes: EpisodeSettings | None = None):
        mark("loading")  # start-up marks (sync/startup.py): the engine marks `warming` when vLLM has the model
        torch.set_num_threads(num_threads)
        self.fingerprint = fingerprint
        self.engine = VllmEngine(settings)
        self.tokenizer = self.engine.tokenizer
        self.episodes = EpisodeRunner(self.engine, self.tokenizer, episodes) if episodes is not None else None
        self.weights_version = 0
        self.last_load: dict[str, float] = {}
        # In-flight updates: the newest weights offered (`offer_weights`, from another thread while `generate` runs).
        self.offered: Offer | None = None
        self._offer_lock = threading.Lock()
        mark("ready")

    def generate(self, prompts: Sequence[str | Sequence[int]], seeds: Sequence[int], sampling: SamplingSettings,
                 version: int | None = None, *buckets: Weights, probe: SampleProbe | tuple | None = None,
                 in_flight: bool = False) -> RolloutGroups:
        """Sample `sampling.group_size` completions per prompt: [len(prompts)][G]. One seed per prompt, so a
        prompt's completions do not depend on which worker serves it or what else is in the batch. One path:
        1. Load (`load_weights`) the request's weights, `version` and `buckets` (the sync and the next request in one
           call); with `in_flight` (`rollout.in_flight_updates`), the newest of those and the offered ones
           (`offer_weights`), if newer than the engine's (`_first_load`). `probe` then runs on them before anything
           else can fill the prefix cache (`run_probe`); a `SampleProbe` runs as the first prompt of the request's
           own engine batch on a batch-invariant engine (scheduled first, so its cache hits are what survived the
           load; its bits are those of a probe alone).
        2. Sample. With `in_flight`, one engine step at a time, taking any newer offer between two steps (requests
           in progress are preempted and their KV computed again, so every token after the load is sampled by the
           new weights), each token tagged with the version that sampled it; the last of those loads is probed
           after the request (`score_probe` without the prefix-cache check: the request's own entries are in it).
        The result's `loads` lists every load with its probe (or None) and whether it came during the request."""
        started = time.time()
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        first = self._first_load(Offer(version, probe, buckets), in_flight)
        in_batch = (first is not None and isinstance(first.probe, SampleProbe) and self.episodes is None
                    and self.engine.batch_invariant and not in_flight)
        loads: list[tuple[Loaded, ProbeSample | None, bool]] = []  # (report, probe, during the request)
        if first is not None:
            loaded = self.load_weights(first.version, *first.buckets)
            loads.append((loaded, self.run_probe(first.probe) if first.probe is not None and not in_batch else None,
                          False))
        during: list[Offer] = []  # the offers loaded during the request
        prompt_ids = self._prompt_ids(prompts)
        if self.episodes is not None:  # multi-turn: `prompts` are EpisodePrompts
            episodes, env_wait_s = self.episodes.run(prompts, prompt_ids, seeds, sampling, self.weights_version)
            result = RolloutGroups(episodes)
            result.env_wait_s = env_wait_s
        else:
            requests = engine_requests(sampling, seeds)
            if in_batch:
                probe_ids, probe_request = self._probe_request(*first.probe)
                [[c], *groups] = self.engine.sample([probe_ids, *prompt_ids], [probe_request, *requests])
                loads[0] = (loads[0][0], self._probe_sample(probe_ids, c), False)
            else:
                groups = self.engine.sample(prompt_ids, requests,
                                            before_step=self._between_steps(loads, during) if in_flight else None)
            result = RolloutGroups([to_rollout(ids, c, self.weights_version) for c in group]
                                   for ids, group in zip(prompt_ids, groups))
        if during and during[-1].probe is not None:  # the engine still serves it: nothing loads between requests
            loads[-1] = (loads[-1][0], self.score_probe(*during[-1].probe, cache_check=False), True)
        result.loads, result.clock = loads, (started, time.time())
        return result

    def offer_weights(self, version: int, probe: tuple | None, *buckets: Weights) -> None:
        """In-flight updates: weights `version` (and its probe, `run_probe`'s), taken between two engine
        steps of the request running now, or at the start of the next. Called in its own concurrency group (Ray
        runs it while `generate` runs); only the newest offer is kept."""
        with self._offer_lock:
            if self.offered is None or version > self.offered.version:
                self.offered = Offer(version, probe, buckets)

    def _newest_offer(self) -> Offer | None:
        with self._offer_lock:
            offered = self.offered
        return offered if offered is not None and offered.version > self.weights_version else None

    def _first_load(self, asked: Offer, in_flight: bool) -> Offer | None:
        """The weights a request loads before it samples: its own, whatever their version (a pooled engine resumed
        to an earlier checkpoint goes back); with in-flight updates, the newest of its own and the offered ones, and
        only if newer than the engine's (an offer may have brought it past the request's)."""
        if not in_flight:
            return asked if asked.version is not None else None
        newest = max((o for o in (asked, self._newest_offer()) if o is not None and o.version is not None),
                     key=lambda o: o.version, default=None)
        return newest if newest is not None and newest.version > self.weights_version else None

    def _between_steps(self, loads: list, during: list[Offer]) -> Callable[[], int]:
        """In-flight updates: what runs before each engine step: load the newest offer if it is newer than the
        engine's (noted in `loads` and `during`); the version the step samples with."""
        def before_step() -> int:
            newer = self._newest_offer()
            if newer is not None:
                loads.append((self.load_weights(newer.version, *newer.buckets, running=True), None, True))
                during.append(newer)
            return self.weights_version
        return before_step

    def load_weights(self, version: int, *buckets: Weights, running: bool = False) -> Loaded:
        """Load every bucket of (name, array) pairs, or the learner's shared-memory buffer (one handle, on the
        learner's node), into the engine in place; return the version now served and the fingerprints of what the
        engine was handed. `last_load` keeps the timings (fingerprint, reload)."""
        started = time.perf_counter()
        with received(buckets) as named:  # fails if the learner rewrote its shared buffer meanwhile
            fingerprinting = time.perf_counter()
            report = Loaded(version, fingerprints(named, self.fingerprint))
            fingerprint_s = time.perf_counter() - fingerprinting
            self.engine.load_weights(named, running)  # running: between two steps of a request
        self.last_load = {"fingerprint_s": fingerprint_s, "reload_s": time.perf_counter() - started - fingerprint_s}
        self.weights_version = version
        return report

    # The `collective` transport: this worker's engine is a member of the learner's weight group.
    def weight_group_ranks(self) -> int:
        """Members this worker adds to a weight group: one per vLLM worker of its engine."""
        return self.engine.num_ranks

    def join_weight_group(self, spec: GroupSpec, first_rank: int) -> None:
        self.engine.join_weight_group(spec, first_rank)

    def receive_weights(self, version: int) -> Loaded:
        """Receive weights `version` from the learner's broadcast and load them in place; return the version now
        served and, per engine process, the fingerprints of what it received. `last_load` keeps the engine's timings
        (receive, reload)."""
        self.last_load, fingerprints = self.engine.receive_weights(self.fingerprint)
        self.weights_version = version
        return Loaded(version, fingerprints)

    def leave_weight_group(self) -> None:
        self.engine.leave_weight_group()

    def tokenize(self, text: str) -> list[int]:
        """`text`'s token ids as this worker's engine gets them (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def batch_invariance(self) -> tuple[bool, str]:
        """Whether the engine's requests' bits do not depend on what else their engine batch holds, as its start
        check found, and a line saying with which kernels (`VllmEngine.batch_invariant`, `.invariance`)."""
        return self.engine.batch_invariant, self.engine.invariance

    def run_probe(self, probe: SampleProbe | tuple) -> ProbeSample:
        """The sync probe a request carries: a `SampleProbe` the engine samples (`probe`), or the learner's own probe
        sample of the weights, whose tokens it scores (`score_probe`'s arguments)."""
        return self.probe(*probe) if isinstance(probe, SampleProbe) else self.score_probe(*probe)

    def probe(self, prompt: str, max_tokens: int, temperature: float, seed: int) -> ProbeSample:
        """Sample one seeded completion of a fixed prompt, with how much of the prompt came from the prefix cache
        (which a load empties: a cache hit on the first probe after a load means stale KV entries survived it)."""
        prompt_ids, request = self._probe_request(prompt, max_tokens, temperature, seed)
        [[c]] = self.engine.sample([prompt_ids], [request])
        return self._probe_sample(prompt_ids, c)

    def _probe_request(self, prompt: str, max_tokens: int, temperature: float, seed: int) -> tuple[list[int], Request]:
        return self.tokenizer.encode(prompt, add_special_tokens=False), Request(1, temperature, 1.0, max_tokens, seed)

    def _probe_sample(self, prompt_ids: list[int], c: SampledCompletion) -> ProbeSample:
        return ProbeSample(prompt_ids, c.response_ids, c.logprobs, self.weights_version, c.cached_prompt_tokens)

    def score_probe(self, prompt_ids: list[int], response_ids: list[int], learner_logprobs: list[float],
                    seed: int, cache_check: bool = True) -> ProbeSample:
        """The asynchronous sync probe: the learner sampled `response_ids` from `prompt_ids` when it exported the
        weights (it has moved on by the time this comes back, so it cannot score a sample of the engine's); the
        engine scores the same tokens (prompt logprobs: temperature 1, as `learner_logprobs`), after a one-token
        seeded sample of the prompt that reports the prefix cache's hits (prompt-logprob requests never read it;
        without `cache_check`, no such sample: `cached_prompt_tokens` None)."""
        cached = None
        if cache_check:
            [[c]] = self.engine.generate([prompt_ids], 1, 1.0, 1.0, 1, [seed])
            cached = c.cached_prompt_tokens
        logprobs = self.engine.score([*prompt_ids, *response_ids])[len(prompt_ids) - 1:]
        return ProbeSample(list(prompt_ids), list(response_ids), logprobs, self.weights_version, cached,
                           list(learner_logprobs))

    def shutdown(self) -> None:
        if self.episodes is not None:
            self.episodes.close()
        self.engine.shutdown()

    def _prompt_ids(self, prompts: Sequence[str | Sequence[int] | EpisodePrompt]) -> list[list[int]]:
        """Text is tokenised here; token ids (a dataset's, tokenised once by the driver) are used as they are."""
        prompts = [(p.text if p.ids is None else p.ids) if isinstance(p, EpisodePrompt) else p for p in prompts]
        return [self.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else [int(t) for t in p]
                for p in prompts]

def engine_requests(sampling: SamplingSettings, seeds: Sequence[int]) -> list[Request]:
    """One engine request per prompt, prompt i with seed i, each with `sampling`'s settings."""
    return [Request(sampling.group_size, sampling.temperature, sampling.top_p, sampling.max_new_tokens, seed,
                    sampling.cache_salt, sampling.stop, sampling.stop_token_ids) for seed in seeds]


def to_rollout(prompt_ids: list[int], c: SampledCompletion, version: int) -> Rollout:
    """A completion as a `Rollout` of weights `version` (the first token's, with in-flight updates' `versions`)."""
    if c.versions is None:
        return Rollout(prompt_ids, c.response_ids, c.logprobs, c.text, c.finish_reason, version)
    first = c.versions[0] if c.versions else version
    return Rollout(prompt_ids, c.response_ids, c.logprobs, c.text, c.finish_reason, first, c.versions)


class Offer(NamedTuple):
    """Weights offered to a worker for in-flight updates (or a request's own), with their probe's arguments."""

    version: int | None
    probe: tuple | None
    buckets: tuple


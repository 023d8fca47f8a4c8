"""AdapterServer: one vLLM engine serving several LoRA adapters at once (vLLM's multi-LoRA), each under its own name
and weights version: `relay serve`'s models share it when their adapters are all they train.

Owns: the engine's lifetime, each adapter's name, rank and version, the fingerprints of what each load hands the
engine (sync/fingerprint.py), and sampling with one adapter. Does not own: which adapters exist or who may sample
them (cluster/tinker/sampling.py), whole-weight loads (a model that trains whole modules gets a `RolloutWorker` of its
own). A plain class: Ray wraps it in cluster/fleet/placement.py's launcher.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from actors.engine import EngineSettings, VllmEngine
from actors.rollout import engine_requests, to_rollout
from actors.rollout_types import RolloutGroups, SamplingSettings
from sync.receive import Loaded, Weights, fingerprints, received
from sync.startup import mark


class AdapterServer:
    """`load` puts a named model's adapters into the engine (a slot of `settings.lora.max_loras`); `generate`
    samples with one of them; `forget` frees its slot."""

    def __init__(self, settings: EngineSettings, num_threads: int = 1, fingerprint: bool = True):
        if settings.lora is None:
            raise ValueError("an AdapterServer serves LoRA adapters: give EngineSettings.lora")
        mark("loading")
        torch.set_num_threads(num_threads)
        self.fingerprint = fingerprint
        self.engine = VllmEngine(settings)
        self.versions: dict[str, int] = {}  # adapter name -> the weights version it serves
        mark("ready")

    def load(self, name: str, version: int, rank: int, alpha: float, *buckets: Weights) -> Loaded:
        """Load adapters `name` (rank `rank`, scale `alpha`; peft's tensor names, in buckets as the learner exports
        them) as weights `version`, in place of what `name` served; the fingerprints of what the engine got. Every
        other adapter stays as it was; the prefix cache is reset (its entries name no version)."""
        serving = replace(self.engine.settings.lora, rank=rank, alpha=alpha)
        with received(buckets) as named:
            report = Loaded(version, fingerprints(named, self.fingerprint))
            self.engine.load_adapters(named, name, serving)
        self.engine.reset_prefix_cache()
        self.versions[name] = version
        return report

    def generate(self, name: str, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                 sampling: SamplingSettings) -> RolloutGroups:
        """`sampling.group_size` completions of each tokenized prompt with adapters `name`, prompt i with seed i:
        [len(prompts)][G], each tagged with the version `name` serves."""
        if name not in self.versions:
            raise KeyError(f"no adapters named {name!r} are loaded")
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        started, version = time.time(), self.versions[name]
        ids = [[int(t) for t in p] for p in prompts]
        groups = self.engine.sample(ids, engine_requests(sampling, seeds), adapter=name)
        result = RolloutGroups([to_rollout(p, c, version) for c in g] for p, g in zip(ids, groups))
        result.clock = (started, time.time())
        return result

    def forget(self, name: str) -> None:
        """Stop serving adapters `name`."""
        self.engine.forget_adapters(name)
        del self.versions[name]

    def shutdown(self) -> None:
        self.engine.shutdown()

"""What a rollout worker hands back: sampling settings in, `Rollout`s out, and how they travel between processes.

Owns: the `Rollout` record, `RolloutGroups` (a [prompts][G] list that pickles packed: flat arrays instead of a
Python object per token), `SamplingSettings`, the probe a request carries (`SampleProbe`), and what multi-turn
episodes add (`EpisodePrompt` in, `EpisodeInfo` and a per-token `model_mask` out). Imports only numpy, so the driver
(and benchmarks that simulate engines) can use these types without torch or vLLM.
Does not own: sampling itself (actors/rollout.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from sync.receive import Loaded


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are sampled (the rollout config's sampling knobs)."""

    group_size: int  # G completions per prompt
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    # The requests' own prefix-cache space (evaluation's: the entries training requests find stay as they were).
    cache_salt: str | None = None
    stop: tuple[str, ...] = ()  # a completion ends at the first of these strings (the Tinker API's `stop`)
    stop_token_ids: tuple[int, ...] = ()  # or at the first of these tokens, which it keeps


class SampleProbe(NamedTuple):
    """The sync probe a loading engine samples itself (`RolloutWorker.probe`'s arguments), for the learner to score;
    a request's `probe` is this, or the learner's own probe sample for the engine to score (`score_probe`'s)."""

    prompt: str
    max_tokens: int
    temperature: float
    seed: int


class EpisodePrompt(NamedTuple):
    """A prompt of a multi-turn episode: its text (for the environment's `reset`), its label, and its token ids when
    the driver tokenised it once (else the worker tokenises the text)."""

    text: str
    label: Any
    ids: Sequence[int] | None = None


@dataclass(slots=True)
class EpisodeInfo:
    """What one multi-turn episode did, beside its tokens (actors/episodes.py)."""

    turns: int  # model turns generated
    turn_ends: list[int]  # response index of the last model token of each turn the environment answered
    turn_rewards: list[float]  # the environment's reward for each of those turns
    calls: int  # environment calls made (reset and steps)
    invalid_calls: int  # steps whose `info` said `invalid_call`
    truncated_observations: int  # observations cut to `env.max_observation_tokens`
    env_seconds: float  # wall time of this episode's environment calls
    error: str | None = None  # one line: an environment call failed (the run's `env.on_failure` applies)


# Not frozen: a frozen dataclass's __init__ sets every field through object.__setattr__, and the driver builds
# thousands per step.
@dataclass(slots=True)
class Rollout:
    """One completion of one prompt, with what the learner needs to score it."""

    prompt_ids: list[int]  # [T_prompt]
    response_ids: Sequence[int]  # [T_resp]; an int32 array after crossing processes (see RolloutGroups)
    behavior_logprobs: Sequence[float]  # [T_resp], from the engine that sampled (weights `weights_version`)
    text: str  # the response text, EOS dropped
    finish_reason: str  # "stop" | "length"
    weights_version: int  # the version that sampled the first token (every token, without in-flight updates)
    versions: Sequence[int] | None = None  # [T_resp] with in-flight updates: the version that sampled each token
    # Process supervision, set by the driver's scoring (never sent between processes): the response index of each
    # step's last token, and each step's combined reward (`cluster.run.scoring.ScoredSteps`).
    step_ends: Any = None
    step_rewards: Any = None
    # Multi-turn episodes: [T_resp] 1 where the model sampled the token, 0 where the environment added it (whose
    # behaviour logprob is 0); None: every response token is the model's. `episode`: what the episode did.
    model_mask: Sequence[int] | None = None
    episode: EpisodeInfo | None = None


class RolloutGroups(list):
    """[prompts][G] Rollouts, as `RolloutWorker.generate` returns them. Between processes (Ray) they travel packed:
    every completion's token ids and logprobs in two flat arrays, so the driver decodes one buffer per request rather
    than a Python object per token (docs/benchmarks.md, scale simulation). On the receiving side
    `response_ids` and `behavior_logprobs` are int32 / float32 numpy views of those arrays (vLLM's logprobs are
    float32: nothing is lost). `loads` lists every weight load the request made, in order, each as (its report, the
    sync probe it ran or scored then (an `actors.rollout.ProbeSample`) or None, whether it came during the request
    (in-flight updates)); `loaded` and `probe` are the load it made first, if it carried one, and its probe;
    `clock` the worker's wall clock (time.time()) when the request started running and when it finished (the
    engines' idle time between requests); `env_wait_s`, with multi-turn episodes, the seconds the engine had
    nothing to generate because every unfinished episode was waiting for its environment."""

    clock: tuple[float, float] | None = None
    loads: Sequence = ()
    env_wait_s: float = 0.0

    @property
    def loaded(self) -> Loaded | None:
        return self.loads[0][0] if self.loads and not self.loads[0][2] else None

    @property
    def probe(self) -> Any:
        return self.loads[0][1] if self.loads and not self.loads[0][2] else None

    def __reduce__(self):
        rollouts = [r for group in self for r in group]
        return (_unpack_groups, (
            [len(group) for group in self], [group[0].prompt_ids if group else [] for group in self],
            np.fromiter((len(r.response_ids) for r in rollouts), np.int64, len(rollouts)),
            np.concatenate([np.asarray(r.response_ids, np.int32) for r in rollouts] or [np.zeros(0, np.int32)]),
            np.concatenate([np.asarray(r.behavior_logprobs, np.float32) for r in rollouts]
                           or [np.zeros(0, np.float32)]),
            [r.text for r in rollouts], [r.finish_reason for r in rollouts], [r.weights_version for r in rollouts],
            self.clock, self.loads,
            None if not rollouts or rollouts[0].versions is None else
            np.concatenate([np.asarray(r.versions, np.int32) for r in rollouts]),
            None if not rollouts or rollouts[0].model_mask is None else
            (np.concatenate([np.asarray(r.model_mask, np.uint8) for r in rollouts]), [r.episode for r in rollouts]),
            self.env_wait_s))


def _unpack_groups(sizes, prompt_ids, lengths, ids, logprobs, texts, finish_reasons, versions,
                   clock=None, loads=(), token_versions=None, episodes=None,
                   env_wait_s=0.0) -> RolloutGroups:
    # Zero-copy arrays from Ray's object store are read-only; one copy each keeps torch.as_tensor quiet downstream.
    ids, logprobs = np.array(ids), np.array(logprobs)
    ends = np.cumsum(lengths).tolist()
    starts = [0] + ends[:-1]
    masks, infos = (None, None) if episodes is None else (np.array(episodes[0]), episodes[1])
    groups, k = RolloutGroups(), 0
    for size, prompt in zip(sizes, prompt_ids):
        groups.append([Rollout(prompt, ids[starts[j]:ends[j]], logprobs[starts[j]:ends[j]], texts[j],
                               finish_reasons[j], versions[j],
                               None if token_versions is None else token_versions[starts[j]:ends[j]],
                               model_mask=None if masks is None else masks[starts[j]:ends[j]],
                               episode=None if infos is None else infos[j])
                       for j in range(k, k + size)])
        k += size
    groups.clock, groups.loads = clock, list(loads)
    groups.env_wait_s = env_wait_s
    return groups

"""Multi-turn episodes: the rollout worker's loop of model turns and environment answers (docs/environments.md).

Owns: `EpisodeSettings` (what a worker needs to run episodes), `open_environments` (the run's `env` section ->
in-process, relay-protocol or OpenEnv `Environments`), `turn_seed`, and `EpisodeRunner`, which runs one request's
G x prompts episodes on the worker's engine: each episode is `reset`, then up to `max_turns` model turns, each
answered by the environment's `step`, whose observation is appended as token ids before the next turn (token in,
token out: the decisions are `EpisodeRunner`'s docstring).
Does not own: the engine (actors/engine.py: `add_turn` / `step_turns`), the environments and their protocol
(rewards/environments/), tool-call parsing and chat rendering (rewards/environments/tools.py), or what the run does
with an episode's rewards and failures (cluster/run/scoring.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from actors.rollout_types import EpisodeInfo, EpisodePrompt, Rollout, SamplingSettings
from rewards.config import EnvironmentConfig
from rewards.environments.interface import EpisodeError, EpisodeSession


@dataclass(frozen=True)
class EpisodeSettings:
    """A rollout worker's episodes: the run's `env` section, `rollout.max_turns` and `rollout.stop`, and the engine's
    `max_model_len`."""

    env: EnvironmentConfig
    max_turns: int
    stop: tuple[str, ...] = ()
    max_model_len: int = 64


def open_environments(env: EnvironmentConfig) -> Any:
    """The `Environments` the `env` section names: its in-process class (`spec`) on a thread pool, or its servers
    (`urls`) spoken to in `env.protocol` (relay's or OpenEnv's). Raises ValueError (one line) on a bad spec, params or
    token variable."""
    if env.spec is not None:
        from rewards.environments.interface import InProcessEnvironments, load_environment

        return InProcessEnvironments(load_environment(env.spec, env.params), max_concurrency=env.max_concurrency,
                                     timeout=env.timeout, name=env.spec)
    remote = dict(timeout=env.timeout, max_retries=env.max_retries, backoff=env.backoff, backoff_max=env.backoff_max,
                  max_concurrency=env.max_concurrency, token_env=env.token_env, verify_tls=env.verify_tls,
                  allow_plain_http_token=env.allow_plain_http_token, name="env")
    if env.protocol == "openenv":
        from rewards.environments.openenv_client import OpenEnvEnvironments

        return OpenEnvEnvironments(env.urls, action_field=env.action_field, observation_field=env.observation_field,
                                   **remote)
    from rewards.environments.remote import RemoteEnvironments

    return RemoteEnvironments(env.urls, **remote)


def turn_seed(seed: int, index: int, turn: int) -> int:
    """The sampling seed of turn `turn` of episode `index` (of G) of a prompt sampled with `seed` (SplitMix64)."""
    x = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9 + (turn + 1) * 0x94D049BB133111EB) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 31)) % 2**31


@dataclass
class _Turns:
    """The turns of one request in flight in the engine, and the futures their episodes wait on."""

    engine: Any
    sampling: SamplingSettings
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    waiting: dict[str, asyncio.Future]
    added: asyncio.Event

    async def sample(self, ids: list[int], seed: int, max_tokens: int) -> Any:
        """One turn from the episode so far (`ids`): the engine's `SampledCompletion`."""
        request_id = self.engine.add_turn(ids, self.sampling.temperature, self.sampling.top_p, max_tokens, seed,
                                          self.stop, self.stop_token_ids, self.sampling.cache_salt)
        future = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        self.added.set()
        return await future


class EpisodeRunner:
    """Runs episodes on a rollout worker's engine against the run's environments. Decisions:
    - Token in, token out. An episode is one token sequence: the prompt's ids, then each turn's sampled ids exactly as
      the engine returned them, then each observation's ids as tokenised once when it arrived. The next turn's prompt
      is that sequence as it stands; nothing is decoded and encoded again (the text of a turn is decoded only to give
      it to the environment). So the learner's tokens are the engine's, and the behaviour logprobs line up with them.
    - `model_mask` marks the tokens the model sampled (1) and the environment's (0, with behaviour logprob 0); the
      learner trains, penalises and compares logprobs on model tokens only.
    - The response ends with a model turn. An observation that does not fit before `rollout.max_new_tokens` (the whole
      episode's response: model and environment tokens) or the engine's `max_model_len` with room for one more token
      is not appended: the episode ends there as `length`. A turn cut at that limit is not sent to the environment.
      An initial observation (`reset`'s) goes first in the response, as environment tokens.
    - The episodes of a request run concurrently on one asyncio loop in the worker's thread: a pump steps the engine
      over every turn in flight while other episodes wait for their environment (in threads, or on the remote
      client's own loop), so a slow environment holds its episode only. The seconds the engine had nothing to do
      because every unfinished episode was waiting for its environment are the request's `env_wait_s`.
    - Each turn is sampled with its own seed, `turn_seed(prompt seed, episode index, turn)`: an episode does not
      depend on what else runs in the engine, or on which worker runs it.
    - An `EpisodeError` (the environment raised, timed out, or its service failed after the retries) ends that
      episode with `EpisodeInfo.error` set; the driver applies `env.on_failure`. Sessions are always closed."""

    def __init__(self, engine: Any, tokenizer: Any, settings: EpisodeSettings):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.environments = open_environments(settings.env)
        self.stop_token_ids: tuple[int, ...] = ()
        self.end_of_turn: int | None = None  # chat: the template's end-of-turn token, which every turn ends with
        self.render: Callable[[str], list[int]] | None = None  # chat: an observation's tool-message ids
        if settings.env.observation == "chat":
            from rewards.environments.tools import ChatObservations

            chat = ChatObservations(tokenizer)
            self.render = chat.ids
            self.end_of_turn = chat.end_of_turn_id
            self.stop_token_ids = (chat.end_of_turn_id,)

    def _text_ids(self, observation: str) -> list[int]:
        return self.tokenizer.encode(observation, add_special_tokens=False) if observation else []

    def observation_ids(self, observation: str, info: EpisodeInfo) -> list[int]:
        """An observation's token ids, tokenised once: its text's (or, in chat, its tool message's), its text cut to
        its first `env.max_observation_tokens` tokens first (counted in `info`)."""
        cap = self.settings.env.max_observation_tokens
        if cap is not None:
            ids = self._text_ids(observation)
            if len(ids) > cap:
                info.truncated_observations += 1
                if self.render is None:
                    return ids[:cap]
                observation = self.tokenizer.decode(ids[:cap])
        return self._text_ids(observation) if self.render is None else self.render(observation)

    def close(self) -> None:
        self.environments.close()

    def __enter__(self) -> EpisodeRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def run(self, prompts: Sequence[EpisodePrompt], prompt_ids: list[list[int]], seeds: Sequence[int],
            sampling: SamplingSettings, version: int) -> tuple[list[list[Rollout]], float]:
        """`sampling.group_size` episodes per prompt, [prompts][G] rollouts (weights `version`), and the request's
        `env_wait_s`."""
        return asyncio.run(self._run(prompts, prompt_ids, seeds, sampling, version))

    async def _run(self, prompts: Sequence[EpisodePrompt], prompt_ids: list[list[int]], seeds: Sequence[int],
                   sampling: SamplingSettings, version: int) -> tuple[list[list[Rollout]], float]:
        turns = _Turns(self.engine, sampling, self.settings.stop, self.stop_token_ids, {}, asyncio.Event())
        tasks = [asyncio.ensure_future(self._episode(prompt, ids, seed, g, sampling, version, turns))
                 for prompt, ids, seed in zip(prompts, prompt_ids, seeds) for g in range(sampling.group_size)]
        everything = asyncio.gather(*tasks)
        idle = 0.0
        try:
            while not everything.done():
                if turns.waiting:
                    for request_id, completion in self.engine.step_turns():
                        turns.waiting.pop(request_id).set_result(completion)
                    await asyncio.sleep(0)  # the episodes whose turn finished go on to their environment
                    continue
                turns.added.clear()
                added = asyncio.ensure_future(turns.added.wait())
                started = time.perf_counter()
                await asyncio.wait([everything, added], return_when=asyncio.FIRST_COMPLETED)
                added.cancel()
                idle += time.perf_counter() - started
            rollouts = everything.result()
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.engine.abort_turns(list(turns.waiting))
            raise
        size = sampling.group_size
        return [rollouts[i * size:(i + 1) * size] for i in range(len(prompts))], idle

    async def _episode(self, prompt: EpisodePrompt, prompt_ids: list[int], seed: int, index: int,
                       sampling: SamplingSettings, version: int, turns: _Turns) -> Rollout:
        """One episode (module docstring); environment failures end it with `EpisodeInfo.error` set."""
        limit = min(sampling.max_new_tokens, self.settings.max_model_len - len(prompt_ids))
        response: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        info = EpisodeInfo(turns=0, turn_ends=[], turn_rewards=[], calls=0, invalid_calls=0, truncated_observations=0,
                           env_seconds=0.0)
        text, finish = "", "stop"
        session = self.environments.open()
        try:
            observation = await self._call(info, session, "reset", prompt.text, prompt.label)
            if observation and self.render is not None:
                raise EpisodeError("with env.observation=chat the initial observation must be empty (a tool message "
                                   "needs an assistant turn before it): put it in the prompt")
            ids = self.observation_ids(observation, info) if self.render is None else []
            if len(ids) >= limit:
                raise EpisodeError(f"the initial observation is {len(ids)} tokens, which leaves no room for the model "
                                   f"within {limit} response tokens (rollout.max_new_tokens, rollout.max_model_len)")
            response += ids
            logprobs += [0.0] * len(ids)
            mask += [0] * len(ids)
            for turn in range(self.settings.max_turns):
                completion = await turns.sample(prompt_ids + response, turn_seed(seed, index, turn),
                                                limit - len(response))
                info.turns += 1
                response += completion.response_ids
                logprobs += completion.logprobs
                mask += [1] * len(completion.response_ids)
                text = self._action_text(completion.response_ids)
                if completion.finish_reason == "length":
                    finish = "length"  # cut at the episode's limit: not an action to answer
                    break
                result = await self._call(info, session, "step", text)
                info.turn_ends.append(len(response) - 1)
                info.turn_rewards.append(result.reward)
                info.invalid_calls += bool(result.info.get("invalid_call"))
                if result.done or turn == self.settings.max_turns - 1:
                    break
                ids = self.observation_ids(result.observation, info)
                if self.end_of_turn is not None and response[-1] != self.end_of_turn:
                    ids = [self.end_of_turn, *ids]  # the turn stopped elsewhere (a stop string): close it as chat does
                if len(response) + len(ids) >= limit:
                    finish = "length"  # no room for the observation and one more model token
                    break
                response += ids
                logprobs += [0.0] * len(ids)
                mask += [0] * len(ids)
        except EpisodeError as err:
            info.error = str(err)
        finally:
            await session.close()
        return Rollout(prompt_ids, response, logprobs, text, finish, version, model_mask=mask, episode=info)

    def _action_text(self, ids: Sequence[int]) -> str:
        """A turn's text for the environment: special tokens dropped; in chat, the turn as written, less the
        end-of-turn (or EOS) token that ended it (a tool-call tag the tokenizer calls special stays)."""
        if self.end_of_turn is None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        ids = list(ids)
        ended = ids and ids[-1] in (self.end_of_turn, self.tokenizer.eos_token_id)
        return self.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)

    @staticmethod
    async def _call(info: EpisodeInfo, session: EpisodeSession, what: str, *args: Any) -> Any:
        started = time.perf_counter()
        info.calls += 1
        try:
            return await getattr(session, what)(*args)
        finally:
            info.env_seconds += time.perf_counter() - started

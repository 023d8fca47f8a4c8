"""Multi-turn episodes on the real vLLM engine, in-process: token in, token out, masks, limits, failures, and a remote
environment giving exactly the in-process episodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.engine import EngineSettings
from actors.episodes import EpisodeRunner, EpisodeSettings, turn_seed
from actors.rollout import RolloutWorker, SamplingSettings
from actors.rollout_types import EpisodePrompt, RolloutGroups
from rewards.config import EnvironmentConfig

pytestmark = pytest.mark.slow

PROMPTS = [EpisodePrompt("37+45=", "82"), EpisodePrompt("1+2=", "3"), EpisodePrompt("9+9=", "18")]
SEEDS = [11, 12, 13]
SAMPLING = SamplingSettings(group_size=4, max_new_tokens=40)


def settings(max_turns: int = 3, stop: tuple[str, ...] = ("=",), **env) -> EpisodeSettings:
    env = {"spec": "tests.envs:Counter", **env}
    return EpisodeSettings(EnvironmentConfig(**env), max_turns=max_turns, stop=stop, max_model_len=64)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def worker(request, tiny_model_dir):
    w = RolloutWorker(EngineSettings(model_path=str(tiny_model_dir), dtype=request.param), episodes=settings())
    yield w
    w.shutdown()


def runner(worker: RolloutWorker, **kwargs) -> EpisodeRunner:
    """Episodes with other settings on the worker's engine (no second engine start)."""
    return EpisodeRunner(worker.engine, worker.tokenizer, settings(**kwargs))


def segments(mask) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values in `mask`."""
    mask = np.asarray(mask)
    cuts = [0, *(np.flatnonzero(np.diff(mask)) + 1).tolist(), len(mask)]
    return [(int(mask[a]), a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def hf_logprobs(model, prompt_ids, response_ids) -> torch.Tensor:
    ids = torch.tensor([list(prompt_ids) + [int(t) for t in response_ids]])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][len(prompt_ids) - 1:]


def test_an_episode_is_the_engines_tokens_and_the_environments_tokens(worker, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    groups = worker.generate(PROMPTS, SEEDS, SAMPLING)
    assert [len(g) for g in groups] == [4, 4, 4]
    dtype = worker.engine.llm.llm_engine.model_config.dtype
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    tokenizer = worker.tokenizer
    gaps = []
    for prompt, group in zip(PROMPTS, groups):
        for r in group:
            assert r.prompt_ids == tokenizer.encode(prompt.text, add_special_tokens=False)
            assert len(r.model_mask) == len(r.response_ids) == len(r.behavior_logprobs) <= SAMPLING.max_new_tokens
            runs = segments(r.model_mask)
            model_runs = [(a, b) for value, a, b in runs if value == 1]
            env_runs = [(a, b) for value, a, b in runs if value == 0]
            info = r.episode
            assert info.error is None and r.model_mask[-1] == 1  # a response ends with the model's turn
            assert info.turns == len(model_runs) and 1 <= info.turns <= 3
            # The environment's tokens are its observations tokenised once, in order: "00 ", "11 ", ...
            for t, (a, b) in enumerate(env_runs):
                assert list(r.response_ids[a:b]) == tokenizer.encode(f"{t}{t} ", add_special_tokens=False)
                assert not np.any(np.asarray(r.behavior_logprobs[a:b]))
            assert info.turn_ends == [b - 1 for a, b in model_runs][:len(info.turn_rewards)]
            assert info.turn_rewards == [float(t + 1) for t in range(len(info.turn_rewards))]
            assert info.calls == 1 + len(info.turn_rewards)  # reset, then one step per answered turn
            last = r.response_ids[model_runs[-1][0]:]
            assert r.text == tokenizer.decode(last, skip_special_tokens=True)
            if r.finish_reason == "stop":
                assert len(info.turn_rewards) == info.turns
            # Each model turn ends at EOS, at the stop string "=" (the model's token), or at the length limit.
            for a, b in model_runs[:-1]:
                assert r.response_ids[b - 1] == tokenizer.eos_token_id or \
                    tokenizer.decode(r.response_ids[b - 1:b]) == "="
            ours = hf_logprobs(model, r.prompt_ids, r.response_ids)
            keep = torch.as_tensor(np.asarray(r.model_mask, bool))
            gaps.append(float((ours[keep] - torch.as_tensor(np.asarray(r.behavior_logprobs))[keep]).abs().max()))
    assert max(gaps) < (1e-4 if dtype == torch.float32 else 0.1), max(gaps)
    assert any(r.episode.turns == 3 for g in groups for r in g)  # several turns happened


def test_episodes_cross_processes_packed(worker):
    import pickle

    groups = worker.generate(PROMPTS[:1], SEEDS[:1], SAMPLING)
    back = pickle.loads(pickle.dumps(groups))
    assert isinstance(back, RolloutGroups) and back.env_wait_s == groups.env_wait_s
    for ours, theirs in zip(groups[0], back[0]):
        assert list(theirs.response_ids) == list(ours.response_ids)
        assert list(theirs.model_mask) == list(ours.model_mask)
        assert theirs.episode == ours.episode


def test_an_episode_does_not_depend_on_the_batch_or_the_worker(worker):
    together = worker.generate(PROMPTS, SEEDS, SAMPLING)
    alone = worker.generate(PROMPTS[1:2], SEEDS[1:2], SAMPLING)
    # The same tokens; logprobs as equal as batches of other shapes compute them (bfloat16: to its precision).
    atol = 1e-5 if worker.engine.llm.llm_engine.model_config.dtype == torch.float32 else 1e-2
    for a, b in zip(together[1], alone[0]):
        assert list(a.response_ids) == list(b.response_ids) and list(a.model_mask) == list(b.model_mask)
        np.testing.assert_allclose(a.behavior_logprobs, b.behavior_logprobs, atol=atol)
    assert len({turn_seed(11, g, t) for g in range(4) for t in range(3)}) == 12


def test_the_initial_observation_opens_the_response(worker):
    with runner(worker, params={"start": "7 "}) as episodes:
        [group], _ = episodes.run(PROMPTS[:1], [worker.tokenizer.encode("37+45=")], SEEDS[:1], SAMPLING, 0)
    start = worker.tokenizer.encode("7 ")
    for r in group:
        assert list(r.response_ids[:2]) == start and list(r.model_mask[:2]) == [0, 0]
        assert r.episode.turn_ends[0] >= 2


def test_the_length_limit_cuts_an_episode_at_a_model_turn(worker):
    short = SamplingSettings(group_size=4, max_new_tokens=7)
    with runner(worker, max_turns=5, params={"turns": 5}) as episodes:
        groups, _ = episodes.run(PROMPTS, [worker.tokenizer.encode(p.text) for p in PROMPTS], SEEDS, short, 0)
    rollouts = [r for g in groups for r in g]
    assert all(len(r.response_ids) <= 7 and r.model_mask[-1] == 1 for r in rollouts)
    assert any(r.finish_reason == "length" for r in rollouts)
    for r in rollouts:
        if r.finish_reason == "stop":  # the environment said done (5 turns would not fit in 7 tokens)
            assert r.episode.turns == len(r.episode.turn_rewards)


def test_an_environment_failure_ends_its_episode_and_is_reported(worker):
    with runner(worker, params={"fail_at": 1, "invalid_at": 0}) as episodes:
        groups, _ = episodes.run(PROMPTS[:2], [worker.tokenizer.encode(p.text) for p in PROMPTS[:2]], SEEDS[:2],
                                 SAMPLING, 0)
    for r in (r for g in groups for r in g):
        info = r.episode
        if info.turns >= 2:  # turn 1 was answered by raising
            assert "Counter fails at turn 1" in info.error and info.turn_rewards == [1.0]
        assert info.invalid_calls == (1 if info.turn_rewards else 0)


def test_a_remote_environment_gives_exactly_the_in_process_episodes(worker, serve_env):
    _, url = serve_env(["--env", "tests.envs:Counter"])
    prompt_ids = [worker.tokenizer.encode(p.text) for p in PROMPTS]
    with runner(worker) as local, EpisodeRunner(worker.engine, worker.tokenizer, EpisodeSettings(
            EnvironmentConfig(urls=[url]), max_turns=3, stop=("=",), max_model_len=64)) as remote:
        ours, _ = local.run(PROMPTS, prompt_ids, SEEDS, SAMPLING, 0)
        theirs, _ = remote.run(PROMPTS, prompt_ids, SEEDS, SAMPLING, 0)
    for a, b in zip((r for g in ours for r in g), (r for g in theirs for r in g)):
        assert list(a.response_ids) == list(b.response_ids) and list(a.model_mask) == list(b.model_mask)
        assert a.episode.turn_rewards == b.episode.turn_rewards and a.episode.turn_ends == b.episode.turn_ends
        assert a.text == b.text and a.finish_reason == b.finish_reason


def test_chat_observations_make_the_whole_conversations_tokens(tmp_path):
    """With `env.observation=chat`, the episode is the chat template's rendering of the whole conversation: the prompt
    rendered with a generation prompt, each turn as sampled (ended by the end-of-turn token), and each observation as
    a tool message, with no token re-encoded."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from cluster.demo.model import save_model_dir, tiny_qwen2_config
    from tests.unit.test_tools import QWEN25_TEMPLATE, chat_tokenizer

    built = chat_tokenizer(QWEN25_TEMPLATE)
    config = tiny_qwen2_config(len(built), max_position_embeddings=256)
    config.eos_token_id = config.bos_token_id = config.pad_token_id = built.eos_token_id
    torch.manual_seed(0)
    path = save_model_dir(Qwen2ForCausalLM(config), built, tmp_path / "chat")
    tokenizer = AutoTokenizer.from_pretrained(path)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                           add_generation_prompt=True)
    worker = RolloutWorker(EngineSettings(model_path=str(path), max_model_len=256), episodes=EpisodeSettings(
        EnvironmentConfig(spec="tests.envs:Counter", observation="chat"), max_turns=3, max_model_len=256))
    try:
        [group] = worker.generate([EpisodePrompt(prompt, "4")], [5], SamplingSettings(4, 120, temperature=1.0))
    finally:
        worker.shutdown()
    for r in group:
        ids = list(r.prompt_ids) + [int(t) for t in r.response_ids]
        runs = segments(r.model_mask)
        turns, observations = [], []
        for value, a, b in runs:
            (turns if value else observations).append(r.response_ids[a:b])
        # Rebuild the conversation: each turn's text (less its end-of-turn), each observation a tool message.
        messages = [{"role": "user", "content": "2+2?"}]
        for t, turn in enumerate(turns[:len(observations)]):
            turn = [int(x) for x in turn]
            closed = turn[-1] == end
            messages.append({"role": "assistant", "content": tokenizer.decode(turn[:-1] if closed else turn)})
            messages.append({"role": "tool", "content": f"{t}{t} "})
            if not closed:  # stopped at the length limit or eos inside a turn: the loop closed it for the template
                assert int(observations[t][0]) == end
        if observations:  # the text of the episode's tokens is the template's text of the conversation
            whole = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            upto = len(r.prompt_ids) + sum(len(x) for x in turns[:len(observations)]) + \
                sum(len(x) for x in observations)
            assert tokenizer.decode(ids[:upto]) == whole
            # (The model's own tokens need not be the canonical encoding of their text: a random model samples
            # bytes that BPE would merge. So the check is on text, and the ids are the engine's, never re-encoded.)
        assert list(r.prompt_ids) == tokenizer.encode(prompt, add_special_tokens=False)
    assert any(len(segments(r.model_mask)) >= 3 for r in group)  # some episode had an observation between turns


def test_a_long_observation_keeps_its_first_tokens_and_is_counted(worker):
    with runner(worker, max_observation_tokens=2) as episodes:
        groups, _ = episodes.run(PROMPTS[:1], [worker.tokenizer.encode("37+45=")], SEEDS[:1], SAMPLING, 0)
    for r in groups[0]:
        env_runs = [(a, b) for value, a, b in segments(r.model_mask) if value == 0]
        for t, (a, b) in enumerate(env_runs):  # "00 " -> "00"
            assert list(r.response_ids[a:b]) == worker.tokenizer.encode(f"{t}{t}", add_special_tokens=False)
        assert r.episode.truncated_observations == len(env_runs)

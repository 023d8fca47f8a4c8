"""OpenRLHF's remote reward protocol (docs/verifiers.md, "OpenRLHF's reward protocol"): what its two ends share.

`POST /get_reward {"query": [prompt+response, ...], "prompts": [...], "labels": [...]}` answers
`{"rewards": [...], "scores": [...], "extra_logs": {...}}`, one reward per query: what OpenRLHF's client
(`openrlhf/utils/agent.py`, `SingleTurnAgentExecutor._fetch_rewards_via_http`) sends and its reference server
(`openrlhf/cli/serve_rm.py`) answers.
Owns: the request's shape (`request_body`, what relay's client sends; `RewardRequest`, what the service reads),
turning a query back into the completion a relay verifier scores (`completion_of`, with the special tokens to
strip: `special_tokens_from` a tokenizer, or `DEFAULT_SPECIAL_TOKENS`), and the reply's body (`reward_reply`).
Imports only pydantic (transformers only when a tokenizer is named).
Does not own: the route and its HTTP plumbing (token, body limit, worker pool, deadlines), shared with `/verify` in
rewards/service.py; nor the client's sending and reading, `RemoteVerifier` with `protocol: openrlhf`
(rewards/remote.py).

Decisions:
- OpenRLHF sends the prompt and the response decoded together with their special tokens
  (`decode(..., skip_special_tokens=False)`): the completion is the query after its prompt, with every special
  token removed, which is the text relay's own rollouts give a verifier (vLLM's `skip_special_tokens=True`).
- A query that does not start with its prompt is scored whole (special tokens removed) and flagged in
  `extra_logs.prompt_mismatch`, rather than refused: OpenRLHF causes it itself (it cuts long prompts on the left;
  a tokenizer whose decode does not give the text back, e.g. `clean_up_tokenization_spaces`), its reference
  server scores whole queries anyway, and the protocol has no per-query error: OpenRLHF's client retries any 4xx
  five times and then leaves the sample without a reward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

DEFAULT_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", "<|endoftext|>",  # ChatML: Qwen, and others
    "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",  # Llama 3
    "<s>", "</s>",  # Llama 2, Mistral
    "<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>",  # Gemma
    "<|end|>",  # Phi-3
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",  # DeepSeek (R1 and its distilled models)
)
"""Stripped from a query's completion when the service has no `--tokenizer`."""


class RewardRequest(BaseModel):
    """Body of `POST /get_reward`. `prompts` and `labels` are optional (OpenRLHF's reference server reads only
    `query`); given, they hold one entry per query. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")
    query: list[str]
    prompts: list[str] | None = None
    labels: list[Any] | None = None

    def problem(self) -> str | None:
        """Why the lists do not line up (one line), or None."""
        for name, values in (("prompts", self.prompts), ("labels", self.labels)):
            if values is not None and len(values) != len(self.query):
                return f"{name} has {len(values)} entries for {len(self.query)} queries; send one per query"
        return None


def request_body(queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> dict[str, list]:
    """The body of one request, as OpenRLHF's client sends it: one query, prompt and label per sample."""
    return {"query": list(queries), "prompts": list(prompts), "labels": list(labels)}


def special_tokens_from(path: str) -> tuple[str, ...]:
    """The special tokens (`all_special_tokens`) of the tokenizer at `path` (a directory or a Hugging Face name);
    ValueError (one line) if it cannot be loaded."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:  # OSError, ValueError, ...: the user named the wrong thing
        raise ValueError(f"--tokenizer {path!r}: cannot load a tokenizer from it ({type(err).__name__}); give the "
                         "policy model's directory or Hugging Face name") from None
    return tuple(tokenizer.all_special_tokens)


def longest_first(tokens: Iterable[str]) -> tuple[str, ...]:
    """The distinct non-empty tokens, longest first: a token that contains another is removed whole before the
    shorter one could split it."""
    return tuple(sorted({t for t in tokens if t}, key=len, reverse=True))


def completion_of(query: str, prompt: str | None, special_tokens: Sequence[str]) -> tuple[str, bool]:
    """(the completion a verifier scores, whether the query started with its prompt).

    The completion is the query after `prompt` (the whole query when it does not start with it, or without a
    prompt), with each of `special_tokens` removed wherever it occurs; give them `longest_first`.
    """
    matched = prompt is not None and query.startswith(prompt)
    text = query[len(prompt):] if matched else query
    for token in special_tokens:
        text = text.replace(token, "")
    return text, matched


def reward_reply(rewards: list[float], mismatched: list[bool]) -> dict[str, Any]:
    """The body of a 200 reply: one reward per query, the same numbers as `scores` (OpenRLHF's dynamic filtering
    reads them), and per query 1.0 in `extra_logs.prompt_mismatch` where the query was scored whole."""
    return {"rewards": rewards, "scores": rewards,
            "extra_logs": {"prompt_mismatch": [1.0 if m else 0.0 for m in mismatched]}}

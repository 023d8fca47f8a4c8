"""OpenRLHF's remote reward protocol (docs/verifiers.md, "OpenRLHF's reward protocol"): what its two ends share.

`POST /get_reward {"query": [prompt+response, ...], "prompts": [...], "labels": [...]}` answers
`{"rewards": [...], "scores": [...], "extra_logs": {...}}`, one reward per query, as OpenRLHF's client
(`openrlhf/utils/agent.py`) sends and its reference server (`openrlhf/cli/serve_rm.py`) answers.
Owns: the request's shape (`request_body`, what relay's client sends; `RewardRequest`, what the service reads),
turning a query back into the completion a relay verifier scores (`completion_of`, and why: its docstring; the special
tokens to strip: `special_tokens_from` a tokenizer, or `DEFAULT_SPECIAL_TOKENS`), and the reply's body
(`reward_reply`). Imports only pydantic (transformers only when a tokenizer is named).
Does not own: the route and its HTTP plumbing (token, body limit, worker pool, deadlines), shared with `/verify` in
rewards/service.py; nor the client's sending and reading, `RemoteVerifier` with `protocol: openrlhf`
(rewards/remote.py).
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
    """The special tokens of the tokenizer at `path` (a directory or a Hugging Face name): its `all_special_tokens`
    and every added token marked special (Llama 3's `<|python_tag|>`), the tokens `decode(...,
    skip_special_tokens=True)` drops, as relay's rollouts do; ValueError (one line) if it cannot be loaded."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:  # OSError, ValueError, ...: the user named the wrong thing
        raise ValueError(f"--tokenizer {path!r}: cannot load a tokenizer from it ({type(err).__name__}); give the "
                         "policy model's directory or Hugging Face name") from None
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    return tuple(dict.fromkeys([*tokenizer.all_special_tokens, *(token.content for token in added if token.special)]))


def longest_first(tokens: Iterable[str]) -> tuple[str, ...]:
    """The distinct non-empty tokens, longest first: a token that contains another is removed whole before the
    shorter one could split it."""
    return tuple(sorted({t for t in tokens if t}, key=len, reverse=True))


def completion_of(query: str, prompt: str | None, special_tokens: Sequence[str]) -> tuple[str, bool]:
    """(the completion a verifier scores, whether the query started with its prompt as sent).

    Each of `special_tokens` (give them `longest_first`) is removed from the query and the prompt wherever it
    occurs; the completion is the query after the prompt. A query that does not start with its prompt (a tokenizer
    cleaned up its spaces; OpenRLHF cut it on the left) starts with an end of it: compared without spaces, the
    longest end of the prompt that starts the query is its prompt (`_prompt_end`), and the completion follows it.
    Without a prompt the whole query is the completion (and did not start with its prompt). A query that starts with
    no end of its prompt is a ValueError: the prompt's text is never scored as an answer.

    Why: OpenRLHF sends the prompt and the response decoded together with their special tokens (`decode(...,
    skip_special_tokens=False)`); without them the completion is the text relay's own rollouts give a verifier
    (vLLM's `skip_special_tokens=True`). A query that does not start with its prompt is OpenRLHF's doing (a BOS
    before the prompt; a decode that does not give the text back, e.g. `clean_up_tokenization_spaces`; prompts cut on
    the left), and the whole query would score the prompt's text as the answer (`numeric_match` reads its numbers):
    the service flags it in `extra_logs.prompt_mismatch`, and reports a ValueError as that query's failure (the
    route's to report, rewards/service.py), never as a reward.
    """
    for token in special_tokens:
        query = query.replace(token, "")
        prompt = prompt.replace(token, "") if prompt is not None else None
    if prompt is None:
        return query, False
    if query.startswith(prompt):
        return query[len(prompt):], True
    end = _prompt_end(query, prompt)
    if end is None:
        raise ValueError("the query does not start with its prompt nor with any end of it (special tokens and "
                         "spaces aside); send each query as its prompt followed by the response")
    return query[end:], False


def _prompt_end(query: str, prompt: str) -> int | None:
    """Where the prompt ends in `query`, or None: the longest end of `prompt` that starts `query`, both compared
    without spaces (U+0020: clean-up and SentencePiece add or drop them) and the query without the replacement
    characters a cut through a character leaves; then as many of the query's spaces as the prompt ends with."""
    text = query.lstrip("\ufffd")
    kept = [i for i, c in enumerate(text) if c != " "]  # where each compared character of the query is
    head, tail = "".join(text[i] for i in kept), prompt.replace(" ", "")
    if not tail:
        matched = 0
    else:
        matched = _longest_end_starting(tail, head[:len(tail)])
        if matched == 0:
            return None
    end = len(query) - len(text) + (kept[matched - 1] + 1 if matched else 0)
    spaces = len(prompt) - len(prompt.rstrip(" "))
    while spaces and query[end:end + 1] == " ":
        end, spaces = end + 1, spaces - 1
    return end


def _longest_end_starting(text: str, start: str) -> int:
    """The length of the longest end (suffix) of `text` that is a beginning (prefix) of `start`: Knuth-Morris-Pratt,
    `start` as the pattern run over `text`, linear in both."""
    fail, k = [0] * len(start), 0  # fail[i]: the longest proper prefix of start[:i + 1] that also ends it
    for i in range(1, len(start)):
        while k and start[i] != start[k]:
            k = fail[k - 1]
        k += start[i] == start[k]
        fail[i] = k
    k = 0
    for c in text:
        while k and (k == len(start) or c != start[k]):
            k = fail[k - 1]
        k += k < len(start) and c == start[k]
    return k


def reward_reply(rewards: list[float], mismatched: list[bool]) -> dict[str, Any]:
    """The body of a 200 reply: one reward per query, the same numbers as `scores` (OpenRLHF's dynamic filtering
    reads them), and per query 1.0 in `extra_logs.prompt_mismatch` where the query did not start with its prompt as
    sent (`completion_of`)."""
    return {"rewards": rewards, "scores": rewards,
            "extra_logs": {"prompt_mismatch": [1.0 if m else 0.0 for m in mismatched]}}

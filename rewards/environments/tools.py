"""Tool calling for chat models: tool calls read from the model's text, an environment that runs them, and the token
ids of a tool's answer in the chat template's own format (docs/environments.md, "Tool calling through the chat
template").

Owns: `ToolCall`, `parse_tool_calls` (the Hermes / Qwen2.5 format) and `ToolCallError`; `load_tools` (`package.module:
function` specs -> functions by name) and `tool_schemas` (their JSON schemas, for `apply_chat_template(..., tools=
...)`); `ToolEnvironment` (runs the calls, scores the final answer; a model's mistake is an observation, a broken
setup raises); `ChatObservations` and `end_of_turn_id` (an observation as the token ids that follow a model's turn,
rendered by the tokenizer's chat template, earlier turns never re-encoded); `calculate`, an example tool.
Does not own: the episode loop (generation, stop tokens, masking, `rollout.max_turns`, counting `env/invalid_calls`
from `info`), the environment interface (rewards/environments/interface.py), verifiers (rewards/verifiers.py).
"""

from __future__ import annotations

import ast
import inspect
import json
import logging
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rewards.environments.interface import StepResult
from rewards.registry import load_verifier
from rewards.specs import import_spec

log = logging.getLogger(__name__)

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_CALL_FORMAT = '<tool_call>\\n{"name": <tool name>, "arguments": {<argument>: <value>, ...}}\\n</tool_call>'

Tools = str | Sequence[str | Callable[..., Any]]
"""Tools as configured: `"pkg.mod:fn, pkg.mod:other"`, or a list of such specs (or of functions, from Python)."""


# ---------------------------------------------------------------- parsing


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: `name(**arguments)`."""

    name: str
    arguments: dict[str, Any]


class ToolCallError(ValueError):
    """A tool call in the model's text cannot be read; the message is one line and says what is wrong."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in `text`, in order: each a `<tool_call>` ... `</tool_call>` block holding a JSON object
    `{"name": str, "arguments": object}` (Hermes' format, which Qwen2.5's and Qwen3's chat templates use).

    Text outside the blocks is ignored, and whitespace around the JSON too. `arguments` may be missing (no
    arguments) or a JSON string that holds an object (some models write it so). Raises `ToolCallError` for an
    unclosed `<tool_call>`, a `</tool_call>` without its opening tag, a body that is not a JSON object, a missing
    or empty name, a key other than `name` and `arguments`, or arguments that are not an object.
    """
    calls: list[ToolCall] = []
    position = 0
    while True:
        start, stray = text.find(_OPEN, position), text.find(_CLOSE, position)
        if stray != -1 and (start == -1 or stray < start):
            raise ToolCallError(f"{_CLOSE} without {_OPEN} after tool call {len(calls)}; write {_CALL_FORMAT}")
        if start == -1:
            return calls
        body_start = start + len(_OPEN)
        end, nested = text.find(_CLOSE, body_start), text.find(_OPEN, body_start)
        if end == -1 or (nested != -1 and nested < end):
            raise ToolCallError(f"tool call {len(calls) + 1}: {_OPEN} is not closed by {_CLOSE}")
        calls.append(_parse_call(text[body_start:end], len(calls) + 1))
        position = end + len(_CLOSE)


def _parse_call(body: str, number: int) -> ToolCall:
    where = f"tool call {number}"
    try:
        value = json.loads(body)  # surrounding whitespace is allowed by JSON
    except json.JSONDecodeError as error:
        raise ToolCallError(f"{where} is not JSON ({error.msg} at char {error.pos}); write {_CALL_FORMAT}") \
            from error
    if not isinstance(value, dict):
        raise ToolCallError(f"{where} is a JSON {_json_kind(value)}, not an object; write {_CALL_FORMAT}")
    unexpected = [key for key in value if key not in ("name", "arguments")]
    if unexpected:
        raise ToolCallError(f"{where} has an unexpected key {unexpected[0]!r}; write {_CALL_FORMAT}")
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolCallError(f"{where} has no name (a non-empty string under \"name\")")
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise ToolCallError(f"{where}: arguments is a string that is not JSON ({error.msg})") from error
    if not isinstance(arguments, dict):
        raise ToolCallError(f"{where}: arguments is a JSON {_json_kind(arguments)}, not an object")
    return ToolCall(name.strip(), arguments)


def _json_kind(value: Any) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", dict: "object"}
    return kinds.get(type(value), "null")


# ---------------------------------------------------------------- tools


def load_tools(tools: Tools) -> dict[str, Callable[..., Any]]:
    """The functions `tools` names, by their `__name__` (the name the model calls and `tool_schemas` gives).

    Every problem (no tool, a malformed spec, a module that does not import, a missing attribute, something not
    callable, two tools of one name) is a one-line `ValueError`.
    """
    specs = [part.strip() for part in tools.split(",")] if isinstance(tools, str) else list(tools)
    if not specs or any(spec == "" for spec in specs):
        raise ValueError(f"tools {tools!r}: give one or more 'package.module:function', separated by commas")
    table: dict[str, Callable[..., Any]] = {}
    for spec in specs:
        fn = spec if callable(spec) else _resolve_function(spec)
        name = getattr(fn, "__name__", None)
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"tool {spec!r} has no function name (__name__): use a plain function")
        if name in table:
            raise ValueError(f"two tools are named {name!r}: the model calls tools by name, rename one")
        table[name] = fn
    return table


def _resolve_function(spec: str) -> Callable[..., Any]:
    fn = import_spec(spec, "tool", "function")
    attr_path = spec.partition(":")[2]
    if not callable(fn):
        raise ValueError(f"tool {spec!r}: {attr_path!r} is a {type(fn).__name__}, not a function")
    return fn


def tool_schemas(tools: Tools) -> list[dict[str, Any]]:
    """OpenAI-style function schemas of `tools` (`{"type": "function", "function": {"name", "description",
    "parameters"}}`), built by transformers' `get_json_schema` from each function's type hints and Google-style
    docstring (a summary line, and an `Args:` section describing every parameter). Pass them as
    `tokenizer.apply_chat_template(messages, tools=tool_schemas(...), ...)` to list the tools in the prompt.
    A function without hints or descriptions is a one-line `ValueError` naming it."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    schemas = []
    for name, fn in load_tools(tools).items():
        try:
            schemas.append(get_json_schema(fn))
        except (DocstringParsingException, TypeHintParsingException) as error:
            raise ValueError(f"tool {name!r}: no JSON schema ({error}); give every parameter a type hint and a "
                             "Google-style docstring with an 'Args:' line for it") from error
    return schemas


class _InvalidCall(Exception):
    """A call the model got wrong; its message (one line) is shown to the model."""


class ToolEnvironment:
    """An environment whose actions are tool calls and, at the end, an answer.

    A turn with tool calls runs them (`function(**arguments)`). Its observation is the result: a string as it is,
    anything else as JSON (`str(result)` if it is not JSON-able); several calls give one JSON array of their
    results, in order. Reward 0.0, not done, `info={"tool_calls": n}`. A call the model got wrong (malformed, an
    unknown tool, arguments the function does not take, a tool that raises) answers `error: ...` in its place and
    sets `info["invalid_call"] = True`; the other calls of the turn still run, and the episode goes on.
    A turn without a tool call is the final answer: reward `verifier(action.strip(), label)`, done.
    At most `max_calls` calls per episode (a malformed turn counts as one): the turn that would go past ends the
    episode, reward 0.0, `info["max_calls_exceeded"] = True`, its calls not run.

    tools: `"pkg.mod:fn, pkg.mod:other"` or a list of specs (`load_tools`). verifier: a name in relay's verifier
    registry or `package.module:function`, with `verifier_params` (`load_verifier`).
    """

    def __init__(self, tools: Tools, verifier: str = "exact_match", max_calls: int = 4,
                 verifier_params: Mapping[str, Any] | None = None):
        if max_calls < 1:
            raise ValueError(f"ToolEnvironment: max_calls must be at least 1 (got {max_calls})")
        self.tools = load_tools(tools)
        self.signatures = {name: inspect.signature(fn) for name, fn in self.tools.items()}
        self.verify = load_verifier(verifier, verifier_params)
        self.max_calls = max_calls
        self.label: Any = None
        self.calls = 0

    def reset(self, prompt: str, label: Any) -> str:
        self.label, self.calls = label, 0
        return ""

    def step(self, action: str) -> StepResult:
        try:
            calls = parse_tool_calls(action)
        except ToolCallError as error:
            if self._over_limit(1):
                return self._limit_reached()
            return StepResult(f"error: {error}", info={"tool_calls": 0, "invalid_call": True})
        if not calls:
            return StepResult("", reward=float(self.verify(action.strip(), self.label)), done=True,
                              info={"tool_calls": 0})
        if self._over_limit(len(calls)):
            return self._limit_reached()
        results, invalid = [], False
        for call in calls:
            try:
                results.append(self._run(call))
            except _InvalidCall as error:
                results.append(f"error: {error}")
                invalid = True
        observation = _result_text(results[0]) if len(results) == 1 else \
            json.dumps([_jsonable(result) for result in results], ensure_ascii=False)
        info: dict[str, Any] = {"tool_calls": len(calls)}
        if invalid:
            info["invalid_call"] = True
        return StepResult(observation, info=info)

    def _over_limit(self, calls: int) -> bool:
        self.calls += calls
        return self.calls > self.max_calls

    def _limit_reached(self) -> StepResult:
        return StepResult(f"error: more than {self.max_calls} tool calls", reward=0.0, done=True,
                          info={"tool_calls": 0, "max_calls_exceeded": True})

    def _run(self, call: ToolCall) -> Any:
        fn = self.tools.get(call.name)
        if fn is None:
            raise _InvalidCall(f"unknown tool {call.name!r}; the tools are {', '.join(self.tools)}")
        try:
            self.signatures[call.name].bind(**call.arguments)
        except TypeError as error:
            raise _InvalidCall(f"{call.name}: {error}") from error
        try:
            return fn(**call.arguments)
        except Exception as error:  # the model's arguments made the tool fail: it sees why and may retry
            log.debug("tool %r raised on %r", call.name, call.arguments, exc_info=True)
            message = str(error).strip().splitlines()
            raise _InvalidCall(f"{call.name} raised {type(error).__name__}"
                               + (f": {message[0]}" if message else "")) from error


def _jsonable(value: Any) -> Any:
    """`value` if JSON can hold it, else `str(value)`."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def _result_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(_jsonable(value), ensure_ascii=False)


# ---------------------------------------------------------------- an example tool

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPRESSION_CHARS = 200
_MAX_DIGITS = 100  # |value| < 10**100: no result, nor a power on the way to it, costs more than a few digits


def calculate(expression: str) -> int | float:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression, for example "2 * (3 + 4) / 7".
    """
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")  # parsed, never evaluated by Python: no eval
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from error
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex, str
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(left) > 1 and right * math.log10(abs(left)) >= _MAX_DIGITS:
            raise ValueError(f"{left} ** {right} has more than {_MAX_DIGITS} digits")  # checked before computing it
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ValueError(f"unsupported {type(node).__name__} in an arithmetic expression: use numbers, + - * / // % ** "
                     "and parentheses")


def _bounded(value: Any) -> int | float:
    if not isinstance(value, (int, float)):  # e.g. (-8) ** 0.5 is complex
        raise ValueError(f"the result {value} is not a real number")
    if abs(value) >= 10**_MAX_DIGITS:  # also inf: a float beyond 1e100 is refused before it overflows
        raise ValueError(f"a number has more than {_MAX_DIGITS} digits")
    return value


# ---------------------------------------------------------------- observations as token ids

# Probe contents: unlikely in any template's own text, so the first match is the message's.
_PROBE_USER = "relay probe: the user's question"
_PROBE_ASSISTANT = "relay probe: the assistant's answer"
_PROBE_NEXT_USER = "relay probe: the next question"
_PROBE_OBSERVATION = "relay probe: the observation"


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool,
            template_kwargs: Mapping[str, Any]) -> str:
    import jinja2

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template: tool calling through the chat "
                         "template needs a chat model's tokenizer")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **template_kwargs)
    except jinja2.TemplateError as error:
        roles = "/".join(message["role"] for message in messages)
        raise ValueError(f"the chat template cannot render the conversation {roles} ({error})") from error


@dataclass(frozen=True)
class _TurnEnd:
    head: str
    """A rendered [user, assistant] conversation up to and including the assistant's end-of-turn token."""
    end_of_turn_id: int


def _turn_end(tokenizer: Any, template_kwargs: Mapping[str, Any]) -> _TurnEnd:
    """Where the template ends an assistant turn: the first token it writes after the assistant's content.

    The assistant's turn is rendered followed by a user turn, never last: some templates render the last assistant
    turn differently (Qwen3 adds an empty <think> block to it), which is not how a turn looks once followed.
    """
    messages = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT},
                {"role": "user", "content": _PROBE_NEXT_USER}]
    reference = _render(tokenizer, messages, False, template_kwargs)
    at = reference.find(_PROBE_ASSISTANT)
    if at == -1:
        raise ValueError("the chat template does not render an assistant message's content as it is")
    after = reference[at + len(_PROBE_ASSISTANT):]
    ids = tokenizer.encode(after, add_special_tokens=False)
    added = tokenizer.added_tokens_decoder  # id -> AddedToken: split off before the model's own tokenization
    if not ids or ids[0] not in added or not after.startswith(added[ids[0]].content):
        raise ValueError(f"the chat template does not end an assistant turn with a special token right after its "
                         f"content (it writes {after[:40]!r}); tool calling needs one, as Qwen's <|im_end|>")
    return _TurnEnd(reference[: at + len(_PROBE_ASSISTANT) + len(added[ids[0]].content)], ids[0])


def end_of_turn_id(tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None) -> int:
    """The token that ends a model's turn in the tokenizer's chat template (`<|im_end|>` for Qwen, `<|eot_id|>` for
    Llama 3): the first token the template writes after an assistant message's content, which must be an added
    (special) token. Not always the tokenizer's eos token (Qwen2.5 base models: eos `<|endoftext|>`). The loop
    generates with it as a stop token, and it must end each turn before `ChatObservations.ids` is appended."""
    return _turn_end(tokenizer, dict(template_kwargs or {})).end_of_turn_id


class ChatObservations:
    """An environment's observation as the token ids that follow a model's turn, in the chat template's format.

    `ids(observation)` is what goes after the turn's end-of-turn token (`end_of_turn_id`): the rest of the template's
    rendering of a `{"role": role, "content": observation}` message after the assistant turn, then the generation
    prompt of the next assistant turn. For Qwen2.5 and role "tool": `\\n<|im_start|>user\\n<tool_response>\\n{obs}
    \\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`. So prompt ids + each turn's sampled ids (ending with
    the end-of-turn token) + `ids(observation)` + ... equals the tokenization of the whole conversation rendered at
    once, and no earlier turn is ever re-encoded.

    How: per observation, render [user, assistant, observation] with the generation prompt, check it starts with a
    [user, assistant] rendering up to the end-of-turn token (computed once, here), and tokenise only the rest. The
    rest begins after a special token, so it tokenises as it would inside the whole conversation.
    template_kwargs: passed to `apply_chat_template` (e.g. `{"enable_thinking": False}` for Qwen3, `tools`); use the
    same as for the prompt. Raises a one-line `ValueError` for a tokenizer without a chat template, a template that
    fails on or drops `role` messages, or one whose rendering of earlier turns changes when an observation follows.
    """

    def __init__(self, tokenizer: Any, role: str = "tool", template_kwargs: Mapping[str, Any] | None = None):
        self.tokenizer, self.role = tokenizer, role
        self.template_kwargs = dict(template_kwargs or {})
        turn_end = _turn_end(tokenizer, self.template_kwargs)
        self.end_of_turn_id = turn_end.end_of_turn_id
        self._head = turn_end.head
        if _PROBE_OBSERVATION not in self.text(_PROBE_OBSERVATION):
            raise ValueError(f"the chat template drops {role!r} messages: choose a role it renders (e.g. 'tool' or "
                             "'user')")

    def text(self, observation: str) -> str:
        """The text whose tokens `ids(observation)` returns."""
        messages = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT},
                    {"role": self.role, "content": observation}]
        full = _render(self.tokenizer, messages, True, self.template_kwargs)
        if not full.startswith(self._head):
            raise ValueError(f"the chat template renders the turns before a {self.role!r} message differently once it "
                             "follows, so its tokens cannot be appended to the episode's: choose another role")
        return full[len(self._head):]

    def ids(self, observation: str) -> list[int]:
        """The token ids to append after a turn that ended with `end_of_turn_id`: the observation as a `role` message
        and the next assistant turn's generation prompt."""
        return self.tokenizer.encode(self.text(observation), add_special_tokens=False)

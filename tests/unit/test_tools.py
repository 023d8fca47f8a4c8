"""Tool calling for chat models (rewards/environments/tools.py): parsing Hermes-style `<tool_call>` blocks, the
`ToolEnvironment` (calls run, mistakes shown to the model and flagged, the call limit, the final answer scored),
`tool_schemas`, the safe `calculate`, and `ChatObservations`: prompt ids + sampled turn ids + observation ids equal
the tokenization of the whole conversation rendered at once (token in, token out).

No hub: the tokenizer is a byte-level BPE built here with Qwen2.5's special tokens and a chat template written in
the style of Qwen2.5's (tool messages as `<tool_response>` blocks inside a user turn, tools in the system prompt).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rewards.environments.interface import InProcessEnvironments, StepResult, load_environment
from rewards.environments.tools import (
    ChatObservations,
    ToolCall,
    ToolCallError,
    ToolEnvironment,
    calculate,
    end_of_turn_id,
    load_tools,
    parse_tool_calls,
    tool_schemas,
)

# ---------------------------------------------------------------- tools the tests load by spec


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def weather(city: str) -> dict:
    """The weather in a city.

    Args:
        city: The city's name.
    """
    return {"city": city, "celsius": 21}


def undocumented(a: int) -> int:
    return a


COUNTED: list[str] = []


def counted(tag: str) -> str:
    """Records its call.

    Args:
        tag: Any text.
    """
    COUNTED.append(tag)
    return tag


HERE = __name__  # the name pytest imported this module under: specs below resolve to these very functions
TOOLS = f"{HERE}:add, {HERE}:weather, rewards.environments.tools:calculate"


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# ---------------------------------------------------------------- a local tokenizer with a Qwen2.5-style template

QWEN25_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call these functions, whose signatures are within <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nCall one as:\n<tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# As Qwen3's: the last assistant turn after the last real user message gets an empty <think> block, and
# `enable_thinking=False` puts one in the generation prompt.
QWEN3_TEMPLATE = QWEN25_TEMPLATE.replace(
    "{%- for message in messages %}",
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}",
).replace(
    "{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}",
    "{{- '<|im_start|>assistant\\n' }}{%- if loop.last and loop.index0 > ns.last_query %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{{- message.content + '<|im_end|>\\n' }}",
).replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}",
)


@functools.cache
def chat_tokenizer(chat_template: str | None = QWEN25_TEMPLATE) -> PreTrainedTokenizerFast:
    """A byte-level BPE: one token per byte plus a few merges (so that where a text is cut changes its tokens),
    Qwen2.5's special tokens (`<tool_call>` added but not special, as Qwen2.5's), and eos `<|endoftext|>`, as a
    Qwen2.5 base model's: the end of a turn is `<|im_end|>`, which is not eos."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # printable stand-ins for the 256 bytes: "\n" -> "Ċ"
    merges = [("Ċ", "<"), (">", "Ċ"), ("t", "o"), ("to", "o"), ("too", "l"), ("Ċ", "Ċ")]
    vocab = {char: i for i, char in enumerate(alphabet)}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True)
                                for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    backend.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>", unk_token=None, clean_up_tokenization_spaces=False)
    tokenizer.chat_template = chat_template
    return tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


# ---------------------------------------------------------------- parse_tool_calls


def test_parse_reads_one_call_and_ignores_text_around_it():
    text = 'I will add them.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 2, "b": 3})]


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
    '<tool_call>\n\n  {"name" : "add",\n "arguments": {"a": 2,\n "b": 3}}  \t\n</tool_call>\n',
    '<tool_call>\n{"name": " add ", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}\n</tool_call>',  # arguments as a string
])
def test_parse_is_robust_to_whitespace_and_string_arguments(text):
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 2, "b": 3})]


def test_parse_reads_several_calls_in_order_and_none():
    now = '<tool_call>{"name": "now"}</tool_call>'  # a call without arguments may leave them out
    text = f"first {call('add', a=1, b=2)} then\n{call('weather', city='Paris')}\n{now}"
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("weather", {"city": "Paris"}),
                                      ToolCall("now", {})]
    assert parse_tool_calls("The answer is 5.") == []
    assert parse_tool_calls("") == []


@pytest.mark.parametrize("text, problem", [
    ('<tool_call>\n{"name": "add", "arguments": {}}', "tool call 1: <tool_call> is not closed by </tool_call>"),
    (f'{call("add")}<tool_call>{{"name": "add"}}', "tool call 2: <tool_call> is not closed"),
    ('<tool_call>{"name": "a"}<tool_call>{"name": "b"}</tool_call>', "tool call 1: <tool_call> is not closed"),
    ('{"name": "add"}</tool_call>', "</tool_call> without <tool_call> after tool call 0"),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', "tool call 1 is not JSON"),
    ("<tool_call></tool_call>", "tool call 1 is not JSON (Expecting value at char 0)"),
    ('<tool_call>["add", {"a": 1}]</tool_call>', "tool call 1 is a JSON array, not an object"),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', "tool call 1 has no name"),
    ('<tool_call>{"name": "  ", "arguments": {}}</tool_call>', "tool call 1 has no name"),
    ('<tool_call>{"name": 7, "arguments": {}}</tool_call>', "tool call 1 has no name"),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "tool call 1: arguments is a JSON array"),
    ('<tool_call>{"name": "add", "arguments": null}</tool_call>', "tool call 1: arguments is a JSON null"),
    ('<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>',
     "tool call 1: arguments is a string that is not JSON (Expecting value)"),
    ('<tool_call>{"name": "add", "arguments": "[1]"}</tool_call>', "tool call 1: arguments is a JSON array"),
    ('<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>',
     "tool call 1 has an unexpected key 'parameters'"),
])
def test_parse_rejects_malformed_calls_in_one_line(text, problem):
    with pytest.raises(ToolCallError, match="^" + re.escape(problem)) as caught:
        parse_tool_calls(text)
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------- ToolEnvironment


def env(label="5", **kwargs) -> ToolEnvironment:
    environment = ToolEnvironment(kwargs.pop("tools", TOOLS), **kwargs)
    assert environment.reset("What is 2+3?", label) == ""
    return environment


def test_a_tool_call_runs_the_function_and_answers_its_result():
    environment = env()
    assert environment.step("Let me add.\n" + call("add", a=2, b=3)) == StepResult("5", 0.0, False, {"tool_calls": 1})
    assert environment.step(call("calculate", expression="2 * (3 + 4) / 7")) == \
        StepResult("2.0", 0.0, False, {"tool_calls": 1})
    # a result that is not a string is JSON
    assert environment.step(call("weather", city="Paris")).observation == '{"city": "Paris", "celsius": 21}'


def test_several_calls_answer_a_json_array_of_their_results_in_order():
    environment = env()
    result = environment.step(call("add", a=1, b=2) + "\n" + call("weather", city="Oslo") + call("calculate",
                                                                                                expression="7*6"))
    assert result == StepResult('[3, {"city": "Oslo", "celsius": 21}, 42]', 0.0, False, {"tool_calls": 3})


@pytest.mark.parametrize("action, observation", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',
     "error: tool call 1 is not JSON (Expecting property name enclosed in double quotes at char 37); write "),
    (call("sub", a=1, b=2), "error: unknown tool 'sub'; the tools are add, weather, calculate"),
    (call("add", a=1), "error: add: missing a required argument: 'b'"),
    (call("add", a=1, b=2, c=3), "error: add: got an unexpected keyword argument 'c'"),
    (call("calculate", expression="1 / 0"), "error: calculate raised ZeroDivisionError: division by zero"),
    (call("calculate", expression="__import__('os').system('ls')"),
     "error: calculate raised ValueError: unsupported Call in an arithmetic expression"),
])
def test_a_call_the_model_got_wrong_is_an_error_observation_and_the_episode_goes_on(action, observation):
    result = env().step(action)
    assert result.observation.startswith(observation) and "\n" not in result.observation
    assert (result.reward, result.done, result.info["invalid_call"]) == (0.0, False, True)


def test_one_wrong_call_among_several_leaves_the_others_run():
    result = env().step(call("add", a=1, b=2) + call("nope") + call("add", a=3, b=4))
    assert json.loads(result.observation) == [3, "error: unknown tool 'nope'; the tools are add, weather, calculate", 7]
    assert result.info == {"tool_calls": 3, "invalid_call": True}


def test_the_call_that_goes_past_max_calls_ends_the_episode_unrun():
    COUNTED.clear()
    environment = env(tools=[counted], max_calls=3)
    assert environment.step(call("counted", tag="a")).done is False
    assert environment.step("<tool_call>oops</tool_call>").info == {"tool_calls": 0, "invalid_call": True}  # counts 1
    result = environment.step(call("counted", tag="b") + call("counted", tag="c"))  # 1 + 1 + 2 > 3
    assert result == StepResult("error: more than 3 tool calls", 0.0, True,
                                {"tool_calls": 0, "max_calls_exceeded": True})
    assert COUNTED == ["a"]
    environment.reset("again", None)  # a new episode counts from zero
    assert [environment.step(call("counted", tag=t)).done for t in "xyz"] == [False, False, False]
    assert environment.step("<tool_call>").done is True


def test_a_turn_without_a_tool_call_is_the_final_answer_scored_by_the_verifier():
    environment = env(label=5)
    assert environment.step(call("add", a=2, b=3)).done is False
    assert environment.step("  5\n") == StepResult("", 1.0, True, {"tool_calls": 0})
    assert env(label=5).step("6") == StepResult("", 0.0, True, {"tool_calls": 0})
    environment = env(verifier="numeric_match", verifier_params={"tolerance": 0.01}, label="5")
    assert environment.step("The sum is 5.001").reward == 1.0


def test_an_episode_runs_through_the_interface_loaded_by_spec():
    factory = load_environment("rewards.environments.tools:ToolEnvironment",
                               {"tools": TOOLS, "verifier": "exact_match", "max_calls": 2})

    async def play() -> list[StepResult]:
        session = environments.open()
        await session.reset("What is 2+3?", 5)
        try:
            return [await session.step(action) for action in (call("add", a=2, b=3), call("x"), "5")]
        finally:
            await session.close()

    with InProcessEnvironments(factory, max_concurrency=2) as environments:
        results = asyncio.run(play())  # each StepResult passed the interface's checks (types, JSON-able info)
    assert [(r.observation[:19], r.reward, r.done) for r in results] == \
        [("5", 0.0, False), ("error: unknown tool", 0.0, False), ("", 1.0, True)]


@pytest.mark.parametrize("kwargs, problem", [
    ({"tools": "add"}, "tool 'add' is not of the form 'package.module:function'"),
    ({"tools": ""}, "tools '': give one or more 'package.module:function'"),
    ({"tools": f"{HERE}:add,"}, "give one or more"),
    ({"tools": "no_such_module_xyz:add"}, "tool 'no_such_module_xyz:add': cannot import module"),
    ({"tools": f"{HERE}:sub"}, f"tool '{HERE}:sub': module '{HERE}' has no attribute 'sub'"),
    ({"tools": f"{HERE}:HERE"}, "'HERE' is a str, not a function"),
    ({"tools": [add, f"{HERE}:add"]}, "two tools are named 'add'"),
    ({"tools": [functools.partial(add, 1)]}, "has no function name"),
    ({"verifier": "nope"}, "unknown verifier 'nope'"),
    ({"max_calls": 0}, "max_calls must be at least 1"),
])
def test_a_bad_setup_is_a_one_line_error_at_construction(kwargs, problem):
    with pytest.raises(ValueError) as caught:
        ToolEnvironment(**{"tools": TOOLS} | kwargs)
    assert problem in str(caught.value) and "\n" not in str(caught.value)


# ---------------------------------------------------------------- tool_schemas and calculate


def test_tool_schemas_describe_the_functions_and_go_into_the_prompt():
    schemas = tool_schemas(f"{HERE}:add, rewards.environments.tools:calculate")
    assert schemas[0] == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first integer."},
                                                        "b": {"type": "integer", "description": "The second integer."}},
                       "required": ["a", "b"]},
        "return": {"type": "integer"}}}
    assert schemas[1]["function"]["name"] == "calculate"
    assert schemas[1]["function"]["parameters"]["required"] == ["expression"]
    assert load_tools([add, calculate]) == {"add": add, "calculate": calculate}
    prompt = render(chat_tokenizer(), [{"role": "user", "content": "2+3?"}], tools=schemas, add_generation_prompt=True)
    assert json.dumps(schemas[0]) in prompt and prompt.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="^tool 'undocumented': no JSON schema .*no docstring"):
        tool_schemas([undocumented])


@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("7 / 2", 3.5), ("7 // 2", 3), ("-7 % 3", 2), ("2 ** 10", 1024),
    ("2 ** -1", 0.5), ("  -(1.5) + +2 ", 0.5), ("10 ** 99", 10**99),
])
def test_calculate_evaluates_arithmetic(expression, value):
    result = calculate(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize("expression, problem", [
    ("9 ** 9 ** 9", "has more than 100 digits"),  # refused before computing it
    ("10 ** 100", "has more than 100 digits"),
    ("10 ** 50 * 10 ** 50", "a number has more than 100 digits"),
    ("1e308 * 10", "a number has more than 100 digits"),
    ("(-8) ** 0.5", "is not a real number"),
    ("True + 1", "unsupported Constant"),
    ("x + 1", "unsupported Name"),
    ("(1).__class__", "unsupported Attribute"),
    ("abs(-1)", "unsupported Call"),
    ("1 +", "not an arithmetic expression"),
    ("1" * 201, "longer than 200 characters"),
])
def test_calculate_refuses_anything_but_small_arithmetic(expression, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")):
        calculate(expression)


# ---------------------------------------------------------------- ChatObservations: token in, token out

OBSERVATIONS = ["5", "", "line one\nline two\n", "  spaces around  ", '{"city": "Oslo", "celsius": 21}',
                "unicode: é ü ✓ 😀", "<tool_call> and </tool_response> inside", "\n\n"]


def test_an_observation_is_the_tool_message_and_the_next_generation_prompt():
    tokenizer = chat_tokenizer()
    observations = ChatObservations(tokenizer)
    assert observations.text("5") == \
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert observations.ids("5") == encode(tokenizer, observations.text("5"))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert observations.end_of_turn_id == end_of_turn_id(tokenizer) == im_end != tokenizer.eos_token_id
    assert observations.ids("5")[0] == encode(tokenizer, "\n")[0]  # starts after <|im_end|>, never repeats it
    user = ChatObservations(tokenizer, role="user")
    assert user.text("higher") == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("template, template_kwargs", [
    (QWEN25_TEMPLATE, {}),
    (QWEN25_TEMPLATE, {"tools": [add, calculate]}),
    (QWEN3_TEMPLATE, {}),
])
@pytest.mark.parametrize("observation", OBSERVATIONS)
def test_prompt_turn_and_observation_ids_are_the_whole_conversations_tokens(template, template_kwargs, observation):
    tokenizer = chat_tokenizer(template)
    observations = ChatObservations(tokenizer, template_kwargs=template_kwargs)
    messages = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 2+3, twice?"}]
    ids = encode(tokenizer, render(tokenizer, messages, add_generation_prompt=True, **template_kwargs))
    turns = [call("add", a=2, b=3), "Now the second.\n" + call("add", a=5, b=5)]
    for turn in turns:  # as the loop: the sampled turn ends with the end-of-turn token, the observation follows
        ids += encode(tokenizer, turn) + [observations.end_of_turn_id] + observations.ids(observation)
        messages += [{"role": "assistant", "content": turn}, {"role": "tool", "content": observation}]
    whole = render(tokenizer, messages, add_generation_prompt=True, **template_kwargs)
    assert ids == encode(tokenizer, whole)
    assert tokenizer.decode(ids, skip_special_tokens=False) == whole


def test_qwen3s_last_assistant_turn_is_rendered_differently_which_is_why_the_probe_turn_is_followed():
    tokenizer = chat_tokenizer(QWEN3_TEMPLATE)
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    alone = render(tokenizer, messages)
    followed = render(tokenizer, messages + [{"role": "tool", "content": "z"}], add_generation_prompt=True)
    assert "<think>" in alone and not followed.startswith(alone)
    assert ChatObservations(tokenizer).text("z") == followed.split("y<|im_end|>", 1)[1]
    # template_kwargs reach the template: the next turn's generation prompt holds the empty <think> block (so the
    # episode's tokens differ from a re-rendering, in which Qwen3 drops it: the reason to append, never re-render)
    no_thinking = ChatObservations(tokenizer, template_kwargs={"enable_thinking": False}).text("z")
    assert no_thinking == followed.split("y<|im_end|>", 1)[1] + "<think>\n\n</think>\n\n"


def test_the_observation_is_tokenised_with_the_template_text_around_it():
    # The merge "\n<" crosses from the template's text into an observation that starts with "<": tokenising the
    # observation on its own would cut that token in two.
    tokenizer = chat_tokenizer()
    ids = ChatObservations(tokenizer).ids("<b>")
    before, after = "\n<|im_start|>user\n<tool_response>\n", "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert ids == encode(tokenizer, before + "<b>" + after)
    assert ids != encode(tokenizer, before) + encode(tokenizer, "<b>") + encode(tokenizer, after)
    assert tokenizer.convert_tokens_to_ids("Ċ<") in ids


ASSISTANT = "{%- elif message.role == 'assistant' %}"
BAD_TEMPLATES = {
    "no chat template": (None, "tool", "has no chat template"),
    "role dropped": (QWEN25_TEMPLATE, "observation", "the chat template drops 'observation' messages"),
    "role refused": (QWEN25_TEMPLATE.replace(
        "{%- elif message.role == 'tool' %}",
        "{%- elif message.role == 'tool' %}{{ raise_exception('no tools here') }}"),
        "tool", "the chat template cannot render the conversation user/assistant/tool (no tools here)"),
    "earlier turns change": (QWEN25_TEMPLATE.replace(
        "{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}",
        "{{- '<|im_start|>assistant\\n' + message.content }}{%- if not loop.last and "
        "messages[loop.index0 + 1].role == 'tool' %}{{- ' [calls]' }}{%- endif %}{{- '<|im_end|>\\n' }}"),
        "tool", "renders the turns before a 'tool' message differently once it follows"),
    "no end-of-turn token": (QWEN25_TEMPLATE.replace("message.content + '<|im_end|>\\n'", "message.content + '\\n\\n'"),
                             "tool", "does not end an assistant turn with a special token right after its content"),
}


@pytest.mark.parametrize("case", BAD_TEMPLATES)
def test_a_template_that_cannot_append_observations_is_a_one_line_error(case):
    template, role, problem = BAD_TEMPLATES[case]
    with pytest.raises(ValueError) as caught:
        ChatObservations(chat_tokenizer(template), role=role)
    assert problem in str(caught.value) and "\n" not in str(caught.value)

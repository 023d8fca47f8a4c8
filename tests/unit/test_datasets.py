"""Prompt datasets (cluster/run/data.py): the three file formats, fields, labels as JSON text, chat templates, the
length filter, the tokenizer round trip, seeded epochs, the resumable cursor, and one-line errors naming file, row
and field.

The character tokenizer holds only "0123456789+-*= " (one token each; it drops everything else, which the round trip
refuses), so prompts made of those characters have a token count equal to their length. `byte_tokenizer` holds any
text, one token per UTF-8 byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cluster.config import DataConfig
from cluster.demo.task import Problem
from cluster.demo.tokenizer import build_char_tokenizer
from cluster.run.data import (
    ArithmeticPrompts,
    CalcPrompts,
    ChainSumPrompts,
    DataError,
    PromptDataset,
    make_prompt_source,
)

# Readable roles, for asserting rendered text: "<user>1+2=\n<assistant>".
READABLE_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>{% endif %}")
# Only in-vocabulary characters, so every rendered character is a token: user "2+2" -> "1 2+2 =" (7 tokens).
COUNTABLE_TEMPLATE = ("{% for m in messages %}{{ '0' if m['role'] == 'system' else '1' }} {{ m['content'] }} "
                      "{% endfor %}{% if add_generation_prompt %}={% endif %}")
ROWS = [{"prompt": f"{i}+{i}=", "label": str(2 * i)} for i in range(6)]
PROBLEMS = [Problem(prompt=f"{i}+{i}=", label=str(2 * i)) for i in range(6)]
TASKS = {ArithmeticPrompts: "arithmetic", ChainSumPrompts: "chain_sum", CalcPrompts: "calc"}


@pytest.fixture
def tokenizer():
    return build_char_tokenizer()


def byte_tokenizer():
    """The demo's tokenizer over the whole byte-level alphabet: every byte one token, so any text is held."""
    from tokenizers import pre_tokenizers

    return build_char_tokenizer(model_max_length=4096, characters="".join(sorted(pre_tokenizers.ByteLevel.alphabet())))


@pytest.fixture
def chat_tokenizer():
    tok = byte_tokenizer()  # readable templates ("<user>", newlines): the digits-only tokenizer cannot hold them
    tok.chat_template = READABLE_TEMPLATE
    return tok


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dataset(path: Path, tokenizer, batch_size: int = 2, max_prompt_tokens: int = 1000, seed: int = 0,
            **config) -> PromptDataset:
    config = {"task": "dataset", "path": str(path), "shuffle": False} | config
    return PromptDataset(DataConfig(**config), seed, batch_size, tokenizer, max_prompt_tokens)


def draw(source, batches: int) -> list[Problem]:
    return [problem for _ in range(batches) for problem in source.next_batch()]


# --- formats and fields -------------------------------------------------------------------------------------------


def test_jsonl_parquet_and_datasets_directories_give_the_same_problems(tmp_path, tokenizer):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("\n".join(json.dumps(row) for row in ROWS[:3]) + "\n\n  \n" +
                     "\n".join(json.dumps(row) for row in ROWS[3:]))  # blank lines are skipped
    parquet = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    single = tmp_path / "single"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(single))
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:1]),
                          "test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(splits))

    for path, split in [(jsonl, "train"), (parquet, "train"), (single, "train"), (splits, "test")]:
        data = dataset(path, tokenizer, split=split)
        assert data.problems == PROBLEMS, path
        assert (data.num_prompts, data.filtered) == (6, 0)
    assert dataset(splits, tokenizer, split="train").problems == PROBLEMS[:1]


def test_custom_field_names_and_json_labels(tmp_path, tokenizer):
    rows = [{"question": "1+1=", "answer": 2, "id": 0}, {"question": "2+2=", "answer": [4, "four"]},
            {"question": "3+3=", "answer": {"value": 6}}, {"question": "4+4=", "answer": "8"}]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    data = dataset(path, tokenizer, prompt_field="question", label_field="answer")
    assert data.problems == [Problem("1+1=", 2), Problem("2+2=", [4, "four"]), Problem("3+3=", {"value": 6}),
                             Problem("4+4=", "8")]
    # No label field: labels are None and rows need not have one.
    unlabeled = dataset(path, tokenizer, prompt_field="question", label_field=None)
    assert [p.label for p in unlabeled.problems] == [None] * 4


def test_message_prompts_always_get_the_chat_template(tmp_path, chat_tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "1+2="}], "label": "3"},
            {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "2+2="}], "label": "4"}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    plain = dataset(path, chat_tokenizer)  # chat_template=false concerns string prompts only
    assert [p.prompt for p in plain.problems] == ["<user>1+2=\n<assistant>", "<system>own\n<user>2+2=\n<assistant>"]
    # The system prompt goes first, unless the row brings its own system message.
    with_system = dataset(path, chat_tokenizer, system_prompt="Add.")
    assert [p.prompt for p in with_system.problems] == ["<system>Add.\n<user>1+2=\n<assistant>",
                                                        "<system>own\n<user>2+2=\n<assistant>"]
    assert [p.label for p in with_system.problems] == ["3", "4"]


def test_string_prompts_get_the_chat_template_only_when_asked(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS[:2])
    assert [p.prompt for p in dataset(path, chat_tokenizer, system_prompt="Add.").problems] == ["0+0=", "1+1="]
    templated = dataset(path, chat_tokenizer, chat_template=True)
    assert [p.prompt for p in templated.problems] == ["<user>0+0=\n<assistant>", "<user>1+1=\n<assistant>"]
    with_system = dataset(path, chat_tokenizer, chat_template=True, system_prompt="Add.")
    assert with_system.problems[0] == Problem("<system>Add.\n<user>0+0=\n<assistant>", "0")


def test_data_tools_go_into_the_chat_template(tmp_path, chat_tokenizer):
    # A template that lists the tools' names before the messages, as real ones list their schemas.
    chat_tokenizer.chat_template = ("{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
                                    + READABLE_TEMPLATE)
    path = write_jsonl(tmp_path / "data.jsonl", ROWS[:1])
    tools = ["rewards.environments.tools:calculate"]
    assert dataset(path, chat_tokenizer, chat_template=True, tools=tools).problems[0].prompt == \
        "[calculate]<user>0+0=\n<assistant>"
    with pytest.raises(DataError, match="data.tools: .*"):
        dataset(path, chat_tokenizer, chat_template=True, tools=["rewards.environments.tools:nothing_here"])


def test_a_needed_chat_template_that_the_tokenizer_lacks_is_a_data_error(tmp_path, tokenizer):
    strings = write_jsonl(tmp_path / "strings.jsonl", ROWS[:2])
    messages = write_jsonl(tmp_path / "messages.jsonl", [{"prompt": [{"role": "user", "content": "1"}], "label": 1}])
    for path, config in [(strings, {"chat_template": True}), (messages, {})]:
        with pytest.raises(DataError) as err:
            dataset(path, tokenizer, **config)
        message = str(err.value)
        assert "\n" not in message
        assert f"{path} line 1" in message
        assert "has no chat template" in message or "has none" in message
        assert "data.chat_template=false" in message


# --- the length filter --------------------------------------------------------------------------------------------


def test_prompts_longer_than_max_prompt_tokens_are_skipped_and_counted(tmp_path, tokenizer):
    prompts = ["12", "1234", "123456", "12345678", "1+2="]  # 2, 4, 6, 8, 4 tokens
    path = write_jsonl(tmp_path / "data.jsonl", [{"prompt": p, "label": p} for p in prompts])
    data = dataset(path, tokenizer, max_prompt_tokens=4)
    assert [p.prompt for p in data.problems] == ["12", "1234", "1+2="]  # exactly 4 tokens is kept
    assert (data.num_prompts, data.filtered) == (3, 2)
    assert data.metrics()["data/filtered_prompts"] == 2.0
    assert {p.prompt for p in draw(data, 3)} == {"12", "1234", "1+2="}  # filtered prompts are never drawn


def test_the_length_filter_counts_the_chat_template(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = COUNTABLE_TEMPLATE
    path = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "2+2", "label": 4}, {"prompt": "22+22", "label": 44}])
    # "1 2+2 =" is 7 tokens, "1 22+22 =" 9; with the system prompt "0 9 " adds 4 more.
    data = dataset(path, tok, chat_template=True, max_prompt_tokens=7)
    assert [p.prompt for p in data.problems] == ["1 2+2 ="]
    assert data.filtered == 1
    with pytest.raises(DataError, match=r"all 2 prompts are longer than max_prompt_tokens=7 .*shortest has 11"):
        dataset(path, tok, chat_template=True, system_prompt="9", max_prompt_tokens=7)


# --- order, epochs, resume ----------------------------------------------------------------------------------------


def test_shuffle_false_keeps_file_order_and_wraps_across_epochs(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS[:5])
    data = dataset(path, tokenizer, batch_size=3)
    batches = [[p.prompt for p in data.next_batch()] for _ in range(3)]
    assert batches == [["0+0=", "1+1=", "2+2="], ["3+3=", "4+4=", "0+0="], ["1+1=", "2+2=", "3+3="]]
    assert data.metrics()["data/epoch"] == 9 / 5


def test_seeded_shuffle_is_deterministic_and_differs_across_seeds_and_epochs(tmp_path, tokenizer):
    rows = [{"prompt": str(i), "label": i} for i in range(20)]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    first = [p.label for p in draw(dataset(path, tokenizer, batch_size=5, shuffle=True, seed=1), 8)]
    again = [p.label for p in draw(dataset(path, tokenizer, batch_size=5, shuffle=True, seed=1), 8)]
    other = [p.label for p in draw(dataset(path, tokenizer, batch_size=5, shuffle=True, seed=2), 8)]
    assert first == again
    assert first[:20] != other[:20]
    epoch0, epoch1 = first[:20], first[20:]
    assert sorted(epoch0) == sorted(epoch1) == list(range(20))  # each epoch visits every prompt once
    assert epoch0 != epoch1 and epoch0 != list(range(20))


def test_batches_spanning_epochs_cover_every_prompt_once_per_epoch(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", [{"prompt": str(i), "label": i} for i in range(7)])
    data = dataset(path, tokenizer, batch_size=3, shuffle=True, seed=5)
    labels = [p.label for p in draw(data, 7)]  # 21 prompts: exactly 3 epochs, batches 3 and 5 straddle borders
    epochs = [labels[0:7], labels[7:14], labels[14:21]]
    assert all(sorted(epoch) == list(range(7)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3  # a new order each epoch
    assert data.metrics()["data/epoch"] == 3.0


def test_a_dataset_smaller_than_a_batch_repeats_within_it(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS[:2])
    batch = dataset(path, tokenizer, batch_size=5, shuffle=True).next_batch()
    assert len(batch) == 5
    labels = [p.label for p in batch]
    assert sorted(labels[0:2]) == sorted(labels[2:4]) == ["0", "2"] and labels[4] in {"0", "2"}


@pytest.mark.parametrize("consumed_batches", [0, 1, 3, 5])
def test_a_resumed_dataset_draws_the_batches_an_uninterrupted_one_would(tmp_path, tokenizer, consumed_batches):
    path = write_jsonl(tmp_path / "data.jsonl", [{"prompt": str(i), "label": i} for i in range(7)])
    uninterrupted = dataset(path, tokenizer, batch_size=3, shuffle=True, seed=3)
    expected = draw(uninterrupted, consumed_batches + 4)[3 * consumed_batches:]
    interrupted = dataset(path, tokenizer, batch_size=3, shuffle=True, seed=3)
    draw(interrupted, consumed_batches)
    state = json.loads(json.dumps(interrupted.state()))
    resumed = dataset(path, tokenizer, batch_size=3, shuffle=True, seed=3)
    resumed.load_state(state)
    assert draw(resumed, 4) == expected
    assert resumed.metrics() == uninterrupted.metrics()


def test_a_state_from_a_different_dataset_is_refused(tmp_path, tokenizer):
    data = dataset(write_jsonl(tmp_path / "a.jsonl", ROWS), tokenizer)
    data.next_batch()
    smaller = dataset(write_jsonl(tmp_path / "b.jsonl", ROWS[:4]), tokenizer)
    with pytest.raises(DataError, match="saved data state was for 6 prompts but the dataset now keeps 4"):
        smaller.load_state(data.state())


@pytest.mark.parametrize("source_cls", [ArithmeticPrompts, ChainSumPrompts, CalcPrompts])
@pytest.mark.parametrize("consumed_batches", [0, 2])
def test_a_resumed_generated_source_draws_the_same_batches(consumed_batches, source_cls):
    config = DataConfig(task=TASKS[source_cls], prompts_per_step=4)
    expected = draw(source_cls(config, seed=7), consumed_batches + 3)[4 * consumed_batches:]
    interrupted = source_cls(config, seed=7)
    draw(interrupted, consumed_batches)
    assert interrupted.state() == {"batches": consumed_batches}
    resumed = source_cls(config, seed=7)
    resumed.load_state(json.loads(json.dumps(interrupted.state())))
    assert draw(resumed, 3) == expected
    assert resumed.metrics() == {}
    with pytest.raises(ValueError, match="non-negative integer 'batches'"):
        resumed.load_state({"batches": -1})


def test_make_prompt_source_picks_the_task(tmp_path, tiny_model_dir):
    arithmetic = make_prompt_source(DataConfig(prompts_per_step=32), seed=0, batch_size=3,
                                    model_path=str(tiny_model_dir), max_prompt_tokens=10)
    assert isinstance(arithmetic, ArithmeticPrompts) and len(arithmetic.next_batch()) == 3
    path = write_jsonl(tmp_path / "data.jsonl", ROWS + [{"prompt": "1" * 11, "label": "x"}])
    data = make_prompt_source(DataConfig(task="dataset", path=str(path), shuffle=False), seed=0, batch_size=6,
                              model_path=str(tiny_model_dir), max_prompt_tokens=10)
    assert isinstance(data, PromptDataset)
    assert data.next_batch() == PROBLEMS and data.filtered == 1  # the saved tokenizer counts one token a digit


# --- malformed input: one line naming the file, the row and the field ----------------------------------------------


MESSAGES = [{"role": "user", "content": "1"}]


@pytest.mark.parametrize(("lines", "where", "fragments"), [
    ([{"prompt": "1", "label": "1"}, {"question": "2", "label": "2"}], "line 2", ["no field 'prompt'", "question"]),
    ([{"prompt": 5, "label": "5"}], "line 1", ["field 'prompt' is a number", "string or a list of chat messages"]),
    ([{"prompt": "", "label": "5"}], "line 1", ["field 'prompt' is an empty string"]),
    ([{"prompt": "1", "label": "1"}, "", "{\"prompt\": \"2\",", {"prompt": "3", "label": "3"}], "line 3",
     ["not valid JSON"]),
    (['["1", "1"]'], "line 1", ["holds an array, not a JSON object"]),
    ([{"prompt": [{"role": "user"}], "label": "1"}], "line 1", ["field 'prompt' message 0", '"content"']),
    ([{"prompt": [{"role": "user", "content": "1"}, "hi"], "label": "1"}], "line 1", ["field 'prompt' message 1"]),
    ([{"prompt": [], "label": "1"}], "line 1", ["field 'prompt' is an empty message list"]),
    ([{"prompt": "1", "label": "1"}, {"prompt": "2"}], "line 2", ["no field 'label'", "data.label_field"]),
    ([{"prompt": "1", "label": None}], "line 1", ["field 'label' is null"]),
])
def test_malformed_jsonl_rows_are_one_line_data_errors(tmp_path, chat_tokenizer, lines, where, fragments):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    with pytest.raises(DataError) as err:
        dataset(path, chat_tokenizer)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{path} {where}: ")
    for fragment in fragments:
        assert fragment in message


def test_an_empty_file_is_a_data_error(tmp_path, tokenizer):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: holds no rows"):
        dataset(path, tokenizer)


def test_columnar_errors_name_the_row_from_zero_and_the_column(tmp_path, tokenizer):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1", "label": "1"}, {"prompt": None, "label": "2"}]), path)
    with pytest.raises(DataError, match=rf"^{path} row 1 \(0-based\): field 'prompt' is null;"):
        dataset(path, tokenizer)
    with pytest.raises(DataError, match=rf"^{path}: has no column 'answer' \(for data.label_field\); set "
                                        r"data.label_field to one of prompt, label or to null"):
        dataset(path, tokenizer, label_field="answer")
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS)}
                         ).save_to_disk(str(splits))
    with pytest.raises(DataError, match=r"has no split 'validation'; set data.split to one of test, train$"):
        dataset(splits, tokenizer, split="validation")
    with pytest.raises(DataError, match=rf"^{splits} split 'test': has no column 'question'"):
        dataset(splits, tokenizer, split="test", prompt_field="question")


def test_unusable_paths_are_data_errors(tmp_path, tokenizer):
    (tmp_path / "data.csv").write_text("prompt,label\n1,1\n")
    (tmp_path / "plain_dir").mkdir()
    (tmp_path / "junk.parquet").write_text("not parquet")
    cases = [(tmp_path / "missing.jsonl", "does not exist"), (tmp_path / "data.csv", "unsupported extension '.csv'"),
             (tmp_path / "plain_dir", "not one written by datasets' save_to_disk"),
             (tmp_path / "junk.parquet", "cannot be read as Parquet")]
    for path, fragment in cases:
        with pytest.raises(DataError) as err:
            dataset(path, tokenizer)
        assert fragment in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_datasets_prompts_carry_their_token_ids_tokenised_once(tmp_path, tokenizer):
    """The length filter's tokenisation is kept: the engines get these ids and do not tokenise the text again."""
    source = dataset(write_jsonl(tmp_path / "data.jsonl", ROWS), tokenizer)
    for problem in draw(source, 2):
        assert problem.prompt_ids.dtype == np.int32
        assert problem.prompt_ids.tolist() == tokenizer.encode(problem.prompt, add_special_tokens=False)


# --- labels as JSON text ------------------------------------------------------------------------------------------


def test_label_format_json_decodes_string_labels_in_every_format(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "1+1=", "label": "[1, 2]"}, {"prompt": "2+2=", "label": '{"a": {"b": null}}'},
            {"prompt": "3+3=", "label": '"6"'}]
    jsonl = write_jsonl(tmp_path / "data.jsonl", rows)
    parquet = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for path in (jsonl, parquet):
        assert [p.label for p in dataset(path, tokenizer).problems] == ["[1, 2]", '{"a": {"b": null}}', '"6"']
        assert [p.label for p in dataset(path, tokenizer, label_format="json").problems] == [[1, 2], {"a": {"b": None}},
                                                                                             "6"]
    # A label that is not a string (JSONL's own objects, numbers) is kept as it is.
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "1=", "label": {"x": 1}}, {"prompt": "2=", "label": 7}])
    assert [p.label for p in dataset(mixed, tokenizer, label_format="json").problems] == [{"x": 1}, 7]
    bad = write_jsonl(tmp_path / "bad.jsonl", [*rows[:1], {"prompt": "2+2=", "label": "four"}])
    with pytest.raises(DataError, match=rf"^{bad} line 2: field 'label' is not JSON text \(Expecting value at "
                                        r"column 1\) but data.label_format=json; write labels with json.dumps"):
        dataset(bad, tokenizer, label_format="json")


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.parquet", "rows_dir"])
def test_write_prompts_gives_every_label_back_under_label_format_json(tmp_path, name):
    from cluster.run.prompt_format import write_prompts

    # Strings that read as other JSON values must come back as the strings they were, beside the values themselves.
    labels = ["42", "-0.5", "1e3", "true", "null", '"6"', '{"a": 1}', "[1, 2]", "", " 7 ", "four", "\u00e9\u4e00",
              42, 4.5, True, {"a": "1", "b": ["2", None]}, ["42", 42], {}]
    write_prompts(tmp_path / name, [{"prompt": f"{i}=", "label": label} for i, label in enumerate(labels)])
    read = dataset(tmp_path / name, byte_tokenizer(), label_format="json").problems
    assert [p.label for p in read] == labels
    assert [type(p.label) for p in read] == [type(label) for label in labels]  # 42 and 42.0, True and 1 kept apart


# --- the tokenizer round trip -------------------------------------------------------------------------------------


def test_a_prompt_the_tokenizer_cannot_hold_is_refused_naming_row_and_character(tmp_path, tokenizer):
    # The demo tokenizer drops what it lacks: "2+2=\n" would reach the engine as "2+2=", "What is 3+3=" as " 3+3=".
    rows = [{"prompt": "1+1=", "label": 2}, {"prompt": "2+2=\n", "label": 4}, {"prompt": "What is 3+3=", "label": 6}]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(DataError) as err:
        dataset(path, tokenizer)
    assert str(err.value) == (
        f"{path} line 2: the model tokenizer cannot hold the prompt: its token ids decode to other text from character "
        "4 ('\\n') on; use a model whose tokenizer covers the text, fix the row, or set data.untokenizable=filter to "
        "skip such prompts")
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([rows[0], rows[2]]), parquet)
    with pytest.raises(DataError, match=rf"^{parquet} row 1 \(0-based\): .* from character 0 \('W'\) on;"):
        dataset(parquet, tokenizer)
    # Through a chat template too: the rendered text is what must survive.
    chat = build_char_tokenizer()
    chat.chat_template = READABLE_TEMPLATE
    with pytest.raises(DataError, match=rf"^{path} line 1: .* from character 0 \('<'\) on;"):
        dataset(path, chat, chat_template=True)


def test_untokenizable_filter_skips_and_counts_them_with_the_long_ones(tmp_path, tokenizer):
    prompts = ["1+1=", "2+2=\n", "What is 3+3=", "12345678", "4+4=", "x"]
    path = write_jsonl(tmp_path / "data.jsonl", [{"prompt": p, "label": p} for p in prompts])
    data = dataset(path, tokenizer, untokenizable="filter", max_prompt_tokens=6)
    assert [p.prompt for p in data.problems] == ["1+1=", "4+4="]
    assert data.metrics()["data/filtered_prompts"] == 4.0  # 3 untokenizable + 1 too long
    assert {p.prompt for p in draw(data, 3)} == {"1+1=", "4+4="}
    with pytest.raises(DataError, match=r"all 2 prompts are longer than max_prompt_tokens=3 tokens \(the shortest "
                                        r"has 4\), and 2 untokenizable ones were skipped; raise data.max_prompt"):
        dataset(write_jsonl(tmp_path / "long.jsonl", [{"prompt": p, "label": p} for p in prompts[:4]]), tokenizer,
                untokenizable="filter", max_prompt_tokens=3)


def word_tokenizer():
    """A real word-level tokenizer with an unknown token: splits on words and punctuation, decodes with a space
    between tokens (so "1+1" comes back as "1 + 1")."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "1": 1, "+": 2, "=": 3, "2": 4, "\n": 5}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(" "), behavior="removed"),
                                                     pre_tokenizers.Split(Regex(r"\w+|[^\w ]"), behavior="isolated")])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=False)


def test_the_round_trip_ignores_spaces_only(tmp_path):
    from cluster.run.data import _holds

    tok = word_tokenizer()
    texts = ["1+1=2", "1 +\n1", "1+x=2", "1+[UNK]", "1+1=\t2"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert tok.backend_tokenizer.decode(ids[0]) == "1 + 1 = 2"  # spaces added: held
    # held: spaces added; a newline kept. Not: x unknown. Held: the unknown token written out literally. Not: a tab.
    assert _holds(tok, texts, ids) == [True, True, False, True, False]

    class PerfectDecoder:
        """Decodes to the text whatever the ids: only the unknown-token count can tell."""
        unk_token_id, unk_token, backend_tokenizer = 0, "<unk>", None

        def batch_decode(self, rows, **_):
            return ["a<unk>b"] * len(rows)

    assert _holds(PerfectDecoder(), ["a<unk>b", "a<unk>b"], [[7, 0, 8], [7, 0, 0]]) == [True, False]


def test_the_round_trip_decodes_in_batches(tmp_path, tokenizer, monkeypatch):
    from cluster.run import data as module

    calls = []
    decode = module._decode
    monkeypatch.setattr(module, "_decode", lambda tok, rows: calls.append(len(rows)) or decode(tok, rows))
    path = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"{i}+{i}=", "label": 2 * i} for i in range(2500)])
    assert dataset(path, tokenizer).num_prompts == 2500
    assert calls == [1024, 1024, 452]  # one decode per tokenised chunk, not per prompt

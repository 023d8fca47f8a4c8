"""The form of prompts and prompt files, shared by every prompt source: rendering chat messages with the tokenizer's
template (`apply_chat_template`), checking a row's messages, writing prompt files that `data.path` reads
(`write_prompts`), and `DataError`, a dataset that cannot be used.
Does not own: reading datasets or drawing batches (cluster/run/data.py), reasoning-gym's tasks
(cluster/run/reasoning_gym.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cluster.config import DataConfig


class DataError(ValueError):
    """A prompt dataset cannot be used; the message is one line naming the file, the row, the field and the fix."""


def _checked_messages(value: list, where: str, field: str) -> list[dict[str, Any]]:
    if not value:
        raise DataError(f"{where}: field '{field}' is an empty message list; give at least one "
                        '{"role": "user", "content": ...} message')
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and message["role"]
                and isinstance(message.get("content"), str)):
            shown = json.dumps(message, default=str)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise DataError(f"{where}: field '{field}' message {i} is {shown}; each message must be an object "
                            'with a string "role" and a string "content"')
    return [dict(message) for message in value]


def apply_chat_template(config: DataConfig, tokenizer: Any, where: str, messages: list[dict[str, Any]]) -> str:
    """Render with the tokenizer's template and a generation prompt, and `config.tools`' schemas; `config.system_prompt`
    goes first unless the row brings its own system message (two system messages break most templates)."""
    if not getattr(tokenizer, "chat_template", None):
        why = "data.chat_template=true" if config.chat_template else "its prompt is a list of chat messages"
        raise DataError(
            f"{where}: needs a chat template ({why}) but the tokenizer of "
            f"'{getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}' has none; set "
            "data.chat_template=false and give string prompts, or use a model whose tokenizer has a chat template")
    if config.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": config.system_prompt}, *messages]
    tools = {}
    if config.tools:
        from rewards.environments.tools import tool_schemas

        try:
            tools = {"tools": tool_schemas(config.tools)}
        except ValueError as err:
            raise DataError(f"data.tools: {err}") from None
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **tools)
    except Exception as err:  # a template may raise on the row's content (e.g. roles must alternate)
        raise DataError(f"{where}: the chat template of the tokenizer failed on field '{config.prompt_field}': "
                        f"{' '.join(str(err).split())}; fix the messages or the template") from err
    return text


def write_prompts(path: str | Path, rows: list[dict[str, Any]], label_field: str = "label") -> None:
    """Writes `rows` ({prompt field: ..., `label_field`: any JSON value, ...}) where `data.path` reads them: JSONL
    (`.jsonl`, labels as JSON values, except that a string label is written as JSON text: `data.label_format=json`
    decodes every string label, so "42" written as itself would come back as 42), Parquet (`.parquet`) or a
    `datasets` directory (any other path), whose label column holds each label as JSON text, since a columnar file
    would merge labels of different shapes into one type and fill the gaps with nulls. Read back with
    `data.label_format=json`: every format gives the labels `json.loads(json.dumps(label))`."""
    if not rows:
        raise ValueError(f"write_prompts: no rows to write to {path}")
    path = Path(path)
    if path.suffix == ".jsonl":
        lines = [{**row, label_field: json.dumps(row[label_field], ensure_ascii=False)}
                 if isinstance(row.get(label_field), str) else row for row in rows]
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in lines), encoding="utf-8")
        return
    encoded = [{**row, label_field: json.dumps(row[label_field], ensure_ascii=False)} for row in rows]
    columns = {key: [row[key] for row in encoded] for key in encoded[0]}
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(columns), path)
        return
    import datasets

    datasets.Dataset.from_dict(columns).save_to_disk(str(path))


def _json_kind(value: Any) -> str:
    """What a value is, in JSON's words, for messages: "null", "a number", "an array"."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
             dict: "an object"}
    return "null" if value is None else names.get(type(value), f"a {type(value).__name__}")

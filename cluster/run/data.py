"""Prompt sources for the driver: seeded, resumable iterators of (prompt, label) problems.

Owns: which problems step k trains on, and reading a user's prompt dataset (JSONL, Parquet or a `datasets`
directory) into problems: field checks, the chat template, the prompt-length filter, and the prompts' token ids
(tokenised once, when the dataset loads; the engines get these ids). A batch depends only on (seed, cursor), so a
resumed run draws exactly the batches an uninterrupted one would.
Does not own: the demo tasks, arithmetic, chain_sum and calc (cluster/demo/task.py; their prompts go to the engines
as text, which they tokenise)
or rewards (rewards/). `datasets`, `pyarrow` and `transformers` are imported on use only.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cluster.config import DataConfig
from cluster.demo.task import Problem, make_calc_problems, make_chain_problems, make_problems

SUPPORTED_FORMATS = "a .jsonl or .parquet file, or a directory written by datasets' save_to_disk"
_TOKENIZE_CHUNK = 1024  # prompts tokenized per call


class DataError(ValueError):
    """A prompt dataset cannot be used; the message is one line naming the file, the row, the field and the fix."""


class PromptSource(Protocol):
    """What the driver draws prompts from: a seeded stream of batches with a resumable cursor."""

    def next_batch(self) -> list[Problem]: ...

    def state(self) -> dict[str, int]: ...

    def load_state(self, state: Mapping[str, Any]) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class ArithmeticPrompts:
    """`a+b=` problems, `batch_size` (default `prompts_per_step`) per batch; an endless stream without epochs."""

    def __init__(self, config: DataConfig, seed: int, batch_size: int | None = None):
        self.config = config
        self.seed = seed
        self.batch_size = config.prompts_per_step if batch_size is None else batch_size
        self.cursor = 0  # batches drawn so far

    def next_batch(self) -> list[Problem]:
        rng = random.Random(f"relay-data:{self.seed}:{self.cursor}")
        self.cursor += 1
        return self.draw(rng)

    def draw(self, rng: random.Random) -> list[Problem]:
        """One batch of the task's problems from `rng`."""
        return make_problems(rng, self.batch_size, self.config.min_operand, self.config.max_operand)

    def state(self) -> dict[str, int]:
        """The cursor, JSON-able; `load_state` of it on a fresh source continues the same stream."""
        return {"batches": self.cursor}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.cursor = _count(state, "batches")

    def metrics(self) -> dict[str, float]:
        """Nothing: the stream has no epochs and filters nothing."""
        return {}


class ChainSumPrompts(ArithmeticPrompts):
    """`12+34+56=` problems (`config.num_terms` terms) labelled with their partial sums (`46 102`); otherwise as
    `ArithmeticPrompts`: the same (seed, cursor) stream and state."""

    def draw(self, rng: random.Random) -> list[Problem]:
        return make_chain_problems(
            rng, self.batch_size, self.config.num_terms, self.config.min_operand, self.config.max_operand)


class CalcPrompts(ArithmeticPrompts):
    """`37*48=` problems labelled with the product (`1776`), operands in [`config.min_operand`, `config.max_operand`],
    for episodes with the `Calculator` tool; otherwise as `ArithmeticPrompts`: the same (seed, cursor) stream and
    state."""

    def draw(self, rng: random.Random) -> list[Problem]:
        return make_calc_problems(rng, self.batch_size, self.config.min_operand, self.config.max_operand)


class PromptDataset:
    """A user's prompts (`data.path`), cycled epoch after epoch in a seeded order, `batch_size` per batch.

    Rows whose prompt (after the chat template) has more than `max_prompt_tokens` tokens are skipped and counted
    in `filtered`. Epoch e visits every kept prompt once, in file order or (with `config.shuffle`) in a permutation
    drawn from (seed, e); batches run on across epoch boundaries, so one batch may hold the end of an epoch and
    the start of the next, and a dataset smaller than a batch repeats within it.
    """

    def __init__(self, config: DataConfig, seed: int, batch_size: int, tokenizer: Any, max_prompt_tokens: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.seed = seed
        self.batch_size = batch_size
        self.shuffle = config.shuffle
        self.path = config.path
        candidates = [(where, _render_prompt(config, tokenizer, where, row), _label(config, where, row))
                      for where, row in read_rows(config)]
        if not candidates:
            raise DataError(f"{config.path}: holds no rows; add prompts or point data.path at another file")
        token_ids = _tokenize(tokenizer, [text for _, text, _ in candidates])
        lengths = [len(ids) for ids in token_ids]
        self.problems = [Problem(prompt=text, label=label, prompt_ids=ids)
                         for (_, text, label), ids in zip(candidates, token_ids) if len(ids) <= max_prompt_tokens]
        self.filtered = len(candidates) - len(self.problems)
        self.num_prompts = len(self.problems)
        if not self.problems:
            raise DataError(
                f"{config.path}: all {len(candidates)} prompts are longer than max_prompt_tokens={max_prompt_tokens} "
                f"tokens (the shortest has {min(lengths)}); raise data.max_prompt_tokens or rollout.max_model_len")
        self.consumed = 0  # prompts drawn so far, over all epochs
        self._order_epoch = -1
        self._order: list[int] = []

    def next_batch(self) -> list[Problem]:
        batch = []
        for position in range(self.consumed, self.consumed + self.batch_size):
            epoch, offset = divmod(position, self.num_prompts)
            batch.append(self.problems[self.epoch_order(epoch)[offset]])
        self.consumed += self.batch_size
        return batch

    def epoch_order(self, epoch: int) -> list[int]:
        """Indices of the kept prompts in the order epoch `epoch` visits them (the last epoch's is cached)."""
        if epoch != self._order_epoch:
            order = list(range(self.num_prompts))
            if self.shuffle:
                random.Random(f"relay-data-order:{self.seed}:{epoch}").shuffle(order)
            self._order_epoch, self._order = epoch, order
        return self._order

    def state(self) -> dict[str, int]:
        """The cursor (prompts drawn so far, over all epochs), JSON-able; `load_state` of it on a fresh dataset
        continues with the same batches. A resumed run keeps `data.prompts_per_step` (cluster/run/resume.py refuses a
        change): the batches, and so the run, depend on it."""
        return {"consumed": self.consumed, "num_prompts": self.num_prompts}

    def load_state(self, state: Mapping[str, Any]) -> None:
        expected = state.get("num_prompts", self.num_prompts)
        if expected != self.num_prompts:
            raise DataError(
                f"{self.path}: the saved data state was for {expected} prompts but the dataset now keeps "
                f"{self.num_prompts}; resume with the same data.path, filter settings and model, or start a new run")
        self.consumed = _count(state, "consumed")

    def metrics(self) -> dict[str, float]:
        """`data/epoch`: epochs completed so far (fractional); `data/filtered_prompts`: rows too long to keep."""
        return {"data/epoch": self.consumed / self.num_prompts, "data/filtered_prompts": float(self.filtered)}


def make_prompt_source(config: DataConfig, seed: int, batch_size: int, model_path: str | None,
                       max_prompt_tokens: int) -> ArithmeticPrompts | ChainSumPrompts | CalcPrompts | PromptDataset:
    """The prompt source `config.task` names; a dataset's templates and lengths use the model's tokenizer (`model_path`
    None: the demo model's, made in memory, the same as the one its directory will hold)."""
    if config.task == "arithmetic":
        return ArithmeticPrompts(config, seed, batch_size)
    if config.task == "chain_sum":
        return ChainSumPrompts(config, seed, batch_size)
    if config.task == "calc":
        return CalcPrompts(config, seed, batch_size)
    if model_path is None:
        from cluster.demo.tokenizer import build_char_tokenizer

        tokenizer = build_char_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    return PromptDataset(config, seed, batch_size, tokenizer, max_prompt_tokens)


def sampling_seeds(seed: int, step: int, n: int, round_: int = 0) -> list[int]:
    """One sampling seed per prompt of a step's generation round, independent of how prompts are split across
    workers (rounds > 0 happen with dynamic sampling)."""
    rng = random.Random(f"relay-sample:{seed}:{step}" + (f":{round_}" if round_ else ""))
    return [rng.getrandbits(31) for _ in range(n)]


# --- reading rows -------------------------------------------------------------------------------------------------


def read_rows(config: DataConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield `(where, row)` for every row of `config.path`; `where` names the file and the row for errors
    ("data.jsonl line 3", 1-based, for JSONL; "data.parquet row 2 (0-based)" for Parquet and `datasets`)."""
    if not config.path:
        raise DataError(f"data.path is empty; set it to {SUPPORTED_FORMATS}")
    path = Path(config.path)
    if path.is_dir():
        return _read_saved_dataset(path, config)
    if not path.exists():
        raise DataError(f"data.path '{path}' does not exist; set it to {SUPPORTED_FORMATS}")
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    if path.suffix == ".parquet":
        return _read_parquet(path, config)
    raise DataError(f"data.path '{path}' has an unsupported extension '{path.suffix}'; use {SUPPORTED_FORMATS}")


def _read_jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: is not UTF-8 text (byte {err.start}); save it as UTF-8 JSON lines") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue  # blank lines (a trailing newline, spacing) carry no row
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: is not valid JSON ({err.msg} at column {err.colno}); write one JSON "
                            "object per line") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: holds {_json_kind(row)}, not a JSON object; write one object per line, "
                            'e.g. {"prompt": ..., "label": ...}')
        yield where, row


def _read_parquet(path: Path, config: DataConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        columns = pq.read_schema(path).names
        table = pq.read_table(path, columns=_needed_columns(config, columns, str(path)))
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: cannot be read as Parquet ({str(err).splitlines()[0]}); "
                        "write it with pyarrow or pandas' to_parquet") from None
    for index, row in enumerate(table.to_pylist()):
        yield f"{path} row {index} (0-based)", row


def _read_saved_dataset(path: Path, config: DataConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise DataError(f"data.path '{path}' is a directory but not one written by datasets' save_to_disk; "
                        f"use {SUPPORTED_FORMATS}") from None
    name = str(path)
    if isinstance(loaded, datasets.DatasetDict):
        if config.split not in loaded:
            raise DataError(f"{path}: has no split '{config.split}'; set data.split to one of "
                            f"{', '.join(sorted(loaded))}")
        loaded, name = loaded[config.split], f"{path} split '{config.split}'"
    loaded = loaded.select_columns(_needed_columns(config, loaded.column_names, name))
    for index, row in enumerate(loaded.to_list()):
        yield f"{name} row {index} (0-based)", row


def _needed_columns(config: DataConfig, columns: list[str], name: str) -> list[str]:
    """The prompt and label columns, checked up front: a columnar file has a field in every row or in none."""
    needed = [config.prompt_field] + ([config.label_field] if config.label_field else [])
    for field, key in zip(needed, ("prompt_field", "label_field")):
        if field not in columns:
            fix = f"set data.{key} to one of {', '.join(columns)}" + ("" if key == "prompt_field" else
                                                                       " or to null for no labels")
            raise DataError(f"{name}: has no column '{field}' (for data.{key}); {fix}")
    return needed


# --- one row -> one problem ---------------------------------------------------------------------------------------


def _render_prompt(config: DataConfig, tokenizer: Any, where: str, row: dict[str, Any]) -> str:
    """The text the engine receives: the prompt field as is, or rendered with the tokenizer's chat template."""
    field = config.prompt_field
    if field not in row:
        raise DataError(f"{where}: has no field '{field}' (fields: {', '.join(row) or 'none'}); add it to every "
                        "row or set data.prompt_field")
    value = row[field]
    if isinstance(value, str):
        if not value:
            raise DataError(f"{where}: field '{field}' is an empty string; give every row a prompt")
        if not config.chat_template:
            return value
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list):
        messages = _checked_messages(value, where, field)
    else:
        raise DataError(f"{where}: field '{field}' is {_json_kind(value)}; a prompt must be a string or a list "
                        'of chat messages [{"role": ..., "content": ...}]')
    return _apply_chat_template(config, tokenizer, where, messages)


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


def _apply_chat_template(config: DataConfig, tokenizer: Any, where: str, messages: list[dict[str, Any]]) -> str:
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


def _label(config: DataConfig, where: str, row: dict[str, Any]) -> Any:
    field = config.label_field
    if field is None:
        return None
    if field not in row:
        raise DataError(f"{where}: has no field '{field}' (fields: {', '.join(row) or 'none'}); add a label to "
                        "every row, set data.label_field, or set it to null for no labels")
    if row[field] is None:  # also how Parquet and datasets store a row that lacks the field
        raise DataError(f"{where}: field '{field}' is null; give every row a label or set data.label_field=null")
    return row[field]


def _tokenize(tokenizer: Any, texts: list[str]) -> list[np.ndarray]:
    """Each prompt's token ids (int32), without special tokens (chat templates write theirs into the text), as the
    engines would encode it: they get these ids and do not tokenise the text again."""
    ids: list[np.ndarray] = []
    for start in range(0, len(texts), _TOKENIZE_CHUNK):
        encoded = tokenizer(texts[start:start + _TOKENIZE_CHUNK], add_special_tokens=False)["input_ids"]
        ids.extend(np.asarray(row, dtype=np.int32) for row in encoded)
    return ids


def _json_kind(value: Any) -> str:
    """What a value is, in JSON's words, for messages: "null", "a number", "an array"."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
             dict: "an object"}
    return "null" if value is None else names.get(type(value), f"a {type(value).__name__}")


def _count(state: Mapping[str, Any], key: str) -> int:
    value = state.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"data state must hold a non-negative integer '{key}', got {dict(state)!r}")
    return value

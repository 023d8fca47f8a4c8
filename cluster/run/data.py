"""Prompt sources for the driver: seeded, resumable iterators of (prompt, label) problems.

Owns: which problems step k trains on (a batch depends only on (seed, cursor), so a resumed run draws exactly the
batches an uninterrupted one would), and reading a user's prompt dataset (JSONL, Parquet or a `datasets` directory)
into problems: field checks, labels (JSON text decoded with `data.label_format=json`), the prompt-length filter, the
tokenizer round trip (`data.untokenizable`), and the prompts' token ids (tokenised once; the engines get these ids).
Does not own: the demo tasks (cluster/demo/task.py; their prompts go to the engines as text), the chat template and
the prompt file format (cluster/run/prompt_format.py), generating reasoning-gym's tasks (cluster/run/reasoning_gym.py;
kept, tokenised and batched here like a file's rows) or rewards (rewards/). `datasets`, `pyarrow` and `transformers`
are imported on use only.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cluster.data_config import DataConfig
from cluster.demo.task import Problem, make_calc_problems, make_chain_problems, make_problems
from cluster.run.prompt_format import DataError, _checked_messages, _json_kind, apply_chat_template

SUPPORTED_FORMATS = "a .jsonl or .parquet file, or a directory written by datasets' save_to_disk"
_TOKENIZE_CHUNK = 1024  # prompts tokenized per call


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
        """One batch of the task's problems from `rng`, each drawn again while it is held out (`data.held_out`;
        drawing them one by one is drawing them at once: nothing held out, the stream is the same)."""
        batch: list[Problem] = []
        while len(batch) < self.batch_size:
            problem = self.draw_one(rng)
            if not is_held_out(problem.prompt, self.config.held_out):
                batch.append(problem)
        return batch

    def draw_one(self, rng: random.Random) -> Problem:
        """One of the task's problems from `rng`."""
        return make_problems(rng, 1, self.config.min_operand, self.config.max_operand)[0]

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

    def draw_one(self, rng: random.Random) -> Problem:
        return make_chain_problems(rng, 1, self.config.num_terms, self.config.min_operand, self.config.max_operand)[0]


class CalcPrompts(ArithmeticPrompts):
    """`37*48=` problems labelled with the product (`1776`), operands in [`config.min_operand`, `config.max_operand`],
    for episodes with the `Calculator` tool; otherwise as `ArithmeticPrompts`: the same (seed, cursor) stream and
    state."""

    def draw_one(self, rng: random.Random) -> Problem:
        return make_calc_problems(rng, 1, self.config.min_operand, self.config.max_operand)[0]


class PromptDataset:
    """A user's prompts (`data.path`, or `candidates` made elsewhere: reasoning-gym's tasks), cycled epoch after epoch
    in a seeded order, `batch_size` per batch.

    Rows whose prompt (after the chat template) the tokenizer cannot hold (`_holds`) are refused, or with
    `config.untokenizable=filter` skipped; rows with more than `max_prompt_tokens` tokens are skipped; both are
    counted in `filtered`. Epoch e visits every kept prompt once, in file order or (with `config.shuffle`) in a
    permutation drawn from (seed, e); batches run on across epoch boundaries, so one batch may hold the end of an
    epoch and the start of the next, and a dataset smaller than a batch repeats within it.
    """

    def __init__(self, config: DataConfig, seed: int, batch_size: int, tokenizer: Any, max_prompt_tokens: int,
                 candidates: list[tuple[str, str, Any]] | None = None, name: str | None = None):
        """`candidates`: (where, prompt text, label) rows already rendered, named `name` in messages; None reads
        `config.path`."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.seed = seed
        self.batch_size = batch_size
        self.shuffle = config.shuffle
        self.path = name or config.path
        if candidates is None:
            candidates = [(where, _render_prompt(config, tokenizer, where, row), _label(config, where, row))
                          for where, row in read_rows(config)]
        if not candidates:
            raise DataError(f"{self.path}: holds no rows; add prompts or point data.path at another file")
        token_ids, held = _tokenize(tokenizer, [text for _, text, _ in candidates])
        _refuse_untokenizable(config, tokenizer, candidates, token_ids, held)
        lengths = [len(ids) for ids in token_ids]
        kept = [Problem(prompt=text, label=label, prompt_ids=ids) for (_, text, label), ids, ok
                in zip(candidates, token_ids, held) if ok and len(ids) <= max_prompt_tokens]
        self.filtered = len(candidates) - len(kept)
        if not kept:
            raise DataError(_nothing_kept(self.path, lengths, held, max_prompt_tokens))
        self.problems = [p for p in kept if not is_held_out(p.prompt, config.held_out)]
        self.held_out = [p for p in kept if is_held_out(p.prompt, config.held_out)]  # `data.held_out`, in file order
        self.num_prompts = len(self.problems)
        if not self.problems:
            raise DataError(f"{self.path}: data.held_out={config.held_out:g} leaves no prompt to train on of the "
                            f"{len(kept)} kept; choose another data.held_out")
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
                f"{self.num_prompts}; resume with the same data, filter settings and model, or start a new run")
        self.consumed = _count(state, "consumed")

    def metrics(self) -> dict[str, float]:
        """`data/epoch`: epochs completed so far (fractional); `data/filtered_prompts`: rows too long to keep, or
        (with `data.untokenizable=filter`) that the tokenizer cannot hold."""
        return {"data/epoch": self.consumed / self.num_prompts, "data/filtered_prompts": float(self.filtered)}


def _nothing_kept(name: str, lengths: list[int], held: list[bool], max_prompt_tokens: int) -> str:
    """Why no prompt was kept, and the fix."""
    unheld = held.count(False)
    if unheld == len(held):
        return (f"{name}: the tokenizer cannot hold any of the {unheld} prompts (data.untokenizable=filter skipped "
                "them all); use a model whose tokenizer covers the text")
    shortest = min(n for n, ok in zip(lengths, held) if ok)
    skipped = f", and {unheld} untokenizable ones were skipped" if unheld else ""
    return (f"{name}: all {len(held) - unheld} prompts are longer than max_prompt_tokens={max_prompt_tokens} tokens "
            f"(the shortest has {shortest}){skipped}; raise data.max_prompt_tokens or rollout.max_model_len")


def make_prompt_source(config: DataConfig, seed: int, batch_size: int, model_path: str | None,
                       max_prompt_tokens: int) -> ArithmeticPrompts | ChainSumPrompts | CalcPrompts | PromptDataset:
    """The prompt source `config.task` names; a dataset's or reasoning-gym's templates, lengths and round trip use the
    model's tokenizer (`model_path` None: the demo model's, made in memory, the same as the one its directory will
    hold). reasoning-gym's tasks are generated here, so an unknown dataset name or a missing package is a DataError
    before anything starts."""
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
    if config.task == "reasoning_gym":
        from cluster.run.reasoning_gym import reasoning_gym_prompts

        candidates = reasoning_gym_prompts(config, seed, tokenizer)
        return PromptDataset(config, seed, batch_size, tokenizer, max_prompt_tokens, candidates, "data.reasoning_gym")
    return PromptDataset(config, seed, batch_size, tokenizer, max_prompt_tokens)


def is_held_out(prompt: str, share: float) -> bool:
    """Whether `prompt` is in the share `share` of problems held out of training (`data.held_out`): the first 8 bytes
    of the SHA-256 of its text, read as a fraction of 2^64, fall below `share`. The same on every machine, Python
    and seed."""
    if share <= 0:
        return False
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") < share * 2**64


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
    return apply_chat_template(config, tokenizer, where, messages)


def _label(config: DataConfig, where: str, row: dict[str, Any]) -> Any:
    field = config.label_field
    if field is None:
        return None
    if field not in row:
        raise DataError(f"{where}: has no field '{field}' (fields: {', '.join(row) or 'none'}); add a label to "
                        "every row, set data.label_field, or set it to null for no labels")
    if row[field] is None:  # also how Parquet and datasets store a row that lacks the field
        raise DataError(f"{where}: field '{field}' is null; give every row a label or set data.label_field=null")
    if config.label_format == "json" and isinstance(row[field], str):
        try:
            return json.loads(row[field])
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: field '{field}' is not JSON text ({err.msg} at column {err.colno}) but "
                            "data.label_format=json; write labels with json.dumps, or set data.label_format=value"
                            ) from None
    return row[field]


def _tokenize(tokenizer: Any, texts: list[str]) -> tuple[list[np.ndarray], list[bool]]:
    """Each prompt's token ids (int32), without special tokens (chat templates write theirs into the text), as the
    engines would encode it: they get these ids and do not tokenise the text again; and whether the tokenizer holds
    it (`_holds`), checked chunk by chunk on the lists the tokenizer returned."""
    ids: list[np.ndarray] = []
    held: list[bool] = []
    for start in range(0, len(texts), _TOKENIZE_CHUNK):
        chunk = texts[start:start + _TOKENIZE_CHUNK]
        # verbose=False: transformers' warning about prompts over the model's length is ours to give (the filter).
        encoded = tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]
        held.extend(_holds(tokenizer, chunk, encoded))
        ids.extend(np.asarray(row, dtype=np.int32) for row in encoded)
    return ids, held


def _holds(tokenizer: Any, texts: list[str], token_ids: list[list[int]]) -> list[bool]:
    """Per prompt: its token ids decode back to its text, spaces aside, and hold no more unknown tokens than the text
    writes out literally. Decoded as the ids were encoded: special tokens kept (a chat template writes them as text),
    no clean-up of spaces. Spaces (U+0020) are not compared: SentencePiece tokenizers (Llama 2, Mistral v0.1) add or
    drop one at the start and after special tokens; every other character is, so a dropped letter, newline or tab, a
    replaced or normalised character, or an unknown token is caught. One decode call for the batch."""
    unk_id, unk = getattr(tokenizer, "unk_token_id", None), getattr(tokenizer, "unk_token", None)
    held = []
    for text, ids, decoded in zip(texts, token_ids, _decode(tokenizer, token_ids)):
        same = decoded == text or decoded.replace(" ", "") == text.replace(" ", "")
        unknown = unk_id is not None and ids.count(unk_id) > (text.count(unk) if unk else 0)
        held.append(same and not unknown)
    return held


def _refuse_untokenizable(config: DataConfig, tokenizer: Any, candidates: list[tuple[str, str, Any]],
                          token_ids: list[np.ndarray], held: list[bool]) -> None:
    """With `config.untokenizable=refuse`, the first prompt the tokenizer does not hold is a DataError naming its row
    and the first character its token ids do not reproduce (`filter` skips them: the caller's business)."""
    if config.untokenizable != "refuse" or all(held):
        return
    index = held.index(False)
    where, text, _ = candidates[index]
    at = _first_difference(text, _decode(tokenizer, [token_ids[index].tolist()])[0])
    shown = f"character {at} ({text[at]!r})" if at < len(text) else f"its end ({len(text)} characters)"
    name = getattr(tokenizer, "name_or_path", "")
    raise DataError(
        f"{where}: {f'the tokenizer of {name!r}' if name else 'the model tokenizer'} cannot hold the prompt: its "
        f"token ids decode to other text from {shown} on; use a model whose tokenizer covers the text, fix the row, "
        "or set data.untokenizable=filter to skip such prompts")


def _decode(tokenizer: Any, token_ids: list[list[int]]) -> list[str]:
    """The texts `token_ids` stand for, special tokens kept, spaces not cleaned up: a fast tokenizer's backend decodes
    the batch at once, a slow one each row."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode_batch(token_ids, skip_special_tokens=False)
    return tokenizer.batch_decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _first_difference(text: str, decoded: str) -> int:
    """Index in `text` of the first character (spaces skipped) that `decoded` does not reproduce; `len(text)` when
    `decoded` only adds text after it, or when they differ only in unknown tokens written out literally."""
    i = j = 0
    while True:
        while i < len(text) and text[i] == " ":
            i += 1
        while j < len(decoded) and decoded[j] == " ":
            j += 1
        if i == len(text) or j == len(decoded) or text[i] != decoded[j]:
            return min(i, len(text))
        i, j = i + 1, j + 1


def _count(state: Mapping[str, Any], key: str) -> int:
    value = state.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"data state must hold a non-negative integer '{key}', got {dict(state)!r}")
    return value

"""reasoning-gym's procedural tasks as relay's prompts (`data.task=reasoning_gym`), and their export to a file that
`data.task=dataset` reads.

Owns: building reasoning-gym's composite dataset from `data.reasoning_gym` (a missing package, an unknown dataset
name or a setting its config refuses is one DataError line, raised when the driver makes its prompt source, before
any actor starts), each entry's prompt with the instruction (`data.system_prompt`, else reasoning-gym's default
system prompt, which asks for `<answer>` tags: a system message with the chat template, a prefix without), the
entries as labels (whole and as reasoning-gym made them: its scorers compare some metadata as tuples; with their
dataset's config under `config`, which the verifier scores with), and `export`
(`python -m cluster.run.reasoning_gym OUT [overrides]`).
Does not own: epochs, batches, tokenisation and the tokenizer round trip (`cluster/run/data.py`'s `PromptDataset`),
scoring (`rewards/`: the `reasoning_gym` verifier), importing the package (`rewards/reasoning_gym.py`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
from pathlib import Path
from typing import Any

from cluster.config import DataConfig
from cluster.run.prompt_format import DataError, apply_chat_template, write_prompts
from rewards.reasoning_gym import dataset_names, import_reasoning_gym


def reasoning_gym_prompts(config: DataConfig, seed: int, tokenizer: Any) -> list[tuple[str, str, Any]]:
    """(where, prompt text, entry) for each of the `config.reasoning_gym.size` entries, in index order; `where` names
    the entry for messages ("data.reasoning_gym entry 3 (leg_counting)")."""
    _, entries = generate(config, seed)
    text = instruction(config)
    rows = []
    for index, entry in enumerate(entries):
        where = f"data.reasoning_gym entry {index} ({entry['metadata']['source_dataset']})"
        prompt = render(config, entry["question"], text)
        rows.append((where, prompt if isinstance(prompt, str) else
                     apply_chat_template(config, tokenizer, where, prompt), entry))
    return rows


def instruction(config: DataConfig) -> str:
    """What every prompt asks besides its question: `config.system_prompt`, else reasoning-gym's default system
    prompt (`reasoning_gym.utils.SYSTEM_PROMPTS["default"]`: think step by step, answer in `<answer>` tags)."""
    if config.system_prompt is not None:
        return config.system_prompt
    _package()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


def render(config: DataConfig, question: str, text: str) -> str | list[dict[str, str]]:
    """The prompt of one entry: with `config.chat_template`, a system message `text` and a user message `question`
    (rendered later with the tokenizer's template); without, `text` (trailing newlines dropped), a blank line, then
    `question` (the question alone when `text` is empty)."""
    if config.chat_template:
        return [{"role": "system", "content": text}, {"role": "user", "content": question}]
    return f"{text.rstrip(chr(10))}\n\n{question}" if text else question


def generate(config: DataConfig, seed: int) -> tuple[Any, list[dict[str, Any]]]:
    """reasoning-gym's composite dataset of `config.reasoning_gym` (seed: its own, else `seed`) and its entries, each
    with its dataset's settings (`data.reasoning_gym.datasets.<name>.config`) under `config`: the `reasoning_gym`
    verifier scores with the dataset so configured (several scorers read their config), in the run and from an
    exported file alike."""
    package = _package()
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    settings = config.reasoning_gym
    specs = []
    for name, spec in settings.datasets.items():
        _check_dataset(package, name, spec.config)
        specs.append(DatasetSpec(name=name, weight=spec.weight, config=dict(spec.config)))
    composite = CompositeConfig(size=settings.size, seed=seed if settings.seed is None else settings.seed,
                                datasets=specs)
    try:
        dataset = CompositeDataset(composite)
        entries = [dataset[index] for index in range(settings.size)]
        entries = [{**entry, "config": dict(settings.datasets[entry["metadata"]["source_dataset"]].config)}
                   for entry in entries]
    except Exception as err:  # settings each config accepted but its generator did not: the user's to change
        raise DataError(f"data.reasoning_gym: reasoning-gym could not generate the entries "
                        f"({' '.join(str(err).split()) or type(err).__name__}); change the datasets' config") from err
    return dataset, entries


def export(config: DataConfig, seed: int, path: str | Path) -> int:
    """Writes the entries of `config.reasoning_gym` with their prompts (`render`: chat messages with
    `config.chat_template`, else text) to `path` (`.jsonl`, `.parquet` or a `datasets` directory:
    `cluster.run.prompt_format.write_prompts`), each labelled with its whole entry; returns the rows written. Train on
    it with `data.task=dataset data.label_format=json` and the `reasoning_gym` verifier. An entry that JSON cannot carry
    faithfully (its dataset scores its own answer differently after a JSON round trip: tuples become lists) is a
    DataError naming the dataset: train that one with `data.task=reasoning_gym`."""
    dataset, entries = generate(config, seed)
    text = instruction(config)
    for index, entry in enumerate(entries):
        _check_json_faithful(dataset, index, entry)
    write_prompts(path, [{"prompt": render(config, entry["question"], text), "label": entry} for entry in entries])
    return len(entries)


def _package() -> Any:
    try:
        return import_reasoning_gym()
    except ValueError as err:
        raise DataError(f"data.task=reasoning_gym: {err}") from None


def _check_dataset(package: Any, name: str, settings: dict[str, Any]) -> None:
    """One DataError line for a name reasoning-gym does not register (with the closest ones) or settings its config
    class refuses (an unknown field, or its own `validate`)."""
    names = dataset_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else f"it has {len(names)}, e.g. {', '.join(names[:4])}"
        raise DataError(f"data.reasoning_gym.datasets: reasoning-gym has no dataset {name!r}; {hint} (all: python "
                        "-c \"import reasoning_gym.factory as f; print(sorted(f.DATASETS))\")")
    from reasoning_gym.factory import DATASETS

    config_class = DATASETS[name][1]
    fields = [field.name for field in dataclasses.fields(config_class)]
    unknown = [key for key in settings if key not in fields]
    where = f"data.reasoning_gym.datasets.{name}.config"
    if unknown:
        raise DataError(f"{where}: {name} has no setting {unknown[0]!r}; its settings: {', '.join(fields)}")
    try:
        checked = config_class(**settings)
        if hasattr(checked, "validate"):
            checked.validate()
    except (AssertionError, ValueError, TypeError) as err:  # reasoning-gym's configs check with assert
        raise DataError(f"{where}: {' '.join(str(err).split()) or 'rejected by ' + config_class.__name__}") from None


def _check_json_faithful(dataset: Any, index: int, entry: dict[str, Any]) -> None:
    try:
        back = json.loads(json.dumps(entry))
    except (TypeError, ValueError) as err:
        raise DataError(f"data.reasoning_gym entry {index} ({entry['metadata']['source_dataset']}) cannot be "
                        f"written as JSON ({err}); train it with data.task=reasoning_gym") from None
    if back != entry:
        before, after = dataset.score_answer(entry["answer"], entry), dataset.score_answer(entry["answer"], back)
        if before != after:
            name = entry["metadata"]["source_dataset"]
            raise DataError(f"reasoning-gym dataset {name!r} does not survive JSON: its scorer gives entry {index}'s "
                            f"own answer {before} but {after} after a JSON round trip (tuples become lists); train it "
                            "with data.task=reasoning_gym instead of an exported file")


USAGE = ("usage: python -m cluster.run.reasoning_gym OUT.jsonl|OUT.parquet|OUT_DIR [key=value ...]\n"
         "  e.g. python -m cluster.run.reasoning_gym rg.parquet data.reasoning_gym.datasets.leg_counting.weight=1 "
         "data.reasoning_gym.size=500 seed=1")


def main(argv: list[str] | None = None) -> int:
    """Export reasoning-gym entries for `data.task=dataset`: OUT, then the run config's dotted overrides (the task is
    `reasoning_gym`; `data.chat_template=true` writes chat messages). Exit 2 with one line on bad input."""
    from cluster.config import ConfigError, load_config

    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-") or "=" in args[0]:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        config = load_config(None, ["data.task=reasoning_gym", *args[1:]])
        rows = export(config.data, config.seed, args[0])
    except (ConfigError, DataError) as err:
        print(f"relay: config error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {rows} entries to {args[0]}; train on them with data.task=dataset data.path={args[0]} "
          "data.label_format=json reward.sources.correct.verifier=reasoning_gym")
    return 0


if __name__ == "__main__":
    sys.exit(main())

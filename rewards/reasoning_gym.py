"""reasoning-gym, the optional package (`pip install -e '.[reasoning-gym]'` in relay's checkout), as relay's rewards
and prompt source reach it: imported on first use, with a one-line install hint when it is missing.

Owns: `import_reasoning_gym` (the import and its error), `dataset_names`, `check_entry` (is a label a reasoning-gym
entry: question, answer, metadata naming its source dataset) and `score_answer_fn` (the `score_answer` of the entry's
dataset built with the config the label records, once per dataset and config). Does not own: the verifier
(`rewards/verifiers.py`: `reasoning_gym_match`), prompts and the config they record (`cluster/run/reasoning_gym.py`).
Nothing here imports reasoning-gym at module import time.
"""

from __future__ import annotations

import dis
import functools
import json
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

INSTALL = "pip install -e '.[reasoning-gym]' in relay's checkout (or pip install reasoning-gym==0.1.25)"
_IMPORT_LOCK = threading.Lock()


def import_reasoning_gym() -> ModuleType:
    """The `reasoning_gym` package; a ValueError naming the install command when it cannot be imported."""
    with _IMPORT_LOCK, warnings.catch_warnings():
        # One of its dependencies (cellpylib) compiles with SyntaxWarnings; they say nothing about the user's run.
        warnings.simplefilter("ignore", SyntaxWarning)
        try:
            import reasoning_gym
        except ImportError as err:
            raise ValueError(f"reasoning-gym is not installed ({err}); install it with {INSTALL}") from None
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset name the installed reasoning-gym registers, sorted (its composite excluded: relay mixes)."""
    import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(name for name in DATASETS if name != "composite")


def check_entry(label: Any, who: str = "reasoning_gym") -> dict[str, Any]:
    """`label` itself if it is a reasoning-gym entry (an object with `question`, `answer` and `metadata` whose
    `source_dataset` names the dataset that made it); else a one-line ValueError saying what it is and the fix."""
    if isinstance(label, dict) and "answer" in label and "question" in label and \
            isinstance(label.get("metadata"), dict) and isinstance(label["metadata"].get("source_dataset"), str):
        return label
    if isinstance(label, str) and _holds_entry(label):
        raise ValueError(f"{who}: the label is JSON text of a reasoning-gym entry, not the entry; read the file with "
                         "data.label_format=json")
    raise ValueError(f"{who}: the label {_shown(label)} is not a reasoning-gym entry (an object with question, answer "
                     "and metadata.source_dataset); train with data.task=reasoning_gym, or label each row with its "
                     "whole entry")


def score_answer_fn(entry: dict[str, Any]) -> Callable[[str | None, dict[str, Any]], float]:
    """The `score_answer(answer, entry)` of the dataset that made `entry` (a `check_entry` label), built with the
    settings the entry records in its `config` key (`cluster/run/reasoning_gym.py` writes the run's
    `data.reasoning_gym.datasets.<name>.config` there): several scorers read their dataset's config
    (decimal_arithmetic's tolerance, time_intervals' partial credit, puzzle24's value range). An entry without
    `config` is scored with the dataset's defaults only where its scorer reads nothing of its dataset
    (`_reads_dataset`); elsewhere, and for settings the installed version refuses, a one-line ValueError."""
    name = entry["metadata"]["source_dataset"]
    if name not in dataset_names():
        raise ValueError(f"reasoning_gym: metadata.source_dataset {name!r} is not a dataset of the installed "
                         f"reasoning-gym {_version()}; install the version that wrote the entries")
    settings = entry.get("config")
    if settings is None and _reads_dataset(name):
        raise ValueError(f"reasoning_gym: the label of a {name} entry does not record its dataset's config, which "
                         f"its scorer reads; make the entries with data.task=reasoning_gym or export them with "
                         f"python -m cluster.run.reasoning_gym, or add \"config\": {{...}} (the settings the entry "
                         "was made with, {} for reasoning-gym's defaults) to each label")
    if not isinstance(settings, dict | None):
        raise ValueError(f"reasoning_gym: the label's config for {name} is not an object of its settings "
                         f"({_shown(settings)}); record them as {{\"setting\": value, ...}}")
    return _scorer(name, json.dumps(settings or {}, sort_keys=True))


@functools.lru_cache(maxsize=256)
def _scorer(name: str, settings: str) -> Callable[[str | None, dict[str, Any]], float]:
    """Dataset `name` built with `settings` (JSON text: a cache key), as reasoning-gym's `create_dataset` builds it;
    its `score_answer`. Cached: some datasets load data files when built."""
    from reasoning_gym.factory import DATASETS

    dataset_cls, config_cls = DATASETS[name]
    try:
        config = config_cls(**json.loads(settings))
        if hasattr(config, "validate"):
            config.validate()
        return dataset_cls(config=config).score_answer
    except (AssertionError, TypeError, ValueError) as err:  # reasoning-gym's configs check with assert
        raise ValueError(f"reasoning_gym: the label's config for {name} ({_shown(json.loads(settings))}) is refused "
                         f"by the installed reasoning-gym {_version()}: {' '.join(str(err).split())}; record the "
                         "settings the entry was made with, from the version that made it") from None


def _reads_dataset(name: str) -> bool:
    """Whether dataset `name`'s `score_answer` may read its dataset (`self`: the config, or methods that do); False
    only where its code never loads `self` (reasoning-gym's base scorer, and many that compare with the entry)."""
    from reasoning_gym.factory import DATASETS

    code = getattr(DATASETS[name][0].score_answer, "__code__", None)
    if code is None or "self" in code.co_cellvars:
        return True
    return any("self" in (names if isinstance(names := instruction.argval, tuple) else (names,))  # 3.13 pairs them
               for instruction in dis.get_instructions(code) if instruction.opname.startswith("LOAD_FAST"))


def _shown(value: Any) -> str:
    shown = json.dumps(value, default=repr)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _holds_entry(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and isinstance(value.get("metadata"), dict) and "answer" in value


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("reasoning-gym")
    except PackageNotFoundError:
        return "(version unknown)"

"""reasoning-gym, the optional package (`pip install 'relay-rl[reasoning-gym]'`), as relay's rewards and prompt source
reach it: imported on first use, with a one-line install hint when it is missing.

Owns: `import_reasoning_gym` (the import and its error), `dataset_names`, `check_entry` (is a label a reasoning-gym
entry: question, answer, metadata naming its source dataset) and `score_answer_fn` (each dataset's own
`score_answer`, built once per name). Does not own: the verifier (`rewards/verifiers.py`: `reasoning_gym_match`),
prompts (`cluster/run/reasoning_gym.py`). Nothing here imports reasoning-gym at module import time.
"""

from __future__ import annotations

import functools
import json
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

INSTALL = "pip install 'relay-rl[reasoning-gym]'"
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
    shown = json.dumps(label, default=repr)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise ValueError(f"{who}: the label {shown} is not a reasoning-gym entry (an object with question, answer and "
                     "metadata.source_dataset); train with data.task=reasoning_gym, or label each row with its "
                     "whole entry")


@functools.lru_cache(maxsize=None)
def score_answer_fn(name: str) -> Callable[[str | None, dict[str, Any]], float]:
    """Dataset `name`'s own `score_answer(answer, entry)` (reasoning-gym's `get_score_answer_fn`: an instance with
    the dataset's default config; its scorers read the entry, not the config). One instance per name: some load
    data files when built. A ValueError for a name the installed version does not register."""
    package = import_reasoning_gym()
    if name not in dataset_names():
        raise ValueError(f"reasoning_gym: metadata.source_dataset {name!r} is not a dataset of the installed "
                         f"reasoning-gym {_version()}; install the version that wrote the entries")
    return package.get_score_answer_fn(name)


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

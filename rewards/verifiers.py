"""Rule verifiers: pure functions (completion, label) -> reward, and step verifiers (steps, label) -> one reward per
step.

Owns: exact, numeric, mathematical (math-verify) and format matching of one completion against one label, scoring
it with a reasoning-gym entry's own dataset (`reasoning_gym_match`; the optional package is imported on first use,
`rewards/reasoning_gym.py`), and matching each step against the label's (`step_match`).
Does not own: the name -> function table and resolving a config's spec (`rewards/registry.py`: `load_verifier`),
batching, weighting of several reward sources,
time limits (callers that need a deadline enforce it around the call), remote verifiers or reward models.

Data errors (a label that is not a number, a bad regex, unknown params) raise `ValueError`; a completion that
cannot be read is a wrong answer and scores 0.0.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Sequence
from typing import Any

from math_verify import LatexExtractionConfig, parse, verify

from rewards.reasoning_gym import check_entry, import_reasoning_gym, score_answer_fn

# A number as written in prose: optional sign, thousands separators (1,234), decimals (.5, 3.25), an exponent
# (1.5e3) and a trailing percent sign that is read as a unit (50% -> 50). A minus right after a word character or
# a closing bracket is subtraction, not a sign: "10-3" ends in 3, not -3.
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])[-+])?"
    r"(?<![\d.])(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d*\.\d+|\d+)"
    r"(?:[eE][-+]?\d+)?"
    r"(?:\s*%)?"
)
_TAG_NAME = re.compile(r"[A-Za-z_][\w.:-]*")


def exact_match(completion: str, label: Any) -> float:
    """1.0 iff the completion is exactly ``str(label)``, else 0.0.

    No stripping: the completion already stops before end-of-sequence, so trailing text or whitespace is an error.
    """
    return 1.0 if completion == str(label) else 0.0


def numeric_match(completion: str, label: Any, tolerance: float = 1e-6) -> float:
    """1.0 iff the last number in the completion equals the label within ``tolerance``, else 0.0.

    The last-number rule of GSM8K grading (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems"):
    ``|x - y| <= max(tolerance * max(|x|, |y|), tolerance)`` (``math.isclose``, relative for large values).
    A label "... #### 72" is read after the last "####". A label that is not a number raises ``ValueError``.
    """
    if tolerance < 0:
        raise ValueError(f"numeric_match: tolerance must be >= 0, got {tolerance}")
    target = _label_number(label)
    numbers = _NUMBER.findall(completion)
    if not numbers:
        return 0.0
    return 1.0 if math.isclose(_to_float(numbers[-1]), target, rel_tol=tolerance, abs_tol=tolerance) else 0.0


_MATH_VERIFY_SECONDS = 5


def math_verify_match(completion: str, label: Any) -> float:
    """1.0 iff the completion's answer is mathematically equal to the label per math-verify, else 0.0.

    math-verify (Hugging Face, github.com/huggingface/Math-Verify) extracts the answer (``\\boxed{}``, ``$...$``,
    "final answer is ...", else the last expression), parses it to SymPy and compares numerically and symbolically:
    ``\\frac{1}{2}`` == 0.5 == 1/2, sets, intervals, and a percentage "50%" equals both 50 and 0.5.
    The label is read as LaTeX inside ``\\boxed{}`` (as verl does) unless it already has ``\\boxed`` or ``$``;
    a label "... #### 72" is read after the last "####". A completion that cannot be parsed scores 0.0.
    """
    gold = _parse_gold(label)
    # A completion like \boxed{9^{9^{9}}} makes `verify` compute 9**387420489 and never return, so the completion's
    # parse and the comparison get math-verify's own deadline (5 s each; past it the answer counts as not equal) on
    # the main thread, where the driver scores. Its deadline is signal.alarm, which raises elsewhere: in worker
    # threads (the verifier service) the caller owns the deadline (the service's sample_timeout).
    deadline = _MATH_VERIFY_SECONDS if threading.current_thread() is threading.main_thread() else None
    answer = parse(completion, parsing_timeout=deadline)
    return 1.0 if verify(gold, answer, timeout_seconds=deadline) else 0.0


def format_match(
    completion: str, label: Any, pattern: str | None = None, tags: Sequence[str] | None = None
) -> float:
    """1.0 iff the completion has the required format, else 0.0; the label is ignored.

    ``pattern``: the whole completion matches the regular expression (``re.fullmatch``, ``re.DOTALL``).
    ``tags``: every ``<tag>...</tag>`` pair appears, well formed and in the given order (e.g. ``["think", "answer"]``
    as in DeepSeek-R1's format reward). With both, both must hold.
    """
    if pattern is None and not tags:
        raise ValueError("format: give `pattern` (a regular expression) and/or `tags` (e.g. ['think', 'answer'])")
    tag_names = _tag_names(tags or [])
    if pattern is not None:
        try:
            compiled = re.compile(pattern, re.DOTALL)
        except re.error as error:
            raise ValueError(f"format: invalid regular expression {pattern!r} ({error}); fix `pattern`") from error
        if compiled.fullmatch(completion) is None:
            return 0.0
    return 1.0 if _has_tags_in_order(completion, tag_names) else 0.0


def reasoning_gym_match(completion: str, label: Any, tag: str = "answer", extract: str = "tag") -> float:
    """reasoning-gym's own score of the completion's answer, in [0, 1]: the label is a reasoning-gym entry
    (question, answer, metadata naming its `source_dataset`, and the `config` its dataset was made with), scored by
    that dataset's `score_answer` built with that config (`rewards/reasoning_gym.py`: `score_answer_fn`; some give
    partial credit, e.g. 0.05 for a well-formed wrong board).

    The answer, by reasoning-gym's convention (its system prompts ask for it): with ``extract="tag"`` the text of the
    last ``<tag>...</tag>`` (``tag`` "answer" by default), stripped, as `reasoning_gym.utils.extract_answer` reads it;
    no such pair is no answer (every dataset scores it 0.0). With ``extract="none"`` the whole completion, stripped.
    An answer the dataset's scorer cannot read (some raise on text they cannot parse) scores 0.0, unless the scorer
    also fails on the entry's own answer: then the label is at fault and this raises ``ValueError``, as it does for a
    label that is not an entry.
    """
    check_reasoning_gym_params(tag, extract, import_package=False)
    entry = check_entry(label)
    score = score_answer_fn(entry)
    if extract == "tag":
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(completion, tag_name=tag)
    else:
        answer = completion.strip()
    try:
        return float(score(answer, entry))
    except Exception:  # the model's text, unreadable to the scorer: a wrong answer, unless the entry is the problem
        try:
            score(entry["answer"], entry)
        except Exception as err:
            raise ValueError(f"reasoning_gym: the {entry['metadata']['source_dataset']} scorer fails on the label's "
                             f"own answer ({err!r}); the label is not an entry as reasoning-gym wrote it") from err
        return 0.0


def check_reasoning_gym_params(tag: str = "answer", extract: str = "tag", import_package: bool = True) -> None:
    """Raises ValueError (one line) if `reasoning_gym_match` cannot run with these params: `extract` not `tag` or
    `none`, `tag` not a tag name, or (``import_package``) reasoning-gym not installed. Run when the verifier loads."""
    if extract not in ("tag", "none"):
        raise ValueError(f"reasoning_gym: extract must be 'tag' (the answer in <tag>...</tag>) or 'none' (the whole "
                         f"completion), got {extract!r}")
    if not isinstance(tag, str) or not _TAG_NAME.fullmatch(tag):
        raise ValueError(f"reasoning_gym: tag {tag!r} is not a tag name; write 'answer', not '<answer>'")
    if import_package:
        import_reasoning_gym()


def step_match(steps: Sequence[str], label: Any, separator: str | None = None) -> list[float]:
    """A step verifier: step j earns 1.0 iff its text (stripped of surrounding whitespace) equals the label's step j.

    The label's steps: a list (each item as ``str``), or a string split on ``separator`` (whitespace when None), so
    the `chain_sum` demo's label ``"46 102"`` has steps ``46`` and ``102``. Steps beyond the label's count earn 0.0
    (an answer with extra steps is not rewarded for them).
    """
    expected = ([str(item).strip() for item in label] if isinstance(label, (list, tuple))
                else str(label).split(separator))
    return [1.0 if j < len(expected) and step.strip() == expected[j].strip() else 0.0 for j, step in enumerate(steps)]


def _label_number(label: Any) -> float:
    """The label as a float: a number, or a string holding one number (after "####" if present)."""
    if isinstance(label, bool):
        raise ValueError(f"numeric_match: label {label!r} is not a number; fix the dataset's label column")
    if isinstance(label, (int, float)):
        value = float(label)
    elif isinstance(label, str) and _NUMBER.fullmatch(_after_hashes(label)):
        value = _to_float(_after_hashes(label))
    else:
        raise ValueError(f"numeric_match: label {label!r} is not a number; fix the dataset's label column")
    if not math.isfinite(value):
        raise ValueError(f"numeric_match: label {label!r} is not a finite number; fix the dataset's label column")
    return value


def _to_float(number: str) -> float:
    """A string matched by ``_NUMBER`` as a float: separators and the percent sign dropped."""
    return float(number.replace(",", "").rstrip("% \t\n"))


def _after_hashes(label: str) -> str:
    """GSM8K's label format: the reasoning, then "#### <answer>"; anything else unchanged. Stripped."""
    return label.rpartition("####")[2].strip()


def _parse_gold(label: Any) -> list[Any]:
    """The label parsed by math-verify; raises if nothing in it is an answer."""
    text = _after_hashes(str(label))
    if "\\boxed" in text or "$" in text:
        gold = parse(text, parsing_timeout=None)
    else:
        # Bare LaTeX such as "\sqrt{2}" or "(1, 2]" is only recognised inside a LaTeX environment.
        gold = parse(f"\\boxed{{{text}}}", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    if not gold:
        raise ValueError(f"math_verify: label {label!r} has no answer math-verify can parse; fix the dataset's label")
    return gold


def _tag_names(tags: Sequence[str]) -> list[str]:
    """Validated tag names; a bare string would otherwise be read as one tag per character."""
    if isinstance(tags, str):
        raise ValueError(f"format: tags must be a list of tag names like ['think', 'answer'], got the string {tags!r}")
    for tag in tags:
        if not isinstance(tag, str) or not _TAG_NAME.fullmatch(tag):
            raise ValueError(f"format: tag {tag!r} is not a tag name; write 'answer', not '<answer>'")
    return list(tags)


def _has_tags_in_order(completion: str, tags: list[str]) -> bool:
    """Each ``<tag>...</tag>`` found after the previous one's end; no second ``<tag>`` before the closing one."""
    position = 0
    for tag in tags:
        opening, closing = f"<{tag}>", f"</{tag}>"
        start = completion.find(opening, position)
        if start < 0:
            return False
        end = completion.find(closing, start + len(opening))
        if end < 0 or opening in completion[start + len(opening):end]:
            return False
        position = end + len(closing)
    return True

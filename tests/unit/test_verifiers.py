"""Rule verifiers against hand-written expectations, the registry's names, and `load_verifier`'s errors."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from rewards.registry import RULE_VERIFIERS, load_verifier
from rewards.verifiers import exact_match, format_match, math_verify_match, numeric_match, reasoning_gym_match

GSM8K_LABEL = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips in April and May.\n#### 72"
LONG_PROSE = "word " * 20_000  # 100,000 characters


# ---------------------------------------------------------------- exact_match


@pytest.mark.parametrize(
    ("completion", "label", "expected"),
    [
        ("82", "82", 1.0),
        ("82", 82, 1.0),  # compared with str(label)
        ("82.0", 82, 0.0),  # str(82) is "82": no numeric reading
        ("82 ", "82", 0.0),  # no stripping
        ("", "", 1.0),
        ("", "82", 0.0),
    ],
)
def test_exact_match(completion: str, label: Any, expected: float) -> None:
    assert exact_match(completion, label) == expected


def test_exact_match_is_reexported_from_arithmetic() -> None:
    from cluster.demo import task as arithmetic

    assert arithmetic.exact_match is exact_match


# ---------------------------------------------------------------- numeric_match


@pytest.mark.parametrize(
    ("completion", "label", "expected"),
    [
        ("72", "72", 1.0),
        ("The answer is 72.", 72, 1.0),  # the sentence's full stop is not a decimal point
        ("72.0", "72", 1.0),
        ("72", 72.0, 1.0),
        ("73", 72, 0.0),
        ("She has 1,234 apples", 1234, 1.0),  # thousands separator
        ("1,234,567", "1234567", 1.0),
        ("Total: $1,234.50", "1234.5", 1.0),
        ("1234", "1,234", 1.0),  # the label is read with the same grammar
        ("-5", -5, 1.0),
        ("x = -5", "-5", 1.0),
        ("(-3)", -3, 1.0),
        ("5", -5, 0.0),
        ("10-3=7", 7, 1.0),
        ("pages 10-15", 15, 1.0),  # a minus after a digit is subtraction: the last number is 15, not -15
        ("pages 10-15", -15, 0.0),
        ("50%", 50, 1.0),  # the percent sign is a unit: 50% reads as 50 ...
        ("50 %", "50", 1.0),
        ("50%", 0.5, 0.0),  # ... not 0.5
        (".5", 0.5, 1.0),
        ("1.5e3", 1500, 1.0),
        ("first 72, then 5", 72, 0.0),  # the last number counts
        ("first 5, then 72", 72, 1.0),
        ("no digits here", 1, 0.0),
        ("", 0, 0.0),
        ("So she sold 72 clips.", GSM8K_LABEL, 1.0),  # the label after "####"
        ("So she sold 71 clips.", GSM8K_LABEL, 0.0),
        ("72", "#### 1,000", 0.0),
        ("1000", "#### 1,000", 1.0),
        (LONG_PROSE + "42", 42, 1.0),
        ("\u65e5\u672c\u8a9e\U0001f642\x00\ufffd", 42, 0.0),  # garbage unicode: no number
        # default tolerance 1e-6, relative for large values: |x - y| <= max(1e-6 * max(|x|, |y|), 1e-6)
        ("0.1 + 0.2 = 0.30000000000000004", 0.3, 1.0),
        ("1000001", 1_000_000, 1.0),  # |diff| 1 <= 1e-6 * 1000001 = 1.000001
        ("1000002", 1_000_000, 0.0),  # |diff| 2 > 1e-6 * 1000002 = 1.000002
        ("0.0000001", 0, 1.0),  # |diff| 1e-7 <= abs_tol 1e-6
        ("0.00001", 0, 0.0),  # |diff| 1e-5 > 1e-6
    ],
)
def test_numeric_match(completion: str, label: Any, expected: float) -> None:
    assert numeric_match(completion, label) == expected


def test_numeric_match_tolerance() -> None:
    # |3.14 - 3.14159| = 0.00159 <= max(1e-2 * 3.14159, 1e-2) = 0.0314..., but > 1e-6
    assert numeric_match("3.14", "3.14159", tolerance=1e-2) == 1.0
    assert numeric_match("3.14", "3.14159") == 0.0
    assert numeric_match("72", 72, tolerance=0.0) == 1.0
    with pytest.raises(ValueError, match="tolerance must be >= 0"):
        numeric_match("72", 72, tolerance=-1.0)


@pytest.mark.parametrize("label", ["seventy-two", "", "72 apples", "#### ", None, [72], True, float("nan"), "inf"])
def test_numeric_match_rejects_a_label_that_is_not_a_number(label: Any) -> None:
    with pytest.raises(ValueError, match="numeric_match: label .* is not a") as error:
        numeric_match("72", label)
    assert repr(label) in str(error.value)


# ---------------------------------------------------------------- math_verify_match


@pytest.mark.parametrize(
    ("completion", "label", "expected"),
    [
        # fractions, decimals and slashes are the same number
        ("\\frac{1}{2}", "0.5", 1.0),
        ("0.5", "\\frac{1}{2}", 1.0),
        ("1/2", "\\frac{1}{2}", 1.0),
        ("$\\frac{1}{2}$", 0.5, 1.0),
        ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("\\boxed{0.75}", "3/4", 1.0),
        ("\\boxed{\\dfrac{1}{3}}", "1/3", 1.0),
        ("0.333333", "\\frac{1}{3}", 1.0),  # floats compare rounded to 6 decimals
        ("0.333", "1/3", 0.0),
        ("3.0", 3, 1.0),
        # sqrt: inside $...$ or \boxed{} it is read; bare LaTeX without either is not extracted from a completion
        ("$\\sqrt{4}$", 2, 1.0),
        ("\\boxed{\\sqrt{4}}", "2", 1.0),
        ("2", "\\sqrt{4}", 1.0),  # a label is read as if boxed
        ("\\sqrt{4}", 2, 0.0),
        # thousands separators
        ("1,000", 1000, 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("1000", "1,000", 1.0),
        # percentages: "50%" in a completion equals both 50 and 0.5; a label "50\%" is 50%, so 0.5 and 50 match too
        ("50%", "50", 1.0),
        ("50%", "0.5", 1.0),
        ("$50\\%$", "50", 1.0),
        ("0.5", "50\\%", 1.0),
        ("50", "50\\%", 1.0),
        ("40%", "0.5", 0.0),
        # signs
        ("-3", -3, 1.0),
        ("$-3$", "-3", 1.0),
        ("3", "-3", 0.0),
        # answers in prose
        ("The answer is \\boxed{42}.", 42, 1.0),
        ("The answer is \\boxed{43}.", 42, 0.0),
        ("I think 70. Final answer: 72", 72, 1.0),
        ("first 5, finally \\boxed{6}", "6", 1.0),
        ("72 then 5", 72, 0.0),  # without an anchor the last expression is the answer
        ("\\boxed{5} and \\boxed{6}", "5", 0.0),  # two boxes read as the set {5, 6}
        (LONG_PROSE + "\\boxed{42}", "42", 1.0),
        # GSM8K labels: the part after "####"
        ("So she sold 72 clips.", GSM8K_LABEL, 1.0),
        ("\\boxed{72}", "#### 72", 1.0),
        ("\\boxed{71}", GSM8K_LABEL, 0.0),
        # sets, intervals, expressions, constants, equations
        ("$\\{1, 2\\}$", "\\{2, 1\\}", 1.0),
        ("\\boxed{(1, 2]}", "(1,2]", 1.0),
        ("\\boxed{(1, 2)}", "(1,2]", 0.0),  # open vs half-open interval
        ("$x^2 + 2x + 1$", "(x+1)^2", 1.0),
        ("\\boxed{\\pi}", "\\pi", 1.0),
        ("3.14159", "\\pi", 0.0),
        ("x = 5", 5, 1.0),
        # malformed completions are wrong answers, never errors
        ("", "42", 0.0),
        ("\\boxed{12", "12", 0.0),  # unbalanced brace: nothing is extracted
        ("}{", "1", 0.0),
        ("\\frac{", "1", 0.0),
        ("$$", "1", 0.0),
        ("\u65e5\u672c\u8a9e\U0001f642\x00\ufffd", "42", 0.0),
        ("x" * 100_000, "42", 0.0),
    ],
)
def test_math_verify_match(completion: str, label: Any, expected: float) -> None:
    assert math_verify_match(completion, label) == expected


@pytest.mark.parametrize("label", ["", "   ", "#### ", "}{"])
def test_math_verify_match_rejects_a_label_it_cannot_parse(label: str) -> None:
    with pytest.raises(ValueError, match="math_verify: label .* has no answer math-verify can parse"):
        math_verify_match("1", label)


def test_math_verify_match_works_outside_the_main_thread() -> None:
    # math-verify's default signal.alarm timeout raises "signal only works in main thread" here.
    cases = [("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("$\\sqrt{4}$", "2", 1.0), ("50%", "0.5", 1.0), ("7", "8", 0.0)] * 8
    seen_threads: set[str] = set()

    def score(case: tuple[str, str, float]) -> float:
        assert threading.current_thread() is not threading.main_thread()
        seen_threads.add(threading.current_thread().name)
        return math_verify_match(case[0], case[1])

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(score, cases))
    assert results == [expected for _, _, expected in cases]
    assert seen_threads  # the body ran (and its main-thread assertion held) in the pool


# ---------------------------------------------------------------- format_match

R1_PATTERN = r"<think>.*?</think>\s*<answer>.*?</answer>"


@pytest.mark.parametrize(
    ("completion", "pattern", "tags", "expected"),
    [
        # pattern: re.fullmatch with DOTALL
        ("<answer>42</answer>", r"<answer>\d+</answer>", None, 1.0),
        ("<answer>42</answer> and more", r"<answer>\d+</answer>", None, 0.0),  # fullmatch, not search
        ("<think>a\nb</think>\n<answer>4</answer>", R1_PATTERN, None, 1.0),  # "." crosses newlines
        ("<answer>4</answer>", R1_PATTERN, None, 0.0),
        ("", r".*", None, 1.0),
        # tags: each pair well formed, in the given order
        ("<think>x</think><answer>4</answer>", None, ["think", "answer"], 1.0),
        ("Sure. <think>x</think> so <answer>4</answer>.", None, ["think", "answer"], 1.0),  # text around is fine
        ("<think></think><answer></answer>", None, ["think", "answer"], 1.0),  # empty contents
        ("<answer>4</answer><think>x</think>", None, ["think", "answer"], 0.0),  # wrong order
        ("<think>x</think>", None, ["think", "answer"], 0.0),  # missing tag
        ("<think>x<answer>4</answer>", None, ["think", "answer"], 0.0),  # <think> never closed
        ("</think>x<think>", None, ["think"], 0.0),  # closed before opened
        ("<think><think>x</think>", None, ["think"], 0.0),  # a second opening before the close
        ("<Think>x</Think>", None, ["think"], 0.0),  # case-sensitive
        ("", None, ["answer"], 0.0),
        # both: both must hold
        ("<answer>42</answer>", r"<answer>\d+</answer>", ["answer"], 1.0),
        ("<answer>4x</answer>", r"<answer>\d+</answer>", ["answer"], 0.0),  # tags hold, pattern does not
        ("<answer>42</answer>", r".*\d.*", ["think"], 0.0),  # pattern holds, tags do not
        # pattern given, tags empty: only the pattern counts
        ("42", r"\d+", [], 1.0),
    ],
)
def test_format_match(completion: str, pattern: str | None, tags: list[str] | None, expected: float) -> None:
    assert format_match(completion, None, pattern=pattern, tags=tags) == expected


def test_format_match_ignores_the_label() -> None:
    for label in (None, "", "anything", 42, {"a": 1}):
        assert format_match("<a>1</a>", label, tags=["a"]) == 1.0
        assert format_match("<b>1</b>", label, tags=["a"]) == 0.0


@pytest.mark.parametrize(
    ("pattern", "tags", "message"),
    [
        (None, None, "give `pattern`"),
        (None, [], "give `pattern`"),
        ("(unclosed", None, "invalid regular expression '\\(unclosed'"),
        (None, "think", "tags must be a list"),  # a string would be read as tags t, h, i, n, k
        (r"no match", "think", "tags must be a list"),  # checked even when the pattern already fails
        (None, ["<answer>"], "tag '<answer>' is not a tag name"),
        (None, [""], "tag '' is not a tag name"),
    ],
)
def test_format_match_argument_errors(pattern: str | None, tags: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        format_match("<answer>1</answer>", None, pattern=pattern, tags=tags)


# ---------------------------------------------------------------- the registry and load_verifier


def test_registry_names_and_functions() -> None:
    assert RULE_VERIFIERS == {
        "exact_match": exact_match,
        "numeric_match": numeric_match,
        "math_verify": math_verify_match,
        "format": format_match,
        "reasoning_gym": reasoning_gym_match,
    }


def length_reward(completion: str, label: Any, target: int = 3) -> float:
    """A user's own verifier: 1.0 iff the completion has ``target`` characters."""
    return 1.0 if len(completion) == target else 0.0


def anything_goes(completion: str, label: Any, **options: Any) -> float:
    return float(options.get("score", 0.0))


class Scorers:
    @staticmethod
    def starts_with_label(completion: str, label: Any) -> float:
        return 1.0 if completion.startswith(str(label)) else 0.0

    not_a_function = 3


def test_load_verifier_by_registry_name() -> None:
    for name, fn in RULE_VERIFIERS.items():
        assert load_verifier(name) is fn
    assert load_verifier("exact_match", {})("82", "82") == 1.0


def test_load_verifier_binds_params() -> None:
    fmt = load_verifier("format", {"tags": ["think", "answer"]})
    assert fmt("<think>x</think><answer>4</answer>", None) == 1.0
    assert fmt("<answer>4</answer>", None) == 0.0
    loose = load_verifier("numeric_match", {"tolerance": 1e-2})
    assert loose("3.14", "3.14159") == 1.0  # |diff| 0.00159 <= 0.0314
    assert load_verifier("numeric_match")("3.14", "3.14159") == 0.0


def test_load_verifier_by_module_and_function() -> None:
    own = load_verifier(f"{__name__}:length_reward")
    assert (own("abc", None), own("abcd", None)) == (1.0, 0.0)
    assert load_verifier(f"{__name__}:length_reward", {"target": 4})("abcd", None) == 1.0
    assert load_verifier(f"{__name__}:anything_goes", {"score": 0.5, "other": 1})("x", None) == 0.5  # **options
    assert load_verifier(f"{__name__}:Scorers.starts_with_label")("42 apples", 42) == 1.0  # dotted attribute
    assert load_verifier("operator:eq")("72", "72") == 1.0  # a stdlib function with (a, b): True == 1.0


def test_load_verifier_module_whose_own_import_fails(tmp_path, monkeypatch) -> None:
    (tmp_path / "broken_scorer_xyz.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as error:
        load_verifier("broken_scorer_xyz:score")
    message = str(error.value)
    assert "cannot import module 'broken_scorer_xyz'" in message
    assert "No module named 'no_such_dependency_xyz'" in message  # the ImportError's own message


@pytest.mark.parametrize(
    ("spec", "params", "message"),
    [
        ("exact", None, "unknown verifier 'exact': use one of exact_match, numeric_match, math_verify, format, "
         "reasoning_gym, or your own as 'package.module:function'"),
        ("math_verify_match", None, "unknown verifier 'math_verify_match'"),  # the function's name is not the key
        ("no_such_module_xyz:score", None, "cannot import module 'no_such_module_xyz' (No module named "
         "'no_such_module_xyz'); check the name and that it is on PYTHONPATH"),
        ("math:no_such_function", None, "module 'math' has no attribute 'no_such_function'"),
        (f"{__name__}:Scorers.missing", None, "has no attribute 'Scorers.missing'"),
        ("math:pi", None, "'pi' is a float, not a function"),
        (f"{__name__}:Scorers.not_a_function", None, "is a int, not a function"),
        (":score", None, "is not of the form 'package.module:function'"),
        ("math:", None, "is not of the form 'package.module:function'"),
        ("a:b:c", None, "is not of the form 'package.module:function'"),
        ("exact_match", {"tolerance": 1e-3}, "verifier 'exact_match' does not accept parameter 'tolerance'; its "
         "parameters are (completion, label)"),
        ("format", {"pattern": ".*", "tag": ["a"]}, "does not accept parameter 'tag'"),
        (f"{__name__}:length_reward", {"size": 3}, "does not accept parameter 'size'"),
        ("numeric_match", {"label": 3}, "cannot be called as fn(completion, label, **params): multiple "
         "values for argument 'label'"),
        ("operator:eq", {"c": 1}, "does not accept parameter 'c'"),
    ],
)
def test_load_verifier_errors(spec: str, params: dict[str, Any] | None, message: str) -> None:
    with pytest.raises(ValueError) as error:
        load_verifier(spec, params)
    assert message in str(error.value)
    assert "\n" not in str(error.value)  # one line for the user


def test_math_verify_gives_up_on_a_huge_power_within_its_deadline():
    # 9^(9^9) has ~370 million digits: without a deadline `verify` never returns; on the main thread it gets 5 s.
    import time

    started = time.monotonic()
    assert math_verify_match(r"\boxed{9^{9^{9}}}", "5") == 0.0
    assert time.monotonic() - started < 15

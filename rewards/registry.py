"""Rule verifiers by the name the config uses: pure functions (completion, label) -> reward, and step verifiers
(steps, label) -> one reward per step.

Owns: the mapping from a rule source's `verifier` names to functions. Does not own: the functions themselves
(`rewards/verifiers.py`) nor resolving a user's `package.module:function` (`rewards.verifiers.load_verifier`).
"""

from __future__ import annotations

from collections.abc import Callable

from rewards.verifiers import exact_match, format_match, math_verify_match, numeric_match, step_match

RULE_VERIFIERS: dict[str, Callable[..., float]] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "math_verify": math_verify_match,
    "format": format_match,
}

STEP_VERIFIERS: dict[str, Callable[..., list[float]]] = {
    "step_match": step_match,
}

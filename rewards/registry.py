"""Rule verifiers by the name the config uses: pure functions (completion, label) -> reward, and step verifiers
(steps, label) -> one reward per step.

Owns: the mapping from a rule source's `verifier` names to functions, and `load_verifier`, which turns a spec (one
of those names, or the user's `package.module:function`) plus params into a ready-to-call function. Does not own:
the functions themselves (`rewards/verifiers.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from rewards.specs import check_params, import_spec
from rewards.verifiers import (
    check_reasoning_gym_params,
    exact_match,
    format_match,
    math_verify_match,
    numeric_match,
    reasoning_gym_match,
    step_match,
)

Verifier = Callable[[str, Any], float]

RULE_VERIFIERS: dict[str, Callable[..., float]] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "math_verify": math_verify_match,
    "format": format_match,
    "reasoning_gym": reasoning_gym_match,
}

# Checks run when a verifier loads, before any scoring, for those that need more than their signature checked: an
# optional package installed, params in range. Each takes the verifier's params and raises a one-line ValueError.
LOAD_CHECKS: dict[str, Callable[..., None]] = {
    "reasoning_gym": check_reasoning_gym_params,
}

STEP_VERIFIERS: dict[str, Callable[..., list[float]]] = {
    "step_match": step_match,
}


def load_verifier(spec: str, params: Mapping[str, Any] | None = None, steps: bool = False) -> Verifier:
    """The verifier named by ``spec`` with ``params`` bound as keyword arguments.

    ``spec`` is a name in ``RULE_VERIFIERS`` (``STEP_VERIFIERS`` with ``steps``: functions (steps, label) ->
    list[float]) or the user's own ``package.module:function``. Every problem (unknown name, module not importable,
    missing attribute, not callable, params the signature does not accept, a `LOAD_CHECKS` failure such as an optional
    package not installed) is a one-line ``ValueError`` raised here, before any scoring.
    """
    params = dict(params or {})
    fn = _resolve(spec, steps)
    check_params(spec, "verifier", fn, params, ("completion", "label"), "fn(completion, label, **params)")
    if not steps and spec in LOAD_CHECKS:
        LOAD_CHECKS[spec](**params)
    return functools.partial(fn, **params) if params else fn


def _resolve(spec: str, steps: bool = False) -> Callable[..., Any]:
    """The function a spec names: a registry entry, or `module:attr` imported."""
    table = STEP_VERIFIERS if steps else RULE_VERIFIERS
    if ":" not in spec:
        if spec in table:
            return table[spec]
        names = ", ".join(table)
        if spec in (RULE_VERIFIERS if steps else STEP_VERIFIERS):
            kind = "an outcome verifier: use it with level=outcome (relay verifier serve: --verifier)" if steps \
                else "a step verifier: use it with level=steps (relay verifier serve: --step-verifier)"
            raise ValueError(f"verifier {spec!r} is {kind}, or use one of {names}")
        raise ValueError(f"unknown verifier {spec!r}: use one of {names}, or your own as 'package.module:function'")
    fn = import_spec(spec, "verifier", "function")
    attr_path = spec.partition(":")[2]
    if not callable(fn):
        raise ValueError(
            f"verifier {spec!r}: {attr_path!r} is a {type(fn).__name__}, not a function (completion, label) -> float"
        )
    return fn

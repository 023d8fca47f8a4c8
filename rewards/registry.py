"""Rule verifiers by the name the config uses: pure functions (completion, label) -> reward.

Owns: the mapping from `reward.verifier` names to functions. Does not own: the functions themselves.
"""

from __future__ import annotations

from collections.abc import Callable

from rewards.arithmetic import exact_match

RULE_VERIFIERS: dict[str, Callable[[str, str], float]] = {"exact_match": exact_match}

"""Resolving `package.module:attribute` specs: the user's own verifiers, environments and tools.

Owns: `import_spec` and `check_params` (will the object take the config's params), with the one-line errors every
config key that takes such a spec shares. Does not own: what the object must be (a function of some signature, a
class with `reset` and `step`): its caller checks that.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any


def import_spec(spec: str, what: str, form: str) -> Any:
    """The object `spec` (`package.module:name`, or `package.module:Class.attribute`) names. `what` names the kind
    in messages (e.g. "verifier"), `form` the last part of the expected form (e.g. "function"). Raises ValueError
    (one line) on a malformed spec, a module that does not import, or a missing attribute."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path or ":" in attr_path:
        raise ValueError(f"{what} {spec!r} is not of the form 'package.module:{form}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r} ({error}); check the name and that "
                         "it is on PYTHONPATH") from error
    found: Any = module
    for attr in attr_path.split("."):
        if not hasattr(found, attr):
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr_path!r}")
        found = getattr(found, attr)
    return found


def check_params(spec: str, what: str, target: Any, params: Mapping[str, Any], positional: tuple = (),
                 call: str = "fn(**params)") -> None:
    """Raises ValueError (one line, naming the offending parameter) if `target(*positional, **params)` would not
    bind; `call` shows the call in the message. Nothing is checked for a target without a published signature."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return  # some C functions publish no signature: nothing to check before the first call
    try:
        signature.bind(*positional, **params)
    except TypeError as error:
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
        unknown = [name for name in params if name not in signature.parameters and not takes_any]
        problem = f"does not accept parameter {unknown[0]!r}" if unknown else f"cannot be called as {call}: {error}"
        raise ValueError(f"{what} {spec!r} {problem}; its parameters are ({', '.join(signature.parameters)})") \
            from error

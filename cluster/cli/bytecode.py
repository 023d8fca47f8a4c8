"""Python's bytecode kept between runs, also where the environment forbids writing it.

With PYTHONDONTWRITEBYTECODE set (as many container images and this project's build machines set it) and packages
installed without bytecode (uv's default), every process of a run compiles every module it imports from source, every
time: torch, transformers and vLLM in each actor, which on a small machine is most of a run's start
(docs/benchmarks.md, "Start-up"). `keep_bytecode` sends the bytecode to relay's cache instead (PYTHONPYCACHEPREFIX,
Python's own place for it outside the packages' directories), for the CLI's process and every process it starts:
Ray's, and the actors' of a local Ray instance. A prefix already set is kept; nothing is written into the installed
packages.

Owns: `keep_bytecode`. Imports nothing beyond the standard library: it runs before the CLI's own imports.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def keep_bytecode(environ: dict[str, str] | None = None) -> str | None:
    """Where Python may not write bytecode, let it write under `$PYTHONPYCACHEPREFIX` (if set) or relay's cache
    (`$RELAY_CACHE_DIR/pycache`, else `~/.cache/relay/pycache`), in this process and (through `environ`, default
    `os.environ`) the processes it starts. Returns the prefix it set, or None where Python writes bytecode already."""
    environ = os.environ if environ is None else environ
    if not (sys.dont_write_bytecode or environ.get("PYTHONDONTWRITEBYTECODE")):
        return None
    prefix = environ.get("PYTHONPYCACHEPREFIX") or sys.pycache_prefix or str(
        Path(environ.get("RELAY_CACHE_DIR") or Path.home() / ".cache" / "relay") / "pycache")
    environ.pop("PYTHONDONTWRITEBYTECODE", None)
    environ["PYTHONPYCACHEPREFIX"] = prefix
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False
    return prefix

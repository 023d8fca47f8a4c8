"""`relay` keeps Python's bytecode between runs where the environment forbids writing it (cluster/cli/bytecode.py):
under relay's cache (or the prefix the user set), for its own process and every process it starts; nothing changes
where Python writes bytecode already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# In a fresh interpreter: keep_bytecode, then import a module of its own, then start a child and ask it how it writes.
PROBE = """
import json, subprocess, sys
sys.path.insert(0, sys.argv[1])
from cluster.cli.bytecode import keep_bytecode
prefix = keep_bytecode()
import probe_module
child = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps([sys.flags.dont_write_bytecode, "
                        "sys.pycache_prefix]))"], capture_output=True, text=True, check=True).stdout
print(json.dumps({"prefix": prefix, "child": json.loads(child)}))
"""


def probe(tmp_path: Path, **env: str) -> dict:
    modules = tmp_path / "modules"
    modules.mkdir(exist_ok=True)
    (modules / "probe_module.py").write_text("VALUE = 1\n")
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    result = subprocess.run([sys.executable, "-c", PROBE, str(ROOT)], capture_output=True, text=True, check=True,
                            cwd=modules, env={**base, "RELAY_CACHE_DIR": str(tmp_path / "cache"), **env})
    return json.loads(result.stdout)


def compiled(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("probe_module*.pyc"))


def test_where_bytecode_is_forbidden_it_goes_to_relays_cache_for_every_process(tmp_path):
    got = probe(tmp_path, PYTHONDONTWRITEBYTECODE="1")
    prefix = str(tmp_path / "cache" / "pycache")
    assert got == {"prefix": prefix, "child": [0, prefix]}
    assert compiled(Path(prefix)) and not compiled(tmp_path / "modules")  # nothing beside the module itself


def test_a_prefix_the_user_set_is_kept(tmp_path):
    mine = str(tmp_path / "mine")
    got = probe(tmp_path, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=mine)
    assert got == {"prefix": mine, "child": [0, mine]} and compiled(Path(mine))


def test_where_python_writes_bytecode_nothing_changes(tmp_path):
    got = probe(tmp_path)
    assert got == {"prefix": None, "child": [0, None]}
    assert compiled(tmp_path / "modules") and not (tmp_path / "cache").exists()

"""Shared fixtures: tiny model directories built locally (no hub), disposable caches, and a local Ray instance.

`tests/unit` needs only torch; `tests/actors` runs workers in-process (real vLLM); `tests/cluster` uses a real local
Ray started here (never `ray stop`, which would kill every Ray process on the machine); `tests/e2e` runs the CLI.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

# The shared run checks' asserts (tests/resume.py, tests/fleets.py) explain a failure as a test module's do
pytest.register_assert_rewrite("tests.resume", "tests.fleets")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "VLLM_CACHE_ROOT" not in os.environ:  # `make test` sets it (the checkout's .cache/vllm); else a disposable one
    os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="relay-vllm-cache-")
    atexit.register(shutil.rmtree, os.environ["VLLM_CACHE_ROOT"], True)
os.environ.setdefault("RELAY_CACHE_DIR", str(ROOT / ".cache" / "relay"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Bytecode as `make test` keeps it (Makefile: PYTHONPYCACHEPREFIX), for this process's later imports and every process
# it starts, also when pytest runs directly: the environment is not compiled at set-up, and where
# PYTHONDONTWRITEBYTECODE is set every process would compile all it imports.
if "PYTHONPYCACHEPREFIX" not in os.environ:
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix = str(ROOT / ".cache" / "pycache")
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
# Ray 2.60's token authentication: the first `ray.init` that starts a local Ray turns it on and exports
# RAY_AUTH_MODE=token, but a process reads the mode once. Pinned here, so a test that starts its own nodes gets the
# same mode whether or not a `ray.init` ran before it in this process.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised Qwen2 (hidden 64, 2 heads of 32, 2 layers, untied) with the character tokenizer."""
    from cluster.demo.model import make_random_model_dir

    return make_random_model_dir(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_tied_model_dir(tmp_path_factory) -> Path:
    """Like `tiny_model_dir` but with tied input/output embeddings (the CPU backend's stale-head trap)."""
    from cluster.demo.model import make_random_model_dir

    return make_random_model_dir(tmp_path_factory.mktemp("models") / "tiny_tied", seed=1, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised Qwen2 sequence classifier with one output, with the character tokenizer."""
    from cluster.demo.model import make_random_reward_model_dir

    return make_random_reward_model_dir(tmp_path_factory.mktemp("models") / "tiny_rm", seed=2)


@pytest.fixture(scope="session")
def tiny_prm_dir(tmp_path_factory) -> Path:
    """A randomly initialised Qwen2 token classifier with one output (a process reward model), char tokenizer."""
    from cluster.demo.model import make_random_process_reward_model_dir

    return make_random_process_reward_model_dir(tmp_path_factory.mktemp("models") / "tiny_prm", seed=3)


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The demo's warmed-up base model, built once into RELAY_CACHE_DIR (about a minute the first time)."""
    from cluster.demo.cache import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture(scope="session")
def chain_model_dir() -> Path:
    """The chained-sum demo task's warmed-up base model (process supervision), built once into RELAY_CACHE_DIR."""
    from cluster.demo.cache import ensure_demo_model

    return ensure_demo_model(task="chain_sum")


@pytest.fixture(scope="session")
def calc_model_dir() -> Path:
    """The calculator-tool demo task's warmed-up base model (multi-turn episodes), built once into RELAY_CACHE_DIR."""
    from cluster.demo.cache import ensure_demo_model

    return ensure_demo_model(task="calc")


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray instance for the whole session, shut down (only it) at the end."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield ray
    _clear_fleets()
    ray.shutdown()


@pytest.fixture
def fleets(ray_local):
    """The session's `ParkingPool` (tests/fleets.py), for `run_training(..., pool=fleets)`."""
    from tests.fleets import POOL

    return POOL


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """In each directory, the modules none of whose tests share fleets run first: each such test on the session's
    Ray clears the session's pool (below), and the next run on it must then start its actor processes again.
    Modules stay whole and in their order otherwise."""
    directories = list(dict.fromkeys(item.path.parent for item in items))
    sharing = {item.path for item in items if "fleets" in item.fixturenames}
    items.sort(key=lambda item: (directories.index(item.path.parent), item.path in sharing))


@pytest.fixture(autouse=True)
def _no_parked_fleet_unless_shared(request):
    """A test on the session's Ray (`ray_local`) that does not share fleets starts with none parked: the cluster's
    resources are all free. A test that does not use it (the CLI in processes of its own, HTTP services) leaves the
    parked fleet to the next test that shares fleets."""
    if "fleets" not in request.fixturenames and "ray_local" in request.fixturenames:
        _clear_fleets()


def _clear_fleets() -> None:
    fleets = sys.modules.get("tests.fleets")
    if fleets is not None:
        fleets.POOL.clear()


@contextmanager
def _relay_services(command: str):
    """`relay <command> serve ARGS` (the console script `pip install -e .` made), with `env` added to this process's,
    on a free port, waited for until its /health answers. Yields the factory `serve(args, env) -> (process, base
    URL)`; every process still running at the end is stopped."""
    import socket
    import subprocess
    import time

    import httpx

    script = Path(sys.executable).parent / "relay"
    relay = [str(script)] if script.exists() else [sys.executable, "-m", "cluster.cli"]
    started: list[subprocess.Popen] = []

    def serve(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        process = subprocess.Popen([*relay, command, "serve", "--port", str(port), *args], cwd=ROOT,
                                   env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        started.append(process)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()[1]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return process, url
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"relay {command} serve did not become healthy in 60 s"
            time.sleep(0.1)

    try:
        yield serve
    finally:
        for process in started:
            if process.poll() is None:
                process.terminate()
                process.communicate(timeout=30)


@pytest.fixture
def serve_verifier():
    """`relay verifier serve ARGS` on a free port: call it as `serve_verifier(args, env)`, get (process, base URL)."""
    with _relay_services("verifier") as serve:
        yield serve


@pytest.fixture
def serve_env():
    """`relay env serve ARGS` on a free port: call it as `serve_env(args, env)`, get (process, base URL)."""
    with _relay_services("env") as serve:
        yield serve

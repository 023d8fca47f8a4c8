"""`relay verifier serve` as a user runs it: the address its listening socket is bound to (loopback unless --host
says otherwise; connecting to 127.0.0.1 would succeed either way, so the socket itself is read), and the warning
on stderr when it serves beyond loopback without a token."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "relay"  # the console script `pip install -e .` made
RELAY = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "cluster.cli"]
OPEN_WARNING = "serving on 0.0.0.0 without a token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(*args: str) -> tuple[list[str], str]:
    """Run `relay verifier serve --verifier exact_match ARGS` on a free port until /health answers; return the
    addresses its process listens on and its stderr (after it is stopped)."""
    port = free_port()
    process = subprocess.Popen([*RELAY, "verifier", "serve", "--verifier", "exact_match", "--port", str(port), *args],
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "SERVE_TOKEN": "t0k3n-for-test"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()[1]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "relay verifier serve did not become healthy in 60 s"
            time.sleep(0.1)
        listening = [c.laddr.ip for c in psutil.Process(process.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    return listening, stderr


@pytest.mark.parametrize("args, bound, warns", [
    ([], "127.0.0.1", False),  # the default: loopback only
    (["--host", "0.0.0.0"], "0.0.0.0", True),  # every interface, no token: anyone who can reach it can use it
    (["--host", "0.0.0.0", "--token-env", "SERVE_TOKEN"], "0.0.0.0", False),
], ids=["default", "all-interfaces", "all-interfaces-with-token"])
def test_serve_binds_where_asked_and_warns_when_open(args, bound, warns):
    listening, stderr = serve(*args)
    assert listening == [bound], stderr
    assert (OPEN_WARNING in stderr) == warns, stderr

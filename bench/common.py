"""What several benchmark scripts share: when a learning curve reaches a target, and a `relay ... serve` service on
a free local port."""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def steps_to_target(values: list[float], target: float, window: int = 10) -> int | None:
    """The first step (1-based) at which the mean of the last `window` values is >= `target`; None if never."""
    for end in range(window, len(values) + 1):
        if statistics.fmean(values[end - window:end]) >= target:
            return end
    return None


def start_service(args: list[str]) -> tuple[subprocess.Popen, str]:
    """`relay <args> --port P` (e.g. `["env", "serve", "--env", "pkg.mod:Class"]`) on a free port of this machine,
    waited for until its /health answers; returns the process and its base URL. Exits the script if it does not
    come up within 60 s."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = Path(sys.executable).parent / "relay"
    relay = [str(script)] if script.exists() else [sys.executable, "-m", "cluster.cli"]
    process = subprocess.Popen([*relay, *args, "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"relay {' '.join(args[:2])} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.1)
    process.terminate()
    raise SystemExit(f"relay {' '.join(args[:2])} did not become healthy within 60 s")

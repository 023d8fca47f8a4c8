"""`relay verifier serve` as a user runs it: the address its listening socket is bound to (loopback unless --host
says otherwise; connecting to 127.0.0.1 would succeed either way, so the socket itself is read), and the warning
on stderr when it serves beyond loopback without a token; and a step verifier served beside an outcome verifier."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from rewards.config import RemoteSource
from rewards.remote import RemoteVerifier, VerifierSample

ROOT = Path(__file__).resolve().parents[2]

OPEN_WARNING = "serving on 0.0.0.0 without a token"


@pytest.mark.parametrize("args, bound, warns", [
    ([], "127.0.0.1", False),  # the default: loopback only
    (["--host", "0.0.0.0"], "0.0.0.0", True),  # every interface, no token: anyone who can reach it can use it
    (["--host", "0.0.0.0", "--token-env", "SERVE_TOKEN"], "0.0.0.0", False),
], ids=["default", "all-interfaces", "all-interfaces-with-token"])
def test_serve_binds_where_asked_and_warns_when_open(serve_verifier, args, bound, warns):
    process, url = serve_verifier(["--verifier", "exact_match", *args], {"SERVE_TOKEN": "t0k3n-for-test"})
    port = int(url.rsplit(":", 1)[1])
    listening = [c.laddr.ip for c in psutil.Process(process.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    process.terminate()
    _, stderr = process.communicate(timeout=30)
    assert listening == [bound], stderr
    assert (OPEN_WARNING in stderr) == warns, stderr


def test_serve_a_step_verifier_beside_an_outcome_verifier(serve_verifier):
    _, url = serve_verifier(["--verifier", "exact_match", "--step-verifier", "step_match", "--step-param",
                             "separator=,"])
    samples = [VerifierSample(id="right", prompt="12+34+56=", completion="46 102", label="46,102", steps=["46", "102"]),
               VerifierSample(id="wrong", prompt="12+34+56=", completion="46 101", label="46,102", steps=["46", "101"])]
    with RemoteVerifier("judge", RemoteSource(type="remote", urls=[url], level="steps")) as verifier:
        scores = verifier.score(samples)
    plain = httpx.post(f"{url}/verify", json={"samples": [{"id": "a", "prompt": "", "completion": "4", "label": "4"}]})
    assert scores.rewards == [[1.0, 1.0], [1.0, 0.0]] and scores.metrics["failures"] == 0
    assert plain.json() == {"results": [{"id": "a", "reward": 1.0}]}  # without steps: the outcome verifier


def test_serve_needs_a_verifier():
    script = Path(sys.executable).parent / "relay"
    relay = [str(script)] if script.exists() else [sys.executable, "-m", "cluster.cli"]
    done = subprocess.run([*relay, "verifier", "serve"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and done.stderr == ("relay: config error: give --verifier, --step-verifier, or both "
                                                    "(e.g. --verifier exact_match)\n")

"""`relay verifier serve` as a user runs it: the address its listening socket is bound to (loopback unless --host
says otherwise; connecting to 127.0.0.1 would succeed either way, so the socket itself is read), and the warning
on stderr when it serves beyond loopback without a token; the API's description (`/openapi.json`, `/docs`, `/redoc`)
behind the token when there is one; and a step verifier served beside an outcome verifier."""

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
TOKEN = "t0k3n-for-test"


@pytest.mark.parametrize("args, bound, warns", [
    ([], "127.0.0.1", False),  # the default: loopback only
    (["--host", "0.0.0.0"], "0.0.0.0", True),  # every interface, no token: anyone who can reach it can use it
    (["--host", "0.0.0.0", "--token-env", "SERVE_TOKEN"], "0.0.0.0", False),
], ids=["default", "all-interfaces", "all-interfaces-with-token"])
def test_serve_binds_where_asked_and_warns_when_open(serve_verifier, args, bound, warns):
    process, url = serve_verifier(["--verifier", "exact_match", *args], {"SERVE_TOKEN": TOKEN})
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
    described = httpx.get(f"{url}/openapi.json")  # without a token, the API's description is open as the API is
    assert scores.rewards == [[1.0, 1.0], [1.0, 0.0]] and scores.metrics["failures"] == 0
    assert plain.json() == {"results": [{"id": "a", "reward": 1.0}]}  # without steps: the outcome verifier
    assert described.status_code == 200 and "/verify" in described.json()["paths"]


def test_with_a_token_the_api_description_needs_it_too(serve_verifier):
    _, url = serve_verifier(["--verifier", "exact_match", "--token-env", "SERVE_TOKEN"], {"SERVE_TOKEN": TOKEN})
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    docs = {path: (httpx.get(f"{url}{path}").status_code, httpx.get(f"{url}{path}", headers=bearer).status_code)
            for path in ("/openapi.json", "/docs", "/redoc")}
    wrong = httpx.get(f"{url}/openapi.json", headers={"Authorization": "Bearer wrong"})
    health = httpx.get(f"{url}/health")  # load balancers probe without a token
    assert docs == {"/openapi.json": (401, 200), "/docs": (401, 200), "/redoc": (401, 200)}
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
    assert health.status_code == 200


def test_serve_needs_a_verifier():
    script = Path(sys.executable).parent / "relay"
    relay = [str(script)] if script.exists() else [sys.executable, "-m", "cluster.cli"]
    done = subprocess.run([*relay, "verifier", "serve"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and done.stderr == ("relay: config error: give --verifier, --step-verifier, or both "
                                                    "(e.g. --verifier exact_match)\n")

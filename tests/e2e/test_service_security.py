"""`relay env serve` and `relay verifier serve` on loopback without a token, as a web page in a browser on the same
machine would reach them (rewards/http.py's `BrowserGuard`): a WebSocket handshake or request carrying a foreign
`Origin` is refused unless `--allow-origin` names it; a POST whose body is not declared `application/json` (a blind
`text/plain` form post needs no CORS preflight) gets 415 and runs nothing; a request naming another host in `Host`
(DNS rebinding: a page's own name resolved to 127.0.0.1) is refused. Clients that send neither (relay's, OpenEnv's,
OpenRLHF's) and the service's own pages (same origin, `/docs`) still work."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

SPEC = "rewards.environments.examples:GuessNumber"
PAGE = "https://example.invalid"
STEP = b'{"action": {"message": "3"}, "label": 3}'  # OpenEnv's stateless step: one action on a fresh environment


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/ws"


def handshake(url: str, **options) -> int:
    """The HTTP status of a WebSocket handshake to `url`'s `/ws` (101: accepted), after one reset if accepted."""
    try:
        with connect(ws_url(url), open_timeout=10, **options) as ws:
            ws.send('{"type": "reset", "data": {"label": 3}}')
            assert '"observation"' in ws.recv(timeout=10)
            return 101
    except InvalidStatus as refused:
        return refused.response.status_code


def rebound(url: str) -> dict:
    """Options of `handshake` that connect to the service on 127.0.0.1 but name another host in `Host`, as a page
    whose DNS name was rebound to 127.0.0.1 does."""
    port = int(url.rsplit(":", 1)[1])
    return {"sock": socket.create_connection(("127.0.0.1", port)), "uri": f"ws://attacker.example:{port}/ws"}


def handshake_rebound(url: str) -> int:
    options = rebound(url)
    try:
        with connect(options["uri"], sock=options["sock"], open_timeout=10):
            return 101
    except InvalidStatus as refused:
        return refused.response.status_code


def test_env_serve_refuses_what_a_web_page_can_send(serve_env):
    _, url = serve_env(["--env", SPEC])
    port = url.rsplit(":", 1)[1]
    text_plain = httpx.post(f"{url}/step", content=STEP, headers={"content-type": "text/plain"})
    form = httpx.post(f"{url}/reset", content=b'{"prompt": "p", "label": 3}',
                      headers={"content-type": "application/x-www-form-urlencoded"})
    undeclared = httpx.post(f"{url}/step", content=STEP)  # no Content-Type at all
    foreign_post = httpx.post(f"{url}/step", content=STEP, headers={"content-type": "application/json",
                                                                    "origin": PAGE})
    rebound_post = httpx.post(f"{url}/step", content=STEP, headers={"content-type": "application/json",
                                                                    "host": f"attacker.example:{port}"})
    rebound_get = httpx.get(f"{url}/metadata", headers={"host": f"attacker.example:{port}"})
    json_post = httpx.post(f"{url}/step", content=STEP, headers={"content-type": "application/json; charset=utf-8"})
    same_origin = httpx.post(f"{url}/step", content=STEP, headers={"content-type": "application/json",
                                                                   "origin": f"http://127.0.0.1:{port}"})
    assert handshake(url, origin=PAGE) == 403  # the acceptance check of issue 58
    assert handshake(url, origin="null") == 403  # a sandboxed frame or a file:// page
    assert handshake_rebound(url) == 403
    assert handshake(url) == 101  # no Origin: not a browser (relay's client, OpenEnv's)
    assert (text_plain.status_code, form.status_code, undeclared.status_code) == (415, 415, 415)
    assert text_plain.json() == {"detail": "Content-Type must be application/json (got 'text/plain'); send the body "
                                           "as JSON with that header"}
    assert undeclared.json()["detail"].endswith("(got none); send the body as JSON with that header")
    assert foreign_post.status_code == 403
    assert foreign_post.json() == {"detail": f"Origin {PAGE} may not use this service: web pages are refused unless "
                                             "allowed (relay env serve --allow-origin ORIGIN)"}
    assert (rebound_post.status_code, rebound_get.status_code) == (403, 403)
    assert rebound_get.json() == {"detail": f"Host attacker.example:{port} is not this machine: a service reached "
                                            "on loopback answers requests to localhost, 127.0.0.1 or [::1] only "
                                            "(DNS rebinding)"}
    assert json_post.status_code == 200 and json_post.json()["reward"] == 1.0
    assert same_origin.status_code == 200  # the service's own pages (/docs) call it from its own origin


def test_env_serve_admits_the_origins_it_is_told_to(serve_env):
    _, url = serve_env(["--env", SPEC, "--allow-origin", PAGE, "--allow-origin", "http://localhost:3000/"])
    from_page = httpx.post(f"{url}/step", content=STEP, headers={"content-type": "application/json",
                                                                 "origin": PAGE})
    assert handshake(url, origin=PAGE) == 101
    assert handshake(url, origin="http://localhost:3000") == 101  # the trailing slash is not part of an origin
    assert handshake(url, origin="https://other.invalid") == 403
    assert from_page.status_code == 200


@pytest.mark.parametrize("origin, message", [
    ("example.invalid", "--allow-origin 'example.invalid' is not an origin: give scheme://host[:port], e.g. "
                        "https://dashboard.example:8443"),
    ("https://example.invalid/page", "--allow-origin 'https://example.invalid/page' is not an origin: give "
                                     "scheme://host[:port], e.g. https://dashboard.example:8443"),
])
def test_a_bad_allow_origin_is_a_one_line_error(origin, message):
    result = subprocess.run([sys.executable, "-m", "cluster.cli", "env", "serve", "--env", SPEC, "--allow-origin",
                             origin], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == f"relay: config error: {message}"


def test_verifier_serve_refuses_what_a_web_page_can_send(serve_verifier):
    _, url = serve_verifier(["--verifier", "exact_match"])
    port = url.rsplit(":", 1)[1]
    verify = b'{"samples": [{"id": "a", "prompt": "p", "completion": "1", "label": "1"}]}'
    reward = b'{"query": ["p1"], "prompts": ["p"], "labels": ["1"]}'
    replies = {
        (path, case): httpx.post(f"{url}{path}", content=body, headers=headers).status_code
        for path, body in (("/verify", verify), ("/get_reward", reward))
        for case, headers in (("text/plain", {"content-type": "text/plain"}),
                              ("origin", {"content-type": "application/json", "origin": PAGE}),
                              ("rebound", {"content-type": "application/json", "host": f"attacker.example:{port}"}),
                              ("json", {"content-type": "application/json"}))}
    assert replies == {("/verify", "text/plain"): 415, ("/verify", "origin"): 403, ("/verify", "rebound"): 403,
                       ("/verify", "json"): 200, ("/get_reward", "text/plain"): 415, ("/get_reward", "origin"): 403,
                       ("/get_reward", "rebound"): 403, ("/get_reward", "json"): 200}

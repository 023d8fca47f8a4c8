"""`relay verifier serve` as a user runs it: the address its listening socket is bound to (loopback unless --host
says otherwise; connecting to 127.0.0.1 would succeed either way, so the socket itself is read), and the warning
on stderr when it serves beyond loopback without a token."""

from __future__ import annotations

import psutil
import pytest

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

"""The clients of verifier and environment services never put a bearer token on the network in clear text: a URL of
plain http (OpenEnv's WebSocket: plain ws) to a host other than this machine, with a `token_env`, is refused at
config validation (one line naming `allow_plain_http_token` and the fixes) and by each client's constructor (relay's
verifier and environment clients, OpenEnv's), before the token is read, unless `allow_plain_http_token` opts in;
https, loopback (a tunnel's near end) and no token at all pass."""

from __future__ import annotations

import pytest

from cluster.config import ConfigError, load_config
from rewards.config import EnvironmentConfig, RemoteSource
from rewards.environments.openenv_client import OpenEnvEnvironments
from rewards.environments.remote import RemoteEnvironments
from rewards.remote import RemoteVerifier

TOKEN = "tok-3c8d1e-secret"
REFUSED = "is plain http to another machine: it would carry the bearer token from $SVC_TOKEN in clear text"
FIXES = ("https://", "ssh -L", "allow_plain_http_token: true")
LOOPBACK = ["http://127.0.0.1:8000", "http://127.9.8.7:8000", "http://localhost:8000", "http://LOCALHOST:8000"]
LOOKALIKES = ["http://127.0.0.1.evil.example:8000", "http://localhost.evil.example:8000", "http://10.0.0.5:8000"]


def verifier(url: str, **options) -> RemoteVerifier:
    source = RemoteSource.model_construct(**{**RemoteSource(type="remote", urls=[url]).model_dump(), **options})
    return RemoteVerifier("judge", source)  # model_construct: the constructor's own check, not the config's


CLIENTS = {
    "verifier": verifier,
    "environment": lambda url, **options: RemoteEnvironments([url], **options),
    "openenv": lambda url, **options: OpenEnvEnvironments([url], **options),
}


@pytest.mark.parametrize("overrides, where", [
    (["reward.sources={judge: {type: remote, urls: [URL], token_env: SVC_TOKEN}}"], "reward.sources.judge"),
    (["reward.sources={judge: {type: remote, protocol: openrlhf, urls: [URL/get_reward], token_env: SVC_TOKEN}}"],
     "reward.sources.judge"),
    (["env.urls=[URL]", "env.token_env=SVC_TOKEN"], "env"),
    (["env.urls=[URL]", "env.protocol=openenv", "env.token_env=SVC_TOKEN"], "env"),
], ids=["verifier", "openrlhf", "environment", "openenv"])
@pytest.mark.parametrize("url", LOOKALIKES)
def test_config_refuses_a_token_over_plain_http_to_another_host(overrides, where, url):
    with pytest.raises(ConfigError) as err:
        load_config(None, [o.replace("URL", url) for o in overrides])
    message = str(err.value)
    assert message.startswith(f"{where}: url {url}") and REFUSED in message and "\n" not in message
    assert all(fix in message for fix in FIXES)


@pytest.mark.parametrize("url", ["https://10.0.0.5:8000", *LOOPBACK])
def test_config_accepts_https_and_loopback(url):
    assert RemoteSource(type="remote", urls=[url], token_env="SVC_TOKEN").urls == [url]
    assert EnvironmentConfig(urls=[url], token_env="SVC_TOKEN").urls == [url]


def test_config_accepts_plain_http_without_a_token_or_when_allowed():
    assert RemoteSource(type="remote", urls=["http://10.0.0.5:8000"]).token_env is None
    assert RemoteSource(type="remote", urls=["http://10.0.0.5:8000"], token_env="SVC_TOKEN",
                        allow_plain_http_token=True).allow_plain_http_token
    assert EnvironmentConfig(urls=["http://10.0.0.5:8000"], token_env="SVC_TOKEN", allow_plain_http_token=True).urls


@pytest.mark.parametrize("make", CLIENTS.values(), ids=CLIENTS)
@pytest.mark.parametrize("url", LOOKALIKES)
def test_clients_refuse_a_token_over_plain_http_to_another_host(monkeypatch, make, url):
    monkeypatch.delenv("SVC_TOKEN", raising=False)  # refused before the token is read
    with pytest.raises(ValueError) as err:
        make(url, token_env="SVC_TOKEN")
    assert str(err.value).startswith(f"url {url} {REFUSED}") and all(fix in str(err.value) for fix in FIXES)


@pytest.mark.parametrize("make", CLIENTS.values(), ids=CLIENTS)
@pytest.mark.parametrize("url, options", [("http://10.0.0.5:8000", {"allow_plain_http_token": True}),
                                          ("https://10.0.0.5:8000", {}), *((u, {}) for u in LOOPBACK)])
def test_clients_send_a_token_over_https_to_loopback_or_when_allowed(monkeypatch, make, url, options):
    monkeypatch.setenv("SVC_TOKEN", TOKEN)
    with make(url, token_env="SVC_TOKEN", **options) as client:  # nothing is sent: constructing connects nowhere
        assert TOKEN not in repr(client)

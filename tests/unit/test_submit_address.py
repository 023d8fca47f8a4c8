"""`relay submit` / `jobs` / `stop` never put the local Ray token on the network in clear text: plain http to a host
other than this machine is refused (exit 2, one line naming the fixes) before anything is sent, unless
`--allow-insecure-token`; https, loopback and "no token at all" pass.

Runs `cluster.cli.main` in-process with Ray's Jobs API client replaced by a recorder, so a test sees whether a client
was made and with which headers, and needs no cluster and no network."""

from __future__ import annotations

import pytest

from cluster.cli.commands import main

TOKEN = "ray-tok-3b9e1d7c"
COMMANDS = {"submit": ["submit", "run_dir=/abs/run", "--no-wait"], "jobs": ["jobs"], "stop": ["stop", "raysubmit_1"]}


class RecordingJobsClient:
    """Stands in for `ray.job_submission.JobSubmissionClient`: records (address, headers), answers without a network."""

    made: list[tuple[str, dict]] = []

    def __init__(self, address: str, headers: dict | None = None, **_: object):
        self.made.append((address, dict(headers or {})))

    def list_jobs(self) -> list:
        return []

    def stop_job(self, job_id: str) -> bool:
        return True

    def submit_job(self, **_: object) -> str:
        return "raysubmit_recorded"


@pytest.fixture
def jobs_api(monkeypatch, tmp_path):
    """The recorder in place of Ray's client; HOME is an empty temp dir and no token variable is set."""
    RecordingJobsClient.made = []
    monkeypatch.setattr("ray.job_submission.JobSubmissionClient", RecordingJobsClient)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    return RecordingJobsClient.made


def token_in_home(tmp_path) -> None:
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(TOKEN + "\n")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("where", ["env", "home", "path"])
def test_plain_http_to_another_host_with_a_token_is_refused(jobs_api, monkeypatch, tmp_path, capsys, command, where):
    if where == "env":
        monkeypatch.setenv("RAY_AUTH_TOKEN", TOKEN)
    elif where == "home":
        token_in_home(tmp_path)
    else:
        (tmp_path / "token").write_text(TOKEN)
        monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    code = main([*COMMANDS[command], "--address", "http://10.1.2.3:8265"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("relay: config error: --address http://10.1.2.3:8265 is plain http to another machine")
    for fix in ("https://", "ssh -L 8265:127.0.0.1:8265", "kubectl port-forward", "--allow-insecure-token"):
        assert fix in err
    source = {"env": "$RAY_AUTH_TOKEN", "home": "~/.ray/auth_token", "path": "$RAY_AUTH_TOKEN_PATH"}[where]
    assert f"(from {source})" in err and TOKEN not in err
    assert jobs_api == []  # no client made: nothing sent


@pytest.mark.parametrize("command", COMMANDS)
def test_allow_insecure_token_sends_it_anyway(jobs_api, monkeypatch, capsys, command):
    monkeypatch.setenv("RAY_AUTH_TOKEN", TOKEN)
    code = main([*COMMANDS[command], "--address", "http://10.1.2.3:8265", "--allow-insecure-token"])
    assert code == 0, capsys.readouterr().err
    assert jobs_api and all(made == ("http://10.1.2.3:8265", {"Authorization": f"Bearer {TOKEN}"})
                            for made in jobs_api)


@pytest.mark.parametrize("address", [
    "https://head.example.com:8265",  # encrypted
    "http://127.0.0.1:8265",  # loopback: a tunnel's near end
    "http://127.9.8.7:8265",
    "http://[::1]:8265",
    "http://localhost:8265",
    "http://LOCALHOST:8265",
])
def test_https_and_loopback_carry_the_token(jobs_api, tmp_path, capsys, address):
    token_in_home(tmp_path)
    assert main(["jobs", "--address", address]) == 0, capsys.readouterr().err
    assert jobs_api == [(address, {"Authorization": f"Bearer {TOKEN}"})]


def test_no_token_is_nothing_to_protect(jobs_api, capsys):
    assert main(["jobs", "--address", "http://10.1.2.3:8265"]) == 0, capsys.readouterr().err
    assert jobs_api == [("http://10.1.2.3:8265", {})]


@pytest.mark.parametrize("address", ["http://127.0.0.1.evil.example:8265", "http://localhost.evil.example:8265",
                                     "http://10.1.2.3:8265/?next=127.0.0.1", "http://user@10.1.2.3:8265"])
def test_loopback_lookalikes_are_refused(jobs_api, monkeypatch, capsys, address):
    monkeypatch.setenv("RAY_AUTH_TOKEN", TOKEN)
    assert main(["jobs", "--address", address]) == 2
    assert "is plain http to another machine" in capsys.readouterr().err and jobs_api == []


def readme_submit() -> list[str]:
    """The README's `relay submit` command (tour step 4), as its words, the placeholder head made loopback."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text().replace("\\\n", " ")
    line = next(line for line in readme.splitlines() if line.startswith("relay submit "))
    return [w.replace("https://HEAD:8265", "http://127.0.0.1:8265") for w in line.split("#")[0].split()[1:]]


def test_the_readmes_submit_command_is_sent_with_only_the_keys_the_user_set(jobs_api, monkeypatch, capsys):
    """The README's command passes the checks made here (paths on the cluster are not looked at here), and the job
    gets only the keys the user set: what the model sets (`rollout.kv_cache_bytes`, `model.dtype`) is derived on the
    cluster, where the model is."""
    import yaml

    shipped = []
    monkeypatch.setattr(RecordingJobsClient, "submit_job", lambda self, **kw: shipped.append(
        yaml.safe_load(open(f"{kw['runtime_env']['working_dir']}/run.yaml"))) or "raysubmit_recorded")
    assert main([*readme_submit(), "--no-wait"]) == 0, capsys.readouterr().err
    [config] = shipped
    assert config["run_dir"].startswith("/") and config["model"]["path"].startswith("/")
    assert "kv_cache_bytes" not in config["rollout"] and "dtype" not in config["model"]
    assert config["rollout"]["max_new_tokens"] == 768  # the preset's own value is kept


def test_a_relative_run_dir_is_refused_with_what_to_pass(jobs_api, capsys):
    assert main(["submit", "run_dir=runs/x", "--no-wait", "--address", "http://127.0.0.1:8265"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run_dir 'runs/x' is relative" in err and "e.g. run_dir=/shared/runs/NAME" in err
    assert jobs_api == []

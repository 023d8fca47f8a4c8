"""Running relay as Ray jobs: `relay submit`, `relay jobs`, `relay stop`, through Ray's Jobs API.

Owns: validating a run's config on the submitting machine (bad input fails here, exit 2, before anything is sent),
staging what the job needs (relay's packages and the config's keys the user set) as the job's `working_dir`, the job's
runtime environment, Ray 2.60's token authentication for the Jobs API (and refusing to send the token in clear
text: plain http to a host other than this machine), streaming a job's logs, and listing and stopping jobs.
Does not own: the run itself (the job runs `python -m cluster.cli train` on the cluster).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from cluster.config import RunConfig
from rewards.config import is_loopback

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "actors", "learner", "rewards", "sync", "configs")  # what a job imports or names; small
FORWARDED_ENV = ("RELAY_CACHE_DIR", "VLLM_CACHE_ROOT", "HF_HOME", "VLLM_LOGGING_LEVEL")  # when set here
AGENT_WAIT_SECONDS = 60


class JobsError(RuntimeError):
    """The Jobs API refused a request; the message is one line."""


def client(address: str) -> Any:
    """A Jobs API client for `address` (http://head:8265). Ray 2.60 clusters require a token: it is read where Ray
    reads it (`local_token`) and sent as a bearer header. Callers check the address first (`check_token_transport`)."""
    from ray.job_submission import JobSubmissionClient

    headers = {}
    found = local_token()
    if found:
        headers["Authorization"] = f"Bearer {found[0]}"
    return JobSubmissionClient(address, headers=headers)


def local_token() -> tuple[str, str] | None:
    """(token, where it came from) for this machine's Ray token, or None: $RAY_AUTH_TOKEN, else the file named by
    $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token (what `ray start` writes), in the order Ray itself reads them."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"], "$RAY_AUTH_TOKEN"
    for where, path in (("$RAY_AUTH_TOKEN_PATH", os.environ.get("RAY_AUTH_TOKEN_PATH")),
                        ("~/.ray/auth_token", Path.home() / ".ray" / "auth_token")):
        token = Path(path).read_text().strip() if path and Path(path).is_file() else ""
        if token:
            return token, where
    return None


def check_token_transport(address: str, allow_insecure: bool = False) -> None:
    """Raise ValueError (one line) if sending the local Ray token to `address` would put it on the network in clear
    text: plain http to a host that is not loopback. https, loopback (a tunnel's end) and no token at all pass."""
    try:
        parts = urlsplit(address)
    except ValueError as err:  # e.g. an unclosed [IPv6 bracket
        raise ValueError(f"--address {address!r} is not a valid URL ({err}); pass e.g. --address "
                         "http://127.0.0.1:8265") from None
    if allow_insecure or parts.scheme.lower() == "https" or is_loopback(parts.hostname):
        return
    found = local_token()
    if found is None:
        return
    raise ValueError(f"--address {address} is plain http to another machine: it would carry your Ray token (from "
                     f"{found[1]}) in clear text; use an https:// address, or tunnel the dashboard to this machine "
                     "(ssh -L 8265:127.0.0.1:8265 HEAD, or kubectl port-forward svc/HEAD-svc 8265:8265) and pass "
                     "--address http://127.0.0.1:8265, or pass --allow-insecure-token to send it anyway")


def submit(config: RunConfig, address: str, run_dir: str | None = None) -> str:
    """Submit the run as a Ray job; returns the job id. The config is resolved and shipped with the code."""
    staging = Path(tempfile.mkdtemp(prefix="relay-job-"))
    try:
        for name in PACKAGES:
            shutil.copytree(ROOT / name, staging / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        resolved = config.model_copy(update={"run_dir": run_dir or config.run_dir})
        # Only the keys the user set: what the model sets where they did not (`model_settings`, the rollout sizes)
        # comes from the model and the GPUs on the cluster, which this machine may not see.
        (staging / "run.yaml").write_text(yaml.safe_dump(resolved.model_dump(mode="json", exclude_unset=True),
                                                         sort_keys=False))
        env = {key: os.environ[key] for key in FORWARDED_ENV if key in os.environ}
        env["PYTHONPATH"] = "."  # the job's working_dir: relay's packages
        jobs = client(address)
        deadline = time.monotonic() + AGENT_WAIT_SECONDS
        while True:
            try:
                return jobs.submit_job(entrypoint="python -m cluster.cli train run.yaml",
                                       runtime_env={"working_dir": str(staging), "env_vars": env},
                                       metadata={"relay": "train", "run_dir": str(resolved.run_dir or "")})
            except RuntimeError as err:
                # A head that has just started has no job agent yet ("No available agent"): wait for it a while.
                if "No available agent" in str(err) and time.monotonic() < deadline:
                    time.sleep(1.0)
                    continue
                raise JobsError(f"the cluster at {address} refused the job: {str(err).splitlines()[0]}") from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def follow(address: str, job_id: str, out) -> str:
    """Stream the job's logs to `out` until it ends; returns its final status."""
    jobs = client(address)

    async def tail() -> None:
        async for lines in jobs.tail_job_logs(job_id):
            out.write(lines)
            out.flush()

    asyncio.run(tail())
    return str(jobs.get_job_status(job_id))


def list_jobs(address: str) -> list[dict[str, str]]:
    """Every job on the cluster, newest first: id, status, entrypoint, start time."""
    rows = []
    for job in client(address).list_jobs():
        rows.append({"id": job.submission_id or job.job_id or "", "status": str(job.status),
                     "entrypoint": job.entrypoint, "start_time": str(job.start_time or "")})
    return sorted(rows, key=lambda r: r["start_time"], reverse=True)


def stop(address: str, job_id: str) -> bool:
    """Ask the cluster to stop a job; False if it had already ended."""
    return client(address).stop_job(job_id)

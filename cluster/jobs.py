"""Running relay as Ray jobs: `relay submit`, `relay jobs`, `relay stop`, through Ray's Jobs API.

Owns: validating a run's config on the submitting machine (bad input fails here, exit 2, before anything is sent),
staging what the job needs (relay's packages and the resolved config) as the job's `working_dir`, the job's
runtime environment, Ray 2.60's token authentication for the Jobs API, streaming a job's logs, and listing and
stopping jobs. Does not own: the run itself (the job runs `python -m cluster.cli train` on the cluster).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from cluster.config import RunConfig, dump_config

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "actors", "learner", "rewards", "configs")  # what a job imports or names; small
FORWARDED_ENV = ("RELAY_CACHE_DIR", "VLLM_CACHE_ROOT", "HF_HOME", "VLLM_LOGGING_LEVEL")  # when set here
AGENT_WAIT_SECONDS = 60


class JobsError(RuntimeError):
    """The Jobs API refused a request; the message is one line."""


def client(address: str) -> Any:
    """A Jobs API client for `address` (http://head:8265). Ray 2.60 clusters require a token: it is read from
    RAY_AUTH_TOKEN or ~/.ray/auth_token (what `ray start` writes) and sent as a bearer header."""
    from ray.job_submission import JobSubmissionClient

    headers = {}
    token = os.environ.get("RAY_AUTH_TOKEN") or _token_file()
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return JobSubmissionClient(address, headers=headers)


def submit(config: RunConfig, address: str, run_dir: str | None = None) -> str:
    """Submit the run as a Ray job; returns the job id. The config is resolved and shipped with the code."""
    staging = Path(tempfile.mkdtemp(prefix="relay-job-"))
    try:
        for name in PACKAGES:
            shutil.copytree(ROOT / name, staging / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        resolved = config.model_copy(update={"run_dir": run_dir or config.run_dir})
        (staging / "run.yaml").write_text(dump_config(resolved))
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


def _token_file() -> str | None:
    path = Path.home() / ".ray" / "auth_token"
    return path.read_text().strip() if path.is_file() else None

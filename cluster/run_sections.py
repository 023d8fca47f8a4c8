"""The run config's own sections, beside those the packages own: the model (`model`), checkpoints (`checkpoint`),
logging and metrics (`logging`), the deadlines of actor calls (`timeouts`) and Ray (`ray`).

Owns: `ModelConfig`, `CheckpointConfig`, `LoggingConfig`, `TimeoutConfig`, `RayConfig`; `cluster/config.py` composes
them into `RunConfig` (and checks them against the other sections). Imports nothing heavier than pydantic.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ModelConfig(_Section):
    path: str | None = None
    """Hugging Face model directory of the initial policy; empty means the demo model of `data.task`, which ships with
    relay (`cluster/demo/models/`, copied to the cache on first use)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype: the engines' and the reference's weights, the learner's forward and backward (autocast when its
    parameters are float32: `learner.master_dtype`), and the saved policy's."""


class CheckpointConfig(_Section):
    every: int = Field(20, ge=0, le=10_000_000)
    """Write a checkpoint every this many steps (and always after the last step); 0: only after the last step. With
    `rollout.max_staleness` >= 1 the pipeline drains at these steps, which fixes the weights version of each batch: a
    resumed run must keep it."""
    keep: int = Field(2, ge=1, le=1000)
    """Checkpoints kept in `run_dir/checkpoints/`; older ones are deleted once a newer one is complete."""


class LoggingConfig(_Section):
    tensorboard: bool = True
    """Write TensorBoard event files to `run_dir/tensorboard/`."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb` and a login or WANDB_API_KEY)."""
    wandb_project: str = Field("relay", min_length=1)
    """Weights & Biases project."""
    wandb_run_name: str | None = None
    """Weights & Biases run name; empty: the run directory's name."""
    prometheus_port: int | None = Field(None, ge=0, le=65535)
    """Serve the run's metrics for Prometheus at http://prometheus_host:PORT/metrics from the driver (0: any free port,
    printed at start); empty: not served. docs/operations.md, "Prometheus and Grafana"."""
    prometheus_host: str = Field("127.0.0.1", min_length=1)
    """Address the metrics server binds (with `prometheus_port`): this machine only by default; `0.0.0.0` lets other
    machines (a Prometheus server) scrape it, and anyone else who can reach the port (no authentication: the run
    warns)."""


class TimeoutConfig(_Section):
    start: float = Field(600.0, gt=0)
    """Seconds for every actor to start (engines load their model here)."""
    generate: float = Field(300.0, gt=0)
    """Seconds for one worker's generate call."""
    reference: float = Field(300.0, gt=0)
    """Seconds for the reference worker's logprobs call."""
    teacher: float = Field(300.0, gt=0)
    """Seconds for the teacher worker's logprobs call (on-policy distillation)."""
    reward: float = Field(300.0, gt=0)
    """Seconds for a reward-model worker's scoring call (remote verifiers have their own `timeout`)."""
    train: float = Field(1800.0, gt=0)
    """Seconds for the learner's train step."""
    sync: float = Field(300.0, gt=0)
    """Seconds for exporting and loading weights on every worker, probe included."""


class RayConfig(_Section):
    address: str | None = None
    """Ray cluster address (`auto`, `ray://host:10001`); empty starts a local Ray instance for this run."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs a local Ray instance advertises (default: every core)."""
    dashboard: bool = False
    """Start the Ray dashboard with a local instance, bound to 127.0.0.1; its address is printed at start. Off by
    default: on a small machine its processes slow the run's start and its steps (docs/benchmarks.md, "Start-up")."""
    log_to_driver: bool = False
    """Echo every actor's log (vLLM's included) on the console; otherwise they stay in Ray's session logs."""

"""How completions are scored: named reward sources (rule verifiers, remote services, reward models) and shaping.

Owned here, beside the verifiers; `cluster/config.py` composes them into the run config. Imports only pydantic (and
the standard library's `ipaddress` and `urllib`).
Also owns where a bearer token may travel (`clear_text_token_error`, `is_loopback`): config validation needs it, and a
config module imports nothing of the project, so the clients (rewards/http.py) and `relay submit` use it from here.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator


def is_loopback(host: str | None) -> bool:
    """Whether `host` is this machine: 127.0.0.0/8, ::1 (or ::ffff:127.x.y.z), `localhost`. Lookalikes such as
    `127.0.0.1.example.com` are not."""
    if not host:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host.lower().rstrip(".") == "localhost"
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is 127.0.0.1
    return (mapped or ip).is_loopback


def clear_text_token_error(urls: Sequence[str], token_env: str | None, allowed: bool) -> str | None:
    """One line saying why sending the bearer token of `token_env` to `urls` would put it on the network in clear
    text, naming the fixes: a URL of plain http (or ws) to a host that is not loopback. None when none would: https,
    loopback (a tunnel's near end), no token, or `allowed` (`allow_plain_http_token`)."""
    if token_env is None or allowed:
        return None
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme.lower() in ("http", "ws") and not is_loopback(parts.hostname):
            return (f"url {url} is plain http to another machine: it would carry the bearer token from ${token_env} "
                    "in clear text; use an https:// URL, or tunnel the service to this machine (ssh -L "
                    "PORT:127.0.0.1:PORT HOST) and use http://127.0.0.1:PORT, or set allow_plain_http_token: true "
                    "to send it anyway")
    return None


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class RuleSource(_Section):
    type: Literal["rule"] = "rule"
    """A rule verifier run in the driver: a pure function (completion, label) -> reward."""
    verifier: str = Field("exact_match", min_length=1)
    """A name from `rewards/registry.py` (`exact_match`, `numeric_match`, `math_verify`, `format`, `reasoning_gym`)
    or your own function as `package.module:function`."""
    params: dict[str, Any] = {}
    """Keyword arguments passed to the verifier (e.g. `pattern` for `format`)."""
    weight: float = Field(1.0, ge=-1000, le=1000)
    """Weight of this source in the combined reward."""
    level: Literal["outcome", "steps"] = "outcome"
    """`outcome`: one reward per completion, `verifier(completion, label) -> float`. `steps` (process supervision,
    needs `reward.steps.delimiter`): one reward per step, `verifier(steps, label) -> list[float]` with `steps` the
    completion's step texts (a registry name: `step_match`, or your own `package.module:function`)."""


class RemoteSource(_Section):
    type: Literal["remote"]
    """A verifier service over HTTP (`POST /verify`, or OpenRLHF's `/get_reward`: `protocol`; docs/verifiers.md)."""
    protocol: Literal["relay", "openrlhf"] = "relay"
    """What the service speaks: `relay`, relay's protocol (`POST <url>/verify`, `relay verifier serve`); `openrlhf`,
    OpenRLHF's remote reward protocol (`POST <url>` with `{query, prompts, labels}`, reply `{rewards, ...}`)."""
    urls: list[str] = Field(min_length=1)
    """The service's replicas, batches spread over them: base URLs (`http(s)://host:port`) with protocol `relay`; the
    full endpoint URLs, as OpenRLHF's `--reward.remote_url` takes them (`http://host:port/get_reward`), with
    `openrlhf`."""
    weight: float = Field(1.0, ge=-1000, le=1000)
    """Weight of this source in the combined reward."""
    batch_size: int = Field(64, ge=1, le=100_000)
    """Samples per request."""
    max_concurrency: int = Field(8, ge=1, le=4096)
    """Requests in flight at once, over all URLs."""
    timeout: float = Field(30.0, gt=0, le=86_400)
    """Deadline of one request, in seconds (connect + send + reply)."""
    max_retries: int = Field(3, ge=0, le=100)
    """Retries of a request that was refused, timed out or got a 5xx reply (never on 4xx)."""
    backoff: float = Field(0.25, gt=0, le=600)
    """First retry delay in seconds; doubles each retry, with full jitter, up to `backoff_max`."""
    backoff_max: float = Field(8.0, gt=0, le=3600)
    """Longest retry delay in seconds."""
    on_failure: Literal["fail", "drop", "default"] = "fail"
    """What happens to samples still unscored after the retries: `fail` stops the run naming the service and the
    error, `drop` removes their groups from the step, `default` gives them `default_reward`. Always counted."""
    default_reward: float | None = None
    """Reward of an unscored sample with `on_failure=default`."""
    token_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of the environment variable holding a bearer token (the token itself is never in the config)."""
    verify_tls: bool = True
    """Verify the service's TLS certificate (https URLs)."""
    allow_plain_http_token: bool = False
    """Send the bearer token (`token_env`) over plain `http://` to a host that is not loopback anyway: anyone on the
    network path can read it. Off: such a URL is refused; use https, or a tunnel to 127.0.0.1 (loopback: 127.0.0.0/8,
    ::1, localhost)."""
    level: Literal["outcome", "steps"] = "outcome"
    """What the service scores: `outcome`, one `reward` per completion; `steps`, the service scores each step of a
    completion (`step_rewards`, docs/verifiers.md); needs `reward.steps.delimiter`."""

    @model_validator(mode="after")
    def _valid(self) -> RemoteSource:
        for url in self.urls:
            if self.protocol == "relay" and not re.fullmatch(r"https?://[^\s/:]+(:\d{1,5})?/?", url):
                raise ValueError(f"url {url!r} is not of the form http(s)://host[:port]"
                                 + (" (an endpoint URL like .../get_reward needs protocol=openrlhf)"
                                    if re.fullmatch(r"https?://[^\s/:]+(:\d{1,5})?/\S+", url) else ""))
            if self.protocol == "openrlhf" and not re.fullmatch(r"https?://[^\s/:]+(:\d{1,5})?/\S+", url):
                raise ValueError(f"url {url!r} is not an endpoint URL: with protocol openrlhf give the whole URL "
                                 "the service answers on, e.g. http://127.0.0.1:5000/get_reward")
        if self.protocol == "openrlhf" and self.level == "steps":
            raise ValueError("protocol openrlhf scores whole completions (one reward per query): level steps needs "
                             "protocol relay")
        if self.on_failure == "default" and self.default_reward is None:
            raise ValueError("on_failure=default needs default_reward (e.g. 0.0); or choose fail or drop")
        if self.backoff > self.backoff_max:
            raise ValueError(f"backoff ({self.backoff}) must not exceed backoff_max ({self.backoff_max})")
        if (error := clear_text_token_error(self.urls, self.token_env, self.allow_plain_http_token)) is not None:
            raise ValueError(error)
        return self


class RewardModelTraining(_Section):
    every: int = Field(ge=1, le=1_000_000)
    """Steps between fine-tunings: at every step that is a multiple of it, after the update, the reward model is
    fine-tuned on that step's completions (its fresh groups), then scores the next steps with the new weights."""
    label_source: str = Field(min_length=1)
    """Name of the outcome source (`type` rule or remote) whose scores are the targets, e.g. `correct`."""
    loss: Literal["bradley_terry", "regression"] = "bradley_terry"
    """`bradley_terry`: -log sigmoid(s_i - s_j) over every pair of one prompt's completions whose targets differ
    (the higher one preferred), as InstructGPT's reward model; `regression`: squared error to the target."""
    lr: float = Field(1e-5, gt=0, le=1)
    """AdamW learning rate of the reward model."""
    epochs: int = Field(1, ge=1, le=100)
    """Passes (each one optimizer step) over the step's completions per fine-tuning."""
    weight_decay: float = Field(0.0, ge=0, le=1)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping threshold (global L2 norm)."""


class ModelSource(_Section):
    type: Literal["model"]
    """A reward model (`AutoModelForSequenceClassification`) in its own Ray actor: frozen, or fine-tuned during the
    run with `train`."""
    path: str | None = Field(None, min_length=1)
    """Hugging Face directory of the reward model (one output: the score). Empty (only with `train`): the policy's
    model with a new, seeded scalar head, as InstructGPT starts its reward model from the SFT model."""
    train: RewardModelTraining | None = None
    """Iterative GRPO: fine-tune the reward model during the run on completions labelled by a verifier source
    (weights and optimizer checkpointed); empty: frozen."""
    weight: float = Field(1.0, ge=-1000, le=1000)
    """Weight of this source in the combined reward."""
    normalize: Literal["none", "batch"] = "none"
    """`batch` whitens the scores over the step's completions (mean 0, std 1) before weighting."""
    num_cpus: float = Field(0.5, gt=0, le=1024)
    """CPUs Ray reserves for the reward-model worker."""
    num_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves for the reward-model worker."""
    num_threads: int = Field(1, ge=1, le=1024)
    """Torch threads of the reward-model worker."""
    micro_batch_size: int | None = Field(None, ge=1, le=1_000_000)
    """Sequences per forward pass at most; empty: only `max_tokens_per_micro_batch` limits a pass."""
    max_tokens_per_micro_batch: int | None = Field(1024, ge=1, le=1_000_000_000)
    """Padded tokens per forward pass at most, as `learner.max_tokens_per_micro_batch` (texts sorted by token
    count, each pass padded to its own longest); empty: no token limit."""
    level: Literal["outcome", "steps"] = "outcome"
    """`outcome`: a sequence classifier (`AutoModelForSequenceClassification`, one output) scores the completion.
    `steps`: a process reward model (`AutoModelForTokenClassification`, 1 output, or 2 read as the probability of
    label 1, as Qwen2.5-Math-PRM) scores each step at the token that follows it (needs `reward.steps.delimiter`)."""
    separator: str | None = Field(None, min_length=1)
    """With `level: steps`: the text the reward model reads after each step, and where it reads the step's score
    (e.g. Qwen2.5-Math-PRM's `<extra_0>`); empty: `reward.steps.delimiter`."""

    @model_validator(mode="after")
    def _trained(self) -> ModelSource:
        if self.path is None and self.train is None:
            raise ValueError("path is empty: give the reward model's directory (an empty path, the policy's model "
                             "with a new head, needs train)")
        if self.train is not None and self.level == "steps":
            raise ValueError("train fine-tunes an outcome reward model; a process reward model (level steps) is frozen")
        return self


def _source_type(value: Any) -> str:
    """A source without `type` is a rule verifier (the common case: `reward.sources.fmt.verifier=format`)."""
    return value.get("type", "rule") if isinstance(value, dict) else getattr(value, "type", "rule")


RewardSource = Annotated[Annotated[RuleSource, Tag("rule")] | Annotated[RemoteSource, Tag("remote")]
                         | Annotated[ModelSource, Tag("model")], Discriminator(_source_type)]


SOURCE_TYPES: dict[str, type[BaseModel]] = {"rule": RuleSource, "remote": RemoteSource, "model": ModelSource}


class EnvironmentConfig(_Section):
    """Multi-turn episodes (docs/environments.md): with `spec` or `urls` set, each completion is an episode of up to
    `rollout.max_turns` model turns, each answered by the environment, whose tokens are appended to the response as
    they are and masked out of the loss."""

    spec: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
    """An in-process environment class, `package.module:Class` (e.g.
    `rewards.environments.examples:Calculator`), one instance per episode, run in each rollout worker's process."""
    params: dict[str, Any] = {}
    """Keyword arguments of the environment class's constructor (in-process), e.g. `{max_calls: 2}`; `null` clears
    those of a YAML file (with `spec=null`, to use `urls` instead)."""
    urls: list[str] = []
    """Base URLs of an environment service's replicas (`http(s)://host:port`, `relay env serve`, or OpenEnv servers
    with `protocol: openenv`); instead of `spec`."""
    protocol: Literal["relay", "openenv"] = "relay"
    """What the `urls` speak: `relay`, relay's environment protocol (`relay env serve`); `openenv`, OpenEnv servers
    (openenv-core's `create_app`): one WebSocket session (`/ws`) per episode, its steps never retried
    (docs/environments.md, "Training against an OpenEnv server")."""
    action_field: str = Field("message", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=128)
    """OpenEnv: the field of the server's action that carries the model's text (an action is `{action_field: text}`)."""
    observation_field: str = Field("text", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=128)
    """OpenEnv: the field of the server's observation whose string is appended to the episode."""
    weight: float = Field(1.0, ge=-1000, le=1000)
    """Weight of the environment's rewards in the combined reward (`reward/env` in the metrics)."""
    turn_rewards: Literal["outcome", "steps"] = "outcome"
    """`outcome`: an episode's turn rewards are summed into its outcome reward; `steps`: each turn's reward is a step
    reward at the turn's last model token (the process-supervision path: grpo, gae or reinforce)."""
    observation: Literal["text", "chat"] = "text"
    """How an observation becomes tokens: `text`, its text tokenised alone (no special tokens); `chat`, a `tool`
    message of the model's chat template after the model's turn, up to the next assistant turn's header
    (`rewards/environments/tools.py`)."""
    max_observation_tokens: int | None = Field(None, ge=1, le=1_000_000)
    """An observation longer than this many tokens keeps its first ones (a tool's long output, as verl's
    `max_tool_response_length`; counted in `env/truncated_observations`); empty: kept whole."""
    max_concurrency: int = Field(32, ge=1, le=4096)
    """Environment calls (in-process: threads) or requests (remote) in flight at once, per rollout worker; with
    `protocol: openenv`, sessions open at once (keep it times the rollout workers within the servers' total
    `max_concurrent_envs`)."""
    timeout: float = Field(30.0, gt=0, le=86_400)
    """Deadline of one environment call (in-process) or request (remote; openenv: opening a session with its reset,
    a step, a close), in seconds."""
    max_retries: int = Field(3, ge=0, le=100)
    """Remote: retries of a request that was refused, timed out or got a 5xx reply (never on 4xx); openenv retries
    opening a session only, never a step."""
    backoff: float = Field(0.25, gt=0, le=600)
    """Remote: first retry delay in seconds; doubles each retry, with full jitter, up to `backoff_max`."""
    backoff_max: float = Field(8.0, gt=0, le=3600)
    """Remote: longest retry delay in seconds."""
    token_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Remote: name of the environment variable holding the service's bearer token."""
    verify_tls: bool = True
    """Remote: verify the service's TLS certificate (https URLs)."""
    allow_plain_http_token: bool = False
    """Remote: send the bearer token (`token_env`) over plain `http://` (openenv: `ws://`) to a host that is not
    loopback anyway: anyone on the network path can read it. Off: such a URL is refused; use https, or a tunnel to
    127.0.0.1 (loopback: 127.0.0.0/8, ::1, localhost)."""
    on_failure: Literal["fail", "drop"] = "fail"
    """What an episode whose environment call failed (raised, timed out, service down after the retries) does:
    `fail` stops the run naming the environment and the error; `drop` removes its group from the step. Always counted
    (`env/failures`)."""

    @property
    def enabled(self) -> bool:
        return self.spec is not None or bool(self.urls)

    @field_validator("params", mode="before")
    @classmethod
    def _cleared(cls, params: Any) -> Any:
        return {} if params is None else params  # an override cannot empty a dict (overrides merge into it)

    @model_validator(mode="after")
    def _valid(self) -> EnvironmentConfig:
        if self.spec is not None and self.urls:
            raise ValueError("spec (an in-process environment) and urls (a service) are both set; keep one")
        if self.params and self.spec is None:
            raise ValueError("params are the constructor arguments of an in-process environment: set spec too, or "
                             "clear them (env.params=null)")
        for url in self.urls:
            if not re.fullmatch(r"https?://[^\s/:]+(:\d{1,5})?/?", url):
                raise ValueError(f"url {url!r} is not of the form http(s)://host[:port]")
        if self.backoff > self.backoff_max:
            raise ValueError(f"backoff ({self.backoff}) must not exceed backoff_max ({self.backoff_max})")
        if (error := clear_text_token_error(self.urls, self.token_env, self.allow_plain_http_token)) is not None:
            raise ValueError(error)
        if self.protocol == "openenv" and not self.urls:
            raise ValueError("protocol 'openenv' talks to OpenEnv servers: set urls (e.g. "
                             "env.urls=[http://127.0.0.1:8000]) instead of spec")
        for name in ("action_field", "observation_field"):  # a dumped config holds the defaults: those pass
            if getattr(self, name) != type(self).model_fields[name].default and self.protocol != "openenv":
                raise ValueError(f"{name} maps text to and from an OpenEnv server's dicts: set protocol=openenv "
                                 f"(and urls), or remove {name}")
        return self


class StepsConfig(_Section):
    delimiter: str | None = Field(None, min_length=1)
    """Process supervision: a response token whose text holds this string ends a step (e.g. a newline, or a space
    for the `chain_sum` demo); the last token ends the last step. Sources with `level: steps` score each step; the
    learner credits each step's reward to the tokens that led to it (docs/algorithms.md). Empty: off."""


class RewardConfig(_Section):
    sources: dict[str, RewardSource] = Field(default_factory=lambda: {"correct": RuleSource()})
    """Named reward sources, each of `type` rule, remote or model, with a `weight`; the reward is the weighted sum.
    Giving `sources` (in YAML or as overrides) replaces the default `{correct: {type: rule, verifier:
    exact_match}}` (`verifier: reasoning_gym` with `data.task=reasoning_gym`). Each source's mean goes in the metrics as
    `reward/<name>`. May be empty (`{}`) when an environment (`env`) gives the rewards."""
    steps: StepsConfig = StepsConfig()
    """How completions are split into steps for the sources with `level: steps`."""
    overlong_buffer: int = Field(0, ge=0, le=1_000_000)
    """DAPO soft overlong punishment: responses longer than `rollout.max_new_tokens - overlong_buffer` tokens lose
    reward linearly, up to `overlong_penalty` at the maximum; 0 turns it off."""
    overlong_penalty: float = Field(1.0, ge=0, le=1000)
    """Reward lost by a response of the maximum length when `overlong_buffer` > 0."""

    @property
    def scores_steps(self) -> bool:
        """Whether some source scores steps (`level: steps`): process supervision is on."""
        return any(source.level == "steps" for source in self.sources.values())

    @model_validator(mode="after")
    def _names(self) -> RewardConfig:
        for name in self.sources:
            if not re.fullmatch(r"[a-z][a-z0-9_]{0,63}", name):
                raise ValueError(f"source name {name!r} must be lower-case letters, digits and _ (it names metrics)")
            if name in ("mean", "std"):
                raise ValueError(f"source name {name!r} would hide the metric reward/{name}; choose another name")
        for name, source in self.sources.items():
            if isinstance(source, ModelSource) and source.train is not None:
                label = self.sources.get(source.train.label_source)
                if label is None or isinstance(label, ModelSource) or label.level != "outcome":
                    raise ValueError(f"sources.{name}.train.label_source {source.train.label_source!r} must name an "
                                     "outcome source of type rule or remote (the verifier whose scores it learns)")
        stepped = [name for name, source in self.sources.items() if source.level == "steps"]
        if stepped and self.steps.delimiter is None:
            raise ValueError(f"source {stepped[0]!r} has level 'steps' but reward.steps.delimiter is empty: set it "
                             "(e.g. reward.steps.delimiter='\\n')")
        return self

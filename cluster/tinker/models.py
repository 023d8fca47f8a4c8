"""The models `relay serve` trains for its clients, and the futures their requests answer with.

Owns: `TrainingRuns` — one training run per `create_model` (its own LoRA adapters and AdamW state: a `DatumLearner`
started as a one-rank learner group, cluster/fleet/learner_group.py), the order of a model's requests (each runs after
the one sent before it), which tenant owns a model and its checkpoints, and `Futures` — request ids, their results or
one-line errors (the SDK's `RequestFailedResponse`: a category and a message), a long poll for `retrieve_future`.
Does not own: HTTP and the wire formats (cluster/tinker/service.py, cluster/tinker/wire.py), the learner's arithmetic
(learner/datums.py).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from learner.config import LearnerConfig, LoraConfig

NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")  # a checkpoint's name: one path component
# A model's id: this server's (`model-<n>-<hex>`) or the SDK's for a model made from a checkpoint
# (`<session id>:train:<n>`, `create_training_client_from_state`); its checkpoints' directory
MODEL_ID = re.compile(r"[A-Za-z0-9._:-]{1,200}")
FULL = 0  # a training run's "rank" when it fine-tunes every weight (no LoRA)
OWNER_FILE = ".owner"  # in a model's checkpoints' directory: the tenant it belongs to (never a checkpoint's name)


class UserError(ValueError):
    """A request the client can fix (category `user`): its message says how."""


@dataclass
class Outcome:
    """A finished request: the value (JSON-ready, or protobuf bytes), or a failure's message and category."""

    value: Any = None
    error: str | None = None
    category: str = "user"


class Futures:
    """Request ids and their results. `start` runs a coroutine and answers at once with its id."""

    def __init__(self) -> None:
        self._tasks: dict[str, tuple[str, asyncio.Task[Outcome]]] = {}  # request id -> (owner, its task)

    def start(self, work: Awaitable[Any], owner: str = "") -> str:
        """Run `work` as a request of tenant `owner`; its id."""
        request_id = uuid.uuid4().hex
        self._tasks[request_id] = (owner, asyncio.ensure_future(_outcome(work)))
        return request_id

    async def result(self, request_id: str, owner: str, wait_s: float) -> Outcome | None:
        """The request's outcome (forgotten once read), None if it is still running after `wait_s` seconds; a
        `UserError` for an id this server never gave `owner` (a server restarted since: the request is lost)."""
        owned, task = self._tasks.get(request_id, (None, None))
        if task is None or owned != owner:
            raise UserError(f"request {request_id} is unknown to this server (restarted since?); send the request "
                            "again")
        done, _ = await asyncio.wait([task], timeout=wait_s)
        if not done:
            return None
        del self._tasks[request_id]
        return task.result()


async def _outcome(work: Awaitable[Any]) -> Outcome:
    try:
        return Outcome(value=await work)
    except UserError as err:
        return Outcome(error=str(err), category="user")
    except Exception as err:  # noqa: BLE001  the client gets it as a server error, with its type; the log too
        import logging

        logging.getLogger(__name__).exception("request failed")
        return Outcome(error=f"{type(err).__name__}: {err}", category="server")


@dataclass
class TrainingRun:
    """One model: its learner group, its rank, and the tail of its request chain."""

    model_id: str
    base_model: str
    lora_rank: int  # FULL (0): full fine-tuning
    group: Any  # cluster.fleet.learner_group.LearnerGroup
    owner: str = ""  # the tenant (API key's fingerprint) that made it; "" on a server without keys
    tail: asyncio.Future | None = None


class TrainingRuns:
    """Every model this server trains, by id. Requests of one model run in the order they were sent."""

    def __init__(self, base_model: str, model_path: str, learner: LearnerConfig, dtype: str, timeouts: Any,
                 state_dir: Path, max_lora_rank: int = 128, learner_options: dict[str, Any] | None = None):
        self.state_dir = state_dir  # save_weights' checkpoints: <state_dir>/<model id>/<name>/
        self.base_model, self.model_path, self.learner = base_model, model_path, learner
        self.dtype, self.timeouts, self.max_lora_rank = dtype, timeouts, max_lora_rank
        self.learner_options = learner_options or {}
        self.runs: dict[str, TrainingRun] = {}
        self._ids = itertools.count()

    def check_base(self, base_model: Any) -> None:
        """A `UserError` unless `base_model` is the model this server serves."""
        if base_model != self.base_model:
            raise UserError(f"base_model {base_model!r} is not served here; use {self.base_model!r} (relay serve "
                            "serves its config's model: model.path)")

    def check_new(self, base_model: str, rank: int | None) -> int:
        """The LoRA rank to train `base_model` with, 0 for full fine-tuning (a `create_model` without `lora_config`,
        where the served config trains no LoRA: `learner.lora.rank` 0); a `UserError` for another model, a rank out
        of bounds, or full fine-tuning on a server configured for LoRA."""
        self.check_base(base_model)
        if rank is None or rank == FULL:
            if self.learner.lora.enabled:
                raise UserError("create_model without lora_config asks for full fine-tuning, which this server's "
                                "config does not allow (learner.lora.rank is set); give a LoRA rank")
            return FULL
        if not 1 <= rank <= self.max_lora_rank:
            raise UserError(f"LoRA rank {rank} is out of bounds; give 1..{self.max_lora_rank}")
        return rank

    async def create(self, base_model: str, rank: int, seed: int | None, model_id: str | None = None,
                     owner: str = "") -> str:
        """Start a model's learner (in a thread: loading takes seconds) for tenant `owner` and return its id
        (`model_id`: the one the SDK derived for a model made from a checkpoint; else a new one). Its checkpoints'
        directory records the owner (`OWNER_FILE`), so that they stay its own across restarts."""
        from cluster.fleet.learner_group import start_learner_group
        from learner.datums import DatumLearner

        lora = LoraConfig(**{**self.learner.lora.model_dump(), "rank": rank}) if rank != FULL else LoraConfig()
        config = self.learner.model_copy(update={"lora": lora, "num_ranks": 1})
        options = {"num_cpus": config.num_cpus, "num_gpus": config.num_gpus, **self.learner_options}
        group = await asyncio.to_thread(
            start_learner_group, [options], self.model_path, config, dtype=self.dtype, temperature=1.0,
            seed=0 if seed is None else seed, critic=None, norm_length=None, timeouts=self.timeouts,
            learner_cls=DatumLearner)
        model_id = model_id or f"model-{next(self._ids)}-{uuid.uuid4().hex[:8]}"  # its checkpoints' directory
        (self.state_dir / model_id).mkdir(parents=True, exist_ok=True)
        (self.state_dir / model_id / OWNER_FILE).write_text(owner)
        self.runs[model_id] = TrainingRun(model_id, base_model, rank, group, owner)
        return model_id

    def get(self, model_id: str, owner: str) -> TrainingRun:
        """Model `model_id` of tenant `owner`; a `UserError` for one unknown to this server or another tenant's."""
        run = self.runs.get(model_id)
        if run is None or run.owner != owner:
            raise UserError(f"model_id {model_id!r} is unknown to this server; create the model first "
                            "(ServiceClient.create_lora_training_client)")
        return run

    def checkpoint(self, model_id: str, name: Any) -> tuple[str, Path]:
        """The SDK's path (`tinker://<model id>/weights/<name>`) and the directory of a model's checkpoint `name`."""
        if not isinstance(name, str) or not NAME.fullmatch(name) or name.startswith("."):
            raise UserError(f"checkpoint name {name!r} is not a plain name; use letters, digits, '.', '_' and '-'")
        return f"tinker://{model_id}/weights/{name}", self.state_dir / model_id / name

    def saved(self, path: Any, owner: str) -> Path:
        """The directory a `tinker://<model id>/weights/<name>` path saved on this server by tenant `owner` names."""
        model_id, sep, name = str(path).removeprefix("tinker://").partition("/weights/")
        if not sep or not str(path).startswith("tinker://"):
            raise UserError(f"path {path!r} is not a checkpoint path; give one save_weights (save_state) returned")
        if not MODEL_ID.fullmatch(model_id) or model_id.startswith("."):
            raise UserError(f"path {path!r} names no model of this server; give a path save_state returned here")
        directory = self.checkpoint(model_id, name)[1]
        owners = self.state_dir / model_id / OWNER_FILE
        if not directory.is_dir() or not owners.is_file() or owners.read_text() != owner:
            raise UserError(f"no checkpoint {path!r} on this server; give a path save_state returned here")
        return directory

    def new_id(self, session_id: Any, model_seq_id: Any) -> str:
        """The id the SDK derives for the model `create_training_client_from_state` makes (`<session>:train:<n>`);
        a `UserError` for one that is taken or malformed."""
        model_id = f"{session_id}:train:{model_seq_id}"
        if not MODEL_ID.fullmatch(model_id) or model_id.startswith(".") or not isinstance(model_seq_id, int):
            raise UserError(f"load_weights without model_id needs the session's session_id and model_seq_id "
                            f"(got {session_id!r}, {model_seq_id!r})")
        if model_id in self.runs:
            raise UserError(f"model {model_id} exists; create the training client from the checkpoint once")
        return model_id

    @staticmethod
    def saved_rank(directory: Path) -> int:
        """The LoRA rank of the adapters a checkpoint holds (its peft `adapter_config.json`), `FULL` for a whole
        model's weights (a Hugging Face directory)."""
        import json

        config = directory / "policy" / "adapter_config.json"
        if not config.exists() and (directory / "policy" / "config.json").is_file():
            return FULL
        try:
            return int(json.loads(config.read_text())["r"])
        except (OSError, ValueError, KeyError, TypeError):
            raise UserError(f"checkpoint {directory.name} holds no weights this server can read") from None

    def drop(self, model_id: str) -> None:
        """Stop model `model_id`'s learner and forget the model."""
        self.runs.pop(model_id).group.kill()

    def in_order(self, run: TrainingRun, work: Callable[[], Awaitable[Any]]) -> Awaitable[Any]:
        """`work()` once every request sent to `run` before it has finished (whatever its outcome)."""
        previous = run.tail

        async def after() -> Any:
            if previous is not None:
                await asyncio.wait([previous])
            return await work()

        task = asyncio.ensure_future(after())
        run.tail = task
        return task

    async def call(self, run: TrainingRun, method: str, *args: Any) -> Any:
        """`method(*args)` on the model's learner, within `timeouts.train`."""
        refs = run.group.submit(method, args)
        return (await asyncio.to_thread(run.group.finish, refs, self.timeouts.train, method))[0]

    def close(self) -> None:
        for run in self.runs.values():
            run.group.kill()
        self.runs.clear()

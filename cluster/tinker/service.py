"""`relay serve`: the Tinker API (REST under `/api/v1`, as the `tinker` SDK calls it) on relay's Ray actors, so that a
user's own training loop written against the SDK drives relay's learner (docs/tinker.md).

Owns: the routes (client config, sessions and heartbeats, server capabilities, health, `create_model`, `get_info`,
`forward_backward`, `optim_step`, `save_weights`, `load_weights`, `save_weights_for_sampler`,
`create_sampling_session`, `asample`, `retrieve_future`, telemetry accepted and dropped), the API key (`X-API-Key`, or
a bearer token: required beyond loopback), the guard against web pages (rewards/http.py's `BrowserGuard`, which here
also admits the SDK's protobuf bodies), starting or joining Ray, and serving.
Does not own: the models and the order of their requests (cluster/tinker/models.py), the binary wire format
(cluster/tinker/wire.py), sampling (cluster/tinker/sampling.py), the learner's passes (learner/datums.py). Not yet:
the losses `dro`, `gspo`, `stable_reinforce` and `custom`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import shutil
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cluster.tinker.models import Futures, TrainingRuns, UserError
from cluster.tinker.sampling import Samplers
from cluster.tinker.wire import WireError, read_forward_backward, write_forward_backward_output
from rewards.config import is_loopback
from rewards.http import BrowserGuard, allowed_origins, read_body, token_from_env

log = logging.getLogger(__name__)
PROTOBUF = "application/x-protobuf"
POLL_S = 20.0  # a retrieve_future waits this long for its result before answering try_again (the SDK waits 45 s)
MAX_BODY = 256 * 1024 * 1024
# What this server tells the SDK about itself (`ClientConfigResponse`): API keys (no JWT exchange), httpx, one
# forward_backward chunk after the other (a model's requests run in order anyway), uncompressed bodies.
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "use_pyqwest_transport": False,
                 "parallel_fwdbwd_chunks": False, "proto_compress_fwdbwd": False}


class TinkerGuard(BrowserGuard):
    """`BrowserGuard`, admitting protobuf bodies as well as JSON: a web page cannot send `application/x-protobuf`
    without a CORS preflight, which the guard's Origin check refuses, so the reason for the JSON-only rule holds."""

    def refusal(self, scope: dict[str, Any]) -> tuple[int, str] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if headers.get("content-type", "").split(";")[0].strip().lower() == PROTOBUF:
            scope = {**scope, "method": "GET"}  # the Host and Origin checks still apply
        return super().refusal(scope)


def tenant_of(headers: Any, keys: list[str]) -> str | None:
    """The tenant a request belongs to: the fingerprint of the API key it carries (`X-API-Key: <key>`, as the SDK
    sends it, or `Authorization: Bearer`), "" when the server has no keys, None for a missing or wrong key."""
    if not keys:
        return ""
    given = headers.get("x-api-key", "")
    scheme, _, bearer = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and not given:
        given = bearer.strip()
    matches = [key for key in keys if hmac.compare_digest(given.encode(), key.encode())]
    return key_fingerprint(matches[0]) if matches else None


def key_fingerprint(key: str) -> str:
    """A tenant's name: stable across restarts (its checkpoints stay its own), and not the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class Routes:
    """The API's handlers over the server's state: `runs`' models, `samplers`, the futures and sessions.

    Each request belongs to its API key's tenant (`request.state.tenant`, set by `create_app`'s key check): models,
    checkpoints, sampling sessions and futures are reachable only by the tenant that made them; to any other they are
    unknown."""

    def __init__(self, runs: TrainingRuns, samplers: Samplers, max_context: int | None, vocab_size: int | None):
        self.runs, self.samplers = runs, samplers
        self.max_context, self.vocab_size = max_context, vocab_size
        self.futures = Futures()
        self.sessions: dict[str, dict[str, Any]] = {}

    def table(self) -> list[tuple[str, str, Callable[..., Any]]]:
        """(method, path under /api/v1, handler) of every route."""
        return [("POST", "/client/config", self.client_config), ("POST", "/client/dynamic_config", self.empty),
                ("GET", "/healthz", self.healthz), ("POST", "/telemetry", self.telemetry),
                ("GET", "/get_server_capabilities", self.capabilities),
                ("POST", "/create_session", self.create_session),
                ("POST", "/session_heartbeat", self.session_heartbeat), ("POST", "/create_model", self.create_model),
                ("POST", "/get_info", self.get_info), ("POST", "/forward_backward", self.forward_backward),
                ("POST", "/optim_step", self.optim_step), ("POST", "/save_weights", self.save_weights),
                ("POST", "/load_weights", self.load_weights),
                ("POST", "/save_weights_for_sampler", self.save_weights_for_sampler),
                ("POST", "/create_sampling_session", self.create_sampling_session),
                ("POST", "/asample", self.asample), ("POST", "/retrieve_future", self.retrieve_future)]

    def future(self, request: Request, work: Awaitable[Any], model_id: str | None = None) -> dict[str, Any]:
        """Start `work` as the request's tenant's future; the SDK's `UntypedAPIFuture`."""
        return {"request_id": self.futures.start(work, request.state.tenant), "model_id": model_id}

    def failed(self, request: Request, err: Exception) -> dict[str, Any]:
        """A future that fails with `err` (the SDK's error shape for these routes: category user)."""
        return self.future(request, _raise(UserError(str(err))))

    async def client_config(self) -> dict[str, Any]:
        return CLIENT_CONFIG

    async def empty(self) -> dict[str, Any]:
        return {}

    async def healthz(self) -> dict[str, Any]:
        return {"status": "ok"}

    async def telemetry(self) -> dict[str, Any]:
        return {"status": "accepted"}

    async def capabilities(self) -> dict[str, Any]:
        return {"supported_models": [{"model_name": self.runs.base_model, "max_context_length": self.max_context,
                                      "trainable": True, "sampleable": True}]}

    async def create_session(self, request: Request) -> Any:
        try:
            data = await body_json(request)
        except UserError as err:
            return refused(err)
        session_id = uuid.uuid4().hex
        self.sessions[session_id] = {"tags": data.get("tags", []), "models": []}
        return {"type": "create_session", "session_id": session_id}

    async def session_heartbeat(self) -> dict[str, Any]:
        return {"type": "session_heartbeat"}

    async def create_model(self, request: Request) -> Any:
        runs = self.runs
        try:
            data = await body_json(request)
            rank = runs.check_new(data.get("base_model"), (data.get("lora_config") or {}).get("rank"))
        except UserError as err:
            return self.failed(request, err)
        seed, owner = (data.get("lora_config") or {}).get("seed"), request.state.tenant

        async def create() -> dict[str, Any]:
            return {"type": "create_model", "model_id": await runs.create(runs.base_model, rank, seed, owner=owner)}

        return self.future(request, create())

    async def get_info(self, request: Request) -> Any:
        try:
            run = self.runs.get((await body_json(request)).get("model_id"), request.state.tenant)
        except UserError as err:
            return refused(err)
        return {"type": "get_info", "model_id": run.model_id, "is_lora": run.lora_rank > 0,
                "lora_rank": run.lora_rank or None,
                "model_name": run.base_model,
                "model_data": {"arch": "relay", "model_name": run.base_model, "tokenizer_id": self.runs.model_path}}

    async def forward_backward(self, request: Request) -> Any:
        try:
            fb = read_forward_backward(await read_body(request, MAX_BODY) or b"", self.vocab_size)
            run = self.runs.get(fb.model_id, request.state.tenant)
            check_forward_backward(fb, self.max_context)
        except (UserError, WireError) as err:
            return self.failed(request, err)

        async def step() -> bytes:
            rows, metrics = await self.runs.call(run, "forward_backward", fb.datums, fb.loss_fn, fb.forward_only,
                                                fb.config)
            return write_forward_backward_output(rows, metrics)

        return self.future(request, self.runs.in_order(run, step), run.model_id)

    async def optim_step(self, request: Request) -> Any:
        try:
            data = await body_json(request)
            run = self.runs.get(data.get("model_id"), request.state.tenant)
            adam = _adam(data)
        except UserError as err:
            return refused(err)

        async def step() -> dict[str, Any]:
            return {"type": "optim_step", "metrics": await self.runs.call(run, "optim_step", *adam)}

        return self.future(request, self.runs.in_order(run, step), run.model_id)

    async def save_weights(self, request: Request) -> Any:
        try:
            data = await body_json(request)
            run = self.runs.get(data.get("model_id"), request.state.tenant)
            path, directory = self.runs.checkpoint(run.model_id, data.get("path"))
            if directory.exists() and not data.get("overwrite"):
                raise UserError(f"checkpoint {path} exists; choose another name or pass overwrite")
        except UserError as err:
            return self.failed(request, err)

        async def save() -> dict[str, Any]:
            if directory.exists():
                shutil.rmtree(directory)
            await self.runs.call(run, "save_state", str(directory))
            return {"type": "save_weights", "path": path}

        return self.future(request, self.runs.in_order(run, save), run.model_id)

    async def load_weights(self, request: Request) -> Any:
        tenant = request.state.tenant
        try:
            data = await body_json(request)
            if data.get("model_id") is None:  # create_training_client_from_state[_with_optimizer]: a new model
                return self.from_state(request, data)
            run = self.runs.get(data.get("model_id"), tenant)
            directory = self.runs.saved(data.get("path"), tenant)
        except UserError as err:
            return self.failed(request, err)

        async def load() -> dict[str, Any]:
            await self.runs.call(run, "load_state", str(directory), bool(data.get("optimizer")))
            return {"type": "load_weights", "path": data["path"], "model_id": run.model_id}

        return self.future(request, self.runs.in_order(run, load), run.model_id)

    def from_state(self, request: Request, data: dict[str, Any]) -> Any:
        """A new model (the id the SDK derived) with the rank of the checkpoint at `path`, loaded from it (AdamW's
        state too with `optimizer`)."""
        runs, tenant = self.runs, request.state.tenant
        model_id = runs.new_id(data.get("session_id"), data.get("model_seq_id"))
        directory = runs.saved(data.get("path"), tenant)
        rank = runs.check_new(data.get("base_model") or runs.base_model, runs.saved_rank(directory))

        async def create_and_load() -> dict[str, Any]:
            await runs.create(runs.base_model, rank, None, model_id=model_id, owner=tenant)
            try:
                await runs.call(runs.get(model_id, tenant), "load_state", str(directory), bool(data.get("optimizer")))
            except BaseException:
                runs.drop(model_id)  # no half-made model left behind
                raise
            return {"type": "load_weights", "path": data["path"], "model_id": model_id}

        return self.future(request, create_and_load(), model_id)

    async def save_weights_for_sampler(self, request: Request) -> Any:
        try:
            data = await body_json(request)
            run = self.runs.get(data.get("model_id"), request.state.tenant)
        except UserError as err:
            return self.failed(request, err)

        async def save() -> dict[str, Any]:
            session_id = await self.samplers.save(run)
            return {"type": "save_weights_for_sampler", "sampling_session_id": session_id,
                    "path": f"tinker://{session_id}"}

        return self.future(request, self.runs.in_order(run, save), run.model_id)

    async def create_sampling_session(self, request: Request) -> Any:
        tenant = request.state.tenant
        try:
            data = await body_json(request)
            if not data.get("model_path"):  # the base model alone
                self.runs.check_base(data.get("base_model"))
                return {"type": "create_sampling_session",
                        "sampling_session_id": await self.samplers.base_session(tenant)}
            session_id = str(data.get("model_path") or "").removeprefix("tinker://")
            session = self.samplers.sessions.get(session_id)
            if session is None or session.owner != tenant:
                raise UserError(f"model_path {data.get('model_path')!r} is not a sampler's weights saved on this "
                                "server; give the path save_weights_for_sampler returned")
        except UserError as err:
            return refused(err)
        return {"type": "create_sampling_session", "sampling_session_id": session_id}

    async def asample(self, request: Request) -> Any:
        try:
            session, prompt, settings, seed, ids = self.samplers.prepare(await body_json(request),
                                                                         request.state.tenant)
        except UserError as err:
            return {**self.failed(request, err), "sample_sequence_ids": []}
        return {**self.future(request, self.samplers.sample(session, prompt, settings, seed)),
                "sample_sequence_ids": ids}

    async def retrieve_future(self, request: Request) -> Any:
        try:
            request_id = (await body_json(request)).get("request_id", "")
            outcome = await self.futures.result(request_id, request.state.tenant, POLL_S)
        except UserError as err:
            return JSONResponse({"error": str(err), "category": "user"})
        if outcome is None:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        if outcome.error is not None:
            return {"error": outcome.error, "category": outcome.category}
        if isinstance(outcome.value, bytes):
            return Response(outcome.value, media_type=PROTOBUF)
        return outcome.value


def create_app(runs: TrainingRuns, samplers: Samplers, keys: list[str] = (), allow_origins: list[str] = (),
               max_context: int | None = None, vocab_size: int | None = None) -> Any:
    """The app serving `runs` and `samplers` (`Routes`) under /api/v1; `keys`: the API keys clients may send, each
    its own tenant (none: no key is asked for, one tenant). Web pages are refused (`TinkerGuard`)."""
    app = FastAPI(title="relay serve (Tinker API)", docs_url=None, redoc_url=None, openapi_url=None)
    routes = Routes(runs, samplers, max_context, vocab_size)
    for method, path, handler in routes.table():
        app.add_api_route(f"/api/v1{path}", handler, methods=[method])

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        request.state.tenant = tenant_of(request.headers, list(keys))
        if request.state.tenant is None:
            return JSONResponse({"detail": "missing or wrong API key: send a key relay serve was started with "
                                           "(TINKER_API_KEY, or the SDK's api_key)"}, status_code=401)
        return await call_next(request)

    app.state.runs = runs
    return TinkerGuard(app, allowed_origins(allow_origins), serve_command="relay serve")


async def body_json(request: Request) -> dict[str, Any]:
    """The request's JSON object; a `UserError` for anything else."""
    raw = await read_body(request, MAX_BODY)
    try:
        data = json.loads(raw or b"{}")
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise UserError("the body is not a JSON object; send the request with the tinker SDK")
    return data


def refused(err: Exception) -> Any:
    """A 400 in the SDK's shape (category user), for the routes that answer at once."""
    return JSONResponse({"detail": str(err), "category": "user"}, status_code=400)


def check_forward_backward(fb: Any, max_context: int | None) -> None:
    """A `UserError` for a `forward_backward` whose loss, loss config (`learner.datums.check_loss`) or datums'
    lengths this server cannot take."""
    from learner.datums import check_loss

    try:
        check_loss(fb.loss_fn, fb.config)
    except ValueError as err:
        raise UserError(str(err)) from None
    if max_context is not None and (longest := max(len(d.input_ids) for d in fb.datums)) > max_context:
        raise UserError(f"a datum has {longest} tokens, over the model's context of {max_context}; shorten it")


async def _raise(err: Exception) -> Any:
    raise err


def _adam(data: dict[str, Any]) -> tuple[float, ...]:
    """`optim_step`'s Adam parameters, in `DatumLearner.optim_step`'s order; a `UserError` for another optimizer."""
    params = data.get("adam_params")
    if not isinstance(params, dict):
        raise UserError("optim_step without adam_params: relay serve steps with Adam; send types.AdamParams")
    names = [("learning_rate", 1e-4), ("beta1", 0.9), ("beta2", 0.95), ("eps", 1e-12), ("weight_decay", 0.0),
             ("grad_clip_norm", 0.0)]
    values = []
    for name, default in names:
        value = params.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise UserError(f"adam_params.{name} must be a number >= 0 (got {value!r})")
        values.append(float(value))
    return tuple(values)


def start_ray(rc: Any) -> bool:
    """Join the cluster at `ray.address` (or $RAY_ADDRESS), else start a local Ray of `ray.num_cpus` CPUs: a new one,
    never a cluster some other process started on this machine (Ray would join its `ray_current_cluster` file). Whether
    this call started it (the service then shuts it down). A cluster that cannot be reached is a one-line error."""
    import ray

    from cluster.fleet.placement import check_reachable

    if ray.is_initialized():
        return False
    address = rc.address or os.environ.get("RAY_ADDRESS")
    try:
        check_reachable(address)
    except ConnectionError as err:
        raise ValueError(f"cannot reach a Ray cluster at ray.address={address}: {err}") from None
    ray.init(address=address or "local", num_cpus=None if address else rc.num_cpus, include_dashboard=False,
             log_to_driver=rc.log_to_driver, logging_level="WARNING")
    return not address


def serve(config: Any, host: str, port: int, key_env: str | None, allow_origins: list[str]) -> None:
    """Start (or join) Ray, then serve the Tinker API for `config`'s model on host:port until interrupted."""
    import uvicorn

    from cluster.demo.cache import ensure_demo_model
    from cluster.plan import resolve_token_budget

    key = token_from_env(key_env, "--key-env")
    keys = [k.strip() for k in key.split(",") if k.strip()] if key else []  # several: one tenant each
    if not keys and not is_loopback(host):
        raise ValueError(f"--host {host} is beyond loopback: set an API key (export TINKER_API_KEY=tml-...; relay "
                         "serve --key-env TINKER_API_KEY)")
    # Served under the name it was given (a relative directory may be named as on the hub, as tinker-cookbook's
    # recipes want: docs/tinker.md); the actors, which run elsewhere, get its absolute path.
    base_model = config.model.path or "relay-demo"
    model_path = (str(Path(config.model.path).resolve()) if config.model.path
                  else str(ensure_demo_model(log=lambda line: print(f"relay: {line}", flush=True))))
    model_config = json.loads((Path(model_path) / "config.json").read_text())
    config, budget = resolve_token_budget(config)  # reads the model's shape only for `auto`
    if budget:
        print(f"relay: {budget}", flush=True)
    started = start_ray(config.ray)
    state_dir = Path(config.run_dir) if config.run_dir else Path.home() / ".cache" / "relay" / "serve"
    runs = TrainingRuns(base_model, model_path, config.learner, config.model.dtype, config.timeouts, state_dir)
    samplers = Samplers(runs, config)
    app = create_app(runs, samplers, keys, allow_origins, model_config.get("max_position_embeddings"),
                     model_config.get("vocab_size"))
    print(f"relay: serving the Tinker API for {base_model!r} on http://{host}:{port} (TINKER_BASE_URL)", flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        samplers.close()
        runs.close()
        if started:
            import ray

            ray.shutdown()


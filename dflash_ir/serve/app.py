"""The dflash-serve ASGI app (Starlette): routes, API key, body limit, JSON errors.

The server answers as soon as it listens; the model loads in a thread meanwhile, and every
route that needs it (and `/health`) says 503 "Loading model" until it is ready. Then the
same thread runs the scheduler. Every error is JSON in OpenAI's shape, never a traceback.
"""
from __future__ import annotations

import contextlib
import hmac
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from jinja2 import TemplateError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from dflash_ir.runtime.engine import Engine
from dflash_ir.runtime.sampling import SamplingParams

from . import openai_api as api
from .generation import Prepared, respond
from .metrics import ServerMetrics
from .reasoning import ReasoningSplit
from .scheduler import Scheduler, speculates

STATIC = Path(__file__).parent / "static"


@dataclass(frozen=True)
class ServeConfig:
    """The server's flags (cli.py has their defaults and meanings)."""
    alias: str
    n_slots: int
    queue_size: int
    api_key: str | None
    max_body_bytes: int
    speculative: bool
    max_tokens: int  # -1: until the context is full
    sampling: SamplingParams
    template_kwargs: dict
    batch_verify: bool = True  # verify the busy slots' blocks together (off: --no-batch-verify)


class ServerState:
    """What the routes share: the config and, once loaded, the engine, scheduler and metrics."""

    def __init__(self, config: ServeConfig, load: Callable[[], Engine], on_failure: Callable[[BaseException], None]):
        self.config = config
        self._load, self._on_failure = load, on_failure
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.metrics: ServerMetrics | None = None
        self.defaults: api.ServerDefaults | None = None
        self.speculative = False
        self.created = int(time.time())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def running(self) -> bool:
        """Whether the engine thread (loading, then the scheduler) is still alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._load_and_serve, name="dflash-serve-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _load_and_serve(self) -> None:
        try:
            engine = self._load()
            cfg = self.config
            speculative = speculates(engine, cfg.speculative)
            scheduler = Scheduler(engine, cfg.n_slots, cfg.queue_size, batch=cfg.batch_verify)
            self.metrics = scheduler.metrics = ServerMetrics(engine.draft.block_size if engine.draft else 16,
                                                             lambda: scheduler.busy_slots, lambda: scheduler.queued)
            self.defaults = api.ServerDefaults(cfg.alias, engine.n_ctx, cfg.max_tokens, cfg.sampling,
                                               cfg.template_kwargs)
            self.speculative, self.scheduler, self.engine = speculative, scheduler, engine
        except BaseException as e:  # reported by the CLI, which then stops the server
            self._on_failure(e)
            return
        scheduler.run(self._stop)

    def check_key(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise api.RequestError("invalid API key: send 'Authorization: Bearer <key>'", status=401,
                                   type="authentication_error", code="invalid_api_key")


def _endpoint(state: ServerState, handler, *, public: bool = False, needs_model: bool = True):
    async def run(request: Request) -> Response:
        try:
            if not public:
                state.check_key(request)
            if needs_model and not state.ready:
                raise api.RequestError("Loading model", status=503, type="unavailable_error")
            return await handler(state, request)
        except api.RequestError as e:
            if state.metrics is not None:
                state.metrics.request("rejected" if e.status == 503 else "invalid")
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
    return run


async def read_json(request: Request, limit: int):
    """The body as JSON: 413 past `limit` bytes (before reading it when Content-Length says so),
    400 for bytes that are not UTF-8 or not JSON."""
    too_large = api.RequestError(f"the request body is larger than {limit} bytes (--max-body-bytes)", status=413,
                                 code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise api.RequestError(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (json.JSONDecodeError, ValueError) as e:
        raise api.RequestError(f"the request body is not valid JSON: {e}") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


# -- routes ---------------------------------------------------------------------------

async def health(state: ServerState, request: Request) -> Response:
    if not state.ready:
        return JSONResponse(api.error_body("Loading model", "unavailable_error", code="loading"), status_code=503)
    return JSONResponse({"status": "ok"})


async def models(state: ServerState, request: Request) -> Response:
    engine = state.engine
    meta = {"n_ctx": engine.n_ctx, "speculative": state.speculative, "n_max": engine.n_max,
            "backend": engine.info.get("backend", {}).get("name"), "slots": len(state.scheduler.slots),
            "n_vocab": engine.tokenizer.vocab_size, "chat_template_kwargs": state.config.template_kwargs}
    return JSONResponse({"object": "list", "data": [{"id": state.config.alias, "object": "model",
                                                     "created": state.created, "owned_by": "dflash-ir", "meta": meta}]})


async def chat_completions(state: ServerState, request: Request) -> Response:
    req = api.parse_chat(await read_json(request, state.config.max_body_bytes), state.defaults)
    engine = state.engine
    if engine.chat_template is None:
        raise api.RequestError("this model has no chat template (tokenizer.chat_template): use /v1/completions")
    try:
        prompt = engine.chat_template.render(req.messages, add_generation_prompt=True, **req.template_kwargs)
    except (TemplateError, TypeError) as e:
        raise api.RequestError(f"the chat template failed on these messages: {e}", param="messages") from None
    ids = engine.tokenizer.encode(prompt, parse_special=True)
    prepared = _prepare(state, "chat", req, ids, "messages")
    prepared.prompt_opens_reasoning = ReasoningSplit.opens_block(prompt)
    return await respond(state.scheduler, engine.tokenizer, state.config.alias, prepared, request)


async def completions(state: ServerState, request: Request) -> Response:
    req = api.parse_completion(await read_json(request, state.config.max_body_bytes), state.defaults)
    ids = req.prompt if isinstance(req.prompt, list) else state.engine.tokenizer.encode(req.prompt, parse_special=True)
    _check_ids(state, ids, "prompt")
    prepared = _prepare(state, "completion", req, ids, "prompt")
    return await respond(state.scheduler, state.engine.tokenizer, state.config.alias, prepared, request)


def _prepare(state: ServerState, kind: str, req: api.GenerationRequest, ids: list[int], field_name: str) -> Prepared:
    n_ctx = state.engine.n_ctx
    if len(ids) >= n_ctx:
        raise api.RequestError(f"the prompt has {len(ids)} tokens but the context holds {n_ctx} (-c): shorten it",
                               param=field_name, code="context_length_exceeded")
    options = dict(max_tokens=req.max_tokens, sampling=req.sampling, speculative=state.speculative, stop=req.stop,
                   ignore_eos=req.ignore_eos)
    return Prepared(kind, req, ids, options)


def _check_ids(state: ServerState, ids: list[int], field_name: str) -> None:
    n = state.engine.tokenizer.vocab_size
    bad = next((t for t in ids if not 0 <= t < n), None)
    if bad is not None:
        raise api.RequestError(f"'{field_name}' holds token id {bad}, outside the vocabulary [0, {n})",
                               param=field_name)


async def tokenize(state: ServerState, request: Request) -> Response:
    f = api.Fields(await read_json(request, state.config.max_body_bytes))
    content = f.get("content", str, required=True)
    ids = state.engine.tokenizer.encode(content, parse_special=f.get("parse_special", bool, default=True))
    return JSONResponse({"tokens": ids})


async def detokenize(state: ServerState, request: Request) -> Response:
    f = api.Fields(await read_json(request, state.config.max_body_bytes))
    ids = f.get("tokens", list, required=True)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise api.RequestError("'tokens' must be a list of integers", param="tokens")
    _check_ids(state, ids, "tokens")
    return JSONResponse({"content": state.engine.tokenizer.decode(ids)})


async def metrics(state: ServerState, request: Request) -> Response:
    return Response(state.metrics.render(), media_type=state.metrics.content_type)


async def slots(state: ServerState, request: Request) -> Response:
    return JSONResponse([{"id": s.index, "n_ctx": state.engine.n_ctx, "is_processing": s.busy,
                          "speculative": state.speculative} for s in state.scheduler.slots])


async def index(state: ServerState, request: Request) -> Response:
    return FileResponse(STATIC / "index.html")


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return JSONResponse(api.error_body(f"{request.method} {request.url.path}: {exc.detail}", "invalid_request_error"),
                        status_code=exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> Response:
    return JSONResponse(api.error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), status_code=500)


def create_app(state: ServerState) -> Starlette:
    def route(path, handler, methods=("GET",), **kw):
        return Route(path, _endpoint(state, handler, **kw), methods=list(methods))

    routes = [
        route("/", index, public=True, needs_model=False),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
        *(route(p, health, public=True, needs_model=False) for p in ("/health", "/v1/health")),
        *(route(p, models) for p in ("/v1/models", "/models")),
        *(route(p, chat_completions, ("POST",)) for p in ("/v1/chat/completions", "/chat/completions")),
        *(route(p, completions, ("POST",)) for p in ("/v1/completions", "/completions")),
        route("/tokenize", tokenize, ("POST",)),
        route("/detokenize", detokenize, ("POST",)),
        route("/metrics", metrics),
        route("/slots", slots),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.start()
        try:
            yield
        finally:
            state.stop()

    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _internal_error},
                     lifespan=lifespan)

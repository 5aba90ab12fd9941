"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncEngine, run by uvicorn on uvloop.

`build_app` wires the routes to an engine (any object with AsyncEngine's interface, which keeps
the routes testable); `serve` owns the process: it builds the engine, runs uvicorn, watches the
engine and returns the exit code. If the engine core dies, /health turns 503, in-flight requests
fail with 503, and the watchdog stops uvicorn so the process exits non-zero instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import shlex
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

import v1_engine
from v1_engine.entrypoints.errors import APIError, error_response, install_error_handlers
from v1_engine.entrypoints.protocol_openai import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from v1_engine.entrypoints.serving_chat import OpenAIServingChat
from v1_engine.entrypoints.serving_completion import OpenAIServingCompletion
from v1_engine.entrypoints.serving_engine import OpenAIServing, ServerOptions
from v1_engine.metrics.prometheus import CONTENT_TYPE, PrometheusStatLogger

logger = logging.getLogger(__name__)

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
WATCHDOG_INTERVAL_S = 0.5
GRACEFUL_SHUTDOWN_S = 5
"""After the engine dies, how long uvicorn waits for open connections before closing them."""


@dataclass
class ServerState:
    engine: Any
    stat_logger: PrometheusStatLogger | None
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokens: OpenAIServing
    api_key: str | None
    engine_dead: asyncio.Event | None = None


def build_app(
    engine: Any,
    stat_logger: PrometheusStatLogger | None = None,
    options: ServerOptions | None = None,
) -> FastAPI:
    """A FastAPI app serving `engine` as `options` say; the model name and context length come
    from the engine's config."""
    options = options or ServerOptions()
    state = ServerState(
        engine=engine,
        stat_logger=stat_logger,
        completion=OpenAIServingCompletion(engine, options),
        chat=OpenAIServingChat(engine, options),
        tokens=OpenAIServing(engine, options),
        api_key=options.api_key or None,
    )
    app = FastAPI(
        title="v1serve",
        version=v1_engine.__version__,
        description="OpenAI-compatible API of v1engine.",
        root_path=options.root_path,
    )
    app.state.server = state
    install_error_handlers(app)
    _install_middleware(app, state)
    if options.allowed_origins:  # outermost: preflights are answered before the key check
        app.add_middleware(
            CORSMiddleware,
            allow_origins=options.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    _add_token_routes(app, state)
    return app


def _install_middleware(app: FastAPI, state: ServerState) -> None:
    @app.middleware("http")
    async def request_id_and_auth(request: Request, call_next):
        if state.api_key is not None and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(token.encode(), state.api_key.encode()):
                return error_response(
                    APIError(
                        "missing or wrong API key; send 'Authorization: Bearer <key>'",
                        HTTPStatus.UNAUTHORIZED,
                        code="invalid_api_key",
                    )
                )
        request.state.request_id = _request_id(request)
        response = await call_next(request)
        response.headers["X-Request-Id"] = request.state.request_id
        return response


def _request_id(request: Request) -> str:
    """The client's X-Request-Id when it is a sane token, else a fresh random id."""
    given = request.headers.get("x-request-id")
    if given and _REQUEST_ID_RE.match(given):
        return given
    return uuid.uuid4().hex


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    served = state.tokens

    @app.get("/health", summary="200 while the engine runs, 503 once it has died.")
    async def health() -> Response:
        if _engine_healthy(state):
            return Response(status_code=200)
        return error_response(
            APIError("the engine core is dead", HTTPStatus.SERVICE_UNAVAILABLE, code="engine_dead")
        )

    @app.get("/metrics", summary="Prometheus metrics of the engine.")
    async def metrics() -> Response:
        body = state.stat_logger.render() if state.stat_logger is not None else b""
        return Response(content=body, media_type=CONTENT_TYPE)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=v1_engine.__version__)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        card = ModelCard(
            id=served.served_model_name,
            root=str(state.engine.config.model_config.model),
            max_model_len=served.max_model_len,
        )
        return ModelList(data=[card])


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", summary="OpenAI completions (streaming with stream=true).")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _require_alive(state)
        return await _guard(state, state.completion.create(body, request, request.state.request_id))

    @app.post("/v1/chat/completions", summary="OpenAI chat completions (chat template applied).")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _require_alive(state)
        return await _guard(state, state.chat.create(body, request, request.state.request_id))


async def _guard(state: ServerState, call) -> Response:
    """Run a handler; a 503 (dead engine) wakes the watchdog at once instead of at its next tick."""
    try:
        return await call
    except APIError as e:
        if e.status == HTTPStatus.SERVICE_UNAVAILABLE and state.engine_dead is not None:
            state.engine_dead.set()
        raise


def _add_token_routes(app: FastAPI, state: ServerState) -> None:
    served = state.tokens

    @app.post(
        "/tokenize",
        response_model=TokenizeResponse,
        summary="Token ids of a prompt, or of a conversation after the chat template.",
    )
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        served.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            messages = [m.flat() for m in body.messages]
            tokens = served.render_chat(messages, body.chat_options())
        else:
            tokens = served.tokenize_prompt(body.prompt, body.add_special_tokens)
        return TokenizeResponse(
            tokens=tokens, count=len(tokens), max_model_len=served.max_model_len
        )

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        served.check_model(body.model)
        served.check_token_ids(body.tokens, field="tokens")
        return DetokenizeResponse(prompt=served.tokenizer.decode(body.tokens))


def _engine_healthy(state: ServerState) -> bool:
    if state.engine_dead is not None and state.engine_dead.is_set():
        return False
    return bool(state.engine.is_healthy())


def _require_alive(state: ServerState) -> None:
    if not _engine_healthy(state):
        if state.engine_dead is not None:
            state.engine_dead.set()
        raise APIError(
            "the engine core has died; the server is shutting down",
            HTTPStatus.SERVICE_UNAVAILABLE,
            code="engine_dead",
        )


async def watch_engine(state: ServerState, on_dead) -> None:
    """Poll the engine (and wake on a request's 503); call `on_dead` once it is gone."""
    state.engine_dead = state.engine_dead or asyncio.Event()
    while True:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(state.engine_dead.wait(), WATCHDOG_INTERVAL_S)
        if not _engine_healthy(state):
            state.engine_dead.set()
            logger.error("the engine core died; shutting the server down")
            on_dead()
            return


def startup_banner(
    host: str, port: int, model: str, api_key: str | None, scheme: str = "http", root_path: str = ""
) -> list[str]:
    """The lines logged once the server listens: the URL and a curl command that works as is."""
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    if ":" in shown_host:
        shown_host = f"[{shown_host}]"
    url = f"{scheme}://{shown_host}:{port}{root_path.rstrip('/')}"
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], '
        f'"max_tokens": 32}}'
    )
    auth = f" -H {shlex.quote('Authorization: Bearer ' + api_key)}" if api_key else ""
    curl = (
        f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d {shlex.quote(body)}"
    )
    return [f"v1serve ready at {url} (model {model!r}); API docs at {url}/docs", f"try: {curl}"]


def _name_uvicorn(record: logging.LogRecord) -> bool:
    """uvicorn logs its start and stop lines as "uvicorn.error": name them "uvicorn"."""
    record.name = "uvicorn"
    return True


async def serve(
    engine_factory: Callable[[list[Any]], Any], model_name: str, options: ServerOptions
) -> int:
    """Build the engine, serve until stopped, and return the process exit code: 0 on a normal
    shutdown (SIGINT/SIGTERM), 1 if the engine core died."""
    stat_logger = PrometheusStatLogger(model_name)
    engine = engine_factory([stat_logger])
    try:
        app = build_app(engine, stat_logger, options)
        state: ServerState = app.state.server
        state.engine_dead = asyncio.Event()
        config = uvicorn.Config(
            app,
            host=options.host,
            port=options.port,
            log_level=options.log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            access_log=options.log_level == "debug",
            log_config=None,  # uvicorn's lines through the root logger, in the server's format
            ssl_keyfile=options.ssl_keyfile,
            ssl_certfile=options.ssl_certfile,
        )
        logging.getLogger("uvicorn.error").addFilter(_name_uvicorn)
        server = uvicorn.Server(config)

        def on_dead() -> None:
            server.should_exit = True

        tasks = [
            asyncio.create_task(watch_engine(state, on_dead)),
            asyncio.create_task(_log_when_started(server, model_name, options)),
            asyncio.create_task(_tick_stat_loggers(engine)),
        ]
        try:
            await server.serve()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return 1 if state.engine_dead.is_set() else 0
    finally:
        engine.shutdown()


async def _tick_stat_loggers(engine: Any, period_s: float = 1.0) -> None:
    """Every second, the engine's stat loggers see the time pass (AsyncEngine.do_log_stats)."""
    tick = getattr(engine, "do_log_stats", None)
    while tick is not None:
        await asyncio.sleep(period_s)
        tick()


async def _log_when_started(server: Any, model: str, options: ServerOptions) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    o = options
    for line in startup_banner(o.host, port, model, o.api_key, o.scheme, o.root_path):
        logger.info(line)

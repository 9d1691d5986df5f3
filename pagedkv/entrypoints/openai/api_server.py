"""The FastAPI app of `pagedkv serve` and the server that runs it (as vllm/entrypoints/openai/api_server.py).

    POST /v1/completions, /v1/chat/completions   OpenAI's API, streamed (server-sent events) or not
    GET  /v1/models, /health, /metrics           the model served, liveness, Prometheus' numbers

Every refusal is OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`: 400 for a
bad request (naming the field), 404 for a model or a path that is not here, 500 when the engine
fails; a traceback goes to the server's log, never to the client.
"""

from __future__ import annotations

import logging
import reprlib
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from pagedkv import __version__
from pagedkv.engine.async_llm import AsyncLLM
from pagedkv.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagedkv.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    RequestError,
)
from pagedkv.entrypoints.openai.serving_chat import ChatTemplate, OpenAIServingChat
from pagedkv.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedkv.entrypoints.openai.serving_engine import EngineError, error_json, failure_message
from pagedkv.models.loader import checkpoint_dir
from pagedkv.worker.tp_executor import EngineDeadError

logger = logging.getLogger(__name__)


def validation_error(error: RequestValidationError) -> JSONResponse:
    """pydantic's complaints as one 400: `param` is the first field at fault, the message names each
    (a union such as `prompt` gives one complaint per form it could take: the first is enough)."""
    messages: dict[str, str] = {}
    for e in error.errors():
        path = [str(part) for part in e["loc"][1:]]  # loc[0] is "body"
        field = path[0] if path else ""
        if field in messages:
            continue
        if e["type"] == "missing":
            messages[field] = f"{'.'.join(path)} is required"
        elif e["type"] == "json_invalid" or not field:
            messages[field] = f"The request body is not a valid JSON object: {e['msg']}"
        else:
            messages[field] = f"{'.'.join(path)}: {e['msg']} (got {reprlib.repr(e.get('input'))})"
    param = next(iter(messages), "") or None
    return JSONResponse(error_json("; ".join(messages.values()) + ".", 400, param), status_code=400)


def build_app(engine: AsyncLLM, served_model_name: str | None = None) -> FastAPI:
    """The app serving `engine` under `served_model_name` (default: the model's name)."""
    model_config = engine.llm.config.model_config
    name = served_model_name or model_config.model
    metrics = ServerMetrics(lambda: engine.stats, name)
    serving = (engine, name, model_config.max_model_len, metrics)
    completion = OpenAIServingCompletion(*serving)
    model_dir = checkpoint_dir(model_config.model)
    chat = OpenAIServingChat(*serving, chat_template=ChatTemplate.load(model_dir), model_dir=model_dir)
    app = FastAPI(title="pagedkv", version=__version__)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error(error)

    @app.exception_handler(RequestError)
    async def _refused(_: Request, error: RequestError) -> JSONResponse:
        body = error_json(error.message, error.status, error.param, error.code)
        return JSONResponse(body, status_code=error.status)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, error: HTTPException) -> JSONResponse:  # an unknown path (404), a wrong method
        return JSONResponse(error_json(str(error.detail), error.status_code), status_code=error.status_code)

    # EngineError and EngineDeadError by name: Starlette re-raises what only the catch-all handles (to
    # log its traceback), which is for surprises; these two say all there is in their message.
    @app.exception_handler(EngineError)
    @app.exception_handler(EngineDeadError)
    @app.exception_handler(Exception)
    async def _failed(_: Request, error: Exception) -> JSONResponse:
        return JSONResponse(error_json(failure_message(error), 500), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine runs, 503 once its loop has stopped."""
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(id=name, root=model_config.model, max_model_len=model_config.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    return app


class _Server(uvicorn.Server):
    """uvicorn's server, which says where it listens once it does (not before: the port may be taken)."""

    def __init__(self, config: uvicorn.Config, announcement: str) -> None:
        super().__init__(config)
        self.announcement = announcement

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.announcement, flush=True)


def run_server(
    model: str,
    engine_args: dict[str, Any],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: str = "info",
) -> None:
    """Build the engine, then serve it until Ctrl-C (or SIGTERM): uvicorn stops taking requests,
    gives those in flight a few seconds, and the engine thread is stopped."""
    engine = AsyncLLM(model, **engine_args)
    try:
        app = build_app(engine, served_model_name)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        announcement = (
            f"pagedkv: serving {served_model_name or model!r} at {url}/v1 (OpenAI API: /v1/completions, "
            f"/v1/chat/completions, /v1/models; {url}/health, {url}/metrics). Ctrl-C stops."
        )
        _Server(config, announcement).run()
    finally:
        engine.shutdown()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's pick), for a server about to start."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until_healthy(url: str, timeout_s: float, alive: Callable[[], bool]) -> None:
    """Return once GET `url`/health answers 200; raise if `alive()` turns False (the server exited)
    or `timeout_s` passes first. A GPU server compiles and captures CUDA graphs before it answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if not alive():
            raise RuntimeError(f"The server for {url} exited before it answered /health.")
        if time.monotonic() > deadline:
            raise RuntimeError(f"The server at {url} did not answer /health within {timeout_s:.0f} s.")
        time.sleep(0.05)


class BackgroundServer:
    """The server inside this process, on a thread of its own: what a notebook or a test starts
    next to its own code (the command line's `pagedkv serve` runs it in the foreground instead).

        engine = AsyncLLM("tiny-pydoc")
        server = BackgroundServer(engine)          # a free loopback port; returns once /health answers
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        ...
        server.stop()                              # the engine stays yours: engine.shutdown()
    """

    def __init__(
        self,
        engine: AsyncLLM,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        served_model_name: str | None = None,
        startup_timeout_s: float = 60.0,
    ) -> None:
        port = port or free_port(host)
        config = uvicorn.Config(build_app(engine, served_model_name), host=host, port=port, log_level="warning")
        self._server = uvicorn.Server(config)
        self.url = f"http://{host}:{port}"
        """Where it answers: the openai client's base_url is this + "/v1"."""
        self._thread = threading.Thread(target=self._server.run, name="pagedkv-server", daemon=True)
        self._thread.start()
        try:
            wait_until_healthy(self.url, startup_timeout_s, self._thread.is_alive)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop taking requests and end the thread (requests in flight get uvicorn's grace period)."""
        self._server.should_exit = True
        self._thread.join(timeout=30)

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

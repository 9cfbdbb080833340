"""The API process: FastAPI app, OpenAI routes, errors as OpenAI error objects, and
``run_api_server``, what every API process runs (the launcher, ``server/launcher.py``, starts
them and the engines).

This process does HTTP, JSON, tokenization, chat templates, detokenization and stop strings;
the engine-core processes run only the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from .. import __version__
from ..engine.config import EngineConfig
from ..engine.dp_client import DataParallelClient
from ..engine.endpoints import EngineEndpoints
from ..engine.stats import FIELDS
from ..tokenizer import Tokenizer
from ..tokenizer.chat_template import read_chat_template
from .metrics import ServerMetrics
from .middleware import Gatekeeper
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, InvalidString,
                       TokenizeRequest, error_response)
from .serving import ServerState, chat_prompt_ids, create_chat_completion, create_completion, prompt_ids
from .tool_calls import TOOL_CALL_PARSERS

log = logging.getLogger("leanserve.server")


@dataclass
class ServerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_waiting_requests: int = 1024
    # A few MiB hold any prompt that fits a context (a 32k-token prompt is ~130 KB of text);
    # past it JSON parsing alone costs hundreds of MB.
    max_request_body_bytes: int = 4 << 20
    shutdown_timeout: float = 5.0  # seconds to let in-flight requests finish on SIGTERM
    watchdog_timeout: float = 60.0  # seconds without engine progress before /health turns 503
    data_parallel_size: int = 1  # engine-core processes, each a model copy (see engine/dp_client.py)
    api_server_count: int = 1  # API processes sharing the port (see server/launcher.py)
    # vLLM's flags: tool_choice "auto" parses the model's own tool-call format with this parser.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    chat_template: str | None = None  # a file or the Jinja source; None: the checkpoint's
    generation_config: str = "auto"  # sampling defaults: auto (the model's file), leanserve (none), or a directory

    def validate(self) -> None:
        if self.data_parallel_size > 1:
            self.engine.check_ray_placement()
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice: needs --tool-call-parser")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser: one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}")


@dataclass(frozen=True)
class ServerPlan:
    """What every API process is built from, settled once by the launcher before any API process
    starts (flags checked, model resolved, sampling defaults read, engines started) and sent to
    each as is."""

    config: ServerConfig
    model_path: str  # as resolved (engine.config.ResolvedConfig)
    sampling_defaults: dict
    endpoints: EngineEndpoints


def load_tokenizer(cfg: ServerConfig, path: str) -> Tokenizer:
    tokenizer = Tokenizer.from_pretrained(path)
    if cfg.chat_template is not None:
        tokenizer.set_chat_template(read_chat_template(cfg.chat_template))
    return tokenizer


def build_app(plan: ServerPlan, tokenizer: Tokenizer, api_index: int = 0) -> FastAPI:
    """The app of API process ``api_index`` (of ``plan.endpoints.num_clients``)."""
    cfg, path, defaults, endpoints = plan.config, plan.model_path, plan.sampling_defaults, plan.endpoints
    model_name = cfg.served_model_name or _default_name(path)
    metrics = ServerMetrics(model_name, endpoints.num_engines, kv_transfer=cfg.engine.kv_transfer is not None)
    engine = DataParallelClient(endpoints, api_index, on_stats=metrics.on_engine_stats,
                                max_pending=cfg.max_waiting_requests, watchdog_timeout=cfg.watchdog_timeout)
    tokenizer.max_token_chars  # computed now (~0.1 s), not by the first request

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        ready = engine.ready
        app.state.server = ServerState(
            engine=engine, tokenizer=tokenizer, metrics=metrics, model_name=model_name, model_path=path,
            max_model_len=ready.max_model_len, vocab_size=ready.vocab_size, max_logprobs=cfg.engine.max_logprobs,
            tool_call_parser=cfg.tool_call_parser if cfg.enable_auto_tool_choice else None,
            sampling_defaults=defaults,
            kv_transfer=cfg.engine.kv_transfer,
        )
        log.info("serving %s (%s) on http://%s:%d, %d KV blocks", model_name, path, cfg.host, cfg.port,
                 ready.num_kv_blocks)
        if (kv := cfg.engine.kv_transfer) is not None:
            log.info("KV transfer: %s, %s, engine %s, side channel %s:%d", kv.kv_connector, kv.kv_role, kv.engine_id,
                     kv.kv_ip, kv.kv_port)
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="leanserve", version=__version__, lifespan=lifespan)
    created = int(time.time())

    app.add_middleware(Gatekeeper, api_key=cfg.api_key, max_body_bytes=cfg.max_request_body_bytes,
                       in_progress=metrics.in_progress)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):  # 404, 405, a body that cannot be parsed, 413
        return error_response(e.status_code, str(e.detail), headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        cause = first.get("ctx", {}).get("error")
        if first.get("type") == "json_invalid":
            msg, param = "Invalid JSON in the request body.", None
        elif isinstance(cause, InvalidString):
            msg, param = str(cause), cause.param
        else:
            param = ".".join(loc) or None
            msg = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
        return error_response(400, msg, param)

    def state(request: Request) -> ServerState:
        return request.app.state.server

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(state(request), body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state(request), body, request)

    @app.get("/v1/models")
    async def models(request: Request):
        s = state(request)
        return {"object": "list", "data": [{"id": s.model_name, "object": "model", "created": created,
                                             "owned_by": "leanserve", "root": s.model_path,
                                             "max_model_len": s.max_model_len}]}

    @app.get("/health")
    async def health(request: Request):
        why = state(request).engine.unavailable
        return error_response(503, why) if why else Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        s = state(request)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            ids = await chat_prompt_ids(s, body.messages, body.add_generation_prompt, body.tools)
        else:
            ids = await prompt_ids(s, body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids.tolist(), "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        s = state(request)
        if any(t < 0 or t >= s.vocab_size for t in body.tokens):
            raise APIError(400, f"tokens: ids must be in [0, {s.vocab_size})", "tokens")
        return {"prompt": s.tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def prometheus(request: Request):
        return Response(state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def iteration_stats(request: Request, since: int | None = None, rows: bool = False):
        """Engine counters and gauges (summed over data-parallel engines, each engine's own under
        ``engines``), the iteration count, and with ``since=<count>`` the p50/p95/p99 of every
        iteration field recorded after that count but the time stamp (benchmarks read their own
        window this way);
        with ``rows=true`` also the rows themselves, in ``fields`` order (benchmarks that select
        their own iterations), and the latest KV transfer times."""
        s = state(request)
        out = s.metrics.engine_totals()
        its = s.metrics.iterations
        out["iterations_total"] = its.count
        if since is not None:
            last = max(0, its.count - since)
            out["window"] = its.summary(last=last)
            if rows:
                out["fields"], out["rows"] = list(FIELDS), its.window(last).tolist()
                out["kv_transfer_times_s"] = list(s.metrics.kv_transfer_times)
        return out

    return app


def _default_name(path: str) -> str:
    name = os.path.basename(path.rstrip("/"))
    return name[:-5] if name.endswith(".gguf") else name


def run_api_server(plan: ServerPlan, tokenizer: Tokenizer, api_index: int, sock: socket.socket) -> None:
    """Serves on ``sock`` (bound by the launcher, shared by every API process) until SIGTERM or
    SIGINT, then drains (``DrainingServer``)."""
    cfg = plan.config
    app = build_app(plan, tokenizer, api_index)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                            timeout_graceful_shutdown=cfg.shutdown_timeout + SEND_GRACE_S)
    # uvicorn re-raises SIGTERM after its shutdown under the handler found at start; this one
    # ends the process with status 0, as a shutdown that completed cleanly should.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    DrainingServer(config, cfg.shutdown_timeout).run(sockets=[sock])


# After the drain deadline ends the remaining requests, their last chunks still have to be sent.
SEND_GRACE_S = 3.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain in its shutdown: on SIGTERM/SIGINT uvicorn stops accepting
    connections, /health and new requests answer 503, in-flight requests get ``shutdown_timeout``
    seconds to finish, and the rest end with finish reason "abort", so every stream gets its
    final chunk and [DONE] before the process exits."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float):
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None):
        engine = self.config.app.state.server.engine
        drain = asyncio.ensure_future(engine.drain(self.shutdown_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()

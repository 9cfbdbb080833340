"""The API process: FastAPI app, OpenAI routes, errors as OpenAI error objects, and serve().

This process does HTTP, JSON, tokenization, chat templates, detokenization and stop strings;
the engine-core process (spawned at start-up) runs only the executor loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse, Response

from .. import __version__
from ..engine.config import EngineConfig
from ..model.loader import resolve_model_path
from ..tokenizer import Tokenizer
from .engine_client import AsyncEngineClient
from .metrics import ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, error_body
from .serving import ServerState, create_chat_completion, create_completion

log = logging.getLogger("leanserve.server")


@dataclass
class ServerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_waiting_requests: int = 1024


def build_app(cfg: ServerConfig) -> FastAPI:
    path = resolve_model_path(cfg.engine.model)
    cfg.engine.model = path
    tokenizer = Tokenizer.from_pretrained(path)
    model_name = cfg.served_model_name or _default_name(path)
    metrics = ServerMetrics(model_name)
    engine = AsyncEngineClient(cfg.engine, list(tokenizer.eos_token_ids), on_stats=metrics.on_engine_stats)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        ready = engine.ready
        app.state.server = ServerState(
            engine=engine, tokenizer=tokenizer, metrics=metrics, model_name=model_name, model_path=path,
            max_model_len=ready.max_model_len, vocab_size=ready.vocab_size, max_logprobs=cfg.engine.max_logprobs,
            max_waiting_requests=cfg.max_waiting_requests,
        )
        log.info("serving %s (%s) on http://%s:%d, %d KV blocks", model_name, path, cfg.host, cfg.port,
                 ready.num_kv_blocks)
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="leanserve", version=__version__, lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg, param = "Invalid JSON in the request body.", None
        else:
            param = ".".join(loc) or None
            msg = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
        return JSONResponse(error_body(msg, "invalid_request_error", param, 400), status_code=400)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if cfg.api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {cfg.api_key}":
                return APIError(401, "Invalid or missing API key.").response()
        return await call_next(request)

    def state(request: Request) -> ServerState:
        return request.app.state.server

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(state(request), body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state(request), body)

    @app.get("/v1/models")
    async def models(request: Request):
        s = state(request)
        return {"object": "list", "data": [{"id": s.model_name, "object": "model", "created": created,
                                             "owned_by": "leanserve", "root": s.model_path,
                                             "max_model_len": s.max_model_len}]}

    @app.get("/health")
    async def health(request: Request):
        if state(request).engine.dead:
            return APIError(503, "the engine process is not running").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        s = state(request)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            text = s.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages],
                                                   body.add_generation_prompt)
            ids = s.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = s.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
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
    async def iteration_stats(request: Request, since: int | None = None):
        """Engine counters and gauges, the iteration count, and with ``since=<count>`` the
        p50/p95/p99 of every iteration field recorded after that count (benchmarks read their
        own window this way)."""
        s = state(request)
        latest = s.engine.latest_stats
        out = {f: getattr(latest, f) for f in latest.__struct_fields__ if f not in ("iterations", "queue_times")} \
            if latest is not None else {}
        its = s.metrics.iterations
        out["iterations_total"] = its.count
        if since is not None:
            out["window"] = its.summary(last=max(0, its.count - since))
        return out

    return app


def _default_name(path: str) -> str:
    name = os.path.basename(path.rstrip("/"))
    return name[:-5] if name.endswith(".gguf") else name


def serve(cfg: ServerConfig) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = build_app(cfg)
    # uvicorn handles SIGINT/SIGTERM: it stops accepting, drains, then runs the lifespan exit,
    # which terminates the engine process. Afterwards it re-raises the signal under the handler
    # found at start; for SIGTERM that handler ends the process with status 0, as a shutdown
    # that completed cleanly should.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=5)



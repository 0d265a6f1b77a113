"""The FastAPI application: routes, error handling, request ids and logs, metrics, engine lifecycle."""
import asyncio
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.api import openai_routes, tgi_routes
from service.api.auth import protected_groups, require_api_key
from service.api.errors import install_handlers
from service.config import Settings
from service.finetune import routes as finetune_routes
from service.finetune.jobs import JobManager
from service.metrics import Metrics

DRAIN_SECONDS = 30.0
ENDPOINTS = {"/": "generate", "/generate": "generate", "/generate_stream": "generate_stream",
             "/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}
OUTCOME_BY_STATUS = {429: "overloaded", 503: "overloaded"}
QUIET_PATHS = {"/health", "/metrics"}  # scraped every few seconds: logged at debug level only
_REQUEST_ID = re.compile(r"[\w.:-]{1,128}")

log = logging.getLogger("service.api")


def create_app(settings: Settings, engine=None) -> FastAPI:
    """The app serving `engine`; when None, the engine is loaded from settings at start-up (lifespan)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if app.state.engine is None:
            from service.engine.async_engine import AsyncEngine  # loads torch and the model code
            app.state.engine = await asyncio.to_thread(AsyncEngine.from_settings, settings)
        app.state.engine.add_step_listener(app.state.metrics.record_step)
        await app.state.engine.start()
        finetune = JobManager(settings, app.state.engine, app.state.metrics)
        await finetune.start()
        app.state.finetune = finetune
        log.info("serving %s (context %d tokens)", app.state.engine.model_name, app.state.engine.max_model_len)
        yield
        log.info("shutting down: draining requests for up to %.0f s", DRAIN_SECONDS)
        await finetune.shutdown()
        await app.state.engine.shutdown(drain_seconds=DRAIN_SECONDS)

    app = FastAPI(title="tritonserve", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.finetune = None  # the JobManager, once the engine runs
    app.state.metrics = Metrics()
    app.state.protected_groups = protected_groups(settings.api_key_routes)
    app.state.started = int(time.time())

    def count_error(request: Request, status: int) -> None:
        endpoint = getattr(request.state, "endpoint", None) or ENDPOINTS.get(request.url.path)
        if endpoint is None or status == 401 or getattr(request.state, "counted", False):
            return
        outcome = OUTCOME_BY_STATUS.get(status, "validation_error" if status < 500 else "internal_error")
        app.state.metrics.count_request(endpoint, outcome)

    install_handlers(app, count_error)
    app.add_middleware(RequestLog)
    app.include_router(tgi_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(finetune_routes.router)

    @app.get("/health")
    async def health(request: Request):
        ready = request.app.state.engine is not None and request.app.state.engine.ready
        return JSONResponse({"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503)

    @app.get("/info")
    async def info(request: Request):
        engine = request.app.state.engine
        return {"model_id": engine.model_name, "max_total_tokens": engine.max_model_len,
                "max_stop_sequences": settings.max_stop_sequences, "max_waiting_requests": settings.max_waiting_requests}

    @app.get("/metrics", dependencies=[Depends(require_api_key("metrics"))])
    async def metrics(request: Request):
        body = request.app.state.metrics.render(request.app.state.engine)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app


class RequestLog:
    """ASGI middleware: gives every request an id (the client's X-Request-Id when sane), returns it as a
    response header, and logs one line per request when its response has been sent."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        incoming = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = incoming if _REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        start = time.perf_counter()
        status = 499  # unless a response starts: the client left first

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            status = 500  # answered by Starlette's outermost error middleware, outside this one
            raise
        finally:
            generation = state.get("generation")
            level = logging.DEBUG if scope["path"] in QUIET_PATHS else logging.INFO
            log.log(level, "request_id=%s method=%s path=%s status=%d latency_ms=%.1f%s", request_id,
                    scope["method"], scope["path"], status, (time.perf_counter() - start) * 1000,
                    " outcome=%s prompt_tokens=%d generated_tokens=%d" % generation if generation else "")

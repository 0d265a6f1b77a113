"""The FastAPI application of an HTTP front-end process: routes, error handling, request ids and logs, metrics,
and its client of the engine core (which runs in another process)."""
import logging
import os
import re
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from service.api import adapter_routes, finetune_routes, openai_routes, responses_routes, tgi_routes, tokenize_routes
from service.api.auth import protected_groups, require_any_api_key, require_api_key
from service.api.engine_client import EngineClient
from service.api.errors import RETRY_AFTER_SECONDS, APIError, error_response, install_handlers
from service.api.generation import engine
from service.api.openapi import openapi_schema
from service.config import Settings, local_model_dir
from service.metrics import FrontendMetrics, exposition

ENDPOINTS = {"/": "generate", "/generate": "generate", "/generate_stream": "generate_stream",
             "/v1/completions": "completions", "/v1/chat/completions": "chat_completions",
             "/v1/responses": "responses"}
OUTCOME_BY_STATUS = {429: "overloaded", 499: "aborted", 503: "overloaded"}
QUIET_PATHS = {"/health", "/metrics"}  # scraped every few seconds: logged at debug level only
_REQUEST_ID = re.compile(r"[\w.:-]{1,128}")

log = logging.getLogger("service.api")


def create_app(settings: Settings, engine_address: str | list[str], name: str | None = None,
               registry: CollectorRegistry | None = None, max_concurrent_requests: int | None = None) -> FastAPI:
    """The app of one front-end, attached to the engine core at engine_address (a ZeroMQ address), or to the cores
    at a list of them (data parallelism). name: this front-end's identity towards the cores (unique among their
    front-ends). Beyond max_concurrent_requests (default: the setting) requests get 503."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = EngineClient(engine_address, name or f"api-{os.getpid()}", app.state.metrics, settings.block_size)
        await client.start(tokenizer_dir=local_model_dir(settings.model))
        app.state.engine = client
        # Accept no connection before this front-end can serve: the front-ends share one port, and the first to
        # answer /health must not vouch for another still waiting for the engine cores (they may load for minutes;
        # meanwhile connections wait in the listening socket's queue). /health: 200 once every core is attached.
        await client.wait_ready()
        yield
        await client.close()
        if app.state.training_data is not None:
            app.state.training_data.close()

    # The API's description is served by our own routes below: behind the API key when one is set.
    app = FastAPI(title="tritonserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.settings = settings
    app.state.engine = None  # the EngineClient, once the app runs
    app.state.training_data = None  # the TrainingDataWorker, once fine-tuning routes need it
    app.state.registry = registry if registry is not None else CollectorRegistry()
    app.state.metrics = FrontendMetrics(app.state.registry)
    app.state.protected_groups = protected_groups(settings.api_key_routes)
    app.state.started = int(time.time())

    def count_error(request: Request, status: int) -> None:
        endpoint = getattr(request.state, "endpoint", None) or ENDPOINTS.get(request.url.path)
        if endpoint is None or status == 401 or getattr(request.state, "counted", False):
            return
        outcome = OUTCOME_BY_STATUS.get(status, "validation_error" if status < 500 else "internal_error")
        app.state.metrics.count_request(endpoint, outcome)

    install_handlers(app, count_error)
    app.add_middleware(ConcurrencyLimit, limit=max_concurrent_requests or settings.max_concurrent_requests)
    app.add_middleware(RequestLog)
    app.include_router(tgi_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(finetune_routes.router)
    app.include_router(adapter_routes.router)
    app.include_router(tokenize_routes.router)

    @app.get("/health")
    async def health(request: Request):
        client = request.app.state.engine
        ready = client is not None and client.ready and client.accepting
        return JSONResponse({"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503)

    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)  # load balancers' probes

    @app.get("/info")
    async def info(request: Request):
        client = engine(request)
        return {"model_id": client.model_name, "max_total_tokens": client.max_model_len,
                "max_stop_sequences": settings.max_stop_sequences,
                "max_waiting_requests": settings.max_waiting_requests}

    @app.get("/metrics", dependencies=[Depends(require_api_key("metrics"))])
    async def metrics(request: Request):
        return Response(exposition(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(require_any_api_key)])
    async def openapi():
        if app.openapi_schema is None:
            app.openapi_schema = openapi_schema(app)
        return JSONResponse(app.openapi_schema)

    @app.get("/docs", include_in_schema=False, dependencies=[Depends(require_any_api_key)])
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title="tritonserve")

    return app


class ConcurrencyLimit:
    """ASGI middleware: beyond `limit` requests in this front-end at once, a 503 (JSON in the route's dialect,
    with Retry-After) instead of another connection, descriptor and stream."""

    def __init__(self, app, limit: int):
        self.app, self.limit, self.active = app, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.active >= self.limit:
            error = APIError(503, f"this front-end serves {self.limit} requests at once", code="overloaded",
                             headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
            return await error_response(scope["path"], error)(scope, receive, send)
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


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

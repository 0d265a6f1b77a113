"""Errors at the HTTP edge, rendered as JSON in the dialect of the route that failed: OpenAI's under /v1,
text-generation-inference's elsewhere."""
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException

log = logging.getLogger("service.api")

RETRY_AFTER_SECONDS = 1

# TGI error_type and OpenAI error type for each kind of failure.
_TGI_TYPES = {400: "validation", 401: "authentication", 404: "not_found", 405: "method_not_allowed",
              408: "validation", 413: "validation", 422: "validation", 429: "overloaded", 500: "generation",
              503: "unavailable"}
_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
                 422: "invalid_request_error", 429: "overloaded", 500: "internal_error", 503: "unavailable"}


class ClientGone(Exception):
    """The client disconnected before its request was read: nobody is left to answer, and nothing failed."""


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def overloaded() -> APIError:
    return APIError(429, "Model is overloaded", code="overloaded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def unavailable() -> APIError:
    return APIError(503, "the engine is not running (starting, restarting or stopped)", code="unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/")


def error_body(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    if is_openai_path(path):
        return {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "invalid_request_error"),
                          "param": param, "code": code}}
    return {"error": message, "error_type": _TGI_TYPES.get(status, "validation" if status < 500 else "generation")}


def error_response(path: str, error: APIError) -> JSONResponse:
    return JSONResponse(error_body(path, error.status, error.message, error.param, error.code),
                        status_code=error.status, headers=error.headers)


def validation_error(error: ValidationError | RequestValidationError, loc_prefix: tuple = ()) -> APIError:
    """A 422 naming the first bad field (dotted path inside the body)."""
    first = error.errors()[0]
    loc = [str(part) for part in (*loc_prefix, *first["loc"]) if part != "body"]
    field = ".".join(loc)
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    elif first["type"] == "value_error":
        message = str(first["ctx"]["error"])
    return APIError(422, f"{field}: {message}" if field else message, param=field or None, code="invalid_value")


def install_handlers(app: FastAPI, on_error) -> None:
    """on_error(request, status) is told about every error response (for request counting; 499 for a client
    that left)."""

    async def api_error(request: Request, exc: APIError):
        on_error(request, exc.status)
        return error_response(request.url.path, exc)

    async def client_gone(request: Request, exc: ClientGone):
        on_error(request, 499)
        return Response(status_code=499)  # nobody reads it; the request log shows it

    async def request_validation(request: Request, exc: RequestValidationError):
        return await api_error(request, validation_error(exc))

    async def http_error(request: Request, exc: HTTPException):
        return await api_error(request, APIError(exc.status_code, str(exc.detail), headers=exc.headers))

    async def unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return await api_error(request, APIError(500, "Internal server error"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(RequestValidationError, request_validation)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)

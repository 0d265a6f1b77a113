"""Reading a request body: a size limit that holds while reading (chunked uploads too), a deadline, strict UTF-8,
JSON, then the pydantic schema, each failure a clear 4xx (FastAPI's own body parsing would answer some of these
with its own shapes). A client that leaves while sending is not an error of ours: ClientGone."""
import asyncio
from collections.abc import AsyncIterator

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from service import strict_json
from service.api.errors import APIError, ClientGone, validation_error


async def limited_stream(request: Request, max_bytes: int, what: str = "request body") -> AsyncIterator[bytes]:
    """The body's chunks, failing with 413 as soon as they pass max_bytes (before anything is kept), with 408
    past the body deadline, and with ClientGone when the client disconnects."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"{what} is larger than {max_bytes} bytes")
    timeout = request.app.state.settings.body_timeout
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise APIError(413, f"{what} is larger than {max_bytes} bytes")
                yield chunk
    except ClientDisconnect:
        raise ClientGone() from None
    except TimeoutError:
        raise APIError(408, f"{what} did not arrive within {timeout:g} s", code="timeout") from None


async def read_body(request: Request, max_bytes: int) -> bytes:
    return b"".join([chunk async for chunk in limited_stream(request, max_bytes)])


def parse_json(body: bytes):
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})", code="invalid_body") from None
    try:
        return strict_json.loads(text)  # NaN/Infinity pass here; the schemas reject them naming the field
    except ValueError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_body") from None


def validated(model: type[BaseModel], data) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


async def read_json(request: Request, model: type[BaseModel], max_bytes: int) -> BaseModel:
    return validated(model, parse_json(await read_body(request, max_bytes)))

"""Reading a JSON request body: size limit, strict UTF-8, JSON, then the pydantic schema, each failure a clear
4xx (FastAPI's own body parsing would answer some of these with its own shapes)."""
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from service import strict_json
from service.api.errors import APIError, validation_error


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body is larger than {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"request body is larger than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(body: bytes):
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})", code="invalid_body") from None
    try:
        return strict_json.loads(text)  # NaN/Infinity pass here; the schemas reject them naming the field
    except ValueError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_body") from None


async def read_json(request: Request, model: type[BaseModel], max_bytes: int) -> BaseModel:
    data = parse_json(await read_body(request, max_bytes))
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None

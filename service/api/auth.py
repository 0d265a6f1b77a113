"""Optional bearer-key authentication, per route group (settings.api_key_routes)."""
import hmac

from fastapi import Request

from service.api.errors import APIError
from service.config import ROUTE_GROUPS


def protected_groups(api_key_routes: str) -> set[str]:
    """The route groups named in the setting (Settings checked that they exist)."""
    return {g.strip() for g in api_key_routes.split(",") if g.strip()}


def require_api_key(group: str):
    """A route dependency: 401 unless the request carries `Authorization: Bearer <settings.api_key>`, when a
    key is configured and `group` is one of the protected groups."""
    if group not in ROUTE_GROUPS:
        raise ValueError(f"unknown route group {group!r}")

    def check(request: Request) -> None:
        settings = request.app.state.settings
        if settings.api_key and group in request.app.state.protected_groups:
            _check(request, settings.api_key)

    return check


def _check(request: Request, key: str) -> None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or invalid API key", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


def require_any_api_key(request: Request) -> None:
    """A route dependency: with a key configured, always require it (the API's own description, /docs)."""
    key = request.app.state.settings.api_key
    if key:
        _check(request, key)

"""HTTP API: TGI- and OpenAI-compatible routes, health and Prometheus metrics."""
from service.api.app import create_app

__all__ = ["create_app"]

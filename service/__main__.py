"""`python -m service --model PATH_OR_ID --host H --port P` (or `llm-serve ...`): loads the model, then serves
the HTTP API until SIGINT/SIGTERM, after which running requests get DRAIN_SECONDS to finish."""
import logging
import sys

import uvicorn

from service.api.app import DRAIN_SECONDS, create_app
from service.config import load_settings


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from service.engine.async_engine import AsyncEngine  # after logging is set up: loading logs its progress

    engine = AsyncEngine.from_settings(settings)
    uvicorn.run(create_app(settings, engine), host=settings.host, port=settings.port,
                log_level=settings.log_level.lower(), access_log=False, timeout_graceful_shutdown=int(DRAIN_SECONDS))


if __name__ == "__main__":
    main()

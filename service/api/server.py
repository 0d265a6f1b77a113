"""An HTTP front-end process: uvicorn serving the app on the listening socket the launcher shares among all
front-ends (the kernel spreads connections over them), attached to the one engine core."""
import asyncio
import socket

import uvicorn

from service.api.app import create_app
from service.config import Settings

DRAIN_SECONDS = 30.0  # on SIGTERM: how long running requests may take to finish


class DrainingServer(uvicorn.Server):
    """uvicorn with the service's drain: on SIGTERM or SIGINT the engine client stops admitting and fails what
    still runs after DRAIN_SECONDS, so every stream ends with an event of ours before uvicorn's own graceful
    timeout (longer) would cut it."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        client = self.config.app.state.engine
        if self.loop is not None and client is not None and not self.should_exit:
            self.loop.call_soon_threadsafe(client.drain, DRAIN_SECONDS)  # we are in a signal handler
        super().handle_exit(sig, frame)


def serve(settings: Settings, engine_address: str, sock: socket.socket, name: str) -> None:
    app = create_app(settings, engine_address, name)
    config = uvicorn.Config(app, log_level=settings.log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=int(DRAIN_SECONDS) + 10)
    DrainingServer(config).run(sockets=[sock])

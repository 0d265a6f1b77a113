"""An HTTP front-end process: uvicorn serving the app on the listening socket the launcher shares among all
front-ends (the kernel spreads connections over them), attached to every engine core."""
import asyncio
import contextlib
import resource
import signal
import socket

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.api.app import create_app
from service.config import Settings

DESCRIPTOR_RESERVE = 64  # kept for the process's own files and sockets when connections are many
SHUTDOWN_GRACE = 10  # seconds uvicorn waits, after the drain, for the open connections (last events, uploads)
QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux only


class DrainingServer(uvicorn.Server):
    """uvicorn with the service's drain: on SIGTERM or SIGINT the engine client stops admitting and fails what
    still runs after the drain time, so every stream ends with an event of ours before uvicorn's own graceful
    timeout would cut it. The listening socket stays open while generations run: new connections get 429s and
    /health 503, which tell a load balancer "draining" where a refused connection says "dead"."""

    def __init__(self, config: uvicorn.Config, drain_seconds: float):
        super().__init__(config)
        self.drain_seconds = drain_seconds
        self.loop: asyncio.AbstractEventLoop | None = None
        self.interrupted = False  # a SIGINT came

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        """Drains on the first signal; only a second SIGINT (Ctrl-C pressed again) forces the exit. uvicorn forces
        it on any SIGINT after any signal, but a Ctrl-C reaches the whole process group and the launcher passes it
        on to us as SIGTERM, which now and then gets here first: that cut every stream in flight."""
        client = self.config.app.state.engine
        if self.loop is not None and client is not None and not self.should_exit:
            self.loop.call_soon_threadsafe(client.drain, self.drain_seconds)  # we are in a signal handler
        forced = self.force_exit or (sig == signal.SIGINT and self.interrupted)
        self.interrupted = self.interrupted or sig == signal.SIGINT
        super().handle_exit(sig, frame)
        self.force_exit = forced

    async def on_tick(self, counter: int) -> bool:
        """Whether to shut down (uvicorn then closes the listener and waits for the open connections): once asked
        to, as soon as this front-end runs no generation any more. The client's drain fails what still runs after
        drain_seconds, so that comes at the latest then; a second Ctrl-C (force_exit) does not wait."""
        if not await super().on_tick(counter):
            return False
        client = self.config.app.state.engine
        return self.force_exit or client is None or not any(core.load for core in client.cores)


def guarded_http(header_timeout: float) -> type:
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's headers, from the connection's opening or
    its previous response. uvicorn has none: its keep-alive timer starts only after a response and any byte
    cancels it, so a client that sends nothing, or a byte now and then (slowloris), held a connection and a
    file descriptor forever.

    And with TCP's delayed ACK (40 ms on Linux) kept out of the first token's way, both ways:
    - every connection gets TCP_NODELAY. A stream's headers and its first event are two small writes: with Nagle
      on, the event waits for the client to ACK the headers, which it may delay by 40 ms (TTFT 44 ms instead of
      11 on the CPU). uvloop sets the option, asyncio's loop does not (only on sockets created with proto
      IPPROTO_TCP; the launcher's listening socket has proto 0): which loop uvicorn runs must not decide it.
    - a request that arrived in part is ACKed at once (TCP_QUICKACK): a client that writes its headers and its body
      apart without TCP_NODELAY holds the body back until the headers are ACKed, which Linux delays by 40 ms on a
      kept-alive connection."""

    class GuardedHttp(HttpToolsProtocol):
        deadline: asyncio.TimerHandle | None = None
        tcp: socket.socket | None = None  # the connection's socket, for its options

        def _arm(self) -> None:
            self._disarm()
            self.deadline = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def _expire(self) -> None:
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):  # not a Unix socket
                self.tcp = sock
                self._set(socket.TCP_NODELAY)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            waiting = self.deadline is not None or (self.cycle is not None and self.cycle.more_body)
            if waiting and QUICKACK is not None:
                self._set(QUICKACK)

        def _set(self, option: int) -> None:
            if self.tcp is not None:
                with contextlib.suppress(OSError):  # the connection may be gone already
                    self.tcp.setsockopt(socket.IPPROTO_TCP, option, 1)

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedHttp


def raise_descriptor_limit() -> int:
    """Lifts the soft limit on open files to the hard one (often 1024 by default, far below what thousands of
    streams need) and returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


def serve(settings: Settings, engine_addresses: list[str], sock: socket.socket, name: str) -> None:
    descriptors = raise_descriptor_limit()
    app = create_app(settings, engine_addresses, name,
                     max_concurrent_requests=min(settings.max_concurrent_requests, descriptors - DESCRIPTOR_RESERVE))
    config = uvicorn.Config(app, log_level=settings.log_level.lower(), access_log=False,
                            http=guarded_http(settings.header_timeout), timeout_keep_alive=settings.keep_alive_timeout,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE)
    DrainingServer(config, settings.drain_seconds).run(sockets=[sock])

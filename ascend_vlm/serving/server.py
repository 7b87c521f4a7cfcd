"""Running the app: uvicorn on a socket bound here, and the drain at SIGTERM.

uvicorn closes its listening socket at the first SIGTERM and re-raises the signal once it
stopped, so the process ends by the signal, not with status 0. :class:`DrainingServer`
replaces that: the first SIGTERM (or SIGINT) stops the engine admitting (new requests get 503,
``/health`` turns 503) while the listener stays open, waits up to ``drain_seconds`` for the
requests in flight to finish, cancels what is left, then lets uvicorn shut down; ``run``
returns and the command exits 0. A second signal exits at once.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import uvicorn

from ascend_vlm.serving.engine import Engine

LOG = logging.getLogger(__name__)
# Seconds the cancelled requests get to deliver their end once the drain timed out.
CANCEL_GRACE_SECONDS = 5.0


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``:``port`` (0: a free port; read it back with
    ``getsockname()``), whose connections asyncio sets ``TCP_NODELAY`` on. OSError names the
    address when it is taken or not local."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections whose protocol is
    # named IPPROTO_TCP, and an accepted connection inherits the listener's: with protocol 0
    # each streamed chunk written right after another waits for the client's delayed ACK.
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        raise OSError(f"--host/--port: cannot listen on {host}:{port} ({error})") from None
    listener.listen(2048)
    listener.setblocking(False)
    return listener


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain described in the module docstring."""

    def __init__(self, app: Any, engine: Engine, drain_seconds: float, **config: Any) -> None:
        config.setdefault("log_level", "info")
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=30, **config))
        self.engine = engine
        self.drain_seconds = drain_seconds
        self._draining = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._draining:
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        self.engine.stop_admitting()
        LOG.info("draining: up to %.0f s for the requests in flight", self.drain_seconds)
        threading.Thread(target=self._drain, name="ascend_vlm-drain", daemon=True).start()

    def _drain(self) -> None:
        if not self.engine.wait_idle(self.drain_seconds):
            LOG.warning("drain: requests still running after %.0f s; cancelling them",
                        self.drain_seconds)  # fmt: skip
            self.engine.cancel_all()
            self.engine.wait_idle(CANCEL_GRACE_SECONDS)
        self.should_exit = True

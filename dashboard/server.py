"""Running the dashboard: bind the socket first (so a port in use is one line, before anything starts),
then hand it to uvicorn. Tests start the same server on a free loopback port in a thread."""

from __future__ import annotations

import errno
import socket
import threading
import time

import uvicorn

from dashboard.app import create_app
from db.store import Store


class ServeError(Exception):
    """The server cannot start (one line for the user)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one); ServeError (one line) when that fails."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=64)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ServeError(
                f"port {port} on {host} is in use (another server?); choose another with --port"
            ) from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise ServeError(
                f"port {port} on {host}: permission denied (ports below 1024 need root)"
            ) from None
        if isinstance(e, socket.gaierror) or e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            raise ServeError(f"--host {host!r}: not an address of this machine") from None
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def make_server(store: Store, sock: socket.socket, quiet: bool = False) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(store), log_level="warning" if quiet else "info", access_log=not quiet, lifespan="off"
    )
    return uvicorn.Server(config)


class Background:
    """The dashboard in a thread of this process (tests): `url`, then `stop()`."""

    def __init__(self, store: Store, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = make_server(store, self.sock, quiet=True)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name="moesweep-serve"
        )

    def start(self) -> Background:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ServeError("the dashboard did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

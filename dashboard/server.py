"""Running the dashboard: bind the socket first (so a port in use is one line, before anything starts),
then hand it to uvicorn. Tests start the same server on a free loopback port in a thread.

The names the dashboard answers to (its Host check) follow the address it listens on: the loopback
names always; a specific address adds itself (and this machine's name); every interface (0.0.0.0, ::)
means any name: whoever exposes the dashboard to a network chose that (it has no login either).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading
import time

import uvicorn

from dashboard.app import LOOPBACK_HOSTS, create_app
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


def trusted_hosts(*addresses: str | None) -> frozenset[str] | None:
    """The Host names (without port) the dashboard answers to when it listens on `addresses` (the bound
    address, and the --host it was given): None, any name, for an unspecified address (every interface)."""
    out = set(LOOPBACK_HOSTS)
    for a in addresses:
        a = (a or "").strip().lower().removeprefix("[").removesuffix("]")
        if not a:
            continue
        try:
            ip = ipaddress.ip_address(a.split("%")[0])
        except ValueError:  # a name (--host dash.example): itself
            out.add(a.rstrip("."))
            continue
        if ip.is_unspecified:
            return None
        out.add(f"[{ip}]" if ip.version == 6 else str(ip))
        if not ip.is_loopback:
            out.add(socket.gethostname().lower())
    return frozenset(out)


def make_server(
    store: Store, sock: socket.socket, quiet: bool = False, host: str | None = None
) -> uvicorn.Server:
    """The server over `sock`, answering to the names `trusted_hosts` gives for its address and `host`.
    Its shutdown (Ctrl-C, SIGTERM) removes the reports' temporary folder (the app's lifespan)."""
    hosts = trusted_hosts(sock.getsockname()[0], host)
    config = uvicorn.Config(
        create_app(store, hosts=hosts),
        log_level="warning" if quiet else "info",
        access_log=not quiet,
        lifespan="on",
    )
    return uvicorn.Server(config)


class Background:
    """The dashboard in a thread of this process (tests): `url`, then `stop()`."""

    def __init__(self, store: Store, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = make_server(store, self.sock, quiet=True, host=host)
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

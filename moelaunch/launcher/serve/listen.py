"""The server's listening socket, bound before the model loads: a port in use or an address this machine
does not have is one clear error at once, not a traceback after minutes of loading."""

from __future__ import annotations

import errno
import socket

from moelaunch.launcher.deploy.config import ServerConfig


def bind_server_socket(server: ServerConfig) -> socket.socket:
    """A socket bound to server.host:server.port (0: a free port), ready for uvicorn to listen on."""
    host, port = server.host, server.port
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise ValueError(
            f"server.host {host!r}: not an address or a name this machine can resolve ({e.strerror}); "
            "use 127.0.0.1, 0.0.0.0 or one of this machine's addresses"
        ) from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"server.port {port} on {host} is in use (another server?): stop it, or choose another "
                "port (0 picks a free one)"
            ) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise ValueError(
                f"server.host {host!r} is not an address of this machine: use 127.0.0.1, 0.0.0.0 or one "
                "of its interfaces' addresses"
            ) from None
        if e.errno == errno.EACCES:
            raise ValueError(
                f"server.port {port}: binding it needs privileges this process lacks; use a port >= 1024"
            ) from None
        raise ValueError(
            f"server.host {host!r}, server.port {port}: cannot listen there ({e.strerror})"
        ) from None
    return sock

"""How ``conductor serve`` runs uvicorn: its HTTP protocol with ``TCP_NODELAY`` on every connection.

asyncio turns Nagle's algorithm off only on sockets whose ``proto`` is ``IPPROTO_TCP``. A single uvicorn
process creates its listening socket through ``loop.create_server`` and gets that; with ``--workers N``
uvicorn binds the socket itself as ``socket.socket(AF_INET)`` (``proto`` 0), so the connections each
worker accepts keep Nagle on. A response goes out as two writes (head, then body): on a keep-alive
connection the body waited for the client's delayed ACK, and every request after a connection's first
took about 40 ms more (measured: 3.3 → 43.8 ms p50 for sequential keep-alive requests with two
processes; docs/benchmarks.md, api).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from uvicorn.protocols.http.auto import AutoHTTPProtocol

HEADER_BUFFER_BYTES = 16 * 1024
"""Room beyond ``max_header_bytes`` in the HTTP parser's buffer (h11's ``max_incomplete_event_size``)
for the request line: a request whose headers fit the setting reaches the app, which answers 431 for
more; only a request far past it is refused by the parser itself (a plain 400)."""

PROTOCOL = f"{__name__}:NoDelayHTTPProtocol"
"""What ``uvicorn.run(http=...)`` takes: an import string, so each worker process imports it."""


def set_nodelay(transport: asyncio.BaseTransport) -> bool:
    """Turns Nagle's algorithm off on a TCP connection; False for other transports (a Unix socket)."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    with contextlib.suppress(OSError):  # the peer may already be gone
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return True
    return False


class NoDelayHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    def connection_made(self, transport: asyncio.Transport) -> None:
        set_nodelay(transport)
        super().connection_made(transport)

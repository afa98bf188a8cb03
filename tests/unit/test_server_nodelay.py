"""``conductor serve`` turns Nagle's algorithm off on every connection (conductor/service/server.py):
with ``--workers N`` uvicorn binds its socket with ``proto`` 0, and asyncio then leaves Nagle on."""

from __future__ import annotations

import asyncio
import socket

from conductor.service.server import PROTOCOL, NoDelayHTTPProtocol, set_nodelay


def nodelay(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_a_connection_accepted_on_a_socket_bound_like_uvicorns_workers_gets_nodelay() -> None:
    seen: dict[str, int | bool] = {}

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            sock = transport.get_extra_info("socket")
            seen["before"] = nodelay(sock)
            seen["set"] = set_nodelay(transport)
            seen["after"] = nodelay(sock)
            transport.close()

    async def main() -> None:
        listener = socket.socket(family=socket.AF_INET)  # as uvicorn's Config.bind_socket does
        listener.bind(("127.0.0.1", 0))
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname())
        for _ in range(100):
            if "after" in seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    assert seen == {"before": 0, "set": True, "after": 1}  # asyncio left it off; set_nodelay turned it on


def test_serve_runs_the_protocol_that_sets_nodelay_on_each_connection() -> None:
    from uvicorn import Config
    from uvicorn.importer import import_from_string
    from uvicorn.server import ServerState

    assert import_from_string(PROTOCOL) is NoDelayHTTPProtocol  # what `conductor serve` passes uvicorn
    config = Config(app=lambda scope, receive, send: None, http=NoDelayHTTPProtocol)
    config.load()
    state = ServerState()
    flags: list[int] = []

    async def main() -> None:
        listener = socket.socket(family=socket.AF_INET)  # as uvicorn's Config.bind_socket does
        listener.bind(("127.0.0.1", 0))
        server = await asyncio.get_running_loop().create_server(
            lambda: NoDelayHTTPProtocol(config=config, server_state=state, app_state={}), sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname())
        for _ in range(100):
            if state.connections:
                break
            await asyncio.sleep(0.01)
        flags.extend(nodelay(c.transport.get_extra_info("socket")) for c in state.connections)
        writer.close()
        for c in list(state.connections):
            c.transport.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    assert flags == [1]  # the accepted connection, through the protocol uvicorn runs

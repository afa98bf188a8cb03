"""An open-loop HTTP/1.1 load generator on raw asyncio streams, for the API benchmark.

httpx's async client costs a few milliseconds of CPU per request: at 150 req/s it took 0.75 of a core on
the 2-core benchmark machine, competing with the API it measured. This client sends one prebuilt request
over keep-alive connections and parses only the status line and ``Content-Length`` (well under 0.1 ms of
CPU per request), so the API, not the client, is what saturates.

Open loop: request ``i`` is due at ``start + i / rate`` whether or not earlier ones were answered, and
its latency runs from when it was due (a stalled server is charged for the requests it kept waiting, not
only for the ones it answered: no coordinated omission).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

MAX_CONNECTIONS = 512
"""Connections opened at most; a request that finds none free waits for one (and is charged for it)."""
TIMEOUT_S = 30.0


@dataclass
class LoadResult:
    latencies: list[float] = field(default_factory=list)
    """Seconds from each answered request's due time to its response, for 2xx answers."""
    statuses: dict[int, int] = field(default_factory=dict)
    errors: int = 0
    """Requests that got no HTTP answer (connection refused or reset, timeout)."""
    wall_s: float = 0.0
    client_cpu_s: float = 0.0


def request_bytes(url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    host = urlsplit(url).netloc
    payload = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
             f"Content-Length: {len(payload)}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length:
        await reader.readexactly(length)
    return status


async def run_load(url: str, request: bytes, *, rate: float, seconds: float) -> LoadResult:
    """Sends ``rate * seconds`` copies of ``request`` at ``rate`` per second; waits for every answer."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    opened = 0
    freed = asyncio.Condition()
    out = LoadResult()

    async def connection() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """A free connection (reused: True) or a new one."""
        nonlocal opened
        async with freed:
            while not idle and opened >= MAX_CONNECTIONS:
                await freed.wait()
            if idle:
                return (*idle.pop(), True)
            opened += 1
        return (*await asyncio.open_connection(host, port), False)

    async def send_on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        try:
            writer.write(request)
            return await _read_response(reader)
        except BaseException:  # a failed (or timed-out) exchange leaves nothing open behind it
            writer.close()
            raise

    async def exchange() -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], int]:
        reader, writer, reused = await connection()
        try:
            return (reader, writer), await send_on(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            if not reused:
                raise
        # The server closed an idle keep-alive connection (as HTTP clients do): once more on a new one.
        reader, writer = await asyncio.open_connection(host, port)
        return (reader, writer), await send_on(reader, writer)

    async def one(due: float) -> None:
        nonlocal opened
        try:
            conn, status = await asyncio.wait_for(exchange(), TIMEOUT_S)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
            out.errors += 1
            async with freed:
                opened -= 1
                freed.notify()
            return
        done = time.perf_counter()
        out.statuses[status] = out.statuses.get(status, 0) + 1
        if 200 <= status < 300:
            out.latencies.append(done - due)
        async with freed:
            idle.append(conn)
            freed.notify()

    cpu0 = time.process_time()
    start = time.perf_counter()
    tasks = []
    for i in range(int(rate * seconds)):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(due)))
    await asyncio.gather(*tasks)
    out.wall_s = time.perf_counter() - start
    out.client_cpu_s = time.process_time() - cpu0
    for _, writer in idle:
        writer.close()
    return out

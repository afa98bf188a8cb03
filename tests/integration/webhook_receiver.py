"""A webhook receiver on loopback for the tests: answers each path with its scripted statuses in turn
(the last one repeats) and records every request as it arrived (headers, raw body)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = int | tuple[int, dict[str, str]]


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    answered: int


@dataclass
class Receiver:
    url: str
    scripts: dict[str, list[Answer]] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on(self, path: str, *answers: Answer) -> str:
        """Scripts ``path``'s answers (a status, or a status and headers); returns its URL."""
        with self.lock:
            self.scripts[path] = list(answers)
        return self.url + path

    def next_answer(self, path: str) -> tuple[int, dict[str, str]]:
        with self.lock:
            script = self.scripts.get(path, [404])
            answer = script.pop(0) if len(script) > 1 else script[0]
        return answer if isinstance(answer, tuple) else (answer, {})

    def at(self, path: str) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.path == path]

    def wait_for(self, path: str, count: int, timeout: float = 60) -> list[Received]:
        """Polls until ``count`` requests reached ``path``; the timeout only keeps a broken run from hanging."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.at(path)
            if len(got) >= count:
                return got
            time.sleep(0.05)
        raise AssertionError(f"{path}: {len(self.at(path))} of {count} webhook requests arrived")


@contextmanager
def serve_receiver() -> Iterator[Receiver]:
    state: dict[str, Receiver] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            receiver = state["r"]
            status, headers = receiver.next_answer(self.path)
            with receiver.lock:
                receiver.received.append(
                    Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body, status)
                )
            self.send_response(status)
            for name, value in {**headers, "content-length": "0"}.items():
                self.send_header(name, value)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state["r"] = Receiver(f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state["r"]
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Silent:
    """A receiver that accepts connections and never answers (a blackholed endpoint)."""

    url: str
    held: list[socket.socket] = field(default_factory=list)

    def wait_for_connections(self, count: int, timeout: float = 30) -> None:
        """Polls until ``count`` connections were accepted; the timeout only keeps a broken run from hanging."""
        deadline = time.monotonic() + timeout
        while len(self.held) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(self.held)} of {count} connections reached the silent receiver")
            time.sleep(0.02)


@contextmanager
def silent_receiver() -> Iterator[Silent]:
    """Listens on loopback, accepts and holds every connection, answers nothing; once closed, connecting
    is refused."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    silent = Silent(f"http://127.0.0.1:{listener.getsockname()[1]}/silent")

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed
                return
            silent.held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield silent
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone leaves it listening)
        listener.close()
        thread.join(timeout=5)
        for conn in silent.held:
            conn.close()

"""``conductor submit --batch FILE.jsonl``: the client side of a batch, over the OpenAI-compatible routes.

Uploads the file, creates the batch, and with ``wait`` shows a progress bar until it ends, then writes
one results file: every line of the output and error files, in the input file's order.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import httpx

from conductor.openai_wire import jsonl_lines

FINAL = ("completed", "failed", "expired", "cancelled")
POLL_S = 1.0
POLL_BACKOFF_MAX_S = 10.0
PATIENCE_S = 300.0
"""How long a wait keeps polling an API that fails (unreachable, 429, 5xx) before it gives up."""
BAR_WIDTH = 30


class BatchSubmitError(Exception):
    """A failure the user can act on (one line)."""


def endpoint_of(path: Path) -> str:
    """The endpoint the file's first request names (every line must name the same one)."""
    try:
        with path.open("rb") as fh:
            for raw in fh:
                if raw.strip():
                    url = json.loads(raw).get("url")
                    if isinstance(url, str):
                        return url
                    break
    except (OSError, ValueError, AttributeError) as exc:
        raise BatchSubmitError(f"cannot read {path}: {exc}") from exc
    raise BatchSubmitError(f"{path}: the first request has no 'url'; pass --endpoint")


def submit(client: httpx.Client, path: Path, endpoint: str) -> dict[str, Any]:
    """Uploads ``path`` and creates the batch; returns the batch."""
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise BatchSubmitError(f"cannot read {path}: {exc.strerror or exc}") from exc
    uploaded = _call(lambda: client.post("/v1/files", data={"purpose": "batch"},
                                         files={"file": (path.name, content, "application/jsonl")}))
    return dict(_call(lambda: client.post("/v1/batches", json={
        "input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": "24h"})))


def wait(client: httpx.Client, batch_id: str, *, out: TextIO = sys.stderr, poll_s: float = POLL_S,
         patience_s: float = PATIENCE_S) -> dict[str, Any]:
    """Polls until the batch ends, drawing a progress bar on ``out``; returns the ended batch. An API that
    cannot be reached or answers 429/5xx is polled again (a line on ``out`` says so) for up to
    ``patience_s`` in a row before the wait gives up."""
    live = out.isatty()
    last = ""

    def note(exc: Transient) -> None:
        nonlocal last
        out.write(f"{chr(10) if live and last else ''}batch {batch_id}: {exc}; polling again\n")
        out.flush()
        last = ""  # the bar is drawn again on its own line

    while True:
        batch = dict(_patiently(lambda: client.get(f"/v1/batches/{batch_id}"), note=note, patience_s=patience_s,
                                pause_s=min(POLL_BACKOFF_MAX_S, poll_s * 4)).json())
        bar = progress_bar(batch)
        if bar != last:
            out.write(("\r" + bar) if live else (bar + "\n"))
            out.flush()
            last = bar
        if batch["status"] in FINAL:
            if live:
                out.write("\n")
            return batch
        time.sleep(poll_s)


def progress_bar(batch: dict[str, Any]) -> str:
    counts = batch["request_counts"]
    total = max(int(counts["total"]), 1)
    done = int(counts["completed"]) + int(counts["failed"])
    filled = BAR_WIDTH * done // total
    return (f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{counts['total']} "
            f"({counts['failed']} failed) {batch['status']}")


def usage_line(batch: dict[str, Any]) -> str | None:
    """What an ended batch's jobs used (``usage`` of the batch object), for a person; None before it ends."""
    usage = batch.get("usage")
    if not isinstance(usage, dict):
        return None
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (usage.get("output_tokens_details") or {}).get("reasoning_tokens", 0)
    return (f"batch {batch['id']} used {usage.get('input_tokens', 0):,} input tokens ({cached:,} cached) and "
            f"{usage.get('output_tokens', 0):,} output tokens ({reasoning:,} reasoning)")


def write_results(client: httpx.Client, batch: dict[str, Any], results: Path, *, out: TextIO = sys.stderr,
                  patience_s: float = PATIENCE_S, retry_s: float = POLL_BACKOFF_MAX_S / 2) -> tuple[int, int]:
    """Writes every line's result, in input order (``GET /v1/batches/{id}/results``), to ``results``;
    returns (succeeded, failed). A failing API is asked again as ``wait`` polls it."""
    def note(exc: Transient) -> None:
        out.write(f"batch {batch['id']}: {exc}; asking for its results again\n")
        out.flush()

    text = _patiently(lambda: client.get(f"/v1/batches/{batch['id']}/results"), note=note, patience_s=patience_s,
                      pause_s=retry_s).text
    lines = [line for line in jsonl_lines(text) if line.strip()]
    failed = sum(1 for line in lines if json.loads(line).get("error") is not None)
    try:
        results.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    except OSError as exc:
        raise BatchSubmitError(f"cannot write {results}: {exc.strerror or exc}") from exc
    return len(lines) - failed, failed


def _patiently(request: Callable[[], httpx.Response], *, note: Callable[[Transient], None], patience_s: float,
               pause_s: float) -> httpx.Response:
    """``_send``, asked again after ``pause_s`` while the API fails transiently (``note`` says so each time),
    until it has failed for ``patience_s`` in a row."""
    started = time.monotonic()
    while True:
        try:
            return _send(request)
        except Transient as exc:
            if time.monotonic() - started > patience_s:
                raise BatchSubmitError(f"{exc}; gave up after {patience_s:g}s of failed tries") from exc
            note(exc)
            time.sleep(pause_s)


def _call(request: Callable[[], httpx.Response]) -> Any:
    return _send(request).json()


class Transient(BatchSubmitError):
    """The API could not be reached, or answered 429 or 5xx: worth asking again."""


def _send(request: Callable[[], httpx.Response]) -> httpx.Response:
    try:
        response = request()
    except httpx.HTTPError as exc:
        raise Transient(f"cannot reach the API ({exc}); is 'conductor serve' running (CONDUCTOR_API_URL)?") from exc
    if response.status_code >= 400:
        message = _message(response)
        if response.status_code == 401:
            message += "; set CONDUCTOR_API_KEY to a key of yours (conductor keys create --tenant T)"
        error = Transient if response.status_code == 429 or response.status_code >= 500 else BatchSubmitError
        raise error(f"API answered {response.status_code}: {message}")
    return response


def _message(response: httpx.Response) -> str:
    """The error's text, from the OpenAI shape (``error.message``) or problem+json (``detail``/``title``)."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if body.get("detail") or body.get("title"):
            return str(body.get("detail") or body.get("title"))
    return response.text[:200]

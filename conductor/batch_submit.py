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


def wait(client: httpx.Client, batch_id: str, *, out: TextIO = sys.stderr, poll_s: float = POLL_S) -> dict[str, Any]:
    """Polls until the batch ends, drawing a progress bar on ``out``; returns the ended batch."""
    live = out.isatty()
    last = ""
    while True:
        batch = dict(_call(lambda: client.get(f"/v1/batches/{batch_id}")))
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


def write_results(client: httpx.Client, batch: dict[str, Any], input_path: Path, results: Path) -> tuple[int, int]:
    """Writes the output and error lines in input order; returns (succeeded, failed)."""
    lines: dict[str, str] = {}
    failed = 0
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key):
            text = _content(client, batch[key])
            for line in jsonl_lines(text):
                if line.strip():
                    lines[json.loads(line)["custom_id"]] = line
                    failed += key == "error_file_id"
    order = [json.loads(raw)["custom_id"] for raw in jsonl_lines(input_path.read_text(encoding="utf-8")) if raw.strip()]
    with results.open("w") as fh:
        for custom_id in order:
            if custom_id in lines:
                fh.write(lines[custom_id] + "\n")
    return len(lines) - failed, failed


def _content(client: httpx.Client, file_id: str) -> str:
    response = _send(lambda: client.get(f"/v1/files/{file_id}/content"))
    return response.text


def _call(request: Callable[[], httpx.Response]) -> Any:
    return _send(request).json()


def _send(request: Callable[[], httpx.Response]) -> httpx.Response:
    try:
        response = request()
    except httpx.HTTPError as exc:
        raise BatchSubmitError(f"cannot reach the API ({exc}); is 'conductor serve' running?") from exc
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise BatchSubmitError(f"API answered {response.status_code}: {message}")
    return response

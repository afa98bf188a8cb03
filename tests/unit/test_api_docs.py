"""``/docs`` loads its Swagger UI assets at one pinned version, each with a Subresource Integrity hash, and
nothing else from another origin (FastAPI's page floated on ``swagger-ui-dist@5``, unchecked, and fetched
a favicon from fastapi.tiangolo.com; its ``/redoc`` page, fonts from Google)."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from fastapi.testclient import TestClient

from conductor.service.api_docs import SWAGGER_UI_VERSION
from conductor.service.app import create_app

client = TestClient(create_app())


class _Resources(HTMLParser):
    """Every ``src``/``href`` a browser fetches from the page, with its tag's attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        fields = dict(attrs)
        url = fields.get("src") or (fields.get("href") if tag == "link" else None)
        if url:
            self.found.append((url, fields))


def test_docs_pins_its_assets_with_integrity_hashes() -> None:
    page = client.get("/docs")
    assert page.status_code == 200
    assert page.headers["referrer-policy"] == "no-referrer"
    # no other site frames it (its Authorize box holds a key), as the viewer's pages
    assert page.headers["content-security-policy"] == "frame-ancestors 'none'"
    assert page.headers["x-frame-options"] == "DENY"
    parser = _Resources()
    parser.feed(page.text)
    remote = [(url, fields) for url, fields in parser.found if not url.startswith(("/", "data:"))]
    assert {url.rsplit("/", 1)[-1] for url, _ in remote} == {"swagger-ui.css", "swagger-ui-bundle.js"}
    for url, fields in remote:
        assert url.startswith(f"https://cdn.jsdelivr.net/npm/swagger-ui-dist@{SWAGGER_UI_VERSION}/"), url
        assert re.fullmatch(r"\d+\.\d+\.\d+", SWAGGER_UI_VERSION)  # an exact version, not a range
        assert re.fullmatch(r"sha384-[A-Za-z0-9+/]{64}", fields.get("integrity") or ""), fields
        assert fields.get("crossorigin") == "anonymous"  # without it a cross-origin SRI check cannot pass
    assert "/openapi.json" in page.text


def test_the_openapi_document_stays_and_redoc_is_gone() -> None:
    assert client.get("/openapi.json").json()["info"]["title"] == "Conductor Queue"
    assert client.get("/redoc").status_code == 404

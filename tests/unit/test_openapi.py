"""The published OpenAPI schema declares every response body as it is sent: a typed model for each
success; for each error, problem+json (and nothing else) on the REST routes and the OpenAI error
document on the OpenAI-compatible ones; so schemathesis can check real responses against it
(tests/integration/test_schemathesis.py)."""

from __future__ import annotations

from typing import Any

import pytest

from conductor.service.app import create_app
from conductor.service.openai_errors import is_openai_path

SPEC = create_app().openapi()
REF = "#/components/schemas/"
RESPONSES = [
    pytest.param(path, status, response, id=f"{method.upper()} {path} {status}")
    for path, operations in SPEC["paths"].items()
    for method, operation in operations.items()
    for status, response in operation["responses"].items()
]


@pytest.mark.parametrize(("path", "status", "response"), RESPONSES)
def test_every_response_declares_its_body(path: str, status: str, response: dict[str, Any]) -> None:
    content = response.get("content", {})
    if status.startswith("3") or status == "204":
        assert not content  # a redirect, or no content: nothing to declare
        return
    assert content, "no body declared"
    assert all("schema" in media for media in content.values()), content
    if status.startswith(("4", "5")) and is_openai_path(path):
        assert content == {"application/json": {"schema": {"$ref": f"{REF}ErrorDocument"}}}
    elif status.startswith(("4", "5")):
        assert content["application/problem+json"]["schema"] == {"$ref": f"{REF}ProblemDocument"}
        others = {media: body["schema"] for media, body in content.items() if media != "application/problem+json"}
        assert others in ({}, {"text/html": {"type": "string"}}), others  # a page route may answer with a page
    elif "application/json" in content:
        ref = content["application/json"]["schema"].get("$ref", "")
        assert ref.startswith(REF) and ref.removeprefix(REF) in SPEC["components"]["schemas"], "not a named model"


def test_job_shapes_are_declared_field_by_field() -> None:
    schemas = SPEC["components"]["schemas"]
    job = schemas["JobPublic"]
    assert {"id", "status", "workflow", "answer", "error", "usage", "links", "created_at"} <= set(job["required"])
    assert schemas["JobStatus"]["enum"] == ["queued", "planning", "running", "succeeded", "failed", "cancelled"]
    assert job["properties"]["created_at"]["format"] == "date-time"
    step = schemas["StepPublic"]["properties"]
    assert step["attempts"]["items"] == {"$ref": f"{REF}AttemptPublic"}
    assert "HTTPValidationError" not in schemas  # validation errors are problem documents too

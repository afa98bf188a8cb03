"""The OpenAPI schema the server publishes, with every response body declared as it is really sent.

FastAPI declares the route's own media type (``application/json``, or ``text/html`` on a page route)
beside each ``responses=`` model, and a 422 ``HTTPValidationError`` on every route with parameters;
neither is what is sent. Errors are problem+json documents (RFC 9457) on the REST routes; the
OpenAI-compatible routes answer validation errors 400 in the OpenAI error shape, which they declare
themselves. A text body declared without a schema (a page, an event stream, Prometheus text) is
declared as a string.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from conductor.service.openai_errors import is_openai_path
from conductor.service.problems import PROBLEM, REF

FASTAPI_VALIDATION = f"{REF}HTTPValidationError"


def published_schema(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
    problem_ref = f"{REF}ProblemDocument"
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.get("responses", {})
            for status, response in list(responses.items()):
                content = response.get("content", {})
                fastapi_default = content.get("application/json", {}).get("schema", {}).get("$ref")
                if fastapi_default == FASTAPI_VALIDATION:
                    if is_openai_path(path):
                        del responses[status]  # answered 400 in the OpenAI error shape, declared by the route
                        continue
                    del content["application/json"]
                    content[PROBLEM] = {"schema": {"$ref": problem_ref}}
                for media, body in list(content.items()):
                    if media != PROBLEM and PROBLEM in content and body.get("schema", {}).get("$ref") == problem_ref:
                        if media == "application/json":
                            del content[media]  # the route's media type, given the model: never sent
                            continue
                        body["schema"] = {"type": "string"}  # e.g. an HTML error page
                    elif "schema" not in body and not media.endswith("json"):
                        body["schema"] = {"type": "string"}
    for unused in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(unused, None)
    app.openapi_schema = schema
    return schema

"""Authentication hands its database connection back before the endpoint runs.

FastAPI runs a sync dependency and the sync endpoint as two separate jobs on its thread pool. If the key
lookup's transaction stayed open in between, a burst of requests that had passed authentication held
every pooled connection while they queued for a thread, and the new requests on every thread waited for
a connection: the API stalled until the pool's timeout (measured: 100 req/s gave 439 read timeouts of
500 requests; with the connection released, 500 of 500 accepted; docs/benchmarks.md, api)."""

from __future__ import annotations

from sqlmodel import Session
from starlette.requests import Request

from conductor.service.deps import tenant_dep
from conductor.service.problems import KEY_FOUND
from conductor.settings import get_settings
from conductor.store.db import get_engine
from tests.integration.conftest import new_key


def test_the_key_lookup_leaves_no_transaction_open() -> None:
    settings = get_settings().model_copy(update={"auth_required": True})
    key = new_key("tenant-release")
    engine = get_engine(settings.database_url)
    with Session(engine, expire_on_commit=False) as session:
        request = Request({"type": "http", "method": "GET", "path": "/v1/jobs", "headers": []})
        assert tenant_dep(request, session, settings, f"Bearer {key}") == "tenant-release"
        assert getattr(request.state, KEY_FOUND)  # a refusal after it will not look the key up again
        assert not session.in_transaction()  # its connection is back in the pool
        checked_out = engine.pool.checkedout()  # type: ignore[attr-defined]
    with Session(engine, expire_on_commit=False) as session:
        session.connection()  # holding one: the count must see it, so the check above can fail
        assert engine.pool.checkedout() == checked_out + 1  # type: ignore[attr-defined]

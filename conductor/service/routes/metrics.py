"""``GET /metrics``: Prometheus text, read from the store and the broker at scrape time.

Who sees what: the bearer of ``CONDUCTOR_METRICS_TOKEN`` (Prometheus) sees every tenant's series and
the queue depths; a tenant's API key sees only its own tenant's series; with auth off, everything.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Header, Response

from conductor.metrics import CONTENT_TYPE, broker_families, exposition, store_families
from conductor.service.deps import SessionDep, SettingsDep, resolve_tenant
from conductor.service.problems import problems
from conductor.store.metrics import read_aggregates

router = APIRouter()
ALL_TENANTS = None


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}},
                     "description": "Prometheus text format"},
               **problems(401, 503)},
)
def metrics(
    session: SessionDep, settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
) -> Response:
    tenant = _scope(session, settings, authorization)
    families = list(store_families(read_aggregates(session, tenant=tenant)))
    if tenant is ALL_TENANTS:  # queue depths are every tenant's traffic: for the operator only
        from conductor.tasks.queue_depth import broker_state

        broker = broker_state(settings)
        if broker is not None:
            families += broker_families(broker)
    return Response(exposition(families), media_type=CONTENT_TYPE)


def _scope(session: SessionDep, settings: SettingsDep, authorization: str | None) -> str | None:
    """The tenant whose series the caller may see, or ``ALL_TENANTS``."""
    if not settings.auth_required:
        return ALL_TENANTS
    scheme, _, token = (authorization or "").partition(" ")
    if settings.metrics_token and scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), settings.metrics_token.encode()
    ):
        return ALL_TENANTS
    return resolve_tenant(session, settings, authorization)

"""API keys: only a salted SHA-256 of each key is stored; the key itself is shown once, at creation."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import datetime, timedelta
from functools import cache
from typing import Any

import sqlalchemy as sa
from sqlmodel import Session, col, select

from conductor.store.models import ApiKey, UiSession, utcnow

KEY_PREFIX = "cq_"
PEPPER_WARNING = (
    "CONDUCTOR_API_KEY_PEPPER is empty: API-key hashes are unkeyed, so a leaked key table verifies keys "
    "by itself. Set it once in production and keep it (changing it invalidates every key)"
)


def hash_key(key: str, pepper: str = "") -> str:
    # Keys are 256-bit random tokens, so a fast keyed hash is enough (no dictionary to attack).
    return hmac.new(pepper.encode(), key.encode(), hashlib.sha256).hexdigest()


def create_key(session: Session, *, tenant: str, pepper: str = "") -> tuple[ApiKey, str]:
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(tenant=tenant, prefix=key[:10], key_hash=hash_key(key, pepper))
    session.add(row)
    session.flush()
    return row, key


def tenant_for_key(session: Session, *, key: str, pepper: str = "") -> str | None:
    """The tenant of an active key (every API request asks: a prebuilt statement, one column)."""
    found = session.connection().execute(_tenant_for_key_stmt(), {"p_hash": hash_key(key, pepper)}).first()
    return str(found[0]) if found is not None else None


@cache
def _tenant_for_key_stmt() -> sa.Select[Any]:
    k: sa.Table = ApiKey.__table__  # type: ignore[attr-defined]
    return sa.select(k.c.tenant).where(k.c.key_hash == sa.bindparam("p_hash", type_=sa.String()),
                                       k.c.revoked_at.is_(None)).limit(1)


def list_keys(session: Session, *, tenant: str | None = None) -> list[ApiKey]:
    stmt = select(ApiKey).order_by(col(ApiKey.created_at))
    if tenant is not None:
        stmt = stmt.where(ApiKey.tenant == tenant)
    return list(session.exec(stmt))


class AmbiguousPrefix(ValueError):
    """More than one active key starts with the prefix given (7 random characters: rare, not impossible)."""

    def __init__(self, prefix: str, rows: list[ApiKey]):
        self.rows = rows
        tenants = sorted({r.tenant for r in rows})
        which = "name the tenant with --tenant, " if len(tenants) > 1 else ""
        super().__init__(f"{len(rows)} active keys start with '{prefix}' (tenants: {', '.join(tenants)}); "
                         f"{which}give the whole key, or revoke them all with --all")


def revoke_key(session: Session, *, prefix: str, tenant: str | None = None, all_matching: bool = False,
               pepper: str = "") -> int:
    """Revokes the active key starting with ``prefix`` (as ``keys list`` shows it), or the key itself when
    the whole key is given, of ``tenant`` if given; returns how many were revoked. Several keys matching a
    prefix are revoked only with ``all_matching`` (else :class:`AmbiguousPrefix`): one revocation never
    silently ends another's key."""
    whole = len(prefix) > len(KEY_PREFIX) + 7
    stmt = select(ApiKey).where(
        ApiKey.key_hash == hash_key(prefix, pepper) if whole else ApiKey.prefix == prefix[: len(KEY_PREFIX) + 7],
        col(ApiKey.revoked_at).is_(None))
    if tenant is not None:
        stmt = stmt.where(ApiKey.tenant == tenant)
    rows = list(session.exec(stmt).all())
    if len(rows) > 1 and not all_matching:
        raise AmbiguousPrefix(prefix, rows)
    for row in rows:
        row.revoked_at = utcnow()
        session.add(row)
    if rows:  # their viewer sessions end with them (tenant_for_session checks the key too)
        session.execute(sa.delete(UiSession).where(col(UiSession.key_id).in_([r.id for r in rows])))
    return len(rows)


SESSION_PREFIX = "cqs_"
MAX_SESSIONS_PER_KEY = 20
"""Live viewer sessions one key may hold; signing in beyond that ends its oldest."""


def create_session(session: Session, *, key: str, pepper: str = "", ttl_s: int) -> tuple[str, str] | None:
    """(tenant, token) of a new trace-viewer session for an active ``key``, valid ``ttl_s`` seconds; None
    for an unknown or revoked key. The token is random and only its keyed hash is stored: a cookie holding
    it opens the viewer, never the API, and a leaked table mints none."""
    row = session.exec(select(ApiKey).where(ApiKey.key_hash == hash_key(key, pepper),
                                            col(ApiKey.revoked_at).is_(None))).first()
    if row is None:
        return None
    now = utcnow()
    sessions = sa.delete(UiSession).where(col(UiSession.key_id) == row.id)
    session.execute(sessions.where(col(UiSession.expires_at) <= now))
    live = session.exec(select(UiSession.token_hash).where(UiSession.key_id == row.id)
                        .order_by(col(UiSession.created_at).desc()).offset(MAX_SESSIONS_PER_KEY - 1)).all()
    if live:
        session.execute(sessions.where(col(UiSession.token_hash).in_(live)))
    token = SESSION_PREFIX + secrets.token_urlsafe(32)
    session.add(UiSession(token_hash=hash_key(token, pepper), key_id=row.id, tenant=row.tenant, created_at=now,
                          expires_at=now + timedelta(seconds=ttl_s)))
    session.flush()
    return row.tenant, token


def tenant_for_session(session: Session, *, token: str, pepper: str = "") -> str | None:
    """The tenant of a viewer session that has not expired and whose key is still active; else None."""
    if not token.startswith(SESSION_PREFIX):
        return None
    found = session.execute(
        sa.select(col(UiSession.tenant)).join(ApiKey, col(ApiKey.id) == col(UiSession.key_id))
        .where(col(UiSession.token_hash) == hash_key(token, pepper), col(UiSession.expires_at) > utcnow(),
               col(ApiKey.revoked_at).is_(None))).first()
    return str(found[0]) if found is not None else None


EXPIRED_SESSIONS_PER_PASS = 1000
"""Expired viewer sessions one reconciler pass deletes (the rest go at the next)."""


def delete_expired_sessions(session: Session, *, now: datetime | None = None,
                            limit: int = EXPIRED_SESSIONS_PER_PASS) -> int:
    """Deletes up to ``limit`` viewer sessions past their expiry; returns how many. Signing in again drops
    a key's own expired sessions; this drops those of keys that never sign in again. Rows another
    transaction holds (a sign-in deleting its key's, in its own order) are skipped, never waited for: left
    to that transaction or the next pass, so the two cannot deadlock."""
    expired = (sa.select(col(UiSession.token_hash)).where(col(UiSession.expires_at) <= (now or utcnow()))
               .limit(limit).with_for_update(skip_locked=True).scalar_subquery())
    result = session.execute(sa.delete(UiSession).where(col(UiSession.token_hash).in_(expired)))
    return int(getattr(result, "rowcount", 0) or 0)


def end_session(session: Session, *, token: str, pepper: str = "") -> None:
    session.execute(sa.delete(UiSession).where(col(UiSession.token_hash) == hash_key(token, pepper)))

"""Migrations that never stall a live service behind a lock queue (Postgres only; env.py runs them so).

A statement that needs ACCESS EXCLUSIVE on ``job`` (ALTER TABLE, CREATE TRIGGER, a plain DROP INDEX) waits
for every transaction already using the table, and while it waits every new query on ``job`` queues behind
it: one slow report or idle-in-transaction client would stall the API and the workers for as long as it
lasts. So every statement of a revision runs with ``lock_timeout`` (``CONDUCTOR_MIGRATION_LOCK_TIMEOUT_S``):
the stall lasts at most that long. On a lock timeout the revision's transaction is rolled back, nothing is
held for ``migration_lock_retry_wait_s`` (the queued queries run), and the revision is tried again, up to
``migration_lock_tries`` times; then MigrationLockTimeout names the session holding the lock.

Concurrent index builds (``online.outside_transaction``) run without ``lock_timeout``: a build waits, by
design, for every transaction older than it, and a timeout there would fail it near its end, leaving an
invalid index. Its waits block no reads or writes (its SHARE UPDATE EXCLUSIVE conflicts with neither), so
it waits them out; the watcher below says what it waits for.

A try runs the revision again from its start, so a lock timeout must not come after the revision committed
part of its work: statements under ``lock_timeout`` are those of the revision's transaction (rolled back
whole) and of autocommit blocks that a re-run continues (0018's batches: updated rows are no longer NULL).
0019 commits its columns before its index builds, which cannot time out (a re-run would meet its table).

No ``statement_timeout`` is set: it would cap backfills (0011's counts, 0018's batches) and index builds,
whose length follows the table's size, not a lock queue. One set on the role or database applies as ever.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

LOCK_NOT_AVAILABLE = "55P03"
"""SQLSTATE of ``canceling statement due to lock timeout`` (psycopg's LockNotAvailable)."""
VERSIONS = Path(__file__).parent / "versions"
WATCH_INTERVAL_S = 0.25
QUERY_CHARS = 120


@dataclass(frozen=True)
class LockPolicy:
    timeout_s: float
    tries: int
    retry_wait_s: float

    @classmethod
    def from_settings(cls) -> LockPolicy:
        from conductor.settings import get_settings

        s = get_settings()
        return cls(s.migration_lock_timeout_s, s.migration_lock_tries, s.migration_lock_retry_wait_s)


class MigrationLockTimeout(Exception):
    """A revision timed out on a lock at each of its tries. The message is one line: the revision, what
    holds the lock, that the schema stayed at the revision before, and what to do."""


@dataclass(frozen=True)
class Holder:
    """A session that held a lock the migration waited for, as pg_stat_activity showed it then."""

    target: str
    """``job`` (a table or index), or the lock's type (``transactionid``: a row, ``virtualxid``)."""
    pid: int
    state: str | None
    xact_s: float | None
    """How long its transaction had been open."""
    query: str | None

    def describe(self) -> str:
        """``pid 4242 (idle in transaction for 3 min: SELECT ...)``"""
        parts = [self.state or "state unknown"]
        if self.xact_s is not None:
            parts[0] += f" for {duration(self.xact_s)}"
        if self.query:
            query = " ".join(self.query.split())
            parts.append(query if len(query) <= QUERY_CHARS else query[:QUERY_CHARS - 3] + "...")
        return f"pid {self.pid} ({': '.join(parts)})"

    def lock(self) -> str:
        """What was waited for: ``a lock on job``, ``a row lock``, ``a virtualxid lock`` (an older transaction)."""
        if self.target in ("transactionid", "tuple"):
            return "a row lock"
        if self.target in LOCK_TYPES:
            return f"a {self.target} lock"
        return f"a lock on {self.target}"


LOCK_TYPES = frozenset({"relation", "extend", "frozenid", "page", "tuple", "transactionid", "virtualxid",
                        "spectoken", "object", "userlock", "advisory", "applytransaction"})
"""pg_locks.locktype values: ``target`` is one of these when the lock is on no table or index."""


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:.0f} s"
    return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:.0f} min"


def is_lock_timeout(exc: BaseException) -> bool:
    orig = getattr(exc, "orig", None)
    return isinstance(exc, DBAPIError) and getattr(orig, "sqlstate", None) == LOCK_NOT_AVAILABLE


def failed_revision(exc: BaseException) -> str | None:
    """The revision whose ``upgrade()`` or ``downgrade()`` raised ``exc`` (from its traceback), or None when
    it was not raised inside one (Alembic's own version table update)."""
    found = None
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        where = frame.f_globals.get("__file__")
        if (frame.f_code.co_name in ("upgrade", "downgrade") and where and Path(where).parent == VERSIONS
                and isinstance(frame.f_globals.get("revision"), str)):
            found = frame.f_globals["revision"]
        tb = tb.tb_next
    return found


RELATIVE = re.compile(r"[+-]\d+$")


def is_relative(target: Any) -> bool:
    """A target counted from where the database is (``-1``, ``+2``, ``head-1``): a try after another that
    committed revisions would count from elsewhere, so such a run is tried once."""
    targets = target if isinstance(target, (tuple, list)) else [target]
    return any(isinstance(t, str) and RELATIVE.search(t) for t in targets)


def waiting_message(revision: str | None, holder: Holder | None, policy: LockPolicy, next_try: int) -> str:
    what = f"migration {revision}" if revision else "the migration"
    lock = f"{holder.lock()} held by {holder.describe()}" if holder else "a lock another session holds"
    return (f"conductor: {what} is waiting for {lock}; rolled back so that queries go on, "
            f"try {next_try} of {policy.tries} in {policy.retry_wait_s:g} s")


def gave_up_message(revision: str | None, holder: Holder | None, policy: LockPolicy, tries: int,
                    at: set[str]) -> str:
    what = f"migration {revision}" if revision else "the migration"
    schema = ", ".join(sorted(at)) or "base (empty)"
    if holder is None:
        who, act = ("another session holds it (SELECT pid, state, query FROM pg_stat_activity shows the ones "
                    "in transaction)"), "end that transaction"
    else:
        who = f"{holder.describe()} holds it"
        act = f"end that transaction (SELECT pg_terminate_backend({holder.pid}))"
    lock = holder.lock() if holder else "a lock"
    plural = "try" if tries == 1 else "tries"
    return (f"{what} could not get {lock} in {tries} {plural} of {policy.timeout_s:g} s: {who}; the schema "
            f"stays at {schema}. To go on, {act} or wait for it to finish, then run conductor migrate again")


def long_wait_message(holder: Holder) -> str:
    if holder.target == "virtualxid":  # a concurrent index build waiting out an older transaction
        return (f"conductor: the migration's index build is waiting for the transaction of {holder.describe()} "
                f"to end, as a concurrent build does for older transactions; reads and writes go on meanwhile")
    return f"conductor: the migration is waiting for {holder.lock()} held by {holder.describe()}"


WAITS = text("""
SELECT coalesce(w.relation::regclass::text, w.locktype) AS target, b.pid, b.state,
       extract(epoch FROM now() - b.xact_start)::float8 AS xact_s, b.query,
       extract(epoch FROM now() - m.query_start)::float8 AS waited_s
FROM pg_locks w
JOIN pg_stat_activity m ON m.pid = w.pid
CROSS JOIN LATERAL unnest(pg_blocking_pids(w.pid)) AS blocking(pid)
JOIN pg_stat_activity b ON b.pid = blocking.pid
WHERE w.pid = :pid AND NOT w.granted
ORDER BY b.wait_event_type = 'Lock', b.xact_start
LIMIT 1
""")
"""What the migration's backend waits for, and the session holding it: one that is not itself waiting
(pg_blocking_pids also names those queued ahead), the oldest first; and how long the migration's
statement has run."""


class LockWatch:
    """A thread on a connection of its own (autocommit: it holds no snapshot an index build would wait for)
    that looks every WATCH_INTERVAL_S at what the migration's backend waits for. ``take()`` returns the
    last holder seen since the previous call. A statement that has waited longer than ``report_after_s``
    (only an index build can: the others time out first) is reported once per holder as it waits."""

    def __init__(self, engine: Engine, pid: int, report_after_s: float):
        self._engine, self._pid, self._report_after_s = engine, pid, report_after_s
        self._seen: Holder | None = None
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conductor-migration-locks", daemon=True)

    def __enter__(self) -> LockWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def take(self) -> Holder | None:
        with self._mutex:
            seen, self._seen = self._seen, None
        return seen

    def _run(self) -> None:
        reported: set[int] = set()
        try:
            with self._engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                while not self._stop.wait(WATCH_INTERVAL_S):
                    row = conn.execute(WAITS, {"pid": self._pid}).first()
                    if row is None:
                        continue
                    holder = Holder(row.target, row.pid, row.state, row.xact_s, row.query)
                    with self._mutex:
                        self._seen = holder
                    if holder.pid not in reported and (row.waited_s or 0) > self._report_after_s:
                        reported.add(holder.pid)
                        print(long_wait_message(holder), file=sys.stderr, flush=True)
        except Exception:  # the watch only explains waits: the migration goes on without it
            return


def set_lock_timeout(connection: Connection, policy: LockPolicy) -> None:
    """Sets the session's ``lock_timeout``, committed: every revision's transaction and autocommit block
    inherits it (the connection is closed when the run ends)."""
    connection.execute(text("SELECT set_config('lock_timeout', :ms, false)"),
                       {"ms": f"{max(1, round(policy.timeout_s * 1000))}ms"})
    connection.commit()


def run(engine: Engine, connection: Connection, migrate: Callable[[], None], heads: Callable[[], set[str]],
        policy: LockPolicy, target: Any) -> None:
    """Runs ``migrate`` (Alembic's run of the revisions, a transaction each) on ``connection`` under the lock
    policy; ``heads`` reads the database's revisions. Tries are counted per revision: a try that got past
    some revisions before timing out starts the next revision's count."""
    if connection.dialect.name != "postgresql" or policy.timeout_s == 0:
        migrate()
        return
    pid = int(connection.execute(text("SELECT pg_backend_pid()")).scalar_one())
    tries_allowed = 1 if is_relative(target) else policy.tries
    set_lock_timeout(connection, policy)
    with LockWatch(engine, pid, report_after_s=2 * policy.timeout_s) as watch:
        tries, at = 0, None
        while True:
            watch.take()
            try:
                migrate()
                return
            except DBAPIError as exc:
                if not is_lock_timeout(exc):
                    raise
                if connection.in_transaction():
                    connection.rollback()
                holder = watch.take()
                now = heads()
                connection.rollback()  # no snapshot held while waiting
                tries = tries + 1 if now == at else 1
                at = now
                revision = failed_revision(exc)
                if tries >= tries_allowed:
                    raise MigrationLockTimeout(
                        gave_up_message(revision, holder, policy, tries, now)) from exc
                print(waiting_message(revision, holder, policy, tries + 1), file=sys.stderr, flush=True)
                time.sleep(policy.retry_wait_s)

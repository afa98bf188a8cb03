"""Transactions that lock several rows of one table take them in one order, ids ascending
(``store.db.in_id_order``), so two of them cannot deadlock (Postgres aborts one after ``deadlock_timeout``,
1 s: a heartbeat missed, a cancel failed, a reconciler pass's work lost until the next).

Before, an UPDATE of several rows locked them in the order its plan visited them: a sequential scan by
where the rows' current versions lie in the table, an index scan by the index (ids; or, for entries of
equal keys, where each row was first written: a HOT update, such as a lease renewal, moves a row further
down its page and leaves the index pointing at its first place). A transaction writing rows one statement
each took them in the order it had read them. Each test crafts rows whose orders disagree, pins the plan
each side gets where a plan decides (table sizes and statistics decide in production), and holds one side
between two statements (a barrier) or at one row (a third transaction's lock), so that before the fix the
two met crosswise every time: each test failed there with DeadlockDetected."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from conductor import engine
from conductor.engine import cancel_job, settle_from_children
from conductor.lease import Heartbeat
from conductor.reconcile import _webhooks_due, reconcile_once
from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store import webhooks as webhook_store
from conductor.store.db import get_engine, reserved_engine, session_scope, transaction
from conductor.store.models import Job, JobStatus, StepStatus, WebhookDelivery, utcnow
from conductor.submission import JobCreate, create_job
from conductor.workflow import CONDUCTOR_AGENT

SEQUENTIAL = {"enable_indexscan": "off", "enable_indexonlyscan": "off", "enable_bitmapscan": "off"}
"""A plan that visits rows in page order (of their current versions)."""
BY_INDEX = {"enable_seqscan": "off", "enable_bitmapscan": "off"}
"""A plan that visits rows through an index: in its order (ids, job and step index), or where each row was
first written (entries of equal keys)."""


@contextmanager
def plans_pinned(by_thread: dict[str, dict[str, str]]) -> Iterator[None]:
    """The transactions of the named threads run with these planner settings (``SET LOCAL`` when their
    connection is checked out: on the shared pool and on the heartbeat's own)."""
    engines = [get_engine(), reserved_engine()]

    def pin(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        settings = by_thread.get(threading.current_thread().name)
        if settings:
            try:
                with dbapi_connection.cursor() as cursor:
                    for name, value in settings.items():
                        cursor.execute(f"SET LOCAL {name} = {value}")
            except psycopg.OperationalError as exc:
                # A pooled connection an earlier test left dead (its backend terminated, the server
                # restarted): the pool opens a fresh one. Raised as is, the error escaped the checkout
                # unwrapped, past ``transaction``'s retry, and the racer ended before it was staged.
                raise sa.exc.DisconnectionError(str(exc)) from exc

    for e in engines:
        sa.event.listen(e, "checkout", pin)
    try:
        yield
    finally:
        for e in engines:
            sa.event.remove(e, "checkout", pin)


def wait_lock_waiters(n: int, *racers: Racer, timeout: float = 30) -> None:
    """Until ``n`` backends of this database wait for a lock: a staged race is then really staged. A racer
    that ended meanwhile fails the test at once, with what it raised (it will never wait)."""
    deadline = time.monotonic() + timeout
    with get_engine().connect() as conn:
        while True:
            waiting = conn.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                           "AND wait_event_type = 'Lock'")).scalar_one()
            conn.rollback()
            if waiting >= n:
                return
            ended = {r.name: f"{type(r.raised).__name__}: {r.raised}" if r.raised else "returned"
                     for r in racers if not r.is_alive()}
            assert not ended, f"{waiting} backends wait for a lock, not {n}: a racer ended before it waited: {ended}"
            assert time.monotonic() < deadline, f"{waiting} backends wait for a lock, not {n}"
            time.sleep(0.02)


class Racer(threading.Thread):
    """Runs ``body`` on a thread of this name and keeps what it raised."""

    def __init__(self, name: str, body: Callable[[], object]):
        super().__init__(name=name, daemon=True)
        self.body = body
        self.raised: BaseException | None = None

    def run(self) -> None:
        try:
            self.body()
        except BaseException as exc:  # reported by the test
            self.raised = exc


def finish(*racers: Racer) -> None:
    for r in racers:
        r.join(60)
        assert not r.is_alive(), f"{r.name} still waits"
    failed = {r.name: f"{type(r.raised).__name__}: {r.raised}".splitlines()[0] for r in racers if r.raised}
    assert not failed, f"a transaction was aborted: {failed}"


@contextmanager
def row_held(table: str, row_id: object) -> Iterator[None]:
    """A third transaction holds this row's lock for the block (where one racer is to stop)."""
    with get_engine().connect() as conn:
        conn.execute(sa.text(f"SELECT 1 FROM {table} WHERE id = :id FOR NO KEY UPDATE"), {"id": row_id})
        try:
            yield
        finally:
            conn.rollback()


def places(table: str, ids: list[Any]) -> dict[Any, tuple[int, int]]:
    """Each row's current place: (page, line)."""
    with session_scope() as s:
        rows = s.execute(sa.text(f"SELECT id, ctid::text FROM {table} WHERE id = ANY(:ids)"), {"ids": ids}).all()
    return {row_id: tuple(int(x) for x in ctid.strip("()").split(",")) for row_id, ctid in rows}  # type: ignore[misc]


def running_job(tenant: str = "lock-order") -> str:
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "lock order"}), tenant=tenant, settings=get_settings())
        assert store.transition_job(s, job_id=job.id, from_=[JobStatus.QUEUED], to=JobStatus.RUNNING)
        return job.id


def insert_steps(job_id: str, rows: list[dict[str, Any]]) -> dict[int, int]:
    """Inserts the job's steps in this order, in one statement: index -> id."""
    with session_scope() as s:
        return store.insert_steps(s, steps=[store.new_step_row(job_id=job_id, instruction=f"step {r['index']}",
                                                                access_list=[], **r) for r in rows], ids=True)


def craft(attempt: Callable[[], tuple[Any, bool]]) -> Any:
    """Rows laid out in the table as a test needs (``attempt`` makes them and says whether they came out
    so): where a row lands depends on which page has room (a row rewritten stays on its page only if that
    page has room), so a layout that came out otherwise is left and crafted again."""
    for _ in range(5):
        made, ok = attempt()
        if ok:
            return made
    pytest.fail("could not craft rows whose places disagree (pages kept filling up)")


def test_a_heartbeat_and_a_cancel_of_the_job_take_its_running_steps_in_one_order() -> None:
    """The heartbeat renews every lease its process holds in one UPDATE; a cancel (or a failure) of the
    job closes all its open steps in one. Three running steps of one job, held by one worker: the
    heartbeat's sequential scan visits them 1, 2, 0 (step 0's lease was renewed alone, so its current
    version lies last on the page), the cancel's index scan visits them 0, 1, 2. Stopped at step 2 (held
    by a third transaction), the heartbeat holds 1 while the cancel takes 0 and waits for 1; let go, the
    heartbeat takes 2 and waits for 0: a deadlock, before the fix. Both now lock them by id."""
    lease_s = 300.0  # the heartbeat thread's own first beat is 100 s away: only the test's beat runs

    def attempt() -> tuple[tuple[str, dict[int, tuple[int, str]]], bool]:
        job_id = running_job()
        owners = {i: f"w#{uuid.uuid4().hex[:12]}" for i in range(3)}
        expires = utcnow() + timedelta(seconds=lease_s)
        ids = insert_steps(job_id, [dict(index=i, agent="a", status=StepStatus.RUNNING, lease_owner=owners[i],
                                         lease_expires_at=expires, started_at=utcnow(), attempts=1) for i in range(3)])
        transaction(lambda s: store.renew_leases(s, held=[(ids[0], owners[0])], seconds=lease_s))
        at = places("step", list(ids.values()))
        same_page = len({at[ids[i]][0] for i in range(3)}) == 1
        return (job_id, {i: (ids[i], owners[i]) for i in range(3)}), same_page and (
            at[ids[1]][1] < at[ids[2]][1] < at[ids[0]][1])

    job_id, steps = craft(attempt)
    heartbeat = Heartbeat(lease_s)
    with (heartbeat.holding(*steps[0]), heartbeat.holding(*steps[1]), heartbeat.holding(*steps[2]),
          plans_pinned({"heartbeat": SEQUENTIAL, "cancel": BY_INDEX})):
        beat = Racer("heartbeat", heartbeat.beat)
        cancel = Racer("cancel", lambda: cancel_job(job_id))
        with row_held("step", steps[2][0]):
            beat.start()
            wait_lock_waiters(1, beat)  # the heartbeat, at step 2
            cancel.start()
            wait_lock_waiters(2, beat, cancel)  # and the cancel, at step 1 (before the fix) or 0 (now)
        finish(beat, cancel)
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        assert job is not None and job.status == JobStatus.CANCELLED
        assert {st.status for st in store.get_steps(s, job_id=job_id)} == {StepStatus.CANCELLED}


def test_settling_a_jobs_recursive_steps_and_cancelling_it_take_its_steps_in_one_order() -> None:
    """The reconciler settles the recursive steps whose child jobs ended (``settle_from_children``), one
    statement each, in the order it reads them; a cancel of the job closes them in one. Two recursive
    steps: the settling reads them 1, 0 (step 0 was written again, further down its page), the cancel's
    index scan takes 0 then 1. The settling stops after step 1; the cancel takes 0 and waits for 1; the
    settling then waits for 0: a deadlock, before the fix. The settling now locks the job row first, as
    every other transaction that writes several of a job's steps does, and its steps by id."""

    def attempt() -> tuple[str, bool]:
        job_id = running_job()
        children = [child_job(job_id, i) for i in range(2)]
        ids = insert_steps(job_id, [
            *[dict(index=i, agent=CONDUCTOR_AGENT, status=StepStatus.RUNNING, started_at=utcnow(),
                   lease_owner=f"w#{uuid.uuid4().hex[:12]}", child_job_id=children[i]) for i in range(2)],
            dict(index=2, agent="a", status=StepStatus.PENDING)])
        with session_scope() as s:  # step 0 written again (as its claim writes its messages and child)
            store.update_step(s, step_id=ids[0], messages=[], child_job_id=children[0], lease_expires_at=None)
        at = places("step", [ids[0], ids[1]])
        return job_id, at[ids[0]][0] == at[ids[1]][0] and at[ids[1]][1] < at[ids[0]][1]

    job_id = craft(attempt)
    paused, go_on = threading.Event(), threading.Event()
    settle_parent_step = engine._settle_parent_step

    def settling_one_at_a_time(*args: Any, **kwargs: Any) -> bool:
        settled = settle_parent_step(*args, **kwargs)
        if threading.current_thread().name == "settle" and not paused.is_set():
            paused.set()
            assert go_on.wait(30)
        return settled

    engine._settle_parent_step = settling_one_at_a_time
    try:
        with plans_pinned({"settle": SEQUENTIAL, "cancel": BY_INDEX}):
            settle = Racer("settle", lambda: settle_from_children(job_id))
            cancel = Racer("cancel", lambda: cancel_job(job_id))
            settle.start()
            assert paused.wait(30)  # one step settled, the other not yet
            cancel.start()
            wait_lock_waiters(1, settle, cancel)  # the cancel waits: for step 1 (before the fix), for the job row (now)
            go_on.set()
            finish(settle, cancel)
    finally:
        engine._settle_parent_step = settle_parent_step
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        assert job is not None and job.status == JobStatus.CANCELLED
        steps = {st.index: st.status for st in store.get_steps(s, job_id=job_id)}
    assert steps == {0: StepStatus.SUCCEEDED, 1: StepStatus.SUCCEEDED, 2: StepStatus.CANCELLED}


def child_job(parent_id: str, index: int) -> str:
    """A child job of ``parent_id``'s step ``index`` that has succeeded."""
    with session_scope() as s:
        parent = store.get_job(s, job_id=parent_id)
        assert parent is not None
        child = Job(tenant=parent.tenant, task="child", pool=parent.pool, pool_config=parent.pool_config,
                    planner=parent.planner, depth=1, parent_job_id=parent_id, parent_step_index=index,
                    root_job_id=parent_id, limits={}, meta={}, status=JobStatus.SUCCEEDED, answer=f"answer {index}",
                    finished_at=utcnow())
        store.insert_job(s, job=child)
        return child.id


def test_the_heartbeat_renewing_plannings_and_the_reconciler_re_driving_them_take_them_in_one_order() -> None:
    """The heartbeat touches every planning its process keeps alive in one UPDATE; the reconciler moves the
    plannings that went silent back to queued, one statement each, in one transaction. Two plannings that
    went silent (their worker stalled) while still held: the reconciler reads them oldest first (a, b)
    and, before the fix, re-drove them in that order, while the heartbeat's sequential scan visits them in
    page order (b, a): stopped after a, the reconciler waits for b, which the heartbeat holds while it waits
    for a. Both now take them by id."""
    long_ago = datetime(2000, 1, 1, tzinfo=UTC)

    def attempt() -> tuple[tuple[str, str], bool]:
        a, b = uuid.uuid4().hex, uuid.uuid4().hex
        with session_scope() as s:  # b written first but silent for less long: b's row lies before a's
            for job_id, silent_since in ((b, long_ago + timedelta(seconds=1)), (a, long_ago)):
                store.insert_job(s, job=Job(id=job_id, tenant="lock-order", task="lock order", pool="sim",
                                            pool_config={}, planner="p", limits={}, meta={}, plan_claims=1,
                                            status=JobStatus.PLANNING, started_at=long_ago, updated_at=silent_since))
        at = places("job", [a, b])
        return (a, b), at[b] < at[a]

    a, b = craft(attempt)
    ours = {a, b}
    paused, go_on = threading.Event(), threading.Event()
    transition_job = store.transition_job

    def re_driving_one_at_a_time(session: Any, *, job_id: str, **kwargs: Any) -> bool:
        moved = transition_job(session, job_id=job_id, **kwargs)
        if threading.current_thread().name == "reconcile" and job_id in ours and not paused.is_set():
            paused.set()
            assert go_on.wait(30)
        return moved

    heartbeat = Heartbeat(300.0)  # its own thread's first beat is 100 s away
    store.transition_job = re_driving_one_at_a_time
    try:
        with (heartbeat.planning(a, 1), heartbeat.planning(b, 1),
              plans_pinned({"heartbeat": SEQUENTIAL, "reconcile": BY_INDEX})):
            passing = Racer("reconcile", lambda: reconcile_once(get_settings()))
            beat = Racer("heartbeat", heartbeat.beat)
            passing.start()
            assert paused.wait(60)  # one planning re-driven, the other not yet
            beat.start()
            wait_lock_waiters(1, passing, beat)  # the heartbeat, at a (before the fix, holding b)
            go_on.set()
            finish(passing, beat)
    finally:
        store.transition_job = transition_job
    with session_scope() as s:
        jobs = [store.get_job(s, job_id=j) for j in ours]
    assert [j.status if j else None for j in jobs] == [JobStatus.QUEUED] * 2  # re-driven, both


def test_two_reconciler_passes_touching_the_running_jobs_take_them_in_one_order() -> None:
    """Each pass touches the running jobs it examines in one UPDATE; two passes overlap when one runs long.
    Three running jobs whose ids and places in the table disagree: one pass's sequential scan visits them
    in page order (h, m, r), the other's index scan in id order (r, h, m). Stopped at m (held by a third
    transaction), the first holds h while the second takes r and waits for h; let go, the first takes m
    and waits for r: a deadlock, before the fix. Both now lock them by id."""
    long_ago = datetime(2000, 1, 1, tzinfo=UTC)

    def attempt() -> tuple[tuple[str, str, str], bool]:
        # The least recently examined of all running jobs, and the first by id (the other running jobs each
        # pass takes may lie anywhere in the table: the second pass must meet these before any of them).
        prefix = f"{'0' * 8}{uuid.uuid4().hex[:21]}"
        r, h, m = (f"{prefix}{n:03d}" for n in range(3))
        with session_scope() as s:
            for job_id in (h, m, r):
                store.insert_job(s, job=Job(id=job_id, tenant="lock-order", task="lock order", pool="sim",
                                            pool_config={}, planner="p", limits={}, meta={},
                                            status=JobStatus.RUNNING, updated_at=long_ago))
        at = places("job", [r, h, m])
        if at[h] < at[m] < at[r]:
            return (r, h, m), True
        with session_scope() as s:  # out of the way of the next attempt's
            for job_id in (r, h, m):
                store.transition_job(s, job_id=job_id, from_=[JobStatus.RUNNING], to=JobStatus.SUCCEEDED)
        return (r, h, m), False

    r, h, m = craft(attempt)
    touched: dict[str, list[str]] = {}

    def touch(name: str) -> Callable[[], None]:
        def run() -> None:
            with session_scope() as s:
                touched[name] = store.running_job_ids(s, older_than=utcnow())
        return run

    with plans_pinned({"pass 1": SEQUENTIAL, "pass 2": BY_INDEX}), row_held("job", m):
        first, second = Racer("pass 1", touch("pass 1")), Racer("pass 2", touch("pass 2"))
        first.start()
        wait_lock_waiters(1, first)  # the first pass, at m
        second.start()
        wait_lock_waiters(2, first, second)  # and the second, at h (before the fix) or r (now)
    finish(first, second)
    assert all({r, h, m} <= set(ids) for ids in touched.values())


def test_a_reconciler_noting_webhook_resends_and_another_pass_sending_them_take_them_in_one_order() -> None:
    """A reconciler pass notes each webhook delivery it re-sends (one statement each, oldest due first) in
    its transaction; another pass overlapping it marks the deliveries it sent in one UPDATE (by id, or in
    page order). Two deliveries, the one with the larger id due first: the first pass notes it and, before
    the fix, then the other, while the second pass marks the other and waits for the first: a deadlock.
    Both now take them by id."""
    long_ago = datetime(2000, 1, 1, tzinfo=UTC)

    def attempt() -> tuple[tuple[str, str], bool]:
        prefix = uuid.uuid4().hex[:28]
        low, high = f"msg_{prefix}0000", f"msg_{prefix}0001"
        for delivery_id, due_at in ((low, long_ago + timedelta(seconds=1)), (high, long_ago)):
            job_id = running_job(tenant="lock-order-hooks")
            cancel_job(job_id)  # no webhook URL: no delivery of its own
            with session_scope() as s:  # its message sent long ago and never taken: to be re-sent
                s.add(WebhookDelivery(id=delivery_id, job_id=job_id, tenant="lock-order-hooks",
                                      url="https://example.com/hook", event_type="job.cancelled",
                                      next_attempt_at=due_at, sent_at=long_ago))
        at = places("webhook_delivery", [low, high])
        return (low, high), at[low] < at[high]  # page order is id order, whichever plan marks them

    low, high = craft(attempt)
    paused, go_on = threading.Event(), threading.Event()
    note_resend = webhook_store.note_resend

    def noting_one_at_a_time(session: Any, *, delivery_id: str, **kwargs: Any) -> None:
        note_resend(session, delivery_id=delivery_id, **kwargs)
        if delivery_id in (low, high) and not paused.is_set():
            paused.set()
            assert go_on.wait(30)

    settings = get_settings()

    def reconcile() -> None:
        with session_scope() as s:
            _webhooks_due(s, now=utcnow(), stale_s=settings.reconcile_stale_s, since=utcnow())

    def send() -> None:
        with session_scope() as s:
            webhook_store.mark_sent(s, delivery_ids=[low, high], due_at=utcnow())

    webhook_store.note_resend = noting_one_at_a_time
    try:
        passing, sending = Racer("reconcile", reconcile), Racer("send", send)
        passing.start()
        assert paused.wait(30)  # one delivery noted, the other not yet
        sending.start()
        wait_lock_waiters(1, passing, sending)
        go_on.set()
        finish(passing, sending)
    finally:
        webhook_store.note_resend = note_resend
    with session_scope() as s:
        rows = [s.get(WebhookDelivery, d) for d in (low, high)]
    assert all(r is not None and r.resends == 1 for r in rows)

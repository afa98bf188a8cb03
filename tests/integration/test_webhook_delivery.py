"""The delivery rules on a real Postgres, driven directly (no broker): the engine writes the delivery
with the job's end, and ``deliver`` makes one attempt per call against a loopback receiver. These pin
down the schedule (Retry-After, the end of the backoff), duplicate messages, and the send-time SSRF
check after DNS resolution — cases the process-level tests cannot stage on demand."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from conductor.engine import Dispatch, plan_job, run_step
from conductor.settings import Settings, get_settings
from conductor.store import webhooks as store
from conductor.store.db import session_scope
from conductor.store.models import DeliveryStatus, TenantSettings, WebhookAttempt, WebhookDelivery, utcnow
from conductor.submission import JobCreate, create_job
from conductor.tasks.webhooks import job_payload
from conductor.webhooks.deliver import deliver
from conductor.webhooks.signing import new_secret
from tests.integration.webhook_receiver import Receiver, serve_receiver, silent_receiver

ONE_STEP = {"model_ids": ["a"], "subtasks": ["s"], "access_lists": [[]]}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with serve_receiver() as r:
        yield r


@pytest.fixture
def settings() -> Settings:
    return get_settings().model_copy(update={"webhook_allow_loopback": True, "webhook_backoff_s": [0.0, 0.0]})


def ended_job_delivery(settings: Settings, url: str, *, tenant: str = "hooks-engine") -> str:
    """A job run to its end by the engine itself; returns the delivery its end wrote."""
    with session_scope() as s:
        body = JobCreate.model_validate({"task": "hook", "workflow": ONE_STEP, "webhook_url": url})
        job, _ = create_job(s, body, tenant=tenant, settings=settings)
        job_id = job.id
    plan_job(job_id, settings=settings)
    ended: Dispatch = run_step(job_id, 0, worker="test", task_id=None, settings=settings)  # finalizes inline
    assert len(ended.webhooks) == 1
    return ended.webhooks[0]


def row(delivery_id: str) -> tuple[WebhookDelivery, list[WebhookAttempt]]:
    with session_scope() as s:
        delivery = store.get_delivery(s, delivery_id=delivery_id)
        assert delivery is not None
        return delivery, store.attempts_for(s, delivery_ids=[delivery_id])


def test_a_longer_retry_after_is_honoured(settings: Settings, receiver: Receiver) -> None:
    delivery_id = ended_job_delivery(settings, receiver.on("/slow-down", (503, {"Retry-After": "120"})))
    outcome = deliver(delivery_id, settings=settings, render=job_payload)
    delivery, attempts = row(delivery_id)
    assert outcome.retry_in == 120.0  # not the 0 s of the backoff schedule
    assert delivery.status == DeliveryStatus.PENDING
    assert delivery.next_attempt_at - (attempts[0].finished_at or utcnow()) >= timedelta(seconds=119)
    assert [a.status_code for a in attempts] == [503]
    duplicate = deliver(delivery_id, settings=settings, render=job_payload)  # not due yet: sends nothing
    assert duplicate.retry_in is None
    assert len(receiver.at("/slow-down")) == 1
    with session_scope() as s:  # leave no retry due later for another test's reconciler pass to send
        store.finish_delivery(s, delivery_id=delivery_id, status=DeliveryStatus.FAILED)


def test_a_200_with_a_retry_after_of_latin1_digits_is_delivered(settings: Settings, receiver: Receiver) -> None:
    """Headers are read as latin-1, where "\xb9" (superscript one) is a digit to ``str.isdigit()`` but not
    to ``float()``: the ValueError left the attempt unsettled, and the reconciler re-sent it after every
    lease for ever though the receiver had answered 200."""
    delivery_id = ended_job_delivery(settings, receiver.on("/odd-header", (200, {"Retry-After": "\xb9"})))
    outcome = deliver(delivery_id, settings=settings, render=job_payload)
    delivery, attempts = row(delivery_id)
    assert outcome.retry_in is None and delivery.status == DeliveryStatus.DELIVERED
    assert [a.status_code for a in attempts] == [200]


def test_an_attempt_that_fails_inside_the_worker_is_settled_and_retried(
    settings: Settings, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    delivery_id = ended_job_delivery(settings, receiver.on("/inner-fault", 200))

    def broken(*_args: Any, **_kwargs: Any) -> Any:  # the injected fault: a bug while sending
        raise RuntimeError("boom")

    monkeypatch.setattr("conductor.webhooks.deliver._post", broken)
    outcome = deliver(delivery_id, settings=settings, render=job_payload)
    monkeypatch.undo()
    delivery, attempts = row(delivery_id)
    assert outcome.retry_in is not None and delivery.status == DeliveryStatus.PENDING
    assert delivery.lease_expires_at is None  # settled: the next attempt follows the schedule, not a lease
    assert len(attempts) == 1 and "RuntimeError" in (attempts[0].error or "")
    assert "boom" not in (attempts[0].error or "")  # the tenant reads it; the worker's log has the detail
    with session_scope() as s:
        store.finish_delivery(s, delivery_id=delivery_id, status=DeliveryStatus.FAILED)


def test_an_attempt_that_outlived_its_lease_does_not_settle_the_newer_claim(settings: Settings,
                                                                             receiver: Receiver) -> None:
    from conductor.webhooks.deliver import _Answer, _settle

    delivery_id = ended_job_delivery(settings, receiver.on("/stale", 500))
    with session_scope() as s:
        first = store.claim_delivery(s, delivery_id=delivery_id, lease_s=0)  # its lease is over at once
    with session_scope() as s:
        second = store.claim_delivery(s, delivery_id=delivery_id, lease_s=300)  # re-driven: claimed again
    assert first is not None and second is not None and second.attempts == first.attempts + 1
    _settle(first, utcnow(), _Answer(None, None, "ReadTimeout"), settings)  # the first attempt ends late
    delivery, attempts = row(delivery_id)
    # before: the late failure rescheduled the delivery and dropped the second attempt's lease
    assert delivery.status == DeliveryStatus.PENDING and delivery.lease_expires_at is not None
    assert [a.n for a in attempts] == [first.attempts]  # its attempt is on record all the same
    _settle(second, utcnow(), _Answer(200, None, None), settings)
    assert row(delivery_id)[0].status == DeliveryStatus.DELIVERED


def test_a_rotated_out_secret_signs_beside_the_new_one_until_it_expires(
    settings: Settings, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Standard Webhooks receivers verify any of several signatures: after a rotation each delivery is
    signed with both secrets while the old one lasts, so no delivery is rejected while receivers switch
    (before: every attempt signed with the new secret only failed at receivers still holding the old)."""
    from cryptography.fernet import Fernet
    from standardwebhooks import Webhook, WebhookVerificationError

    old, new = new_secret(), new_secret()
    try:
        with session_scope() as s:
            store.set_webhook_secret(s, tenant="hooks-engine", secret=old)
            store.set_webhook_secret(s, tenant="hooks-engine", secret=new, keep_previous_s=3600)
        first = ended_job_delivery(settings, receiver.on("/rotating", 200))
        deliver(first, settings=settings, render=job_payload)
        [got] = receiver.at("/rotating")
        for secret in (old, new):  # a receiver with either secret accepts it
            Webhook(secret).verify(got.body, got.headers)

        key = Fernet.generate_key().decode()  # a key set later seals the replaced secret too, still signing
        monkeypatch.setenv("CONDUCTOR_SECRETS_KEY", key)
        get_settings.cache_clear()
        with session_scope() as s:
            store.reseal_secrets(s, tenant="hooks-engine")
            sealed = s.get(TenantSettings, "hooks-engine")
            assert sealed is not None and (sealed.previous_webhook_secret or "").startswith("fernet:")
            assert store.previous_webhook_secret(s, tenant="hooks-engine") is not None
            sealed.previous_secret_expires_at = utcnow() - timedelta(seconds=1)  # the overlap is over
        second = ended_job_delivery(settings, receiver.on("/rotated", 200))
        deliver(second, settings=settings, render=job_payload)
        [got] = receiver.at("/rotated")
        assert len(got.headers["webhook-signature"].split(" ")) == 1
        Webhook(new).verify(got.body, got.headers)
        with pytest.raises(WebhookVerificationError):
            Webhook(old).verify(got.body, got.headers)
    finally:
        monkeypatch.delenv("CONDUCTOR_SECRETS_KEY", raising=False)
        get_settings.cache_clear()
        with session_scope() as s:  # the tenant's secret as other tests expect it: plaintext, nothing kept
            store.set_webhook_secret(s, tenant="hooks-engine", secret=new_secret())


def test_the_delivery_fails_once_the_backoff_schedule_is_spent(settings: Settings, receiver: Receiver) -> None:
    delivery_id = ended_job_delivery(settings, receiver.on("/down", 500))
    for _ in range(len(settings.webhook_backoff_s) + 1):
        deliver(delivery_id, settings=settings, render=job_payload)
    delivery, attempts = row(delivery_id)
    assert delivery.status == DeliveryStatus.FAILED and delivery.finished_at is not None
    assert [a.n for a in attempts] == [1, 2, 3]
    assert deliver(delivery_id, settings=settings, render=job_payload).retry_in is None
    assert len(receiver.at("/down")) == 3  # one request per attempt, none after giving up
    ids = {r.headers["webhook-id"] for r in receiver.at("/down")}
    assert ids == {delivery_id}


def test_a_name_that_resolves_to_a_private_address_is_not_connected_to(
    settings: Settings, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The URL passed the submit check (a public-looking name); at send time it resolves to 10.0.0.1
    (DNS is the faked edge here), so nothing is sent and no connection is made."""
    delivery_id = ended_job_delivery(settings, "https://hooks.example.com/conductor")
    connects: list[Any] = []
    real_connect = socket.socket.connect

    def fake_getaddrinfo(host: str, port: int, *args: object, **kwargs: object) -> list[tuple[Any, ...]]:
        assert host == "hooks.example.com"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", port))]

    def watched_connect(sock: socket.socket, address: Any) -> None:
        connects.append(address)
        real_connect(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", watched_connect)
    outcome = deliver(delivery_id, settings=settings, render=job_payload)
    monkeypatch.undo()

    delivery, attempts = row(delivery_id)
    # retried like a name that does not resolve, and told the same: the tenant reads the attempts, and
    # they must not show which internal names exist (nor their addresses)
    assert outcome.retry_in is not None and delivery.status == DeliveryStatus.PENDING
    error = attempts[0].error or ""
    assert attempts[0].status_code is None and "hooks.example.com does not resolve to a public address" in error
    assert "10.0.0.1" not in error and "private" not in error
    assert connects == []
    with session_scope() as s:  # no retry left due for a later module's workers (they would seal the secret)
        store.finish_delivery(s, delivery_id=delivery_id, status=DeliveryStatus.FAILED)


def test_a_resolver_that_does_not_answer_cannot_hold_the_attempt_past_its_timeout(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The name's lookup is inside the attempt's time: a resolver that never answers (DNS, the faked edge)
    ends the attempt as a name that does not resolve, retried, while the lookup is still stuck."""
    import threading

    quick = settings.model_copy(update={"webhook_timeout_s": 1.0})
    delivery_id = ended_job_delivery(quick, "https://hooks.example.com/stuck-dns")
    answer = threading.Event()
    asked: list[str] = []

    def stuck_getaddrinfo(host: str, port: int, *args: object, **kwargs: object) -> list[tuple[Any, ...]]:
        asked.append(host)
        answer.wait(60)  # before, the attempt waited here until the watchdog (or the test) let it go
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", stuck_getaddrinfo)
    watchdog = threading.Timer(20, answer.set)  # a resolver's own timeouts, twenty times the attempt's
    watchdog.daemon = True
    watchdog.start()
    try:
        outcome = deliver(delivery_id, settings=quick, render=job_payload)
        still_stuck = not answer.is_set()
    finally:
        answer.set()
        watchdog.cancel()
    monkeypatch.undo()
    delivery, attempts = row(delivery_id)
    assert asked == ["hooks.example.com"] and still_stuck  # it ended while the lookup had no answer
    assert outcome.retry_in is not None and delivery.status == DeliveryStatus.PENDING
    assert attempts[0].status_code is None
    assert "hooks.example.com does not resolve to a public address" in (attempts[0].error or "")
    with session_scope() as s:
        store.finish_delivery(s, delivery_id=delivery_id, status=DeliveryStatus.FAILED)


def test_only_top_level_jobs_with_a_url_owe_a_webhook(settings: Settings) -> None:
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "no hook", "workflow": ONE_STEP}),
                            tenant="hooks-engine-none", settings=settings)
        job_id = job.id
    plan_job(job_id, settings=settings)
    assert run_step(job_id, 0, worker="test", task_id=None, settings=settings).webhooks == []
    with session_scope() as s:
        assert store.deliveries_for_job(s, job_id=job_id) == []


def test_a_receiver_trickling_its_answer_cannot_hold_the_attempt_past_its_timeout(settings: Settings) -> None:
    """httpx's timeout bounds each socket read; a receiver sending its headers a byte at a time would hold
    a delivery worker for days. The attempt as a whole ends at ``webhook_timeout_s``."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            for _ in range(600):  # a byte every 0.1 s for a minute: each read is far inside the timeout
                if stop.wait(0.1):
                    return
                try:
                    conn.sendall(b"a")
                except OSError:
                    return  # the sender gave up and closed the connection

    server = threading.Thread(target=trickle, daemon=True)
    server.start()
    quick = settings.model_copy(update={"webhook_timeout_s": 1.0})
    delivery_id = ended_job_delivery(quick, f"http://127.0.0.1:{listener.getsockname()[1]}/hook")
    attempt = threading.Thread(target=deliver, args=(delivery_id,), kwargs={"settings": quick, "render": job_payload})
    attempt.start()
    attempt.join(timeout=30)
    still_waiting = attempt.is_alive()
    stop.set()
    attempt.join()
    listener.close()
    assert not still_waiting, "the attempt was still waiting for the trickling receiver after 30 s"
    delivery, attempts = row(delivery_id)
    assert [(a.status_code, (a.error or "").split(":")[0]) for a in attempts] == [(None, "ReadTimeout")]
    assert delivery.status == DeliveryStatus.PENDING  # retried later, like any receiver that did not answer
    with session_scope() as s:
        store.finish_delivery(s, delivery_id=delivery_id, status=DeliveryStatus.FAILED)


def test_sealing_secrets_plaintext_then_sealed_then_rotated_and_a_worker_without_the_key(
    settings: Settings, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cryptography.fernet import Fernet
    from standardwebhooks import Webhook

    from conductor.sealed import needs_sealing, unseal
    from conductor.webhooks.deliver import UNSEALABLE

    def stored() -> str:
        with session_scope() as s:
            row = s.get(TenantSettings, "hooks-engine")
            assert row is not None and row.webhook_secret is not None
            return row.webhook_secret

    def use_keys(keys: str) -> None:
        monkeypatch.setenv("CONDUCTOR_SECRETS_KEY", keys)
        get_settings.cache_clear()

    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    try:
        use_keys("")
        with session_scope() as s:  # a secret stored before any key was set
            plain = store.ensure_webhook_secret(s, tenant="hooks-engine", new=new_secret())
        assert stored() == plain

        use_keys(old)  # the key is set: the next delivery signs with the same secret and seals it
        first = ended_job_delivery(settings, receiver.on("/sealing", 200, 200))
        deliver(first, settings=settings, render=job_payload)
        [got] = receiver.at("/sealing")
        Webhook(plain).verify(got.body, got.headers)
        assert stored().startswith("fernet:") and unseal(stored(), old) == plain

        use_keys("")  # a worker without the key: an attempt on record saying why, nothing sent, retried
        second = ended_job_delivery(settings, receiver.on("/no-key", 200))
        outcome = deliver(second, settings=settings, render=job_payload)
        delivery, attempts = row(second)
        assert receiver.at("/no-key") == [] and delivery.status == DeliveryStatus.PENDING
        assert [a.error for a in attempts] == [UNSEALABLE] and outcome.retry_in is not None
        with session_scope() as s:
            store.finish_delivery(s, delivery_id=second, status=DeliveryStatus.FAILED)

        use_keys(f"{new},{old}")  # rotation: the new key first; reseal rewrites with it, the secret unchanged
        assert needs_sealing(stored())
        with session_scope() as s:
            result = store.reseal_secrets(s, tenant="hooks-engine")
        assert (result.resealed, result.tenants, result.unopened) == (1, 1, [])
        assert unseal(stored(), new) == plain and not needs_sealing(stored())
    finally:
        monkeypatch.delenv("CONDUCTOR_SECRETS_KEY", raising=False)
        get_settings.cache_clear()
        with session_scope() as s:  # the tenant's secret as other tests expect it: plaintext
            store.set_webhook_secret(s, tenant="hooks-engine", secret=new_secret())


def test_a_tenant_at_its_cap_of_attempts_in_flight_is_put_off_and_another_tenant_is_not(
    settings: Settings, receiver: Receiver
) -> None:
    """Cap 2: two attempts held by a receiver that never answers; the tenant's next two deliveries are parked
    (no attempt, no connection), another tenant's is delivered meanwhile, and as each held attempt ends it
    wakes the oldest parked delivery, which then makes its first attempt."""
    capped = settings.model_copy(update={"webhook_tenant_max_in_flight": 2, "webhook_timeout_s": 10.0,
                                         "webhook_backoff_s": []})
    greedy = f"hooks-greedy-{uuid.uuid4().hex[:8]}"
    with silent_receiver() as silent:
        held_ids = [ended_job_delivery(capped, silent.url, tenant=greedy) for _ in range(2)]
        older, newer = (ended_job_delivery(capped, silent.url, tenant=greedy) for _ in range(2))
        other = ended_job_delivery(capped, receiver.on("/other-tenant", 200), tenant="hooks-other")
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(deliver, d, settings=capped, render=job_payload) for d in held_ids]
            silent.wait_for_connections(2)  # both attempts are in flight, each holding a worker slot

            for parked_id in (newer, older):  # (the newer one's message first: the line goes by age)
                due_before = row(parked_id)[0].next_attempt_at
                put_off = deliver(parked_id, settings=capped, render=job_payload)
                delivery, attempts = row(parked_id)
                assert attempts == [] and delivery.attempts == 0 and delivery.deferrals == 1
                assert delivery.parked_at is not None and delivery.sent_at is None
                assert delivery.next_attempt_at > due_before and put_off.wake is None
                # back by itself at the latest after two attempts' time (few wait), +-50 %
                assert put_off.retry_in is not None and 10.0 <= put_off.retry_in <= 30.0
            # before: a third and a fourth slot held by the same silent receiver for its whole timeout
            assert len(silent.held) == 2

            assert deliver(other, settings=capped, render=job_payload).retry_in is None
            delivered, other_attempts = row(other)
            assert delivered.status == DeliveryStatus.DELIVERED and delivered.deferrals == 0
            assert [a.status_code for a in other_attempts] == [200]
            for delivery_id in held_ids:  # still in flight when the other tenant's webhook was delivered
                leased, none_yet = row(delivery_id)
                assert leased.lease_expires_at is not None and none_yet == []
        ended = [f.result() for f in held]  # timed out; no retry scheduled (none left)
    assert [o.retry_in for o in ended] == [None, None]
    # each end woke the oldest parked delivery in turn: the older first, whichever attempt ended first
    woken = [o.wake for o in sorted(ended, key=lambda o: 0 if o.wake == older else 1)]
    assert woken == [older, newer], (ended, older, newer)
    for delivery_id in held_ids:
        failed, attempts = row(delivery_id)
        assert failed.status == DeliveryStatus.FAILED and [a.n for a in attempts] == [1]
        assert attempts[0].finished_at is not None and other_attempts[0].finished_at is not None
        assert other_attempts[0].finished_at < attempts[0].finished_at
    for parked_id in (older, newer):  # woken: due now, each makes its first attempt at once
        assert row(parked_id)[0].next_attempt_at <= utcnow()
        assert deliver(parked_id, settings=capped, render=job_payload).retry_in is None
        done, attempts = row(parked_id)
        assert [a.n for a in attempts] == [1] and done.attempts == 1 and done.deferrals == 1
        assert done.parked_at is None
        assert done.status == DeliveryStatus.FAILED  # the silent receiver is gone: connection refused
        assert "ConnectError" in (attempts[0].error or "")


def test_an_attempt_that_fails_inside_the_worker_before_sending_is_settled_not_left_claimed(
    settings: Settings, receiver: Receiver
) -> None:
    """The claim commits on its own; a fault after it (here the job's rendering) is recorded as an attempt
    that failed inside the service and retried on the schedule, not left holding the claim (and a place under
    the tenant's cap) until its lease ends."""
    delivery_id = ended_job_delivery(settings, receiver.on("/render-fails", 200))

    def broken(*_args: Any) -> Any:
        raise RuntimeError("boom")

    outcome = deliver(delivery_id, settings=settings, render=broken)
    delivery, attempts = row(delivery_id)
    assert outcome.retry_in is not None and delivery.status == DeliveryStatus.PENDING
    assert delivery.lease_expires_at is None and delivery.attempts == 1
    assert [a.n for a in attempts] == [1] and "failed inside the service (RuntimeError)" in (attempts[0].error or "")
    assert receiver.at("/render-fails") == []
    assert deliver(delivery_id, settings=settings, render=job_payload).retry_in is None  # the retry delivers
    assert row(delivery_id)[0].status == DeliveryStatus.DELIVERED


def test_a_place_freed_goes_to_the_oldest_parked_delivery_whichever_message_comes_first(
    settings: Settings, receiver: Receiver
) -> None:
    """Cap 1: a parked delivery woken by the end of its tenant's attempt keeps the freed place while its
    message comes; a newer delivery whose message comes first is parked behind it, and woken by its end."""
    from conductor.webhooks.deliver import _Answer, _settle

    capped = settings.model_copy(update={"webhook_tenant_max_in_flight": 1})
    tenant = f"hooks-line-{uuid.uuid4().hex[:8]}"
    url = receiver.on("/line", 200)
    first, older = (ended_job_delivery(capped, url, tenant=tenant) for _ in range(2))
    with session_scope() as s:
        in_flight = store.claim_delivery(s, delivery_id=first, lease_s=300, tenant_max_in_flight=1)
    assert isinstance(in_flight, WebhookDelivery)
    assert deliver(older, settings=capped, render=job_payload).retry_in is not None  # parked
    newer = ended_job_delivery(capped, url, tenant=tenant)
    ended = _settle(in_flight, utcnow(), _Answer(200, None, None), capped)  # the attempt in flight ends
    assert ended.wake == older

    put_off = deliver(newer, settings=capped, render=job_payload)  # the newer one's message comes first
    waiting, attempts = row(newer)
    # before: the newer one took the place, and the older one, woken, was parked again behind it
    assert put_off.retry_in is not None and attempts == [] and waiting.parked_at is not None
    done = deliver(older, settings=capped, render=job_payload)
    assert row(older)[0].status == DeliveryStatus.DELIVERED and done.wake == newer
    assert deliver(newer, settings=capped, render=job_payload).wake is None
    assert row(newer)[0].status == DeliveryStatus.DELIVERED
    assert [r.headers["webhook-id"] for r in receiver.at("/line")] == [older, newer]


def test_a_retry_scheduled_for_a_parked_delivery_leaves_the_line(settings: Settings, receiver: Receiver) -> None:
    """An attempt that outlived its lease, re-sent and parked meanwhile, then ends asking for a retry in an
    hour: the delivery leaves the line (its retry is due in an hour), so no wake sends it before then."""
    from conductor.webhooks.deliver import _Answer, _settle

    capped = settings.model_copy(update={"webhook_tenant_max_in_flight": 1, "webhook_backoff_s": [0.0]})
    tenant = f"hooks-retry-line-{uuid.uuid4().hex[:8]}"
    late, other = (ended_job_delivery(capped, receiver.on("/retry-line", 200), tenant=tenant) for _ in range(2))
    with session_scope() as s:
        slow_attempt = store.claim_delivery(s, delivery_id=late, lease_s=0, tenant_max_in_flight=1)  # lease over
    with session_scope() as s:
        place_taker = store.claim_delivery(s, delivery_id=other, lease_s=300, tenant_max_in_flight=1)
    assert isinstance(slow_attempt, WebhookDelivery) and isinstance(place_taker, WebhookDelivery)
    assert deliver(late, settings=capped, render=job_payload).retry_in is not None  # re-sent: parked
    assert row(late)[0].parked_at is not None and row(late)[0].attempts == 1
    _settle(slow_attempt, utcnow(), _Answer(503, 3600.0, "HTTP 503"), capped)  # Retry-After: an hour
    retrying = row(late)[0]
    assert retrying.parked_at is None and retrying.next_attempt_at > utcnow() + timedelta(minutes=59)
    assert _settle(place_taker, utcnow(), _Answer(200, None, None), capped).wake is None  # before: woke it

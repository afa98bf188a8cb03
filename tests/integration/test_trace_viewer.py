"""The trace viewer in a real browser (Debian's headless Chromium driven by Playwright) against the API
and a Celery worker: sign in, open a finished diamond job, see 4 steps and 4 edges, the messages each
worker saw, and user text shown as text, never run as markup."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import BrowserContext, Page, sync_playwright
from sqlmodel import select

from conductor.store.db import session_scope
from conductor.store.jobs import get_attempts, get_steps
from conductor.store.keys import delete_expired_sessions, revoke_key
from conductor.store.models import ApiKey, UiSession, utcnow
from tests.integration.conftest import new_key
from tests.integration.harness import LOGS, start_api, wait_terminal

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
XSS_TASK = 'Compare <script>window.__xss = "task"</script> and <img src=x onerror="window.__xss=\'img\'"> safely'
DIAMOND = {"model_ids": ["a", "b", "c", "d"],
           "subtasks": ["root", "left </pre><script>window.__xss='step'</script>", "right", "join"],
           "access_lists": [[], [0], [0], [1, 2]]}
SCREENSHOT = LOGS / "trace-viewer.png"  # the top of the page; docs/img/trace-viewer.png is a copy
FULL_PAGE = LOGS / "trace-viewer-full.png"


@pytest.fixture(scope="module")
def browser() -> Iterator[BrowserContext]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/ensure-tools.sh (make test does) to install Debian's chromium")
    profile = tempfile.mkdtemp(prefix="conductor-chromium-")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1100, "height": 900})
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def diamond(client: httpx.Client) -> str:
    created = client.post("/v1/jobs", json={"task": XSS_TASK, "workflow": DIAMOND})
    assert created.status_code == 202, created.text
    assert created.json()["links"]["trace"] == f"/ui/jobs/{created.json()['id']}"  # where the viewer shows it
    job = wait_terminal(client, created.json()["id"])
    assert job["status"] == "succeeded", job
    return str(job["id"])


def sign_in(page: Page, api: str, target: str, key: str) -> None:
    page.goto(f"{api}{target}")
    assert page.locator("form.login").count() == 1  # not signed in: the login form, for this page
    page.fill("input[name=key]", key)
    page.click("form.login button[type=submit]")
    page.wait_for_url(f"{api}{target}")


def test_the_viewer_draws_a_finished_diamond_job(browser: BrowserContext, api: str, diamond: str) -> None:
    page = browser.new_page()
    sign_in(page, api, f"/ui/jobs/{diamond}", new_key("tenant-a"))

    graph = page.locator(f'svg.graph[data-job-id="{diamond}"]')
    assert graph.locator("g.node").count() == 4
    assert graph.locator("path.edge").count() == 4
    edges = {(int(e.get_attribute("data-from") or -1), int(e.get_attribute("data-to") or -1))
             for e in graph.locator("path.edge").all()}
    assert edges == {(0, 1), (0, 2), (1, 3), (2, 3)}
    assert all(box is not None and box["width"] > 0 for box in
               (e.bounding_box() for e in graph.locator("path.edge").all()))  # drawn, not just present
    assert page.locator("svg.timeline rect.bar.attempt").count() == 4

    with session_scope() as s:
        steps = get_steps(s, job_id=diamond)
    cards = page.locator("article.step")
    assert cards.count() == 4
    for st, card in zip(steps, cards.all(), strict=True):
        # agent d reports a cache read and a write
        details = f"{st.cached_input_tokens} cached, {st.cache_write_tokens} written to cache"
        cached = f" ({details})" if st.cached_input_tokens else ""
        assert card.locator("dd.tokens").inner_text() == f"{st.input_tokens} in{cached} / {st.output_tokens} out"
        assert card.locator("dd.cost").inner_text() == f"${st.cost_usd:.6f}"
        shown = [m.text_content() for m in card.locator(".message pre").all()]
        assert shown == [m["content"] for m in st.messages or []]  # exactly what the worker saw
    assert [(st.cached_input_tokens, st.cache_write_tokens) for st in steps] == [(0, 0), (0, 0), (0, 0), (4, 2)]

    assert page.evaluate("window.__xss") is None  # no injected script or handler ran
    assert page.locator("pre.task").inner_text() == XSS_TASK
    LOGS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT))
    page.screenshot(path=str(FULL_PAGE), full_page=True)
    assert SCREENSHOT.stat().st_size > 10_000

    page.goto(f"{api}/ui/jobs?status=succeeded")
    assert page.locator(f'a[href="/ui/jobs/{diamond}"]').count() == 1
    page.goto(f"{api}/ui/jobs?status=failed")
    assert page.locator(f'a[href="/ui/jobs/{diamond}"]').count() == 0
    page.close()


def test_viewer_auth_and_tenancy_over_http(api: str, diamond: str) -> None:
    key = new_key("tenant-a")
    html = {"Accept": "text/html"}
    with httpx.Client(base_url=api, timeout=30) as http:
        anonymous = http.get(f"/ui/jobs/{diamond}", headers=html)
        assert anonymous.status_code == 401 and 'name="next" value="/ui/jobs/' in anonymous.text
        assert http.get(f"/ui/jobs/{diamond}").headers["content-type"] == "application/problem+json"

        bearer = http.get(f"/ui/jobs/{diamond}", headers={"Authorization": f"Bearer {key}"})
        assert bearer.status_code == 200 and "default-src 'none'" in bearer.headers["content-security-policy"]
        assert "<script" not in bearer.text and "&lt;script&gt;" in bearer.text
        with session_scope() as s:  # which host ran an attempt is the operator's, not the tenant's
            steps = get_steps(s, job_id=diamond)
            workers = {a.worker for a in get_attempts(s, step_ids=[st.id for st in steps if st.id is not None])}
        assert workers and None not in workers and not any(w in bearer.text for w in workers if w), workers
        other = http.get(f"/ui/jobs/{diamond}", headers={"Authorization": f"Bearer {new_key('tenant-z')}"})
        assert other.status_code == 404  # another tenant's job does not exist for them

        bad = http.post("/ui/login", data={"key": "cq_wrong", "next": "/ui/jobs"})
        assert bad.status_code == 401 and "set-cookie" not in bad.headers
        good = http.post("/ui/login", data={"key": key, "next": "//evil.example/ui/"}, follow_redirects=False)
        assert good.status_code == 303 and good.headers["location"] == "/ui/jobs"  # no open redirect
        cookie = good.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/ui" in cookie
        token = http.cookies["conductor_session"]
        # The cookie that held the key itself before sessions is cleared.
        assert any(c.startswith("conductor_key=") and "max-age=0" in c.lower()
                   for c in good.headers.get_list("set-cookie"))
        assert key not in good.headers["set-cookie"] and token.startswith("cqs_")  # a session, not the key
        signed_in = http.get(f"/ui/jobs/{diamond}", headers=html)
        assert signed_in.status_code == 200 and "action=\"/ui/login\"" not in signed_in.text
        assert http.get("/v1/jobs", headers={"Authorization": f"Bearer {token}"}).status_code == 401  # not a key

    def with_cookie(value: str) -> httpx.Response:
        with httpx.Client(base_url=api, timeout=30, cookies={"conductor_session": value}) as browser:
            return browser.get(f"/ui/jobs/{diamond}", headers=html)

    with session_scope() as s:  # the table holds no token: only keyed hashes of them
        stored = s.exec(select(UiSession).where(UiSession.tenant == "tenant-a")).all()
    assert stored and all(token not in (row.token_hash, row.key_id) for row in stored)
    for value in [token[:-1] + ("A" if token[-1] != "A" else "B"), stored[0].token_hash, key, "x" * 300]:
        page = with_cookie(value)
        assert page.status_code == 401 and 'action="/ui/login"' in page.text, value
    assert with_cookie(token).status_code == 200

    with httpx.Client(base_url=api, timeout=30) as http:  # logging out ends the session, not just the cookie
        http.post("/ui/login", data={"key": key, "next": "/ui/jobs"})
        copied = http.cookies["conductor_session"]
        assert copied != token and with_cookie(copied).status_code == 200
        # another site's form posts (a browser says where they come from) neither sign in nor out
        for where in ({"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
                      {"Origin": "https://evil.example"}, {"Origin": "null"}):
            forged = http.post("/ui/logout", headers=where, follow_redirects=False)
            assert forged.status_code == 403 and "another site" in forged.text, where
            assert with_cookie(copied).status_code == 200  # still signed in
            with httpx.Client(base_url=api, timeout=30) as victim:
                planted = victim.post("/ui/login", data={"key": key}, headers=where, follow_redirects=False)
                assert planted.status_code == 403 and "set-cookie" not in planted.headers, where
        same = {"Sec-Fetch-Site": "same-origin", "Origin": api}
        assert http.post("/ui/login", data={"key": key}, headers=same, follow_redirects=False).status_code == 303
        second = http.cookies["conductor_session"]
        assert with_cookie(second).status_code == 200
        assert with_cookie(copied).status_code == 401  # signing in again ended the session it replaced
        assert http.post("/ui/logout", headers={"Origin": api}, follow_redirects=False).status_code == 303
        assert with_cookie(second).status_code == 401
        http.post("/ui/login", data={"key": key, "next": "/ui/jobs"})
        copied = http.cookies["conductor_session"]
        http.post("/ui/logout")
        assert with_cookie(copied).status_code == 401 and with_cookie(token).status_code == 200
    with session_scope() as s:  # revoking the key ends its browser sessions
        assert revoke_key(s, prefix=key[:10]) == 1
    assert with_cookie(token).status_code == 401
    with session_scope() as s:
        key_id = s.exec(select(ApiKey.id).where(ApiKey.prefix == key[:10])).one()
        assert s.exec(select(UiSession).where(UiSession.key_id == key_id)).all() == []


def test_a_session_cookie_sent_twice_signs_no_one_in(api: str, diamond: str) -> None:
    """A sibling subdomain's site can set ``conductor_session`` for the parent domain (Path=/); the browser
    then sends it after the viewer's own (Path=/ui), and the last one used to win: the viewer showed the
    planting site's tenant. Sent twice, the cookie signs no one in, and the login page says why."""
    mine, planted = (_session_cookie(api, new_key(tenant), {}).split(";")[0].split("=", 1)[1]
                     for tenant in ("tenant-a", "tenant-planted"))
    html = {"Accept": "text/html"}
    with httpx.Client(base_url=api, timeout=30) as browser:
        alone = browser.get(f"/ui/jobs/{diamond}", headers={**html, "Cookie": f"conductor_session={mine}"})
        assert alone.status_code == 200
        both = browser.get("/ui/jobs", headers={**html, "Cookie": f"conductor_session={mine}; "
                                                                  f"conductor_session={planted}"})
        assert both.status_code == 401 and 'action="/ui/login"' in both.text  # before: tenant-planted's jobs
        assert "two session cookies" in both.text
        spaced = browser.get("/ui/jobs", headers={**html, "Cookie": f"conductor_session={mine}; "
                                                                    f"conductor_session ={planted}"})
        assert spaced.status_code == 401  # read as Starlette reads names (stripped): twice still
        logout = browser.post("/ui/logout", follow_redirects=False, headers={
            "Origin": api, "Cookie": f"conductor_session={mine}; conductor_session={planted}"})
        assert logout.status_code == 303  # both sessions ended (ending one needs its token, nothing more)
        for token in (mine, planted):
            page = browser.get("/ui/jobs", headers={**html, "Cookie": f"conductor_session={token}"})
            assert page.status_code == 401, token  # before: the user's own stayed valid for its 8 hours


def test_over_https_the_session_cookie_cannot_be_planted(api: str) -> None:
    """Over https the viewer reads only ``__Host-conductor_session``, which browsers let no other site set:
    a plain ``conductor_session`` planted for the parent domain, even alone (the viewer's own cookie gone,
    after a logout), signs no one in (before: the planting site's tenant)."""
    proxied = {"X-Forwarded-Proto": "https"}  # from loopback, which uvicorn trusts with it by default
    html = {"Accept": "text/html", **proxied}
    planted = _session_cookie(api, new_key("tenant-planted"), {}).split(";")[0].split("=", 1)[1]  # over http
    mine = _session_cookie(api, new_key("tenant-a"), proxied).split(";")[0].split("=", 1)[1]
    with httpx.Client(base_url=api, timeout=30) as browser:
        alone = browser.get("/ui/jobs", headers={**html, "Cookie": f"conductor_session={planted}"})
        assert alone.status_code == 401 and 'action="/ui/login"' in alone.text
        own = browser.get("/ui/jobs", headers={**html, "Cookie": f"__Host-conductor_session={mine}; "
                                                                 f"conductor_session={planted}"})
        assert own.status_code == 200 and "tenant-a" in own.text


def _session_cookie(api: str, key: str, headers: dict[str, str]) -> str:
    with httpx.Client(base_url=api, timeout=30) as http:
        signed_in = http.post("/ui/login", data={"key": key}, headers=headers, follow_redirects=False)
    assert signed_in.status_code == 303, signed_in.text
    return next(c for c in signed_in.headers.get_list("set-cookie")
                if c.startswith(("conductor_session=", "__Host-conductor_session=")) and "max-age=0" not in c.lower())


def test_the_session_cookie_is_secure_behind_an_https_proxy_the_api_does_not_trust(
        proc_env: dict[str, str], api: str) -> None:
    key = new_key("tenant-a")
    proxied = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.7"}
    # By default Secure follows the scheme: plain http without it, https through a proxy on loopback (the
    # one address uvicorn trusts with X-Forwarded-Proto by default) with it.
    plain = _session_cookie(api, key, {})
    assert "secure" not in plain.lower() and plain.startswith("conductor_session=") and "path=/ui" in plain.lower()
    over_https = _session_cookie(api, key, proxied)
    # over https no other site can set it: the __Host- prefix (Secure, host-only, Path=/), not /ui
    assert "; secure" in over_https.lower() and over_https.startswith("__Host-conductor_session=")
    assert "path=/;" in over_https.lower() and "domain" not in over_https.lower()
    # A proxy elsewhere (docker-compose's published port is reached from the Docker network) is not trusted:
    # the scheme stays http, and the cookie went to browsers on https without Secure. The setting says so.
    env = {**proc_env, "FORWARDED_ALLOW_IPS": "192.0.2.1", "CONDUCTOR_UI_COOKIE_SECURE": "true"}
    proc, behind_proxy = start_api(env)
    try:
        assert "; secure" in _session_cookie(behind_proxy, key, proxied).lower()
        on_loopback = _session_cookie(behind_proxy, key, {})
        # plain http to 127.0.0.1 (an SSH tunnel, say): Chrome keeps a Secure cookie there but refuses a
        # __Host- one, so the plain name, Secure; and it signs the browser in (before: never, in Chrome)
        assert on_loopback.startswith("conductor_session=") and "; secure" in on_loopback.lower()
        token = on_loopback.split(";")[0].split("=", 1)[1]
        page = httpx.get(f"{behind_proxy}/ui/jobs", headers={"Accept": "text/html",
                                                             "Cookie": f"conductor_session={token}"})
        assert page.status_code == 200 and 'action="/ui/login"' not in page.text
    finally:
        proc.stop()


def test_expired_viewer_sessions_are_deleted_and_live_ones_kept_on_postgres(api: str) -> None:
    key = new_key("tenant-expiring")
    with httpx.Client(base_url=api, timeout=30) as http, httpx.Client(base_url=api, timeout=30) as other_browser:
        http.post("/ui/login", data={"key": key, "next": "/ui/jobs"})
        live = http.cookies["conductor_session"]
        other_browser.post("/ui/login", data={"key": key, "next": "/ui/jobs"})  # a second browser: its own
    with session_scope() as s:
        key_id = s.exec(select(ApiKey.id).where(ApiKey.prefix == key[:10])).one()
        rows = s.exec(select(UiSession).where(UiSession.key_id == key_id)).all()
        assert len(rows) == 2
        stale = max(rows, key=lambda row: row.created_at)  # the second sign-in's; `live` is the first's
        stale.expires_at = utcnow() - timedelta(seconds=1)
        s.add(stale)
        stale_hash = stale.token_hash
    with session_scope() as s:
        assert delete_expired_sessions(s) >= 1
    with session_scope() as s:
        left = s.exec(select(UiSession.token_hash).where(UiSession.key_id == key_id)).all()
    assert len(left) == 1 and left[0] != stale_hash
    with httpx.Client(base_url=api, timeout=30, cookies={"conductor_session": live}) as browser:
        page = browser.get("/ui/jobs", headers={"Accept": "text/html"})  # its own (empty) list: signed in
        assert page.status_code == 200 and 'action="/ui/login"' not in page.text


def test_a_recursive_step_shows_its_child_job_nested(client: httpx.Client, api: str) -> None:
    created = client.post("/v1/jobs", json={"task": "recurse", "planner": "template:single", "workflow": {
        "model_ids": ["a", "conductor"], "subtasks": ["look", "dig deeper"], "access_lists": [[], [0]]}})
    job = wait_terminal(client, created.json()["id"])
    assert job["status"] == "succeeded", job
    child_id = client.get(f"/v1/jobs/{job['id']}/steps").json()["data"][1]["child_job_id"]
    page = client.get(f"/ui/jobs/{job['id']}").text

    assert page.count('<section class="job depth-0"') == 1 and page.count('<section class="job depth-1"') == 1
    nested = page[page.index('<div class="child">'):]
    assert f'data-job-id="{child_id}"' in nested  # the child's own graph, inside the recursive step
    assert page.count('<svg class="graph"') == 2

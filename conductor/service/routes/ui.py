"""The trace viewer: server-rendered HTML and SVG, no scripts.

``/ui/jobs`` lists the tenant's jobs (with status filters); ``/ui/jobs/{id}`` shows one: the workflow
as a graph, a timeline of steps and attempts, tokens and cost per step, the exact messages each worker
saw, and recursive steps' child jobs nested. Same auth as the API: an ``Authorization: Bearer`` header,
or for a browser the key posted once to ``/ui/login`` (a form post, so the key never appears in a URL or
an access log), which sets an HttpOnly, SameSite=Strict cookie holding a session token (random; only its
keyed hash is stored, in ``ui_session``; not the key, which would also open the API): over https
``__Host-conductor_session`` (Secure, host-only, Path=/: no other site can set it), over plain http
``conductor_session`` scoped to ``/ui``.
A session ends after ``COOKIE_MAX_AGE_S``, at logout, when its browser signs in again, or when its key is
revoked. Every value from
a user or a model is escaped by the templates (Jinja autoescape) and the pages forbid scripts (CSP).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Form, Header, Query, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from sqlmodel import Session

from conductor.quotas import QuotaExceeded, check_failed_lookup
from conductor.service.deps import JOB_ID_RE, SessionDep, SettingsDep, resolve_tenant
from conductor.service.problems import Problem, problem_response, problems
from conductor.service.trace_page import job_section
from conductor.settings import Settings
from conductor.store import jobs as store
from conductor.store.keys import create_session, end_session, tenant_for_session
from conductor.store.models import JobStatus, utcnow

router = APIRouter(prefix="/ui", include_in_schema=True, tags=["ui"])
TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
COOKIE = "conductor_session"
"""The session cookie over plain http (Path=/ui)."""
SECURE_COOKIE = "__Host-conductor_session"
"""The session cookie when it is ``Secure`` (over https): the ``__Host-`` prefix makes browsers refuse it
unless it is Secure, host-only and Path=/, so no other site, a sibling subdomain's included, can set it."""
OLD_COOKIE = "conductor_key"
"""Held the API key itself before sessions: cleared at login and logout."""
COOKIE_MAX_AGE_S = 8 * 3600
MAX_KEY_CHARS = 256
MAX_NEXT_CHARS = 2048
MAX_LIST_LIMIT = 200
CSP = ("default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
       "frame-ancestors 'none'; base-uri 'none'")


def _responses(*statuses: int, ok: int = 200) -> dict[int | str, dict[str, Any]]:
    """OpenAPI: an HTML page, and for each error status problem+json or (for a browser) an HTML page."""
    out = problems(*statuses)
    for status in statuses:
        out[status]["content"] = {**out[status]["content"], "text/html": {}}
    out[ok] = {"content": {"text/html": {}}, "description": "an HTML page"}
    return out


_env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=True, undefined=StrictUndefined)


def _page(template: str, http_status: int = 200, **context: object) -> HTMLResponse:
    body = _env.get_template(template).render(tenant=context.pop("tenant", None), **context)
    return HTMLResponse(body, status_code=http_status, headers=_SECURITY_HEADERS)


_SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",  # pages hold a tenant's prompts and answers
}


def _wants_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "")


def _error(request: Request, status: int, title: str, detail: str, tenant: str | None) -> Response:
    """An HTML page for a browser; problem+json (RFC 9457) for any other client."""
    if _wants_html(request):
        return _page("error.html", status, title=title, detail=detail, tenant=tenant)
    return problem_response(status, title, detail)


def _tenant(request: Request, session: Session, settings: Settings, authorization: str | None) -> str | None:
    """The caller's tenant from the Authorization header, else from the login cookie; None when the
    caller sent neither. A header with a bad key is a 401 problem, as on the API."""
    if authorization:
        return resolve_tenant(session, settings, authorization)
    if not settings.auth_required:
        return resolve_tenant(session, settings, None)
    token = _session_token(request, settings)
    if token is None:
        return None
    return tenant_for_session(session, token=token, pepper=settings.api_key_pepper)  # None: sign in again


def _cookie_name(request: Request, settings: Settings) -> str:
    """``SECURE_COOKIE`` where the cookie is Secure, else ``COOKIE``; a plain one sent over https (set by
    another site for a parent domain, or left from before) is not read there. Except on plain http to a
    loopback host (an SSH tunnel with ``CONDUCTOR_UI_COOKIE_SECURE=true``): Chrome keeps a Secure cookie
    there but refuses a ``__Host-`` one, so the user could never stay signed in; no other site can set a
    cookie for a loopback host."""
    if not _secure_cookie(request, settings):
        return COOKIE
    host = (request.url.hostname or "").lower()
    loopback = host in ("localhost", "127.0.0.1", "::1", "[::1]") or host.endswith(".localhost")
    return COOKIE if request.url.scheme == "http" and loopback else SECURE_COOKIE


def _session_tokens(request: Request, settings: Settings) -> list[str]:
    """Every value of the session cookie the request sent (the name is what comes before the first ``=``,
    spaces and tabs around it ignored, as browsers and Starlette do), each at most ``MAX_KEY_CHARS``."""
    name = _cookie_name(request, settings)
    values = []
    for part in request.headers.get("cookie", "").split(";"):
        key, eq, value = part.partition("=")
        # spaces and tabs only: a name behind another character (a control character, which str.strip
        # also removes) is another name to a browser, one a sibling subdomain could set
        if eq and key.strip(" \t") == name:
            values.append(value.strip(" \t"))
    return [v for v in values if v and len(v) <= MAX_KEY_CHARS]


def _session_token(request: Request, settings: Settings) -> str | None:
    """The session cookie's token; None when there is none, it is too long, or the cookie was sent twice.
    Twice: one was set by another site for a parent domain (``Domain=.example.com``, from a sibling
    subdomain: possible over plain http, where the cookie cannot carry the ``__Host-`` prefix), and of two
    the last wins (Starlette), which the browser sends when its path is shorter: the viewer would show the
    planting site's tenant, a sign-in by another door. Refused rather than guessed."""
    tokens = _session_tokens(request, settings)
    return tokens[0] if len(tokens) == 1 else None


def _to_login(request: Request, settings: Settings) -> Response:
    if not _wants_html(request):
        raise Problem(401, "Unauthorized", "send 'Authorization: Bearer <key>', or sign in at /ui/login",
                      headers={"WWW-Authenticate": "Bearer"})
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    error = TWO_COOKIES if len(_session_tokens(request, settings)) > 1 else None
    login = _page("login.html", 401, next=_safe_next(target), error=error, max_key=MAX_KEY_CHARS)
    return login


def _safe_next(target: str) -> str:
    """Only a path inside the viewer: never an absolute or protocol-relative URL (open redirect)."""
    return target if target.startswith("/ui/") and not target.startswith("//") and "\\" not in target else "/ui/jobs"


def _secure_cookie(request: Request, settings: Settings) -> bool:
    """``CONDUCTOR_UI_COOKIE_SECURE`` when set, else whether the request came over https (as uvicorn
    sees it: ``X-Forwarded-Proto`` counts only from ``FORWARDED_ALLOW_IPS``)."""
    if settings.ui_cookie_secure is not None:
        return settings.ui_cookie_secure
    return request.url.scheme == "https"


AuthHeader = Annotated[str | None, Header(include_in_schema=False)]
CROSS_SITE = "Refused: the form was sent from another site. Sign in from this page."
TWO_COOKIES = ("Refused: your browser sent two session cookies, one of them set by another site of a parent "
               "domain. Clear this site's cookies (and that domain's), then sign in.")


def _cross_site(request: Request) -> bool:
    """A browser's form post from another site (signing a victim in to the sender's tenant, or out):
    ``Sec-Fetch-Site`` where the browser sends it, else ``Origin`` against ``Host``. A request with neither
    header is not a browser's cross-site post (every browser sends one of them with a form POST)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site not in ("same-origin", "none")
    origin = request.headers.get("origin")
    return origin is not None and urlsplit(origin).netloc != request.headers.get("host")


@router.get("", include_in_schema=False)
def ui_root() -> RedirectResponse:
    return RedirectResponse("/ui/jobs", status_code=303)


@router.get("/viewer.css", include_in_schema=False)
def stylesheet() -> Response:
    return Response((TEMPLATES / "viewer.css").read_bytes(), media_type="text/css",
                    headers={"Cache-Control": "max-age=300", "X-Content-Type-Options": "nosniff"})


@router.get("/login", response_class=HTMLResponse, responses=_responses(422))
def login_form(next: Annotated[str, Query(max_length=MAX_NEXT_CHARS)] = "/ui/jobs") -> HTMLResponse:
    return _page("login.html", next=_safe_next(next), error=None, max_key=MAX_KEY_CHARS)


@router.post("/login", response_class=HTMLResponse,
             responses={**_responses(401, 403, 413, 422, 429), 303: {"description": "signed in"}})
def login(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    key: Annotated[str, Form()] = "",
    next: Annotated[str, Form(max_length=MAX_NEXT_CHARS)] = "/ui/jobs",
) -> Response:
    """The key's length is checked here, not by the form's validation, whose refusal is a problem+json
    document: a person who pasted something else gets the form again, saying what a key is."""
    if _cross_site(request):
        return _page("login.html", 403, next="/ui/jobs", error=CROSS_SITE, max_key=MAX_KEY_CHARS)
    if not key.strip() or len(key) > MAX_KEY_CHARS:
        return _page("login.html", 422, next=_safe_next(next), max_key=MAX_KEY_CHARS, error=(
            f"That is not an API key: a key is at most {MAX_KEY_CHARS} characters (conductor keys create "
            "--tenant NAME prints one, starting cq_)." if key.strip() else "Paste an API key to sign in."))
    if not settings.auth_required:  # every caller is the default tenant: nothing to remember
        return RedirectResponse(_safe_next(next), status_code=303)
    signed_in = create_session(session, key=key.strip(), pepper=settings.api_key_pepper, ttl_s=COOKIE_MAX_AGE_S)
    if signed_in is not None:  # the browser's earlier session ends with its cookie (each, if it sent two)
        for replaced in _session_tokens(request, settings):
            end_session(session, token=replaced, pepper=settings.api_key_pepper)
    session.commit()
    if signed_in is None:  # a failed lookup like the API's, counted against the address
        try:
            check_failed_lookup(request.client.host if request.client else "unknown", settings)
        except QuotaExceeded as over:
            refused = _page("login.html", 429, next=_safe_next(next), max_key=MAX_KEY_CHARS,
                            error=f"Unknown or revoked API key, and too many from here: try again in "
                                  f"{over.retry_after} s.")
            refused.headers["Retry-After"] = over.retry_after
            return refused
        return _page("login.html", 401, next=_safe_next(next), error="Unknown or revoked API key.",
                     max_key=MAX_KEY_CHARS)
    response = RedirectResponse(_safe_next(next), status_code=303)
    if _cookie_name(request, settings) == SECURE_COOKIE:  # host-only, Path=/ as the prefix requires
        response.set_cookie(SECURE_COOKIE, signed_in[1], max_age=COOKIE_MAX_AGE_S, path="/", httponly=True,
                            samesite="strict", secure=True)
        response.delete_cookie(COOKIE, path="/ui")  # one set before, over https without the prefix
    else:
        response.set_cookie(COOKIE, signed_in[1], max_age=COOKIE_MAX_AGE_S, path="/ui", httponly=True,
                            samesite="strict", secure=_secure_cookie(request, settings))
    response.delete_cookie(OLD_COOKIE, path="/ui")
    return response


@router.post("/logout", response_class=RedirectResponse,
             responses={**{k: v for k, v in _responses(403).items() if k != 200}, 303: {"description": "signed out"}})
def logout(request: Request, session: SessionDep, settings: SettingsDep) -> Response:
    if _cross_site(request):
        return _page("login.html", 403, next="/ui/jobs", error=CROSS_SITE, max_key=MAX_KEY_CHARS)
    tokens = _session_tokens(request, settings)  # each, if two were sent: ending one needs its token only
    for token in tokens:
        end_session(session, token=token, pepper=settings.api_key_pepper)  # the token stops working, copies too
    session.commit()
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui")
    if _cookie_name(request, settings) == SECURE_COOKIE:
        response.delete_cookie(SECURE_COOKIE, path="/", secure=True, httponly=True, samesite="strict")
    response.delete_cookie(OLD_COOKIE, path="/ui")
    return response


@router.get("/jobs", response_class=HTMLResponse, responses=_responses(401, 422, 503))
def jobs_page(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    status: Annotated[JobStatus | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 100,
    authorization: AuthHeader = None,
) -> Response:
    tenant = _tenant(request, session, settings, authorization)
    if tenant is None:
        return _to_login(request, settings)
    jobs = store.list_jobs(session, tenant=tenant, where=store.JobFilter(statuses=(status,) if status else ()),
                           limit=limit)
    return _page("jobs.html", jobs=jobs, status=status.value if status else None,
                 statuses=[s.value for s in JobStatus], tenant=tenant)


@router.get("/jobs/{job_id}", response_class=HTMLResponse, responses=_responses(401, 404, 503))
def job_page(
    job_id: str,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    authorization: AuthHeader = None,
) -> Response:
    tenant = _tenant(request, session, settings, authorization)
    if tenant is None:
        return _to_login(request, settings)
    job = store.get_job(session, job_id=job_id, tenant=tenant) if JOB_ID_RE.fullmatch(job_id) else None
    if job is None:
        shown = job_id if JOB_ID_RE.fullmatch(job_id) else "(malformed id)"
        return _error(request, 404, "Job not found", f"no job {shown} for this API key", tenant)
    return _page("job.html", section=job_section(session, job, now=utcnow()), tenant=tenant)

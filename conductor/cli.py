"""The ``conductor`` command line. Exit 0 on success; otherwise a one-line reason on stderr."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC
from pathlib import Path
from typing import Any

from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError

from conductor.planner_serve import add_arguments as add_planner_serve_arguments
from conductor.planner_serve import port
from conductor.settings import get_settings
from conductor.statuses import JobStatus

TERMINAL = JobStatus.TERMINAL


class CliError(Exception):
    """A failure the user can act on; printed as one line, exit code 1."""


def main(argv: Sequence[str] | None = None) -> int:
    from pydantic import ValidationError

    try:
        return _main(argv)
    except ValidationError as exc:
        if exc.title != "Settings" or os.environ.get("CONDUCTOR_DEBUG"):
            raise
        print(f"conductor: {settings_problem(exc)}", file=sys.stderr)
        return 1


def settings_problem(exc: Any) -> str:
    """A settings ``ValidationError`` as one line naming each variable (values are never echoed)."""
    problems = []
    for error in exc.errors():
        name = "CONDUCTOR_" + "_".join(str(part) for part in error["loc"]).upper() if error["loc"] else "settings"
        problems.append(f"{name}: {error['msg']}")
    return ("invalid setting: " + "; ".join(problems)
            + " (fix the environment or .env; conductor/settings.py lists each setting and its bounds)")


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        print("conductor: no command given; pick one of the commands above (conductor COMMAND --help)",
              file=sys.stderr)
        return 2
    try:
        return handler(args)
    except CliError as exc:
        print(f"conductor: {exc}", file=sys.stderr)
        return 1
    except DBAPIError as exc:
        if os.environ.get("CONDUCTOR_DEBUG"):
            raise
        print(f"conductor: {_database_problem(exc)} (CONDUCTOR_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
    except (ArgumentError, NoSuchModuleError) as exc:
        if os.environ.get("CONDUCTOR_DEBUG") or not _is_url_problem(exc):
            raise
        print(f"conductor: CONDUCTOR_DATABASE_URL is not a URL the store can use ({exc}); use "
              "postgresql+psycopg://USER@HOST:5432/DB or sqlite:///PATH", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("conductor: interrupted", file=sys.stderr)
        return 130


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


MAX_KEEP_PREVIOUS_HOURS = 720
DEFAULT_KEEP_PREVIOUS_HOURS = 24.0


def keep_hours(text: str) -> float:
    """How long a rotated-out webhook secret keeps signing: 0 to 720 hours."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of hours") from None
    if not 0 <= value <= MAX_KEEP_PREVIOUS_HOURS:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"{value} is not between 0 and {MAX_KEEP_PREVIOUS_HOURS} hours")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conductor", description="Conductor Queue: durable multi-model workflows.")
    sub = p.add_subparsers(metavar="COMMAND")

    c = sub.add_parser("serve", help="run the REST API")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=port, default=8000)
    c.add_argument("--workers", type=int, default=1, metavar="N",
                   help="API processes (default 1); one process uses at most one core, see docs/benchmarks.md")
    c.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info)")
    c.set_defaults(handler=_serve)

    c = sub.add_parser("worker", help="run a Celery worker")
    c.add_argument("--queues", default="planner,steps,maintenance,webhooks",
                   help="comma-separated: planner, steps, maintenance (the reconciler), webhooks")
    c.add_argument("--concurrency", type=positive_int, default=16)
    c.add_argument("--pool", default=get_settings().worker_pool, choices=["threads", "prefork", "solo", "gevent"],
                   help="threads (default; CONDUCTOR_WORKER_POOL) runs any provider; gevent holds hundreds of "
                   "remote provider calls per process (e.g. --concurrency 1000), but not in-process local models")
    c.add_argument("--loglevel", default="info", type=str.lower, choices=LOG_LEVELS)
    c.add_argument("--hostname", default=None)
    c.add_argument("--no-supervise", dest="supervise", action="store_false",
                   help="run Celery in this process (default: a child process, restarted if it dies)")
    c.set_defaults(handler=_worker)

    c = sub.add_parser("beat", help="run the reconciler schedule (Celery beat)")
    c.add_argument("--loglevel", default="info", type=str.lower, choices=LOG_LEVELS)
    c.set_defaults(handler=_beat)

    c = sub.add_parser("flower", help="run Flower, the Celery monitoring UI (set FLOWER_BASIC_AUTH=user:pass)")
    c.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default: Flower can revoke tasks)")
    c.add_argument("--port", type=port, default=5555)
    c.set_defaults(handler=_flower)

    planner = sub.add_parser("planner", help="the conductor model").add_subparsers(metavar="ACTION")
    c = planner.add_parser("serve", help="serve the conductor model with vLLM (GPU node; extra 'gpu')")
    add_planner_serve_arguments(c)
    c.set_defaults(handler=_planner_serve)

    c = sub.add_parser("migrate", help="create or upgrade the database tables")
    c.set_defaults(handler=_migrate)

    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(metavar="ACTION")
    c = keys.add_parser("create", help="create an API key for a tenant (printed once, on the last line)")
    c.add_argument("--tenant", required=True)
    c.set_defaults(handler=_keys_create)
    c = keys.add_parser("list", help="list API keys (prefixes only; keys are never stored)")
    c.add_argument("--tenant")
    c.set_defaults(handler=_keys_list)
    c = keys.add_parser("revoke", help="revoke an API key by the prefix 'keys list' shows, or the whole key")
    c.add_argument("prefix")
    c.add_argument("--tenant", help="only a key of this tenant (when two keys share a prefix)")
    c.add_argument("--all", action="store_true", help="revoke every active key with this prefix")
    c.set_defaults(handler=_keys_revoke)

    hooks = sub.add_parser("webhooks", help="tenants' webhook settings").add_subparsers(metavar="ACTION")
    c = hooks.add_parser("secret", help="print a tenant's signing secret (whsec_…), creating it if it has none")
    c.add_argument("--tenant", required=True)
    c.add_argument("--rotate", action="store_true", help="replace it with a new one; the old one keeps signing "
                   "beside it for --keep-previous-hours, while receivers switch")
    c.add_argument("--keep-previous-hours", type=keep_hours, default=None, metavar="H",
                   help="with --rotate: hours the replaced secret still signs "
                   f"(default {DEFAULT_KEEP_PREVIOUS_HOURS:g}, 0 drops it at once, at most {MAX_KEEP_PREVIOUS_HOURS})")
    c.set_defaults(handler=_webhooks_secret)
    c = hooks.add_parser("reseal", help="seal every stored signing secret with the first CONDUCTOR_SECRETS_KEY "
                         "(after setting or rotating it; receivers keep their secrets)")
    c.add_argument("--tenant", help="only this tenant's secret (default: every tenant's)")
    c.set_defaults(handler=_webhooks_reseal)
    c = hooks.add_parser("url", help="show or set the webhook URL used for a tenant's jobs that name none")
    c.add_argument("--tenant", required=True)
    c.add_argument("url", nargs="?", help="the default URL (omit to show the current one)")
    c.add_argument("--clear", action="store_true", help="remove the default")
    c.set_defaults(handler=_webhooks_url)
    c = hooks.add_parser("enable", help="re-enable a URL that answered 410 Gone (disabled for the tenant)")
    c.add_argument("--tenant", required=True)
    c.add_argument("url")
    c.set_defaults(handler=_webhooks_enable)

    c = sub.add_parser("submit", help="submit a job (or a batch of them) to the API")
    c.add_argument("task", nargs="?")
    c.add_argument("--workflow", type=Path, help="JSON file with an explicit workflow")
    c.add_argument("--planner")
    c.add_argument("--pool")
    c.add_argument("--wait", action="store_true",
                   help="poll until the job ends and print the answer (with --batch: write the results file)")
    c.add_argument("--batch", type=Path, metavar="FILE.jsonl",
                   help="submit an OpenAI-style batch file instead of one task (prints the batch id)")
    c.add_argument("--endpoint", choices=["/v1/jobs", "/v1/chat/completions", "/v1/responses"],
                   help="the batch's endpoint (default: the url of the file's first request)")
    c.add_argument("--batch-id", metavar="ID", help="with --wait: wait for a batch already submitted (after a wait "
                   "was interrupted) and write its results")
    c.add_argument("--output", type=Path, help="with --batch --wait: the results file (default: FILE.results.jsonl)")
    c.set_defaults(handler=_submit)

    c = sub.add_parser("run", help="run one job here and now: one process, no services (embedded mode)")
    c.add_argument("task")
    c.add_argument("--pool", help="pool name or YAML file (default: CONDUCTOR_POOL_FILE if set, else the hosted "
                   "models whose provider keys are set, else local: a small model on this CPU)")
    c.add_argument("--planner", help="conductor (default) | an agent of the pool | template:single|fanout|pev|moa")
    c.add_argument("--data-dir", type=Path, help="where the SQLite store and log live (default: CONDUCTOR_DATA_DIR)")
    c.set_defaults(handler=_run)

    c = sub.add_parser("eval", help="score planners on a dataset: every item x planner is a job (embedded mode)")
    _eval_arguments(c)
    c.add_argument("--planners", default="conductor,fanout",
                   help="comma-separated: conductor, planner:<agent>, single:<agent>, router, moa, fanout, pev "
                   "(default: %(default)s)")
    c.add_argument("--out", type=Path, help="where to write results.jsonl, table.md, summary.json "
                   "(default: <data dir>/evals/<run id>)")
    c.add_argument("--fit-fraction", type=float, default=0.5,
                   help="with router: the share of each category's items used to fit it (default: %(default)s)")
    c.set_defaults(handler=_eval)

    c = sub.add_parser("export-rollouts", help="sample the planner N times per item, score, write GRPO JSONL")
    _eval_arguments(c)
    c.add_argument("--samples", type=int, default=4, help="workflows sampled per item (default: %(default)s)")
    c.add_argument("--temperature", type=float, default=1.0, help="the planner's temperature (default: %(default)s)")
    c.add_argument("--out", type=Path, help="the JSONL file (default: standard output)")
    c.set_defaults(handler=_export_rollouts)

    c = sub.add_parser("status", help="show a job (from the database)")
    c.add_argument("job_id")
    c.add_argument("--data-dir", type=Path, help="read the embedded store of `conductor run` in this directory")
    c.set_defaults(handler=_status)

    c = sub.add_parser("trace", help="render a job's stored trace")
    c.add_argument("job_id")
    c.add_argument("--data-dir", type=Path, help="read the embedded store of `conductor run` in this directory")
    c.add_argument("--full", action="store_true", help="do not shorten instructions and outputs")
    c.add_argument("--json", action="store_true", help="print the steps as JSON")
    c.set_defaults(handler=_trace)

    c = sub.add_parser("cancel", help="cancel a job")
    c.add_argument("job_id")
    c.set_defaults(handler=_cancel)

    c = sub.add_parser("replay", help="run a job again, reusing what did not change (through the API)")
    c.add_argument("job_id")
    c.add_argument("--from-step", type=int, metavar="N",
                   help="re-run step N and what depends on it; reuse the other outputs (default: re-run all)")
    c.add_argument("--agent", action="append", default=[], metavar="I=NAME",
                   help="run step I on agent NAME (repeatable)")
    c.add_argument("--pool", help="a pool published on the server (default: the original job's pool)")
    c.add_argument("--replan", action="store_true", help="ask the planner again instead of reusing the workflow")
    c.add_argument("--wait", action="store_true", help="poll until the job ends and print the answer")
    c.set_defaults(handler=_replay)

    c = sub.add_parser("reconcile", help="run one reconciler pass now")
    c.set_defaults(handler=_reconcile)
    return p


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    if args.workers < 1:
        print("conductor serve: --workers must be at least 1", file=sys.stderr)
        return 2
    from conductor.service.server import HEADER_BUFFER_BYTES, PROTOCOL

    uvicorn.run("conductor.service.app:create_app", factory=True, host=args.host, port=args.port,
                workers=args.workers, http=PROTOCOL, log_level=args.log_level,
                h11_max_incomplete_event_size=get_settings().max_header_bytes + HEADER_BUFFER_BYTES)
    return 0


def _worker(args: argparse.Namespace) -> int:
    from conductor.tasks.app import all_queues, app

    known = all_queues(get_settings())
    queues = [q.strip() for q in args.queues.split(",") if q.strip()]
    if "webhooks" in queues and not get_settings().secrets_key:
        from conductor.sealed import SECRETS_KEY_WARNING

        print(f"warning: {SECRETS_KEY_WARNING}", file=sys.stderr)
    unknown = set(queues) - set(known)
    if unknown or not queues:
        raise CliError(f"unknown queue(s) {', '.join(sorted(unknown))}; use {', '.join(known)} "
                       "(per-agent step queues come from CONDUCTOR_STEP_QUEUES)")
    if args.supervise:
        from conductor.tasks.supervise import supervise

        child = [sys.executable, "-m", "conductor.cli", "worker", "--no-supervise", "--queues", ",".join(queues),
                 "--concurrency", str(args.concurrency), "--pool", args.pool, "--loglevel", args.loglevel]
        if args.hostname:
            child += ["--hostname", args.hostname]
        return supervise(child)
    if args.pool == "gevent" and not _gevent_patched():
        # The standard library must be patched before anything imports it: start over in a module that
        # patches first (this process has already imported sockets and ssl).
        os.execv(sys.executable, [sys.executable, "-m", "conductor.tasks.green", *sys.argv[1:]])
    argv = ["worker", "-Q", ",".join(queues), "-P", args.pool, "-c", str(args.concurrency),
            "--loglevel", args.loglevel]
    if args.hostname:
        argv += ["-n", args.hostname]
    # app.start returns the worker's exit code (worker_main drops it): a crash must not look clean.
    code = int(app.start(argv) or 0)
    print(f"conductor worker: Celery worker stopped with code {code}", file=sys.stderr, flush=True)
    return code


def _gevent_patched() -> bool:
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("socket"))


def _beat(args: argparse.Namespace) -> int:
    from conductor.tasks.app import app

    schedule = get_settings().data_dir / "celerybeat-schedule"
    schedule.parent.mkdir(parents=True, exist_ok=True)
    app.start(["beat", "--loglevel", args.loglevel, "-s", str(schedule)])
    return 0


def _flower(args: argparse.Namespace) -> int:
    from conductor.tasks.app import app

    auth = get_settings().flower_basic_auth
    if args.host not in LOOPBACK_HOSTS and not auth:
        raise CliError(f"Flower on {args.host} would let anyone who reaches it revoke tasks: set "
                       "FLOWER_BASIC_AUTH=user:pass, or keep the default --host 127.0.0.1")
    if auth:  # Flower reads only the process environment; the check above also read .env
        os.environ["FLOWER_BASIC_AUTH"] = auth  # not an argument: other users could read it in ps
    app.start(["flower", f"--address={args.host}", f"--port={args.port}"])
    return 0


def _planner_serve(args: argparse.Namespace) -> int:
    from conductor.planner_serve import serve

    return serve(args)


def _migrate(args: argparse.Namespace) -> int:
    from conductor.migrations.lock_waits import MigrationLockTimeout
    from conductor.migrations.migrate import NewerStoreError, upgrade
    from conductor.store.db import driver_reason

    url = get_settings().database_url
    try:
        upgrade(url)
    except NewerStoreError as exc:
        raise CliError(f"the database at {_safe_url(url)} {exc}") from exc
    except MigrationLockTimeout as exc:  # a LockNotAvailable inside: not "cannot reach the database"
        raise CliError(str(exc)) from exc
    except OperationalError as exc:
        if os.environ.get("CONDUCTOR_DEBUG"):
            raise
        raise CliError(f"cannot reach the database ({driver_reason(exc)}); check CONDUCTOR_DATABASE_URL") from exc
    except DBAPIError as exc:  # not "run conductor migrate": this is it
        if os.environ.get("CONDUCTOR_DEBUG"):
            raise
        raise CliError(f"the migration failed ({driver_reason(exc)}); fix that and run it again "
                       "(CONDUCTOR_DEBUG=1 conductor migrate shows the traceback)") from exc
    print("database is at the latest revision")
    return 0


def _keys_create(args: argparse.Namespace) -> int:
    from conductor.store.db import session_scope
    from conductor.store.keys import PEPPER_WARNING, create_key

    tenant = args.tenant.strip()
    if not tenant or len(tenant) > 128:
        raise CliError("--tenant must be 1-128 characters")
    with session_scope() as s:
        row, key = create_key(s, tenant=tenant, pepper=get_settings().api_key_pepper)
    if not get_settings().api_key_pepper:
        print(f"warning: {PEPPER_WARNING}", file=sys.stderr)
    print(f"created key {row.prefix}… for tenant '{tenant}' (shown once; store it now):")
    print(key)
    return 0


def _keys_list(args: argparse.Namespace) -> int:
    from conductor.store.db import session_scope
    from conductor.store.keys import list_keys

    with session_scope() as s:
        for row in list_keys(s, tenant=args.tenant):
            state = f"revoked {row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "active"
            print(f"{row.prefix}…  tenant={row.tenant}  created {row.created_at:%Y-%m-%d %H:%M}  {state}")
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    from conductor.store.db import session_scope
    from conductor.store.keys import AmbiguousPrefix, revoke_key

    try:
        with session_scope() as s:
            count = revoke_key(s, prefix=args.prefix.rstrip("…"), tenant=args.tenant, all_matching=args.all,
                               pepper=get_settings().api_key_pepper)
    except AmbiguousPrefix as exc:
        raise CliError(f"nothing revoked: {exc}") from exc
    if count == 0:
        whose = f" of tenant '{args.tenant}'" if args.tenant else ""
        shown = args.prefix[:10]  # never echo a whole key (a secret) into a terminal's or CI's log
        hint = (" (a whole key is matched by its hash: CONDUCTOR_API_KEY_PEPPER must be the API's)"
                if len(args.prefix) > 10 else "")
        raise CliError(f"no active key{whose} matches '{shown}…'{hint}; see 'conductor keys list'")
    print(f"revoked {count} key{'s' if count != 1 else ''}")
    return 0


def _tenant_arg(args: argparse.Namespace) -> str:
    tenant = str(args.tenant).strip()
    if not tenant or len(tenant) > 128:
        raise CliError("--tenant must be 1-128 characters")
    return tenant


def _webhook_url_arg(url: str) -> str:
    from pydantic import ValidationError

    from conductor.webhooks.targets import normalize_url

    try:
        return normalize_url(url)
    except ValidationError as exc:
        raise CliError(f"not an http(s) URL: {url}") from exc


def _webhooks_secret(args: argparse.Namespace) -> int:
    from conductor.sealed import SealError
    from conductor.store import webhooks as store
    from conductor.store.db import session_scope
    from conductor.webhooks.signing import new_secret

    tenant = _tenant_arg(args)
    if args.keep_previous_hours is not None and not args.rotate:
        raise CliError("--keep-previous-hours goes with --rotate (it says how long the replaced secret signs)")
    keep_hours = DEFAULT_KEEP_PREVIOUS_HOURS if args.keep_previous_hours is None else args.keep_previous_hours
    replaced = "none"
    try:
        with session_scope() as s:
            if args.rotate:
                replaced = store.set_webhook_secret(s, tenant=tenant, secret=new_secret(),
                                                    keep_previous_s=keep_hours * 3600)
            secret = store.ensure_webhook_secret(s, tenant=tenant, new=new_secret())
            until = store.previous_secret_expires_at(s, tenant=tenant)
    except SealError as exc:
        raise CliError(str(exc)) from exc
    if not get_settings().secrets_key:
        from conductor.sealed import SECRETS_KEY_WARNING

        print(f"warning: {SECRETS_KEY_WARNING}", file=sys.stderr)
    if until is not None:  # on stderr: the last line of stdout stays the secret, for scripts
        print(f"the previous secret also signs every delivery until {until.astimezone(UTC):%Y-%m-%d %H:%M} UTC "
              "(a second signature in webhook-signature): switch receivers before then", file=sys.stderr)
    elif replaced == "unopenable":
        print("warning: the replaced secret was not kept (none of CONDUCTOR_SECRETS_KEY opens it): receivers "
              "must switch to the new one now", file=sys.stderr)
    verb = "new" if args.rotate else "current"
    print(f"{verb} webhook signing secret for tenant '{tenant}' (verify webhook-signature with it):")
    print(secret)
    return 0


def _webhooks_reseal(args: argparse.Namespace) -> int:
    from conductor.sealed import SealError
    from conductor.store import webhooks as store
    from conductor.store.db import session_scope

    if not get_settings().secrets_key:
        raise CliError("CONDUCTOR_SECRETS_KEY is not set: set the key(s) to seal with, the new one first")
    try:
        with session_scope() as s:
            result = store.reseal_secrets(s, tenant=args.tenant)
    except SealError as exc:
        raise CliError(str(exc)) from exc
    print(f"re-sealed {result.resealed} of {result.tenants} tenants' signing secrets with the first key")
    if result.unopened_previous:
        shown = ", ".join(result.unopened_previous[:10]) + (" …" if len(result.unopened_previous) > 10 else "")
        print(f"warning: {len(result.unopened_previous)} tenants' replaced secrets (still signing after a "
              f"rotation) open with none of the keys and sign nothing until the key they were sealed with is "
              f"added back: {shown}", file=sys.stderr)
    if result.unopened:
        shown = ", ".join(result.unopened[:10]) + (" …" if len(result.unopened) > 10 else "")
        raise CliError(f"{len(result.unopened)} tenants' secrets open with none of the keys (add the key they "
                       f"were sealed with, or give those tenants new secrets with --rotate): {shown}")
    return 0


def _webhooks_url(args: argparse.Namespace) -> int:
    from conductor.store import webhooks as store
    from conductor.store.db import session_scope
    from conductor.submission import MAX_URL_CHARS
    from conductor.webhooks.targets import UnsafeTarget, check_url, denied_of

    tenant = _tenant_arg(args)
    if args.url and args.clear:
        raise CliError("give a URL or --clear, not both")
    url = _webhook_url_arg(args.url) if args.url else None
    if url:
        if len(url) > MAX_URL_CHARS:
            raise CliError(f"the URL is longer than {MAX_URL_CHARS} characters")
        try:
            check_url(url, allow_loopback=get_settings().webhook_allow_loopback, denied=denied_of(get_settings()))
        except UnsafeTarget as exc:
            raise CliError(str(exc)) from exc
    with session_scope() as s:
        if url or args.clear:
            store.set_default_webhook_url(s, tenant=tenant, url=url)
        current = store.default_webhook_url(s, tenant=tenant)
    print(current or f"tenant '{tenant}' has no default webhook URL")
    return 0


def _webhooks_enable(args: argparse.Namespace) -> int:
    from conductor.store import webhooks as store
    from conductor.store.db import session_scope

    tenant = _tenant_arg(args)
    with session_scope() as s:
        was_disabled = store.enable_endpoint(s, tenant=tenant, url=_webhook_url_arg(args.url))
    if not was_disabled:
        raise CliError(f"{args.url} is not disabled for tenant '{tenant}' (give the URL exactly as jobs carry it)")
    print(f"re-enabled {args.url} for tenant '{tenant}'")
    return 0


def _client() -> Any:
    import httpx

    settings = get_settings()
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    return httpx.Client(base_url=settings.api_url, headers=headers, timeout=30)


def _api(call: Callable[[], Any]) -> Any:
    import httpx

    try:
        response = call()
    except httpx.HTTPError as exc:
        url = get_settings().api_url
        raise CliError(f"cannot reach the API at {url} ({exc}); is 'conductor serve' running there "
                       "(CONDUCTOR_API_URL)?") from exc
    if response.status_code >= 400:
        try:
            body = response.json()
            detail = body.get("detail") or body.get("title")
        except ValueError:
            detail = response.text[:200]
        if response.status_code == 401:
            detail = (f"{detail}; set CONDUCTOR_API_KEY to a key of yours "
                      "(an operator makes one: conductor keys create --tenant T)")
        raise CliError(f"API answered {response.status_code}: {detail}")
    return response.json()


def _writable_file(path: Path, option: str) -> None:
    """``path`` can be written (its folder is made if missing), or a CliError naming ``option``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"{option} {path}: cannot make its folder ({exc.strerror or exc})") from exc
    if path.is_dir() or not os.access(path if path.exists() else path.parent, os.W_OK):
        raise CliError(f"{option} {path}: cannot write there; choose another path")


def _writable_dir(path: Path, option: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"{option} {path}: cannot make this folder ({exc.strerror or exc})") from exc
    if not os.access(path, os.W_OK):
        raise CliError(f"{option} {path}: cannot write there; choose another folder")


def _submit(args: argparse.Namespace) -> int:
    if args.batch is not None or args.batch_id is not None:
        return _submit_batch(args)
    if not args.task:
        raise CliError("give a TASK, or --batch FILE.jsonl")
    body: dict[str, Any] = {"task": args.task}
    if args.workflow:
        try:
            body["workflow"] = json.loads(args.workflow.read_text())
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot read workflow file {args.workflow}: {exc}") from exc
    if args.planner:
        body["planner"] = args.planner
    if args.pool:
        body["pool"] = args.pool
    with _client() as client:
        created = _api(lambda: client.post("/v1/jobs", json=body))
        print(created["id"])
        return _wait_for_answer(client, created["id"]) if args.wait else 0


def _replay(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"replan": args.replan}
    if args.from_step is not None:
        body["from_step"] = args.from_step
    if args.pool:
        body["pool"] = args.pool
    agents: dict[str, str] = {}
    for item in args.agent:
        index, sep, name = item.partition("=")
        if not sep or not (index.strip().isascii() and index.strip().isdigit()) or not name.strip():
            raise CliError(f"--agent takes STEP_INDEX=AGENT_NAME (e.g. 2=gpt-5), not '{item}'")
        agents[str(int(index))] = name.strip()
    if agents:
        body["agents"] = agents
    with _client() as client:
        created = _api(lambda: client.post(f"/v1/jobs/{args.job_id}/replay", json=body))
        print(created["id"])
        return _wait_for_answer(client, created["id"]) if args.wait else 0


def _wait_for_answer(client: Any, job_id: str) -> int:
    """Polls until the job ends, showing each status on stderr; prints the answer, or fails."""
    last = None
    while True:
        job = _api(lambda: client.get(f"/v1/jobs/{job_id}"))
        if job["status"] != last:
            print(f"  {job['status']}", file=sys.stderr)
            last = job["status"]
        if job["status"] in TERMINAL:
            break
        time.sleep(0.5)
    if job["status"] != JobStatus.SUCCEEDED:
        raise CliError(f"job {job_id} {job['status']}: {(job.get('error') or {}).get('message')}")
    print(job["answer"])
    return 0


def _submit_batch(args: argparse.Namespace) -> int:
    from conductor import batch_submit as b

    if args.task or args.workflow or args.planner or args.pool:
        raise CliError("--batch takes no TASK, --workflow, --planner or --pool: each line carries its own")
    if args.batch_id and args.batch:
        raise CliError("--batch-id waits for a batch already submitted: give it or --batch FILE.jsonl, not both")
    if args.batch_id and not args.wait:
        raise CliError("--batch-id needs --wait (it waits for the batch and writes its results)")
    results: Path | None = None
    if args.wait:  # found unwritable now, not after the whole batch has run
        results = args.output or (args.batch.with_suffix(".results.jsonl") if args.batch
                                  else Path(f"{args.batch_id}.results.jsonl"))
        _writable_file(results, "--output")
    batch_id = args.batch_id
    try:
        with _client() as client:
            if batch_id is None:
                batch = b.submit(client, args.batch, args.endpoint or b.endpoint_of(args.batch))
                batch_id = batch["id"]
                print(batch_id, flush=True)
            if results is None:
                return 0
            batch = b.wait(client, batch_id)
            _, failed = b.write_results(client, batch, results)
    except b.BatchSubmitError as exc:
        resume = (f"; the batch goes on: conductor submit --batch-id {batch_id} --wait --output {results}"
                  if batch_id and results else "")
        raise CliError(f"{exc}{resume}") from exc
    print(results)
    usage = b.usage_line(batch)
    if usage:
        print(usage, file=sys.stderr)
    total = batch["request_counts"]["total"]
    if batch["status"] != "completed" or failed:
        raise CliError(f"batch {batch['id']} {batch['status']}: {failed} of {total} requests failed; "
                       f"results in {results}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from conductor.embedded import EmbeddedError, run

    try:
        return run(args.task, pool=args.pool, planner=args.planner, data_dir=args.data_dir)
    except EmbeddedError as exc:
        raise CliError(str(exc)) from exc


def _eval_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("dataset", help="a JSONL dataset (format: docs/eval.md), or 'shipped' for the bundled one")
    c.add_argument("--pool", help="pool name or YAML file (default as for `conductor run`)")
    c.add_argument("--data-dir", type=Path, help="the embedded store to use (default: CONDUCTOR_DATA_DIR)")
    c.add_argument("--limit", type=int, help="only the first N items")
    c.add_argument("--per-category", type=int, help="only the first N items of each category")
    c.add_argument("--categories", help="comma-separated categories to keep")
    c.add_argument("--concurrency", type=int, help="jobs in flight (default: 4; 1 for a local model)")


def _eval_options(args: argparse.Namespace, **extra: Any) -> Any:
    from conductor.evaluation.runner import EvalOptions

    for name in ("limit", "per_category", "concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CliError(f"--{name.replace('_', '-')} must be at least 1")
    categories = tuple(c.strip() for c in (args.categories or "").split(",") if c.strip())
    return EvalOptions(dataset=args.dataset, pool=args.pool, data_dir=args.data_dir, limit=args.limit,
                       per_category=args.per_category, categories=categories, concurrency=args.concurrency, **extra)


def _eval(args: argparse.Namespace) -> int:
    from conductor.evaluation.runner import EvalError, run_eval

    if not 0 < args.fit_fraction < 1:
        raise CliError("--fit-fraction must be between 0 and 1")
    if args.out is not None:  # found unwritable now, not after every job has run
        _writable_dir(args.out, "--out")
    try:
        run_eval(_eval_options(args, planners=args.planners, out=args.out, fit_fraction=args.fit_fraction))
    except EvalError as exc:
        raise CliError(str(exc)) from exc
    return 0


def _export_rollouts(args: argparse.Namespace) -> int:
    from conductor.evaluation.rollouts import export_rollouts
    from conductor.evaluation.runner import EvalError
    from conductor.pool.config import PoolError

    if not 1 <= args.samples <= 64:
        raise CliError("--samples must be 1-64")
    if not 0 <= args.temperature <= 2:
        raise CliError("--temperature must be 0-2")
    options = _eval_options(args, planners="conductor", samples=args.samples, planner_temperature=args.temperature)
    if args.out is not None:
        _writable_file(args.out, "--out")
    try:
        count = export_rollouts(options, args.out or sys.stdout, err=sys.stderr)
    except (EvalError, PoolError) as exc:
        raise CliError(str(exc)) from exc
    print(f"wrote {count} rollouts" + (f" to {args.out}" if args.out else ""), file=sys.stderr)
    return 0


def _use_data_dir(args: argparse.Namespace) -> None:
    if getattr(args, "data_dir", None) is not None:
        from conductor.embedded import EmbeddedError, open_store

        try:
            open_store(args.data_dir)
        except EmbeddedError as exc:
            raise CliError(str(exc)) from exc


def _load_job(job_id: str) -> Any:
    from conductor.store import jobs as store
    from conductor.store.db import session_scope

    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
    if job is None:
        raise CliError(f"no job '{job_id}' in {_safe_url(get_settings().database_url)}")
    return job


def _status(args: argparse.Namespace) -> int:
    from conductor.service.views import job_view
    from conductor.store import jobs as store
    from conductor.store.db import session_scope

    _use_data_dir(args)
    job = _load_job(args.job_id)
    with session_scope() as s:
        print(job_view(job, store.get_steps(s, job_id=job.id)).model_dump_json(indent=2))
    return 0


def _trace(args: argparse.Namespace) -> int:
    from conductor.store.db import session_scope
    from conductor.trace import render_trace

    _use_data_dir(args)
    job = _load_job(args.job_id)
    with session_scope() as s:
        if args.json:
            from pydantic import TypeAdapter

            from conductor.service.schemas import StepPublic
            from conductor.service.views import steps_tree

            print(TypeAdapter(list[StepPublic]).dump_json(steps_tree(s, job.id), indent=2).decode())
        else:
            print(render_trace(s, job, full=args.full))
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from conductor.engine import cancel_job
    from conductor.tasks.send import send_webhooks_of

    job = _load_job(args.job_id)
    if not cancel_job(job.id):
        raise CliError(f"job {job.id} already ended ({job.status})")
    send_webhooks_of(job.id)
    print(f"job {job.id} cancelled")
    return 0


def _reconcile(args: argparse.Namespace) -> int:
    from conductor.reconcile import reconcile_once
    from conductor.tasks.send import send

    report, _ = reconcile_once(get_settings(), send=send)
    print(json.dumps(report))
    problems = [why for key, why in RECONCILE_PROBLEMS.items() if report.get(key)]
    if problems:
        raise CliError(f"the pass did not finish everything ({'; '.join(problems)}); the log above says why, "
                       "and the next pass retries it")
    return 0


RECONCILE_PROBLEMS = {
    "send_failed": "its re-sends could not be sent: is the broker (CONDUCTOR_BROKER_URL) up?",
    "jobs_failed_to_reconcile": "some jobs could not be reconciled",
    "orphans_failed_to_cancel": "some orphaned child jobs could not be cancelled",
    "batches_error": "the batches could not be reconciled",
    "batches_failed": "some batches could not be ended",
    "metrics_rollup_error": "ended jobs could not be folded into the metrics rollup (scrapes read their rows)",
    "database_away": "the database went away during the pass: is it (CONDUCTOR_DATABASE_URL) up?",
}


SCHEMA_BEHIND = {"42P01": "table", "42703": "column"}
"""SQLSTATEs of a statement naming what the schema lacks (undefined table, undefined column)."""


def _database_problem(exc: DBAPIError) -> str:
    """A database error as one line saying what to do: never its SQL parameters (they can hold secrets)."""
    where = _safe_url(get_settings().database_url)
    from conductor.store.db import driver_reason

    reason = driver_reason(exc)
    code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    if code in SCHEMA_BEHIND or reason.startswith(("no such table", "no such column")):
        return f"the database at {where} lacks Conductor Queue's schema ({reason}): run `conductor migrate`"
    if code == "42501":
        return (f"the database at {where} refused this user ({reason}): grant it the privileges it needs "
                "(to migrate: CREATE on the schema)")
    if isinstance(exc, OperationalError):  # the connection, the login, the server's limits or timeouts
        return (f"cannot use the database at {where} ({reason}): check that it is up and that "
                "CONDUCTOR_DATABASE_URL names it, with a user that may log in")
    return f"the database at {where} refused a statement ({type(exc.orig or exc).__name__}: {reason})"


def _is_url_problem(exc: Exception) -> bool:
    """An ArgumentError / NoSuchModuleError about the database URL itself, not other misuse."""
    return isinstance(exc, NoSuchModuleError) or "URL" in str(exc)


def _safe_url(url: str) -> str:
    """The database URL without its password (in the user part or as a query parameter), for messages."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
        hidden = {k: "***" for k in parsed.query if "pass" in k.lower() or "secret" in k.lower()}
        return parsed.update_query_dict(hidden).render_as_string(hide_password=True)
    except Exception:  # an unparseable URL is shown as nothing rather than leaked
        return "(database)"


if __name__ == "__main__":
    sys.exit(main())

"""The ``conductor`` command line. Exit 0 on success; otherwise a one-line reason on stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from conductor.planner_serve import add_arguments as add_planner_serve_arguments
from conductor.settings import get_settings

TERMINAL = ("succeeded", "failed", "cancelled")


class CliError(Exception):
    """A failure the user can act on; printed as one line, exit code 1."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return handler(args)
    except CliError as exc:
        print(f"conductor: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("conductor: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conductor", description="Conductor Queue: durable multi-model workflows.")
    sub = p.add_subparsers(metavar="COMMAND")

    c = sub.add_parser("serve", help="run the REST API")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, default=8000)
    c.set_defaults(handler=_serve)

    c = sub.add_parser("worker", help="run a Celery worker")
    c.add_argument("--queues", default="planner,steps", help="comma-separated: planner, steps")
    c.add_argument("--concurrency", type=int, default=16)
    c.add_argument("--pool", default="threads", choices=["threads", "prefork", "solo", "gevent"],
                   help="threads (default) suits the I/O-bound planner and step calls")
    c.add_argument("--loglevel", default="info")
    c.add_argument("--hostname", default=None)
    c.add_argument("--no-supervise", dest="supervise", action="store_false",
                   help="run Celery in this process (default: a child process, restarted if it dies)")
    c.set_defaults(handler=_worker)

    c = sub.add_parser("beat", help="run the reconciler schedule (Celery beat)")
    c.add_argument("--loglevel", default="info")
    c.set_defaults(handler=_beat)

    c = sub.add_parser("flower", help="run Flower, the Celery monitoring UI (set FLOWER_BASIC_AUTH=user:pass)")
    c.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default: Flower can revoke tasks)")
    c.add_argument("--port", type=int, default=5555)
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
    c = keys.add_parser("revoke", help="revoke an API key by the prefix 'keys list' shows")
    c.add_argument("prefix")
    c.set_defaults(handler=_keys_revoke)

    c = sub.add_parser("submit", help="submit a job to the API")
    c.add_argument("task")
    c.add_argument("--workflow", type=Path, help="JSON file with an explicit workflow")
    c.add_argument("--planner")
    c.add_argument("--pool")
    c.add_argument("--wait", action="store_true", help="poll until the job ends and print the answer")
    c.set_defaults(handler=_submit)

    c = sub.add_parser("run", help="run one job here and now: one process, no services (embedded mode)")
    c.add_argument("task")
    c.add_argument("--pool", help="pool name or YAML file (default: CONDUCTOR_POOL_FILE if set, else research "
                   "if a provider key is set, else local: a tiny model on this CPU)")
    c.add_argument("--planner", help="conductor (default) | an agent of the pool | template:single|fanout|pev|moa")
    c.add_argument("--data-dir", type=Path, help="where the SQLite store and log live (default: CONDUCTOR_DATA_DIR)")
    c.set_defaults(handler=_run)

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

    c = sub.add_parser("reconcile", help="run one reconciler pass now")
    c.set_defaults(handler=_reconcile)
    return p


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run("conductor.service.app:create_app", factory=True, host=args.host, port=args.port)
    return 0


def _worker(args: argparse.Namespace) -> int:
    from conductor.tasks.app import app

    queues = [q.strip() for q in args.queues.split(",") if q.strip()]
    unknown = set(queues) - {"planner", "steps"}
    if unknown:
        raise CliError(f"unknown queue(s) {', '.join(sorted(unknown))}; use planner and/or steps")
    if args.supervise:
        from conductor.tasks.supervise import supervise

        child = [sys.executable, "-m", "conductor.cli", "worker", "--no-supervise", "--queues", ",".join(queues),
                 "--concurrency", str(args.concurrency), "--pool", args.pool, "--loglevel", args.loglevel]
        if args.hostname:
            child += ["--hostname", args.hostname]
        return supervise(child)
    argv = ["worker", "-Q", ",".join(queues), "-P", args.pool, "-c", str(args.concurrency),
            "--loglevel", args.loglevel]
    if args.hostname:
        argv += ["-n", args.hostname]
    # app.start returns the worker's exit code (worker_main drops it): a crash must not look clean.
    code = int(app.start(argv) or 0)
    print(f"conductor worker: Celery worker stopped with code {code}", file=sys.stderr, flush=True)
    return code


def _beat(args: argparse.Namespace) -> int:
    from conductor.tasks.app import app

    schedule = get_settings().data_dir / "celerybeat-schedule"
    schedule.parent.mkdir(parents=True, exist_ok=True)
    app.start(["beat", "--loglevel", args.loglevel, "-s", str(schedule)])
    return 0


def _flower(args: argparse.Namespace) -> int:
    from conductor.tasks.app import app

    app.start(["flower", f"--address={args.host}", f"--port={args.port}"])
    return 0


def _planner_serve(args: argparse.Namespace) -> int:
    from conductor.planner_serve import serve

    return serve(args)


def _migrate(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import OperationalError

    from conductor.migrations.migrate import upgrade

    url = get_settings().database_url
    try:
        upgrade(url)
    except OperationalError as exc:
        raise CliError(f"cannot reach the database ({exc.orig}); check CONDUCTOR_DATABASE_URL") from exc
    print("database is at the latest revision")
    return 0


def _keys_create(args: argparse.Namespace) -> int:
    from conductor.store.db import session_scope
    from conductor.store.keys import create_key

    tenant = args.tenant.strip()
    if not tenant or len(tenant) > 128:
        raise CliError("--tenant must be 1-128 characters")
    with session_scope() as s:
        row, key = create_key(s, tenant=tenant, pepper=get_settings().api_key_pepper)
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
    from conductor.store.keys import revoke_key

    with session_scope() as s:
        count = revoke_key(s, prefix=args.prefix.rstrip("…"))
    if count == 0:
        raise CliError(f"no active key starts with '{args.prefix}'; see 'conductor keys list'")
    print(f"revoked {count} key{'s' if count != 1 else ''}")
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
        raise CliError(f"cannot reach the API at {url} ({exc}); is 'conductor serve' running?") from exc
    if response.status_code >= 400:
        try:
            body = response.json()
            detail = body.get("detail") or body.get("title")
        except ValueError:
            detail = response.text[:200]
        raise CliError(f"API answered {response.status_code}: {detail}")
    return response.json()


def _submit(args: argparse.Namespace) -> int:
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
        job_id = created["id"]
        print(job_id)
        if not args.wait:
            return 0
        last = None
        while True:
            job = _api(lambda: client.get(f"/v1/jobs/{job_id}"))
            if job["status"] != last:
                print(f"  {job['status']}", file=sys.stderr)
                last = job["status"]
            if job["status"] in TERMINAL:
                break
            time.sleep(0.5)
    if job["status"] != "succeeded":
        raise CliError(f"job {job_id} {job['status']}: {(job.get('error') or {}).get('message')}")
    print(job["answer"])
    return 0


def _run(args: argparse.Namespace) -> int:
    from conductor.embedded import EmbeddedError, run

    try:
        return run(args.task, pool=args.pool, planner=args.planner, data_dir=args.data_dir)
    except EmbeddedError as exc:
        raise CliError(str(exc)) from exc


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
        print(json.dumps(job_view(job, store.get_steps(s, job_id=job.id)), indent=2))
    return 0


def _trace(args: argparse.Namespace) -> int:
    from conductor.store.db import session_scope
    from conductor.trace import render_trace

    _use_data_dir(args)
    job = _load_job(args.job_id)
    with session_scope() as s:
        if args.json:
            from conductor.service.views import steps_tree

            print(json.dumps(steps_tree(s, job.id), indent=2))
        else:
            print(render_trace(s, job, full=args.full))
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from conductor.engine import cancel_job

    job = _load_job(args.job_id)
    if not cancel_job(job.id):
        raise CliError(f"job {job.id} already ended ({job.status})")
    print(f"job {job.id} cancelled")
    return 0


def _reconcile(args: argparse.Namespace) -> int:
    from conductor.reconcile import reconcile_once
    from conductor.tasks.send import send

    report, dispatch = reconcile_once(get_settings())
    send(dispatch)
    print(json.dumps(report))
    return 0


def _safe_url(url: str) -> str:
    """The database URL without its password, for messages."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an unparseable URL is shown as nothing rather than leaked
        return "(database)"


if __name__ == "__main__":
    sys.exit(main())

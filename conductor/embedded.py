"""``conductor run``: one job in one process, no services -- with the production engine and tasks.

Nothing here executes a workflow. It points the one Settings object at an SQLite file in the data
directory and the one Celery app at an in-memory broker, starts a Celery worker (threads pool) inside
this process, submits the job through ``conductor.submission`` and the same send path as the API,
and then only *watches* the store: the plan / run_step / finalize tasks, the claims and leases, the
retries and the trace are exactly the ones a production worker runs against Postgres and Redis.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from conductor.settings import Settings, get_settings
from conductor.statuses import JobStatus, StepStatus

DB_FILE = "conductor.sqlite3"
LOG_FILE = "conductor.log"
MIGRATE_LOCK_FILE = ".migrate.lock"
MEMORY_BROKER = "memory://"
MEMORY_RESULT_BACKEND = "cache+memory://"
BROKER_POLLING_INTERVAL_S = 0.005
"""kombu's in-memory transport polls; its 1 s default would add a second to every hop."""
WORKER_CONCURRENCY = 8
KEY_ENV_VARS = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY")
POLL_S = 0.1
HEARTBEAT_S = 10.0
"""Without a terminal, a progress line at least this often while a step runs."""
PREVIEW = 100

log = logging.getLogger(__name__)


class EmbeddedError(Exception):
    """A one-line, actionable reason ``conductor run`` cannot proceed."""


# --- the embedded store ---------------------------------------------------------------------------


def database_url(data_dir: Path) -> str:
    return f"sqlite:///{(data_dir / DB_FILE).resolve()}"


def prepare_data_dir(data_dir: Path) -> Path:
    """Creates the directory and proves it is writable; EmbeddedError naming the problem otherwise."""
    path = data_dir.expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise EmbeddedError(
            f"cannot use data directory {path}: {reason}; choose another with --data-dir or CONDUCTOR_DATA_DIR"
        ) from exc
    return path.resolve()


def use_store(data_dir: Path, *, embedded_broker: bool = False) -> Settings:
    """Points this process's settings at the SQLite store in ``data_dir`` (and, for ``run``, at the
    in-memory broker). Must run before anything opens a database engine."""
    os.environ["CONDUCTOR_DATA_DIR"] = str(data_dir)
    os.environ["CONDUCTOR_DATABASE_URL"] = database_url(data_dir)
    if embedded_broker:
        os.environ["CONDUCTOR_BROKER_URL"] = MEMORY_BROKER
        os.environ["CONDUCTOR_RESULT_BACKEND"] = MEMORY_RESULT_BACKEND
    get_settings.cache_clear()
    from conductor.store.db import clear_engines

    clear_engines()
    return get_settings()


def open_store(data_dir: Path) -> Settings:
    """For ``trace`` / ``status --data-dir``: the existing store there, or EmbeddedError. A store an older
    release wrote is migrated first, as ``conductor run`` would (``conductor migrate`` has no data
    directory: it migrates CONDUCTOR_DATABASE_URL); one at the head is only read."""
    path = data_dir.expanduser()
    if not (path / DB_FILE).is_file():
        raise EmbeddedError(f"no embedded store at {path / DB_FILE}; `conductor run` creates it")
    settings = use_store(path.resolve())
    _migrate(settings, path.resolve(), only_if_behind=True)
    return settings


def configure_celery(settings: Settings) -> Any:
    """The production Celery app, re-pointed at the in-memory broker (it was built at import)."""
    from conductor.tasks.app import app, celery_config

    conf = celery_config(settings)
    conf.update(
        broker_url=MEMORY_BROKER,
        result_backend=MEMORY_RESULT_BACKEND,
        broker_transport_options={"polling_interval": BROKER_POLLING_INTERVAL_S},
        result_backend_transport_options={},
        # Nobody listens for events in one process; sending them only costs time.
        worker_send_task_events=False,
        task_send_sent_event=False,
    )
    app.conf.update(conf)
    import conductor.tasks.jobs  # noqa: F401  (registers the tasks on the app)

    return app


def _setup_logging(data_dir: Path) -> Path:
    """Everything the worker logs goes to a file in the data directory, not over the progress display."""
    path = data_dir / LOG_FILE
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return path


@contextmanager
def embedded_worker(app: Any, log_path: Path) -> Iterator[Any]:
    """A Celery worker on a thread of this process, consuming both queues."""
    from celery.contrib.testing.worker import start_worker

    from conductor.tasks.app import PLANNER_QUEUE, STEPS_QUEUE

    with start_worker(
        app,
        pool="threads",
        concurrency=WORKER_CONCURRENCY,
        perform_ping_check=False,
        loglevel="INFO",
        logfile=str(log_path),
        shutdown_timeout=60.0,
        queues=[PLANNER_QUEUE, STEPS_QUEUE],
    ) as worker:
        try:
            yield worker
        finally:
            _wake_to_stop(app)


def _wake_to_stop(app: Any) -> None:
    """Stops the worker now rather than after its consumer loop's 2 s poll timeout.

    The loop checks the stop flag only between deliveries, and then polls once more, so the flag is
    set and two no-op messages (``finalize`` of no job does nothing) wake it twice.
    """
    from celery.worker import state

    from conductor.tasks.app import FINALIZE_TASK

    state.should_terminate = 0
    for _ in range(2):
        app.send_task(FINALIZE_TASK, ("",))


# --- pool choice and the local model ----------------------------------------------------------------


def default_pool(settings: Settings | None = None, data_dir: Path | None = None) -> tuple[str, str]:
    """(pool, why): the configured CONDUCTOR_POOL_FILE if set; else, when a provider key is set, the
    hosted models whose keys are set (``hosted_pool``); else the local CPU model (a fresh machine with
    nothing configured)."""
    if settings is not None and "pool_file" in settings.model_fields_set:
        return str(settings.pool_file), "CONDUCTOR_POOL_FILE"
    keys = [k for k in KEY_ENV_VARS if os.environ.get(k)]
    if keys:
        directory = (data_dir or (settings or get_settings()).data_dir).expanduser()
        return str(hosted_pool(directory, keys)), f"{', '.join(keys)} set"
    return "local", "no OPENAI_API_KEY / ANTHROPIC_API_KEY / GEMINI_API_KEY set"


HOSTED_AGENTS = ("gpt-5", "claude-sonnet-4", "gemini-2.5-pro")
"""The research pool's hosted models, in the order the first keyed one is chosen to plan."""


def hosted_pool(directory: Path, keys: list[str]) -> Path:
    """Writes ``<directory>/pools/hosted-<keys>.yaml`` (pool ``hosted``): the research pool's hosted models
    whose keys are set, the first of them also planning (as agent ``<name>-planner``, so it still runs
    steps, in ``<name>``'s rate-limit bucket), ``template:single`` as the fallback. The research pool
    itself plans with the Conductor model on a GPU node
    (``http://planner:8000``) and has open models behind vLLM: reachable inside its deployment only."""
    import yaml

    from conductor.pool.config import load_pool
    from conductor.settings import SHIPPED_POOLS_DIR

    research = load_pool(SHIPPED_POOLS_DIR / "research.yaml")
    agents = {name: research.agents[name].model_dump(mode="json", exclude_unset=True) for name in HOSTED_AGENTS
              if name in research.agents and research.agents[name].api_key_env in keys}
    if not agents:
        raise EmbeddedError(f"none of the research pool's hosted models uses {', '.join(keys)}; "
                            "choose a pool with --pool")
    first = next(iter(agents))
    planner = f"{first}-planner"
    pool = {"name": "hosted", "planner": planner, "fallback": "template:single",
            "agents": {planner: {**agents[first], "description": f"{first}, writing the workflow",
                                 "rpm_bucket": first},  # one provider model: its planning and steps share its rpm
                       **agents}}
    pool = json.loads(json.dumps(pool))  # no shared objects: YAML would write them as anchors
    # one file per set of keys (two shells with different keys must not load each other's), written whole
    # (a run reading it while another writes it sees the old file or the new one)
    suffix = "-".join(key.removesuffix("_API_KEY").lower() for key in sorted(keys))
    target = directory / "pools" / f"hosted-{suffix}.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# Written by `conductor run` from the keys set ({', '.join(keys)}): the research pool's hosted "
              "models\n# with those keys; the first plans. Rewritten at every run without --pool.\n")
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    partial.write_text(header + yaml.safe_dump(pool, sort_keys=False), encoding="utf-8")
    os.replace(partial, target)
    return target


def preflight(pool: Any, err: TextIO) -> None:
    """Builds every agent's provider (bad options fail here, not mid-job) and loads each local model
    once, so a missing llama.cpp or model package is one clear line before any job exists."""
    from conductor.pool.errors import ProviderError
    from conductor.pool.local_provider import LocalProvider
    from conductor.pool.registry import provider_for

    loaded_keys: set[tuple[str, str, int]] = set()
    for name, agent in pool.agents.items():
        try:
            provider = provider_for(name, agent)
            if not isinstance(provider, LocalProvider):
                continue
            key = (provider.options.model_path or "", agent.model, provider.options.n_ctx)
            if key in loaded_keys:
                provider.load()  # shared and already loaded; checks this agent's chat format
                continue
            loaded_keys.add(key)
            started = time.monotonic()
            print(f"loading local model {agent.model} (llama.cpp, CPU) ...", file=err, flush=True)
            loaded = provider.load(progress=err)
        except ProviderError as exc:
            raise EmbeddedError(str(exc)) from exc
        size = loaded.path.stat().st_size / 1e6
        print(
            f"  loaded {loaded.path.name} ({size:.0f} MB, n_ctx {loaded.n_ctx}) in "
            f"{time.monotonic() - started:.1f}s",
            file=err,
            flush=True,
        )


# --- progress -------------------------------------------------------------------------------------


@dataclass
class _Seen:
    job_status: str = ""
    steps: dict[int, str] = field(default_factory=dict)
    planned: bool = False
    last_line: float = 0.0


class Progress:
    """Reads the store and reports what changed: events as lines, plus a live status line on a terminal."""

    def __init__(self, job_id: str, err: TextIO, started: float):
        self.job_id = job_id
        self.err = err
        self.started = started
        self.tty = err.isatty()
        self.seen = _Seen()
        self._status_width = 0

    def _elapsed(self) -> str:
        return f"{time.monotonic() - self.started:6.1f}s"

    def line(self, text: str) -> None:
        self._clear_status()
        print(f"{self._elapsed()}  {text}", file=self.err, flush=True)
        self.seen.last_line = time.monotonic()

    def _clear_status(self) -> None:
        if self.tty and self._status_width:
            self.err.write("\r" + " " * self._status_width + "\r")
            self._status_width = 0

    def _status(self, text: str) -> None:
        if self.tty:
            self._clear_status()
            text = f"{self._elapsed()}  {text}"[: max(20, _terminal_width() - 1)]
            self.err.write(text)
            self.err.flush()
            self._status_width = len(text)
        elif time.monotonic() - self.seen.last_line >= HEARTBEAT_S:
            self.line("... " + text)

    def update(self) -> Any:
        """One look at the store; returns the job row."""
        from conductor.store import jobs as store
        from conductor.store.db import session_scope

        with session_scope() as s:
            job = store.get_job(s, job_id=self.job_id)
            assert job is not None
            steps = store.get_steps(s, job_id=self.job_id)
            if steps and job.workflow_source is None:
                # The plan (its steps and the job's plan columns, one transaction) committed between the two
                # reads: SQLite reads each SELECT in its own snapshot here. Read the job again, or the
                # "planned by" line would name no planner.
                s.refresh(job)
        if job.status != self.seen.job_status:
            self._job_changed(job, steps)
        if steps and not self.seen.planned:
            self.seen.planned = True
            self._planned(job, steps)
        for st in steps:
            if self.seen.steps.get(st.index) != st.status:
                self.seen.steps[st.index] = st.status
                self._step_changed(st)
        running = [st for st in steps if st.status == StepStatus.RUNNING]
        tokens_in = job.planner_input_tokens + sum(st.input_tokens for st in steps)
        tokens_out = job.planner_output_tokens + sum(st.output_tokens for st in steps)
        if job.status == JobStatus.PLANNING:
            doing = f"planning with {_planner_name(job)}"
        elif running:
            doing = "running " + ", ".join(
                f"step {st.index} on {st.agent} ({_since(st.started_at)})" for st in running
            )
        else:
            doing = job.status
        self._status(f"{doing} | tokens so far: {tokens_in} in / {tokens_out} out")
        return job

    def close(self) -> None:
        self._clear_status()

    def _job_changed(self, job: Any, steps: list[Any]) -> None:
        self.seen.job_status = job.status
        if job.status == JobStatus.PLANNING:
            self.line(f"planning with {_planner_name(job)} ...")

    def _planned(self, job: Any, steps: list[Any]) -> None:
        how = {"planner": "planned by", "fallback": "fallback workflow after", "request": "workflow from"}
        source = job.workflow_source or "?"
        tokens = (
            f", {job.planner_input_tokens} in / {job.planner_output_tokens} out tokens"
            if job.planner_calls
            else ""
        )
        self.line(
            f"{how.get(source, source)} {_planner_name(job)}: {len(steps)} step{'s' if len(steps) != 1 else ''} "
            f"(source={source}, format_valid={job.format_valid}{tokens})"
        )
        if job.planner_error:
            self.line(f"  planner output unusable ({job.planner_attempts} tries): {_clip(job.planner_error)}")
        for st in steps:
            sees = ", ".join(map(str, st.access_list)) if st.access_list else "nothing"
            self.line(f"  [{st.index}] {st.agent} (sees {sees}): {_clip(st.instruction)}")

    def _step_changed(self, st: Any) -> None:
        if st.status == StepStatus.RUNNING:
            self.line(f"> step {st.index} running on {st.agent}")
        elif st.status == StepStatus.SUCCEEDED:
            secs = f"{st.latency_ms / 1000:.1f}s" if st.latency_ms is not None else "-"
            self.line(
                f"+ step {st.index} done on {st.agent}: {secs}, {st.input_tokens} in / {st.output_tokens} out tokens"
            )
        elif st.status == StepStatus.FAILED:
            self.line(f"x step {st.index} failed on {st.agent}: {_clip(st.error or st.error_type or '')}")
        elif st.status in (StepStatus.SKIPPED, StepStatus.CANCELLED):
            self.line(f"- step {st.index} {st.status}")


def _planner_name(job: Any) -> str:
    if job.planner != "conductor":
        return str(job.planner)
    return str((job.pool_config or {}).get("planner", "the planner"))


def _since(ts: Any) -> str:
    if ts is None:
        return "-"
    from conductor.store.models import utcnow

    return f"{(utcnow() - ts).total_seconds():.1f}s"


def _clip(text: str, n: int = PREVIEW) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= n else flat[: n - 1] + "…"


def _terminal_width() -> int:
    try:
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        columns = 0
    return columns if columns > 20 else 100


# --- the command ----------------------------------------------------------------------------------


def run(
    task: str,
    *,
    pool: str | None = None,
    planner: str | None = None,
    data_dir: Path | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Runs one job to its end. Prints progress on ``err``, the answer on ``out``; 0 iff it succeeded."""
    out = out or sys.stdout
    err = err or sys.stderr
    started = time.monotonic()
    with embedded_session(pool, data_dir=data_dir, err=err) as session:
        body = _job_body(task, planner=planner)
        # noted from before the submission: the in-process worker may start the job (holding the GIL) before
        # _watch listens, and a SIGTERM or SIGHUP in between killed the process and left the job running
        with _signals_noted() as noted:
            job_id = session.submit(body)
            print(f"job {job_id} submitted (pool {session.pool.name}); worker log: {session.log_path}",
                  file=err, flush=True)
            job = _watch(job_id, err, started, session.settings, noted=noted)
        return _report(job, session.directory, out, err, started)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def _signals_noted() -> Iterator[list[signal.Signals]]:
    """Until ``_watch`` listens: Ctrl-C, a kill or a closed terminal is noted instead of acted on, and
    ``_watch`` then cancels the job for it at once. Acted on, a SIGTERM or SIGHUP killed the process (its
    default action) and left the job to run, found by the next run on the data directory; a Ctrl-C
    interrupted the submission half-way. Outside the main thread (no signals there) nothing."""
    noted: list[signal.Signals] = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return

    def note(signum: int, _frame: Any) -> None:
        noted.append(signal.Signals(signum))

    previous = {s: signal.signal(s, note) for s in STOP_SIGNALS}
    try:
        yield noted
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@dataclass
class EmbeddedSession:
    """The store, pool and in-process worker of one embedded command; jobs go in through ``submit``."""

    settings: Settings
    pool: Any  # PoolConfig
    directory: Path
    log_path: Path
    next_reconcile: float = 0.0

    def submit(self, body: Any) -> str:
        """Creates the job from a ``JobCreate`` (the pool: this session's) and sends its plan message."""
        return _submit(body, settings=self.settings)

    def reconcile_if_due(self) -> None:
        """Beat's one duty, on its schedule: re-drive anything stalled (a lost message, a dead thread)."""
        from conductor.reconcile import reconcile_once
        from conductor.tasks.send import send

        now = time.monotonic()
        if now < self.next_reconcile:
            return
        self.next_reconcile = now + self.settings.reconcile_interval_s
        report, dispatch = reconcile_once(self.settings, send=send)
        if dispatch:
            log.info("reconciler re-drove stalled work: %s", report)


@contextmanager
def embedded_session(pool: str | None, *, data_dir: Path | None, err: TextIO) -> Iterator[EmbeddedSession]:
    """Points this process at the SQLite store in ``data_dir`` and the in-memory broker, checks the pool
    (loading local models once), and runs a Celery worker on threads of this process meanwhile."""
    directory = prepare_data_dir(data_dir or get_settings().data_dir)
    settings = use_store(directory, embedded_broker=True)
    if pool is None:
        pool, why = default_pool(settings, directory)
        print(f"pool: {pool} ({why}; choose one with --pool)", file=err)
    settings, pool_config = _resolve_pool(pool, settings)
    if pool_config.name == "local" or all(a.provider == "local" for a in pool_config.agents.values()):
        print(f"note: {_local_models_note(pool_config)}", file=err)
    if any(a.provider == "sim" for a in pool_config.agents.values()):
        print("note: this pool is SIMULATED: its agents echo their instructions; nothing is solved.", file=err)
    print(f"store: {settings.database_url.removeprefix('sqlite:///')}", file=err)
    log_path = _setup_logging(directory)
    _migrate(settings, directory)
    preflight(pool_config, err)
    app = configure_celery(settings)
    with embedded_worker(app, log_path):
        session = EmbeddedSession(settings, pool_config, directory, log_path)
        session.next_reconcile = time.monotonic() + settings.reconcile_interval_s
        yield session


def _local_models_note(pool: Any) -> str:
    from conductor.pool.local_models import packaged_model

    names = dict.fromkeys(
        (m.description if (m := packaged_model(a.model)) else a.model) for a in pool.agents.values()
        if a.provider == "local"
    )
    return (f"this pool runs {', '.join(names)} on this CPU: a small model, fine for short tasks, weak on hard "
            "ones. For real work set a provider key (OPENAI_API_KEY, ANTHROPIC_API_KEY, GEMINI_API_KEY) and run "
            "without --pool, or use your own pool file.")


def _resolve_pool(pool: str, settings: Settings) -> tuple[Settings, Any]:
    """Finds and validates the pool, then makes its file this process's default pool file, so the job
    is submitted without a pool name (a file path is not a name: the API caps names at 64 characters)."""
    from conductor.pool.config import PoolError, load_pool, resolve_pool_path
    from conductor.submission import pools_dirs

    try:
        path = resolve_pool_path(
            pool, default_file=settings.pool_file, pools_dirs=pools_dirs(settings, local=True), allow_path=True
        )
        config = load_pool(path)
    except PoolError as exc:
        raise EmbeddedError(str(exc)) from exc
    os.environ["CONDUCTOR_POOL_FILE"] = str(path.resolve())
    get_settings.cache_clear()
    return get_settings(), config


@contextmanager
def _migration_lock(directory: Path) -> Iterator[None]:
    """One migration of the store at a time: two ``conductor run`` started together on a data directory
    at an old revision both added the same columns, and the second failed ("duplicate column name").
    An exclusive flock on a file beside the store, released when the file closes (or the process dies)."""
    import fcntl

    with open(directory / MIGRATE_LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _migrate(settings: Settings, directory: Path, *, only_if_behind: bool = False) -> None:
    """Upgrades the store to this package's head, one process at a time; with ``only_if_behind``, first
    checks (without the lock, nor a write) whether it has anything to do."""
    from sqlalchemy.exc import SQLAlchemyError

    from conductor.migrations.migrate import NewerStoreError, is_behind, upgrade
    from conductor.store.db import driver_reason

    store = settings.database_url.removeprefix("sqlite:///")
    try:
        if only_if_behind and not is_behind(settings.database_url):
            return
        with _migration_lock(directory):
            upgrade(settings.database_url)
    except NewerStoreError as exc:
        raise EmbeddedError(f"the store {store} {exc}") from exc
    except OSError as exc:  # the lock file
        raise EmbeddedError(f"cannot prepare the store {store}: {exc.strerror or type(exc).__name__}") from exc
    except SQLAlchemyError as exc:
        why = type(exc).__name__ + (f" ({driver_reason(exc)})" if getattr(exc, "orig", None) is not None else "")
        raise EmbeddedError(f"cannot prepare the store {store}: {why}") from exc


def _job_body(task: str, *, planner: str | None) -> Any:
    from pydantic import ValidationError

    from conductor.submission import JobCreate

    try:
        return JobCreate(task=task, planner=planner)  # the pool: settings.pool_file, set by the session
    except ValidationError as exc:
        first = exc.errors()[0]
        raise EmbeddedError(f"invalid {'.'.join(map(str, first['loc']))}: {first['msg']}") from exc


def _submit(body: Any, *, settings: Settings) -> str:
    from conductor.engine import Dispatch
    from conductor.store.db import session_scope
    from conductor.submission import SubmissionError, create_job
    from conductor.tasks.send import send

    try:
        with session_scope() as s:
            job, _ = create_job(s, body, tenant="local", settings=settings, allow_pool_path=True)
            job_id = job.id
    except SubmissionError as exc:
        reasons = "; ".join(e.msg for e in exc.errors) if exc.errors else exc.title
        raise EmbeddedError(f"{exc.title.lower()}: {reasons}") from exc
    send(Dispatch(plan=[job_id]))
    return job_id


def _watch(job_id: str, err: TextIO, started: float, settings: Settings,
           noted: list[signal.Signals] | None = None) -> Any:
    """Polls the store until the job ends. Also does beat's one duty: the reconciler, on its schedule,
    re-drives anything stalled (a lost message, a step whose worker thread died). ``noted``: signals that
    came while the job was submitted (``_signals_noted``): the job is cancelled for the first at once."""
    from conductor.engine import cancel_job
    from conductor.reconcile import reconcile_once
    from conductor.tasks.send import send

    progress = Progress(job_id, err, started)
    next_reconcile = time.monotonic() + settings.reconcile_interval_s
    stopped_by = [signal.SIGINT]
    signalled: list[signal.Signals] = []

    def stop(signum: int, _frame: Any) -> None:
        stopped_by[0] = signal.Signals(signum)
        signalled.append(stopped_by[0])
        raise KeyboardInterrupt

    # A closed terminal (SIGHUP) or a kill (SIGTERM) cancels the job as Ctrl-C does: left running, it was
    # picked up and finished by the next run on this data directory, after that run's own answer.
    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        if noted:
            stopped_by[0] = noted[0]
            raise KeyboardInterrupt
        while True:
            if signalled:
                # The handler's KeyboardInterrupt is raised wherever the main thread is, and one raised in
                # a garbage-collection callback or a __del__ (SQLAlchemy's event registry, say) is printed
                # as "Exception ignored" and lost: the run went on to the step's end. Raised here again.
                raise KeyboardInterrupt
            job = progress.update()
            if job.status in JobStatus.TERMINAL:
                progress.close()
                return job
            if time.monotonic() >= next_reconcile:
                next_reconcile = time.monotonic() + settings.reconcile_interval_s
                report, dispatch = reconcile_once(settings, send=send)
                if dispatch:
                    log.info("reconciler re-drove stalled work: %s", report)
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        # Ctrl-C: the job is cancelled in the store (a queued step never starts). A model call in
        # flight cannot be interrupted -- llama.cpp or an HTTP request would hold the worker thread
        # for its whole duration -- so the process leaves now instead of waiting for it.
        progress.close()
        cancel_job(job_id)
        print(f"job {job_id} cancelled\nconductor: interrupted ({stopped_by[0].name})", file=err, flush=True)
        sys.stdout.flush()
        os._exit(128 + stopped_by[0])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        progress.close()


def _report(job: Any, directory: Path, out: TextIO, err: TextIO, started: float) -> int:
    from conductor.store import jobs as store
    from conductor.store.db import session_scope
    from conductor.trace import graph_lines

    with session_scope() as s:
        steps = store.get_steps(s, job_id=job.id)
    wall = time.monotonic() - started
    summary = (
        f"job {job.id} {job.status} in {wall:.1f}s: {job.input_tokens} in / {job.output_tokens} out tokens, "
        f"{job.calls} model calls, ${job.cost_usd:.6f}"
    )
    trace_hint = (
        f"full trace: conductor trace {job.id} --data-dir {directory}\n"
        f"  (or: CONDUCTOR_DATABASE_URL={database_url(directory)} conductor trace {job.id})"
    )
    if job.status != JobStatus.SUCCEEDED:
        print(summary, file=err)
        print(trace_hint, file=err)
        raise EmbeddedError(f"job {job.id} {job.status}: {job.error_message or job.error_type or 'no reason recorded'}")
    print("\n--- answer " + "-" * 60, file=err, flush=True)
    answer = job.answer or ""
    out.write(answer if answer.endswith("\n") else answer + "\n")
    out.flush()
    print("-" * 71, file=err)
    print(f"workflow (source={job.workflow_source}, format_valid={job.format_valid}):", file=err)
    for line in graph_lines(steps):
        print(f"  {line}", file=err)
    print(summary, file=err)
    print(trace_hint, file=err, flush=True)
    return 0

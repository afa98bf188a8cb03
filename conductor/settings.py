"""The one place every setting lives: environment variables prefixed ``CONDUCTOR_`` and ``.env``."""

from __future__ import annotations

import ipaddress
import re
from functools import lru_cache
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, HttpUrl, NonNegativeFloat, TypeAdapter, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_RESULT_BACKEND = "redis://127.0.0.1:6379/1"
SHIPPED_POOLS_DIR = Path(__file__).parent / "pools"
DEFAULT_POOL_FILE = SHIPPED_POOLS_DIR / "research.yaml"


QUEUE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
RESERVED_QUEUES = ("planner", "maintenance", "webhooks")


def _default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "conductor-queue"


def _default_models_dir() -> Path:
    return Path.home() / ".cache" / "conductor-queue" / "models"


MAX_RETRY_AFTER_S = 300.0
"""A provider's Retry-After is honoured up to this (``conductor.retry``); beyond it the attempt fails as
exhausted."""


LOOPBACK_HOST_NAMES = ("localhost", "127.0.0.1", "::1")
"""The hosts a server with ``auth_required`` off answers to unless ``allowed_hosts`` says otherwise."""


PORT_SUFFIX = re.compile(r"(:[0-9]*)?")
"""What may follow a Host's name or bracketed IPv6 literal: nothing, or ``:`` and a port (RFC 3986: digits)."""


def host_name(host: str) -> str:
    """The name in a ``Host`` header value (or an ``allowed_hosts`` entry), lowercased, without its port,
    brackets or trailing dot: ``[::1]:8000`` -> ``::1``, ``LocalHost.:80`` -> ``localhost``. ``""`` (a name no
    entry matches but ``*``) when anything but ``:port`` follows the name or the ``]``: ``[::1]evil``,
    ``localhost:evil``, an unclosed ``[``."""
    host = host.strip().lower()
    if host.startswith("["):  # an IPv6 literal, as a Host header writes it
        host, bracket, rest = host[1:].partition("]")
        if not bracket or not PORT_SUFFIX.fullmatch(rest):
            return ""
    elif host.count(":") == 1:  # name:port (an address with several colons is a bare IPv6 literal)
        host, _, port = host.partition(":")
        if not PORT_SUFFIX.fullmatch(":" + port):
            return ""
    return host.rstrip(".")


def allowlist_entry_problem(entry: str) -> str | None:
    """Why the ``allowed_hosts`` entry ``entry`` names no host (None when it names one): an entry that
    normalises to nothing (``[]``, ``:80``, ``.``, ``[::1]evil``), or a ``*`` anywhere but as the whole name
    or a leading ``*.`` before a name (``*.`` normalised to ``*`` and allowed every host)."""
    name = host_name(entry)
    if not name:
        return "it names no host"
    if name == "*":
        return None if entry.strip().partition(":")[0] == "*" else "a '*.' must be followed by a name"
    if "*" in name:
        suffix = name[2:] if name.startswith("*.") else ""
        if not suffix or "*" in suffix or not all(suffix.split(".")):
            return "'*' may only be the whole name or lead one ('*.example.com')"
    return None


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
HOST_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
"""One label of a host name as stored URLs hold it (lowercase ASCII, internationalised names in punycode)."""


def denied_target_problem(entry: str) -> str | None:
    """Why the ``webhook_denied_targets`` entry ``entry`` is neither an IP address or network (CIDR) nor a
    host name as ``allowed_hosts`` writes one (None when it is)."""
    try:
        denied_entry(entry)
    except ValueError as exc:
        return str(exc)
    return None


def denied_entry(entry: str) -> IPNetwork | str:
    """A ``webhook_denied_targets`` entry as what a webhook URL's host is compared with: a network (an address
    is a /32 or /128; an IPv4-mapped IPv6 one the IPv4 network it maps), or a host name normalised as stored
    webhook URLs are (lowercase, punycode, no trailing dot), ``*.`` kept in front of a wildcard's suffix.
    A port is ignored (``8.8.8.8:443``, ``[2001:db8::1]:443``). Raises ValueError naming the problem."""
    name = host_name(entry)
    if not name or name == "*":
        raise ValueError("it names no host" if not name else "'*' would refuse every target")
    network = _network(name)
    if network is not None:
        return network
    if "*" in name:
        problem = allowlist_entry_problem(entry)
        if problem is not None:
            raise ValueError(problem)
        prefix, rest = "*.", name[2:]
    else:
        prefix, rest = "", name
    try:
        parts = urlsplit(str(TypeAdapter(HttpUrl).validate_python(f"http://{rest}/")))
    except ValueError as exc:
        raise ValueError("it is neither an IP address or network nor a host name") from exc
    normal = (parts.hostname or "").rstrip(".")
    if _network(normal) is not None:  # 10, 1.2.3, 0x08080404: a resolver reads them as addresses
        raise ValueError(f"it reads as the address {normal}: write an IPv4 address in dotted decimal")
    if not normal or not all(HOST_LABEL.fullmatch(label) for label in normal.split(".")):
        raise ValueError("it is neither an IP address or network nor a host name")
    return prefix + normal


def _network(text: str) -> IPNetwork | None:
    try:
        network = ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None
    mapped = network.network_address.ipv4_mapped if isinstance(network, ipaddress.IPv6Network) else None
    if mapped is not None and network.prefixlen >= 96:  # ::ffff:1.2.3.4 means 1.2.3.4
        return ipaddress.ip_network(f"{mapped}/{network.prefixlen - 96}", strict=False)
    return network


@lru_cache(maxsize=16)
def webhook_denied(denied_targets: str, allowed_hosts: str) -> tuple[tuple[IPNetwork, ...], tuple[str, ...]]:
    """``webhook_denied_targets`` as (networks, names in ``denied_entry``'s form), with the API's own names
    and addresses from ``allowed_hosts`` (not its wildcards: a tenant's receiver may live below the API's
    domain; not loopback, refused already unless ``webhook_allow_loopback`` lets it be). Cached: a
    submission with a webhook and every delivery read it."""
    networks: list[IPNetwork] = []
    names: list[str] = []
    own = [host_name(n) for n in allowed_hosts.split(",") if n.strip()]
    own = [n for n in own if n and "*" not in n and n not in LOOPBACK_HOST_NAMES and not n.endswith(".localhost")]
    listed = [(e.strip(), True) for e in denied_targets.split(",") if e.strip()]
    for entry, explicit in listed + [(n, False) for n in own]:
        try:
            target = denied_entry(entry)
        except ValueError:
            continue  # (a denied target is checked at start; an allowed host that is no target is not one)
        if isinstance(target, str):
            names.append(target)
        elif explicit or not target.is_loopback:
            networks.append(target)
    return tuple(dict.fromkeys(networks)), tuple(dict.fromkeys(names))


def host_allowed(host: str, allowlist: tuple[str, ...]) -> bool:
    """Whether the name ``host`` (``host_name``'s form) matches ``allowlist``: exactly, by ``*``, or by a
    ``*.suffix`` entry for any name ending in ``.suffix``."""
    return any(entry == "*" or entry == host or (entry.startswith("*.") and host.endswith(entry[1:]))
               for entry in allowlist)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CONDUCTOR_", env_file=".env", extra="ignore",
                                      hide_input_in_errors=True)
    """A bad value is named, never echoed: settings hold keys (a mistyped CONDUCTOR_SECRETS_KEY rotation
    printed the key) and URLs with passwords."""

    database_url: str = DEFAULT_DATABASE_URL
    broker_url: str = DEFAULT_BROKER_URL
    result_backend: str = DEFAULT_RESULT_BACKEND
    pool_file: Path = DEFAULT_POOL_FILE
    pools_dir: Path | None = None
    """Where named pools (``"pool": "NAME"`` -> ``NAME.yaml``) published to API clients are looked up;
    the operator's CLI (``conductor run``, ``eval``) also looks beside the default pool file, then in the
    shipped pools."""
    data_dir: Path = Field(default_factory=_default_data_dir)
    models_dir: Path = Field(default_factory=_default_models_dir)
    """Where local models that ship as PyPI chunk packages are assembled (once, then reused)."""
    auth_required: bool = True
    allowed_hosts: str = ""
    """Host names the API answers to, comma-separated (``CONDUCTOR_ALLOWED_HOSTS``): a request whose ``Host``
    header names another is refused (400) before anything of it is read. A port is ignored (``localhost``
    allows ``localhost:8000``), an IPv6 address may be written with or without brackets, ``*`` allows any
    host and ``*.example.com`` any name below ``example.com`` (not ``example.com`` itself); an entry naming no
    host (``*.``, ``[]``, ``a*b``) is refused at start (``allowlist_entry_problem``). Empty (the
    default): ``*`` while ``auth_required``, else the loopback names only (``LOOPBACK_HOST_NAMES``). Why: a
    server without keys on 127.0.0.1 is still reachable from any web page the machine's browser opens, by
    DNS rebinding (the page's own name re-resolved to 127.0.0.1), and such a request carries the page's
    name as its Host."""

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, v: str) -> str:
        """An entry that names no host stops every process at start: '*.' normalised to '*' and allowed
        every host, and a typo would otherwise refuse every request or be silently ignored."""
        for entry in (e.strip() for e in v.split(",")):
            if entry and (problem := allowlist_entry_problem(entry)) is not None:
                raise ValueError(f"CONDUCTOR_ALLOWED_HOSTS entry {entry!r}: {problem}. Write a host name "
                                 "(api.example.com; a port is ignored), an IP address (10.0.0.7, ::1 or [::1]), "
                                 "'*.example.com' for every name below example.com, or '*' for any host")
        return v

    # Input limits: every request is checked against these before anything is stored.
    max_task_chars: int = Field(default=100_000, ge=1)
    max_steps: int = Field(default=5, ge=1, le=50)
    max_depth: int = Field(default=2, ge=0, le=5)
    max_instruction_chars: int = Field(default=20_000, ge=1)
    max_body_bytes: int = Field(default=1_000_000, ge=1024)
    max_metadata_bytes: int = Field(default=16_384, ge=0)
    max_header_bytes: int = Field(default=32_768, ge=4096, le=1_048_576)
    """Request headers (names and values, every header together) one request may send; more is 431.
    ``conductor serve`` also sizes its HTTP parser's buffer from it (``HEADER_BUFFER_BYTES`` more, for
    the request line), so headers within it are never refused by the parser (its own default: 16 KiB)."""

    # OpenAI-compatible routes.
    chat_max_wait_s: float = Field(default=540.0, gt=0, le=3600)
    """How long ``POST /v1/chat/completions`` waits for its job before answering 504 (the job runs on;
    its id is in the error). The wait holds no database connection. The default stays below the
    official OpenAI SDKs' 600 s read timeout: a client that timed out first would retry the request,
    submitting the job again, where our 504 tells it not to retry."""
    batch_max_lines: int = Field(default=1_000, ge=1, le=50_000)
    """Most requests (lines) one batch input file may hold; ``POST /v1/files`` refuses more."""
    batch_max_file_bytes: int = Field(default=10_000_000, ge=1024, le=200_000_000)
    """Largest batch input file ``POST /v1/files`` accepts (the upload is the one body allowed past
    ``max_body_bytes``; each line's own body must still fit ``max_body_bytes``)."""
    tenant_max_files: int = Field(default=10_000, ge=1)
    """Files a tenant may keep (batch inputs, and the output and error files of its batches); an upload
    past it is refused (400 ``quota_exceeded``) until ``DELETE /v1/files/{id}`` makes room."""
    tenant_max_file_bytes: int = Field(default=1_000_000_000, ge=1024)
    """Bytes a tenant's files may take together, checked at each upload like ``tenant_max_files``."""

    # Execution: how long a step's claim lives without renewal before the reconciler may hand it to
    # another worker. The worker renews it every third of this while it works on the step (heartbeat),
    # so it bounds how late a dead worker's step re-runs, not how long a call may take.
    step_lease_s: float = Field(default=30.0, gt=0)
    db_pool_size: int = Field(default=10, ge=1)
    db_max_overflow: int = Field(default=20, ge=0)
    """Each process (API, worker) opens at most ``db_pool_size + db_max_overflow`` Postgres connections
    (30 by default), and a worker one more for its lease heartbeat; keep the sum over every process under
    the server's ``max_connections`` (100 by default). A gevent worker's greenlets beyond that wait for a
    pooled connection."""
    db_pool_timeout_s: float = Field(default=30.0, gt=0, le=600)
    """How long a caller waits for a pooled connection when every one is in use; then the work is left
    for a retry or the reconciler, as when the database is down (never failed)."""
    db_connect_timeout_s: int = Field(default=10, ge=2, le=600)
    """How long opening a Postgres connection may take (libpq ``connect_timeout``): an unreachable server
    that drops packets otherwise holds the caller, and its pool slot, for minutes (libpq's least is 2)."""
    migration_lock_timeout_s: float = Field(default=5.0, ge=0, le=600)
    """``conductor migrate`` on Postgres: the longest a revision's statement waits for a lock (``lock_timeout``).
    While an ``ALTER TABLE job`` waits behind a long transaction, every new query on ``job`` queues behind
    it: this bounds that stall. On a timeout the revision is rolled back and tried again
    (``migration_lock_tries``). Concurrent index builds wait without it (they block no reads or writes).
    0: wait as long as it takes, once (the behaviour before it existed)."""
    migration_lock_tries: int = Field(default=10, ge=1, le=1000)
    """Tries of a revision that keeps timing out on a lock before ``conductor migrate`` gives up, naming
    the session that holds it; the schema stays at the revision before."""
    migration_lock_retry_wait_s: float = Field(default=10.0, ge=0, le=3600)
    """The pause between two tries of a revision that timed out on a lock, with nothing held (the
    service's queries run meanwhile)."""
    db_synchronous_commit: bool = True
    """Off, Postgres acknowledges a commit before its WAL reaches disk: each transaction stops waiting for
    an fsync (7-13 ms on the benchmark box), and a Postgres crash can lose the last few hundred ms of
    commits — which the engine re-drives (a lost claim or outcome is a step whose lease expires and
    runs again), though a client may have already read a result that is then re-computed."""
    worker_task_events: bool = True
    """Celery task events from workers (what Flower shows); off trades that view for throughput."""
    worker_events_flush_s: float = Field(default=0.05, gt=0, le=5)
    """A worker publishes the task events it buffered once per this interval, in one message, instead of
    one message per event (``conductor.tasks.app.BatchedTaskEvents``): Flower shows them at most this late."""
    task_sent_events: bool = False
    """A ``task-sent`` event per message published (the API's plan messages, a worker's step messages), so
    Flower lists a task while it still waits in the queue. Off by default: each is one more broker publish
    (about a tenth of the API's CPU per submit, docs/benchmarks.md); Flower shows a task from the moment a
    worker receives it either way, and its Broker tab the queue lengths."""
    worker_continue_steps: bool = True
    """A step worker runs one of the steps its step made ready itself, in the same task slot, instead of
    sending it through the broker and waiting for a worker to take it (the rest are sent as usual). It
    removes the broker round trip from every dependent hop, and the step is claimed in the transaction that
    made it ready; a crash after that is recovered like any other (the step's lease expires and it re-runs)."""
    worker_local_slots: int = Field(default=16, ge=0, le=10_000)
    """Steps a worker process runs beside its Celery pool's slots: when a plan or an outcome makes several
    steps ready at once (a fan-out's roots, a step's dependents), the one its task continues with and up
    to this many more (free slots only) are claimed in the same transaction and run at once in this
    process, instead of a broker message and a claim transaction each; the task that claimed them ends
    when they have (warm shutdown waits for them). Steps of a model loaded in the process (provider
    ``local``, one call at a time) are sent instead. 0 sends them all through the broker. Needs
    ``worker_continue_steps``."""
    worker_pool: Literal["threads", "prefork", "solo", "gevent"] = "threads"
    """``conductor worker``'s default Celery pool (``--pool`` overrides it)."""
    planning_stale_s: float = Field(default=60.0, gt=0)
    """A job ``planning`` whose planner's heartbeat (every third of ``step_lease_s``) has been silent this
    long lost its worker and is planned again. A planner that is merely slow keeps beating."""

    # Per-tenant quotas: what one API key's tenant may hold at once, so one tenant cannot crowd out the
    # others. Over a quota the API answers 429 with Retry-After; another tenant is not affected.
    tenant_submits_per_minute: int = Field(default=600, ge=1)
    tenant_submit_burst: int | None = Field(default=None, ge=1)
    """Submissions the tenant may make at once after an idle spell (default: the per-minute rate)."""
    tenant_max_jobs_in_flight: int = Field(default=200, ge=1)
    """Top-level jobs not yet ended (queued, planning or running), a batch's lines not counted."""
    tenant_max_batch_jobs_in_flight: int = Field(default=2_000, ge=1, le=1_000_000)
    """A batch's lines not yet ended. They run apart from the live quota above, behind live plans on the
    broker; a batch is admitted while the tenant's unfinished lines plus its input file's lines fit (two
    batches of the default ``batch_max_lines`` at once): a tenant then has at most this many plus
    ``tenant_max_jobs_in_flight`` jobs unfinished."""
    auth_failures_per_minute: int = Field(default=60, ge=0)
    """Failed API-key lookups (an unknown or revoked key) one client address may make a minute, a burst of as
    many, counted in Redis by every API process; past it such a request is 429 with ``Retry-After`` instead of
    401. Counted only once a lookup has failed: a valid key is never refused, whoever shares its address. 0:
    not counted."""
    tenant_max_streams: int = Field(default=10, ge=1)
    """Open ``GET /v1/jobs/{id}/events`` streams per tenant."""
    max_tree_steps: int = Field(default=60, ge=1)
    """Steps one job tree (a request and all its recursive child jobs) may have in total; a child job
    whose plan would pass it fails (``quota_exceeded``) instead of fanning out further."""

    step_max_attempts: int = Field(default=4, ge=1, le=20)
    retry_backoff_base_s: float = Field(default=1.0, ge=0)
    retry_backoff_max_s: float = Field(default=60.0, ge=0)
    provider_timeout_s: float = Field(default=300.0, gt=0)
    rate_limit_wait_s: float = Field(default=60.0, ge=0)
    """How long a step waits for its agent's shared requests-per-minute bucket before the attempt fails
    as rate limited (and is retried after the time the bucket says)."""
    # How often the reconciler runs and how old unfinished work must be before it is re-driven.
    reconcile_interval_s: float = Field(default=15.0, gt=0)
    reconcile_stale_s: float = Field(default=30.0, ge=0)
    metrics_settle_s: float = Field(default=60.0, ge=0)
    """How long after a job ended (with none of its provider calls still open) the reconciler folds it, its
    steps and attempts into ``metrics_rollup``, so that ``/metrics`` no longer aggregates their rows; a
    webhook delivery this long plus ``webhook_timeout_s`` and its lease's margin after it ended. The
    scrape's cost follows the rows not folded: those in flight and those that ended within this."""
    metrics_abandoned_s: float | None = Field(default=None, ge=0)
    """A job that ended with a call still open (its worker died mid-call, or it is still running and will
    close its attempt and add its usage when it returns), or with a planning that may still be running
    (it was re-driven, or ended before its plan), is folded only this long after it ended. Default: the
    longest a planning may run while its worker lives (two planner calls, each as long as a step's longest
    run: 78 min with the defaults); raise it for agents whose ``timeout_s`` is longer than
    ``provider_timeout_s``."""

    # Webhooks (Standard Webhooks): when each retry of a failed delivery is due, after attempt 1, 2, ...;
    # a delivery still failing after the last one is given up (``failed``).
    webhook_backoff_s: list[NonNegativeFloat] = Field(
        default_factory=lambda: [5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0], max_length=20
    )
    webhook_timeout_s: float = Field(default=15.0, gt=0, le=120)
    webhook_retry_after_max_s: float = Field(default=36000.0, ge=0)
    """A receiver's ``Retry-After`` is honoured up to this long."""
    webhook_tenant_max_in_flight: int = Field(default=4, ge=1, le=10_000)
    """Attempts one tenant may have in flight at once, across every webhooks worker. A due attempt past it
    is put off (not counted as an attempt) and comes back later, so that one tenant's slow or silent
    receivers hold at most this many worker slots for ``webhook_timeout_s`` each, and every other tenant's
    webhooks still go out. Keep it below a webhooks worker's ``--concurrency``."""
    webhook_allow_loopback: bool = False
    """Let webhooks target 127.0.0.0/8 and ::1 (tests, a receiver on the same host). Private, link-local,
    metadata and other non-global addresses stay refused."""
    webhook_denied_targets: str = Field(default="", max_length=10_000)
    """Public targets a webhook may not call besides the non-public ranges, comma-separated: this deployment's
    own addresses and names, so that a tenant's webhook cannot reach its API, Flower or load balancer from
    inside (past a firewall that keeps them from the internet). IP addresses and networks
    (``203.0.113.7``, ``198.51.100.0/24``, ``2001:db8::/32``: checked against every address a webhook's host
    resolves to at each send, and a literal one at submit) and host names as ``CONDUCTOR_ALLOWED_HOSTS``
    writes them (``flower.example.com``, ``*.internal.example.com``). The API's own names
    (``CONDUCTOR_ALLOWED_HOSTS`` entries that are not wildcards) are refused without being listed here. A
    malformed entry stops every process at start."""

    @field_validator("webhook_denied_targets")
    @classmethod
    def _denied_targets(cls, v: str) -> str:
        for entry in (e.strip() for e in v.split(",")):
            if entry and (problem := denied_target_problem(entry)) is not None:
                raise ValueError(f"CONDUCTOR_WEBHOOK_DENIED_TARGETS entry {entry!r}: {problem}. Write an IP "
                                 "address (203.0.113.7), a network (198.51.100.0/24) or a host name "
                                 "(flower.example.com, *.example.com)")
        return v

    api_key_pepper: str = ""
    """Keyed into every API-key hash; set it in production so a leaked table alone verifies nothing."""

    secrets_key: str = Field(default="", repr=False)
    """Fernet key(s), comma-separated (the first seals, any opens), sealing the webhook signing secrets
    at rest (``conductor.sealed``); empty stores them as given."""

    @field_validator("secrets_key")
    @classmethod
    def _fernet_keys(cls, v: str) -> str:
        """A malformed key stops every process at start, not at its first webhook."""
        from cryptography.fernet import Fernet

        for key in (k.strip() for k in v.split(",")):
            try:
                if key:
                    Fernet(key.encode())
            except ValueError as exc:
                raise ValueError("CONDUCTOR_SECRETS_KEY must be Fernet keys (32 url-safe base64 bytes each), "
                                 "comma-separated") from exc
        return v

    prompt_cache_scope: Literal["tenant", "shared"] = "tenant"
    """``tenant``: every worker and planner prompt carries its tenant's cache scope (``context.cache_scope``, a
    line of 16 hex digits of a hash of the tenant) ahead of the task, so no provider's prompt cache
    (Anthropic's, OpenAI's, Gemini's, vLLM's) serves one tenant's prompt from another's writes, and a tenant
    cannot tell from its cached tokens or timing what another sent. ``shared``: no such line; tenants whose
    prompts start alike share cached prefixes (one organization's teams, one deployment per tenant)."""

    def cache_scope(self, tenant: str) -> str:
        """The line a prompt of ``tenant`` carries ahead of its task (empty when caches are shared)."""
        from conductor.context import cache_scope

        return cache_scope(tenant) if self.prompt_cache_scope == "tenant" else ""

    step_queues: dict[str, str] = Field(default_factory=dict)
    """Agent name -> the Celery queue its steps go to (JSON: ``{"gpt-5": "steps-openai"}``), so one
    provider's slow or rate-limited calls hold only the workers of its own queue. Other agents' steps go
    to ``steps``. Every API, planner and step process must see the same map."""

    @field_validator("step_queues")
    @classmethod
    def _queue_names(cls, v: dict[str, str]) -> dict[str, str]:
        for agent, queue in v.items():
            if not QUEUE_NAME.fullmatch(queue) or queue in RESERVED_QUEUES:
                raise ValueError(f"queue {queue!r} for agent {agent!r}: use 1-64 letters, digits, '-', '_' or "
                                 f"'.', and none of {', '.join(RESERVED_QUEUES)}")
        return v

    ui_cookie_secure: bool | None = None
    """Whether the trace viewer's session cookie carries ``Secure`` (a browser then sends it over https
    only). Unset: when the request came over https as the API sees it. Behind a TLS-terminating proxy that
    holds only for a proxy at an address uvicorn trusts with ``X-Forwarded-Proto`` (``FORWARDED_ALLOW_IPS``,
    127.0.0.1 by default): a proxy reaching docker-compose's published port comes from the Docker network,
    and the cookie went out without ``Secure`` to browsers on https. Set true wherever the viewer is served
    over https; false never sets it."""

    metrics_token: str = ""
    """A bearer token for scraping ``/metrics`` with every tenant's series (give it to Prometheus). A
    tenant's API key sees only that tenant's series; with auth off, ``/metrics`` is open."""

    # OpenTelemetry (needs the ``otel`` extra): traces of finished jobs over OTLP/HTTP.
    otel_endpoint: str | None = None
    """OTLP/HTTP traces endpoint, e.g. ``http://collector:4318/v1/traces``; unset: no tracing."""
    otel_service_name: str = "conductor-queue"
    otel_capture_content: bool = False
    """Export the messages each worker saw and its answer (``gen_ai.input/output.messages``)."""
    flower_basic_auth: str | None = Field(default=None, validation_alias=AliasChoices("FLOWER_BASIC_AUTH"))
    """Flower's own ``user:pass`` login (Flower reads the same variable); ``conductor flower`` refuses to
    listen beyond loopback without it, since Flower can revoke tasks and shut workers down."""

    # Client side (``conductor submit``): where the API is and which key to send.
    api_url: str = "http://127.0.0.1:8000"
    api_key: str | None = None


    def host_allowlist(self) -> tuple[str, ...]:
        """``allowed_hosts`` as normalized names (``host_name``), or its default: ``("*",)`` while keys are
        required, the loopback names without them."""
        names = tuple(host_name(n) for n in self.allowed_hosts.split(",") if n.strip())
        if names:
            return names
        return ("*",) if self.auth_required else LOOPBACK_HOST_NAMES

    def step_max_duration_s(self, call_timeout_s: float | None = None) -> float:
        """The longest a step may run while its worker lives: every attempt waiting its full rate-limit
        wait and calling for its full timeout (the agent's, else ``provider_timeout_s``), and between
        attempts the longest wait the retry policy may take (a provider's Retry-After, honoured up to
        ``MAX_RETRY_AFTER_S``, or the longest backoff). Past it the heartbeat stops renewing the step's
        lease (its call is stuck)."""
        per_attempt = (call_timeout_s or self.provider_timeout_s) + self.rate_limit_wait_s
        between = max(self.retry_backoff_max_s, MAX_RETRY_AFTER_S)
        return self.step_max_attempts * per_attempt + (self.step_max_attempts - 1) * between


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Settings loaded once per process; tests call ``get_settings.cache_clear()`` after changing env."""
    return Settings()

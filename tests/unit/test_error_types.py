"""Stored error types are one snake_case vocabulary: every exception that can fail a step or a job
names its ErrorType, none is a provider error unless it came from a provider, and rows written by
earlier releases (Python class names) are renamed by the data migration."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory

from conductor.budget import BudgetExceeded, DeadlineExceeded
from conductor.errors import LEGACY_ERROR_TYPES, ConductorError, ErrorType, InternalError, StepAbandoned
from conductor.migrations.migrate import alembic_config, upgrade
from conductor.pool import errors as provider_errors
from conductor.pool.errors import ProviderError
from conductor.quotas import QuotaExceeded
from conductor.ratelimit import RateLimiterUnavailable, RateLimitTimeout

PROVIDER_ERRORS = [
    cls for cls in vars(provider_errors).values() if isinstance(cls, type) and issubclass(cls, ProviderError)
] + [RateLimitTimeout, RateLimiterUnavailable]
DOMAIN_ERRORS = [BudgetExceeded, DeadlineExceeded, StepAbandoned, InternalError]
NEWER_THAN_CLASS_NAMES = {"QuotaExhausted"}
"""Error classes added after stored types became ErrorType values: no row ever stored their class name."""


def test_every_error_type_is_snake_case() -> None:
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", t.value) for t in ErrorType)


@pytest.mark.parametrize("cls", PROVIDER_ERRORS + DOMAIN_ERRORS, ids=lambda c: c.__name__)
def test_each_error_class_stores_its_own_type_not_its_class_name(cls: type) -> None:
    error_type = cls.error_type  # type: ignore[attr-defined]
    assert isinstance(error_type, ErrorType) and error_type != cls.__name__
    if cls.__name__ not in NEWER_THAN_CLASS_NAMES:
        assert LEGACY_ERROR_TYPES[cls.__name__] == error_type  # what the migration renames its old rows to
    else:
        assert cls.__name__ not in LEGACY_ERROR_TYPES


def test_limits_and_lost_workers_are_domain_errors_not_provider_errors() -> None:
    for cls in [*DOMAIN_ERRORS, QuotaExceeded]:
        assert issubclass(cls, ConductorError) and not issubclass(cls, ProviderError), cls
        assert cls.retryable is False


def test_the_specific_provider_errors_are_told_apart() -> None:
    types = [cls.error_type for cls in PROVIDER_ERRORS if cls.__name__ not in ("RetryableError", "FatalError")]
    assert len(types) == len(set(types)), types



def test_migration_renames_old_rows_and_downgrade_restores_them(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'legacy.sqlite3'}"
    before = ScriptDirectory.from_config(alembic_config(url)).get_revision("0008_error_types").down_revision
    assert isinstance(before, str)
    upgrade(url, before)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO job (id, tenant, status, task, pool, pool_config, planner, depth, planner_attempts, "
            "plan_claims, plan_resends, error_type, planner_input_tokens, planner_output_tokens, planner_cost_usd, "
            "planner_calls, input_tokens, output_tokens, cost_usd, calls, limits, metadata, cancel_requested, "
            "created_at, updated_at) VALUES ('j1', 't', 'failed', 'x', 'p', '{}', 'conductor', 0, 0, 0, 0, "
            "'DeadlineExceeded', 0, 0, 0, 0, 0, 0, 0, 0, '{}', '{}', 0, '2026-01-01', '2026-01-01')"
        ))
        conn.execute(sa.text(
            "INSERT INTO step (id, job_id, \"index\", agent, instruction, access_list, access_all, status, "
            "input_tokens, output_tokens, cost_usd, attempts, resends, error_type) "
            "VALUES (1, 'j1', 0, 'a', 'do', '[]', 0, 'failed', 0, 0, 0, 2, 0, 'StepAbandoned')"
        ))
        for n, old in enumerate(["WorkerLost", "ServerError", "RateLimitTimeout", "child_job_failed"], start=1):
            conn.execute(sa.text(
                "INSERT INTO step_attempt (step_id, n, started_at, error_type) VALUES (1, :n, '2026-01-01', :t)"
            ), {"n": n, "t": old})

    def stored() -> list[str]:
        with engine.connect() as conn:
            return [
                *conn.execute(sa.text("SELECT error_type FROM job")).scalars(),
                *conn.execute(sa.text("SELECT error_type FROM step")).scalars(),
                *conn.execute(sa.text("SELECT error_type FROM step_attempt ORDER BY n")).scalars(),
            ]

    upgrade(url)
    assert stored() == ["deadline_exceeded", "step_abandoned", "worker_lost", "server_error", "rate_limit_timeout",
                        "child_job_failed"]
    assert all(t in set(ErrorType) for t in stored())
    command.downgrade(alembic_config(url), before)
    assert stored() == ["DeadlineExceeded", "StepAbandoned", "WorkerLost", "ServerError", "RateLimitTimeout",
                        "child_job_failed"]
    engine.dispose()


def test_no_code_stores_a_class_name_or_a_bare_string_as_an_error_type() -> None:
    """Every ``error_type=`` in ``conductor/`` passes an ErrorType (or a value read back from a row),
    never ``type(exc).__name__`` nor a string literal outside the enum."""
    package = Path(__file__).parents[2] / "conductor"
    offenders = []
    for path in package.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.keyword) or node.arg != "error_type":
                continue
            literal = isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            class_name = any(isinstance(n, ast.Attribute) and n.attr == "__name__" for n in ast.walk(node.value))
            if literal or class_name:
                offenders.append(f"{path.relative_to(package.parent)}:{node.value.lineno}")
    assert offenders == []


def test_every_rejection_has_one_http_status_and_only_the_service_knows_it() -> None:
    from conductor.errors import Rejection
    from conductor.service.problems import HTTP_STATUS

    assert set(HTTP_STATUS) == set(Rejection)
    assert all(400 <= code < 500 for code in HTTP_STATUS.values())
    assert len(set(HTTP_STATUS.values())) == len(Rejection)  # each status means one thing
    # Outside conductor/service, refusals carry a Rejection, never a number: no `status=4xx` keyword and
    # no numeric first argument to the request errors. (conductor/pool is exempt: a provider error
    # records the status the provider's HTTP API answered.)
    root = Path(__file__).resolve().parents[2] / "conductor"
    numeric = re.compile(r"(status=4\d\d|(SubmissionError|ChatRequestError|BatchFileError)\(\s*4\d\d)")
    offenders = [
        f"{path.relative_to(root)}:{n}"
        for path in root.rglob("*.py") if not {"service", "pool"} & set(path.relative_to(root).parts)
        for n, line in enumerate(path.read_text().splitlines(), start=1) if numeric.search(line)
    ]
    assert offenders == []

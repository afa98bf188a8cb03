"""For the migration tests: where a database's schema is, and migrations raced against each other."""

from __future__ import annotations

import os
import subprocess
import sys

import sqlalchemy as sa
from alembic import command
from alembic.runtime.migration import MigrationContext

from conductor.migrations.migrate import alembic_config, schema_revisions, upgrade
from tests.conftest import TESTS


def revisions(url: str) -> tuple[set[str], set[str]]:
    """The database's current revisions, and the package's heads."""
    current, heads, _ = schema_revisions(url)
    return current, heads


def assert_downgrades_to_base_and_upgrades_again(url: str) -> None:
    """Every revision's downgrade runs (from head to an empty schema), and the upgrade after it."""
    upgrade(url)
    command.downgrade(alembic_config(url), "base")
    assert revisions(url)[0] == set()
    upgrade(url)
    current, heads = revisions(url)
    assert current == heads


def run_together(setup: str, statement: str, *args: str, count: int = 2,
                 env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess[str]]:
    """Starts ``count`` Python processes that each run ``setup`` (imports, mostly; ``sys.argv[1:]`` is
    ``args``), waits until every one has, then releases them all at once to run ``statement``: a race
    between them is then a matter of milliseconds, not of which finished importing first. Returns each
    process's exit code and output."""
    code = f"import sys\n{setup}\nprint('ready', flush=True)\nsys.stdin.readline()\n{statement}\n"
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS.parent), child_env.get("PYTHONPATH")]))
    procs = [subprocess.Popen([sys.executable, "-c", code, *args], env=child_env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(count)]
    try:
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline() != "ready\n":
                raise AssertionError(f"the setup failed: {p.communicate(timeout=60)[1]}")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def assert_schema_is_the_models(url: str) -> None:
    """What ``alembic revision --autogenerate`` would write for a database at head: nothing, both as
    compare_metadata sees it with env.py's filter and as ``alembic check`` runs env.py itself."""
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from sqlmodel import SQLModel

    from conductor.migrations.migrate import objects_for

    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            opts = {"include_object": objects_for(conn.dialect.name)}
            assert compare_metadata(MigrationContext.configure(conn, opts=opts), SQLModel.metadata) == []
    finally:
        engine.dispose()
    command.check(alembic_config(url))

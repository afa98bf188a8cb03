"""Prebuilt statements executed on the driver's cursor: the step hot path's SQL without SQLAlchemy's
per-execution machinery.

SQLAlchemy spends about as much CPU setting up an execution (execution context, parameter processing,
result metadata and row objects) as psycopg spends sending the statement and reading its answer: on
the job-row lock, 192 µs per execution through ``Connection.execute`` against 101 µs on the cursor
(docs/benchmarks.md, engine). A statement here is compiled by SQLAlchemy once per dialect, with its
bind and result processors, and then run on the session's own DBAPI connection, inside the session's
transaction. Errors go through SQLAlchemy's own handling, so they arrive as the usual
``sqlalchemy.exc`` types and a dead connection invalidates the pool exactly as it would have.
``before_cursor_execute`` listeners are called as usual (without an execution context; a listener
registered with ``retval=True`` cannot rewrite these statements).

Only Postgres takes this path. SQLite (embedded mode), statements that SQLAlchemy expands at execution
time (``IN`` over a list) and ``executemany`` run through ``Connection.execute`` as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlmodel import Session

_PREPARED: dict[int, tuple[sa.Executable, _Prepared | None]] = {}
_PREPARED_MAX = 512


@dataclass
class _Prepared:
    sql: str
    constants: Mapping[str, Any]
    """Parameters whose value is part of the statement (literals such as a status), processed once."""
    variables: tuple[tuple[str, str, Callable[[Any], Any] | None], ...]
    """(name in the SQL, key the caller passes, bind processor) of each parameter the caller supplies."""
    columns: tuple[sa.ColumnElement[Any], ...]
    """The returned columns, whose types give the result processors."""
    results: tuple[Callable[[Any], Any] | None, ...] | None = None
    """The result processor of each returned column (None: the driver's value as it is), known after the
    first execution: some depend on the type the server reports (``cursor.description``)."""


class Rows:
    """What a direct execution returns: the subset of ``sqlalchemy.engine.Result`` the store uses."""

    __slots__ = ("rowcount", "rows")

    def __init__(self, rows: list[tuple[Any, ...]], rowcount: int):
        self.rows = rows
        self.rowcount = rowcount

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return iter(self.rows)

    def first(self) -> tuple[Any, ...] | None:
        return self.rows[0] if self.rows else None

    def scalars(self) -> list[Any]:
        return [row[0] for row in self.rows]

    def scalar_one(self) -> Any:
        if len(self.rows) != 1:
            raise sa.exc.NoResultFound("no row") if not self.rows else sa.exc.MultipleResultsFound("several rows")
        return self.rows[0][0]


class Direct:
    """The session's connection, for prebuilt statements (``execute(stmt, params)``)."""

    __slots__ = ("connection", "postgres")

    def __init__(self, session: Session | None = None, *, connection: sa.Connection | None = None):
        self.connection = connection if connection is not None else session.connection()  # type: ignore[union-attr]
        self.postgres = self.connection.dialect.name == "postgresql"
        """Postgres: statements may carry data-modifying CTEs (one round trip for what SQLite needs two)."""

    def execute(self, stmt: sa.Executable, params: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> Any:
        conn = self.connection
        if not isinstance(params, Mapping):  # executemany
            return conn.execute(stmt, params)
        prepared = _prepare(stmt, conn.dialect)
        if prepared is None:
            return conn.execute(stmt, params)
        values = _values(prepared, params)
        fairy = conn.connection  # the pooled DBAPI connection, in the session's transaction
        cursor = fairy.dbapi_connection.cursor()  # type: ignore[union-attr]
        try:
            if conn.dispatch.before_cursor_execute:  # listeners (statement counters, tracing) still see it
                conn.dispatch.before_cursor_execute(conn, cursor, prepared.sql, values, None, False)
            cursor.execute(prepared.sql, values)
            return _rows(prepared, cursor, conn.dialect)
        except conn.dialect.loaded_dbapi.Error as exc:
            # SQLAlchemy's own handling: wraps the error (OperationalError, IntegrityError, …) and, on a
            # disconnect, invalidates this connection and the pool's older ones.
            conn._handle_dbapi_exception(exc, prepared.sql, values, cursor, None)
            raise  # unreachable: the handler raises
        finally:
            cursor.close()

    def execute_pipelined(
        self, statements: Sequence[tuple[sa.Executable, Mapping[str, Any]]], *, commit: bool = False
    ) -> list[Any]:
        """Runs the statements one after another, as ``execute`` would, but on Postgres sends them all
        before reading any answer (a psycopg pipeline: one round trip). Each still runs in its own
        snapshot, after the one before it has finished (a lock the first takes is held when the second
        reads). The first error aborts the rest and is raised as ``execute`` raises it (the error names the
        last statement sent).

        ``commit``: the transaction's ``COMMIT`` goes in the same round trip, so a lock taken here is
        released by the server without waiting for this client again. The session's own commit then
        finds the connection idle and sends nothing; a statement after this one starts a new transaction.
        """
        conn = self.connection
        prepared = [_prepare(stmt, conn.dialect) for stmt, _ in statements]
        ready = [p for p in prepared if p is not None]
        if len(ready) != len(statements):  # SQLite, or a statement SQLAlchemy must expand: one at a time
            answers = [_fetched(self.execute(stmt, params)) for stmt, params in statements]
            if commit:  # on the driver's connection, as below: the session's commit then finds nothing to do
                conn.connection.dbapi_connection.commit()  # type: ignore[union-attr]
            return answers
        dbapi = conn.connection.dbapi_connection
        runs = [(p, _values(p, params), dbapi.cursor()) for p, (_, params) in zip(ready, statements, strict=True)]  # type: ignore[union-attr]
        current = runs[0]
        try:
            with dbapi.pipeline():  # type: ignore[union-attr]
                for current in runs:
                    prep, values, cursor = current
                    if conn.dispatch.before_cursor_execute:
                        conn.dispatch.before_cursor_execute(conn, cursor, prep.sql, values, None, False)
                    cursor.execute(prep.sql, values)
                if commit:
                    dbapi.commit()  # type: ignore[union-attr]
            return [_rows(prep, cursor, conn.dialect) for prep, _, cursor in runs]
        except conn.dialect.loaded_dbapi.Error as exc:
            prep, values, cursor = current
            conn._handle_dbapi_exception(exc, prep.sql, values, cursor, None)
            raise  # unreachable: the handler raises
        finally:
            for _, _, cursor in runs:
                cursor.close()


def _fetched(result: Any) -> Rows:
    """A result read to its end (SQLite cannot commit while a statement's rows are unread)."""
    if isinstance(result, Rows):
        return result
    return Rows([tuple(r) for r in result.all()] if result.returns_rows else [], result.rowcount)


def _values(prepared: _Prepared, params: Mapping[str, Any]) -> dict[str, Any]:
    values = dict(prepared.constants)
    for name, key, process in prepared.variables:
        value = params[key]
        values[name] = process(value) if process is not None else value
    return values


def _rows(prepared: _Prepared, cursor: Any, dialect: Dialect) -> Rows:
    rows: list[tuple[Any, ...]]
    if cursor.description is None:
        rows = []
    else:
        results = prepared.results
        if results is None:
            results = prepared.results = _result_processors(prepared.columns, cursor.description, dialect)
        if any(results):
            rows = [tuple(v if f is None else f(v) for f, v in zip(results, raw, strict=True))
                    for raw in cursor.fetchall()]
        else:
            rows = list(cursor.fetchall())
    return Rows(rows, cursor.rowcount)


def _prepare(stmt: sa.Executable, dialect: Dialect) -> _Prepared | None:
    if dialect.name != "postgresql":
        return None
    cached = _PREPARED.get(id(stmt))
    if cached is not None and cached[0] is stmt:
        return cached[1]
    prepared = _compile(stmt, dialect)
    if len(_PREPARED) >= _PREPARED_MAX:  # statements are built once per process; this only bounds a leak
        _PREPARED.clear()
    _PREPARED[id(stmt)] = (stmt, prepared)  # the statement is kept, so its id is not reused meanwhile
    return prepared


def _compile(stmt: sa.Executable, dialect: Dialect) -> _Prepared | None:
    compiled = stmt.compile(dialect=dialect)  # type: ignore[attr-defined]
    if compiled.post_compile_params or compiled.literal_execute_params:
        return None  # expanded per execution (IN over a list): SQLAlchemy's path
    constants: dict[str, Any] = {}
    variables = []
    escaped = compiled.escaped_bind_names
    for bind, unescaped in compiled.bind_names.items():
        name = escaped.get(unescaped, unescaped)
        process = bind.type.dialect_impl(dialect).bind_processor(dialect)
        if bind.required:  # a bindparam() without a value: the caller supplies it by its key
            variables.append((name, bind.key, process))
        else:
            value = bind.effective_value
            constants[name] = process(value) if process is not None else value
    columns = tuple(stmt.exported_columns) if isinstance(stmt, sa.sql.expression.ReturnsRows) else ()
    return _Prepared(compiled.string, constants, tuple(variables), columns)


def _result_processors(
    columns: tuple[sa.ColumnElement[Any], ...], description: Sequence[Any], dialect: Dialect
) -> tuple[Callable[[Any], Any] | None, ...]:
    return tuple(col.type.dialect_impl(dialect).result_processor(dialect, d[1])
                 for col, d in zip(columns, description, strict=True))

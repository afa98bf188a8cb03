"""Lists on a migrated SQLite store (embedded mode), as on Postgres (tests/integration/test_job_list.py,
test_batch_reads.py): ``GET /v1/jobs``'s metadata filter and several statuses merged across pages; batches
and files paged by a cursor among rows created at the same instant."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.list_cases import (
    check_batch_and_file_pages_with_equal_created_at,
    check_metadata_filter,
    check_several_statuses_across_pages,
)
from tests.sqlite_store import sqlite_store


def test_the_metadata_filter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with sqlite_store(tmp_path, monkeypatch):
        check_metadata_filter(postgres=False)


def test_several_statuses_are_listed_newest_first_across_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with sqlite_store(tmp_path, monkeypatch):
        check_several_statuses_across_pages()


def test_batches_and_files_page_across_equal_created_at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with sqlite_store(tmp_path, monkeypatch):
        check_batch_and_file_pages_with_equal_created_at()

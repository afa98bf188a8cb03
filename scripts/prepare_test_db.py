"""Creates the test database if it is missing and migrates it to the latest revision."""

from __future__ import annotations

import os
import sys

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conductor.migrations.migrate import upgrade

URL = os.environ.get("CONDUCTOR_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/conductor_test")


def main() -> None:
    url = make_url(URL)
    admin = create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        exists = conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": url.database}).first()
        if not exists:
            conn.execute(text(f'CREATE DATABASE "{url.database}"'))
    admin.dispose()
    upgrade(URL)
    print(f"test database ready: {url.render_as_string(hide_password=True)}")


if __name__ == "__main__":
    main()

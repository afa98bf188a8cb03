"""``conductor worker --pool gevent`` runs here: gevent must patch the standard library (sockets, ssl,
threads, sleep) before anything imports it, so this module patches first and then runs the CLI.

Under gevent a worker process holds hundreds of provider calls in flight on greenlets: the SDKs'
HTTP clients (httpx), redis-py and psycopg 3 (gevent-aware since 3.1.14) all yield while they wait.
In-process llama.cpp calls (provider ``local``) never yield: run those on a threads-pool worker.
"""

from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import sys  # noqa: E402

from conductor.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

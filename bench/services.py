"""A private Postgres cluster and Redis server that a soak (or a test) starts, restarts and stops itself.

Never the shared servers (5432, 6379): a cluster under ``root`` made by ``initdb``, listening on loopback at
``pg_port`` (its socket in ``root`` too), and a ``redis-server`` on ``redis_port`` whose dump file lives in
``root``. As root, ``initdb`` and ``postgres`` refuse to run: they run as the ``postgres`` user
(``runuser``), which owns the cluster's directory.

Restarts are the faults a deployment meets: Postgres stopped ``fast`` (sessions ended, a checkpoint) or
``immediate`` (crash recovery at the next start), Redis shut down with a save (its queued messages come
back) or killed without one (``--save ""``: the broker's queued and unacknowledged messages are lost,
and the reconciler must re-send what the rows say is due).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import time
from pathlib import Path

PG_USER = "postgres"
"""The user the cluster runs as when this process is root (initdb and postgres refuse root)."""
START_TIMEOUT_S = 60.0
"""How long a start (Postgres's recovery included) or a stop may take before it is an error."""


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if found:
        return found[-1]
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found: install the Postgres server binaries (Debian: postgresql)")
    return path


class PrivatePostgres:
    """A Postgres cluster of its own under ``root``/pg on ``port``."""

    def __init__(self, root: Path, port: int):
        self.root, self.port = root / "pg", port
        self.data, self.log = self.root / "data", self.root / "postgres.log"
        self._as_root = os.geteuid() == 0

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = list(argv)
        if self._as_root:
            cmd = ["runuser", "-u", PG_USER, "--", *cmd]
        return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=START_TIMEOUT_S + 30)

    def init(self) -> None:
        """initdb (trust auth, superuser ``postgres``) unless the cluster exists."""
        self.root.mkdir(parents=True, exist_ok=True)
        if self._as_root:
            pw = pwd.getpwnam(PG_USER)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        if not (self.data / "PG_VERSION").exists():
            self._run(_pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                      "--no-instructions")

    def start(self) -> None:
        # fsync=off: a process crash (stop -m immediate) loses nothing the OS holds; only a machine crash would.
        opts = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                f"-c max_connections=200 -c full_page_writes=off")
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w",
                  "-t", str(int(START_TIMEOUT_S)), "start")

    def stop(self, mode: str = "fast") -> None:
        """``fast`` or ``immediate`` (no checkpoint: crash recovery at the next start)."""
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", str(int(START_TIMEOUT_S)), "stop",
                  check=False)

    def running(self) -> bool:
        return self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "status", check=False).returncode == 0


class PrivateRedis:
    """A redis-server of its own on ``port``, its dump file (if any) in ``root``/redis."""

    def __init__(self, root: Path, port: int):
        self.root, self.port = root / "redis", port
        self.dump = self.root / "dump.rdb"
        self.popen: subprocess.Popen[bytes] | None = None

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self, *, keep_data: bool = True) -> None:
        """Starts the server; with ``keep_data`` False any dump a save left is removed first (an empty broker)."""
        self.root.mkdir(parents=True, exist_ok=True)
        if not keep_data:
            self.dump.unlink(missing_ok=True)
        log = (self.root / "redis.log").open("ab")
        self.popen = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.root), "--dbfilename", "dump.rdb"], stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()
        import redis

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if redis.Redis(port=self.port, socket_connect_timeout=1).ping():
                    return
            except redis.exceptions.BusyLoadingError:
                pass
            except redis.exceptions.ConnectionError:
                if self.popen.poll() is not None:
                    raise RuntimeError(f"redis-server exited; see {self.root / 'redis.log'}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer within {START_TIMEOUT_S}s")
            time.sleep(0.1)

    def stop(self, *, save: bool) -> None:
        """``SHUTDOWN SAVE`` (the data comes back at the next start) or SIGKILL (it does not)."""
        if self.popen is None or self.popen.poll() is not None:
            return
        if save:
            import redis

            with contextlib.suppress(redis.exceptions.ConnectionError):  # the server closes it as it exits
                redis.Redis(port=self.port, socket_timeout=30).shutdown(save=True)
        else:
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=START_TIMEOUT_S)

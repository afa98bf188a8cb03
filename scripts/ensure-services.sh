#!/usr/bin/env bash
# Makes sure Postgres and Redis answer on 127.0.0.1:5432 and :6379, where the suite runs (some tests stop,
# restart and use fixed Redis databases of that server; CONDUCTOR_TEST_* pick another database there).
# If none answers and the server binaries exist locally, starts them; otherwise says what to do.
set -uo pipefail

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null || python3 - <<'PY'
import socket,sys
s=socket.socket(); s.settimeout(1)
sys.exit(0 if s.connect_ex(("127.0.0.1",5432))==0 else 1)
PY
}
redis_up() { python3 - <<'PY'
import socket,sys
s=socket.socket(); s.settimeout(1)
try:
    s.connect(("127.0.0.1",6379)); s.sendall(b"PING\r\n"); sys.exit(0 if s.recv(16).startswith(b"+PONG") else 1)
except OSError:
    sys.exit(1)
PY
}

if ! pg_up; then
  if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
    echo ">> Postgres is not answering on 127.0.0.1:5432; starting the local cluster"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
    for _ in $(seq 1 30); do pg_up && break; sleep 1; done
  fi
  pg_up || { echo "Postgres is not reachable on 127.0.0.1:5432: start it (e.g. pg_ctlcluster --skip-systemctl-redirect VERSION main start); the suite needs it there" >&2; exit 1; }
fi
if ! redis_up; then
  if command -v redis-server >/dev/null 2>&1; then
    echo ">> Redis is not answering on 127.0.0.1:6379; starting a local one"
    mkdir -p /tmp/conductor-redis
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
      --dir /tmp/conductor-redis --logfile /tmp/conductor-redis/redis.log
    for _ in $(seq 1 30); do redis_up && break; sleep 0.5; done
  fi
  redis_up || { echo "Redis is not reachable on 127.0.0.1:6379: start it (redis-server --daemonize yes --port 6379); the suite needs it there" >&2; exit 1; }
fi
echo ">> Postgres and Redis answer"

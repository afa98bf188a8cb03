#!/usr/bin/env bash
# Installs the system tools the test suite drives, from Debian's packages, only when missing:
#   chromium (+ chromium-driver)  the trace viewer's browser test (Playwright uses /usr/bin/chromium;
#                                 never `playwright install`, which downloads a browser of its own)
#   docker-compose                validates docker-compose.yml (`docker compose config` is used where
#                                 the Compose plugin exists)
set -uo pipefail

missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium chromium-driver)
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null 2>&1; then
  missing+=(docker-compose)
fi
[ ${#missing[@]} -eq 0 ] && { echo ">> chromium and docker compose are installed"; exit 0; }

if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo ">> installing ${missing[*]} from Debian's packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null \
    || { echo "apt-get could not install ${missing[*]}" >&2; exit 1; }
else
  echo "missing ${missing[*]}: install them (Debian: apt-get install ${missing[*]}); the browser and" \
       "compose tests fail without them" >&2
  exit 1
fi

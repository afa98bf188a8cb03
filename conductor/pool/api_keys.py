"""Reads provider API keys from the environment at call time, so a rotated key needs no restart.

The key is never stored on a provider and never put into a message: only the variable's name is.
"""

from __future__ import annotations

import os

from conductor.pool.errors import AuthError


def read_api_key(env_name: str, *, where: str) -> str:
    value = os.environ.get(env_name, "").strip()
    if not value:
        raise AuthError(f"{where}: no API key: set the environment variable {env_name}")
    return value

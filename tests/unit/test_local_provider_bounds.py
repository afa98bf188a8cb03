"""The local provider keeps to the call's timeout like any provider (``slow``: the real Gemma 3 270M):
waiting for the model, which serves one call at a time, counts against it, and so does generation."""

from __future__ import annotations

import threading

import pytest

from conductor.pool.base import CallOptions, Message
from conductor.pool.config import AgentConfig
from conductor.pool.errors import ProviderTimeout
from conductor.pool.local_provider import LocalProvider

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def provider() -> LocalProvider:
    p = LocalProvider("gemma", AgentConfig(provider="local", model="gemma-3-270m-q4_k_m", max_tokens=64,
                                           options={"n_ctx": 2048}))
    p.load()
    return p


def test_a_call_that_waits_for_a_busy_model_past_its_timeout_times_out(provider: LocalProvider) -> None:
    loaded = provider.load()
    loaded.lock.acquire()  # another step's call holds the model
    releaser = threading.Timer(20.0, loaded.lock.release)  # (without the bound, the call would wait for this)
    releaser.start()
    try:
        with pytest.raises(ProviderTimeout, match="busy"):
            provider.complete([Message("user", "Hi")], CallOptions(max_tokens=4, timeout_s=0.2))
        assert releaser.is_alive()  # it gave up on its own, not because the model came free
    finally:
        releaser.cancel()
        if loaded.lock.locked():
            loaded.lock.release()


def test_generation_stops_at_the_timeout_and_frees_the_model(provider: LocalProvider) -> None:
    schema = {"type": "object", "properties": {"essay": {"type": "string", "minLength": 3000}},
              "required": ["essay"], "additionalProperties": False}  # forces a long answer
    with pytest.raises(ProviderTimeout, match="generation passed"):
        provider.complete([Message("user", "Write a long essay.")],
                          CallOptions(max_tokens=1500, timeout_s=1.0, json_schema=schema))
    assert not provider.load().lock.locked()
    short = provider.complete([Message("user", "Say yes.")], CallOptions(max_tokens=4, timeout_s=60))
    assert short.output_tokens > 0

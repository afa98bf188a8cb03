"""Agent config -> a Provider instance. The only place that knows which class serves which provider."""

from __future__ import annotations

from functools import lru_cache

from pydantic import ValidationError

from conductor.pool.base import Provider
from conductor.pool.config import AgentConfig
from conductor.pool.errors import ConfigError


def build_provider(agent: str, config: AgentConfig) -> Provider:
    try:
        return _build(agent, config)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ConfigError(f"agent '{agent}': bad options: {where + ': ' if where else ''}{first['msg']}") from exc


def _build(agent: str, config: AgentConfig) -> Provider:
    if config.provider == "sim":
        from conductor.pool.sim import SimOptions, SimProvider

        return SimProvider(agent, SimOptions.model_validate(config.options))
    if config.provider in ("openai", "openai_compatible"):
        from conductor.pool.openai_provider import OpenAIProvider

        return OpenAIProvider(agent, config)
    if config.provider == "anthropic":
        from conductor.pool.anthropic_provider import AnthropicProvider

        return AnthropicProvider(agent, config)
    if config.provider == "gemini":
        from conductor.pool.gemini_provider import GeminiProvider

        return GeminiProvider(agent, config)
    if config.provider == "local":
        from conductor.pool.local_provider import LocalProvider

        return LocalProvider(agent, config)
    raise ConfigError(f"agent '{agent}': unknown provider '{config.provider}'")


def caches_on_request(config: AgentConfig) -> bool:
    """Whether this agent's calls ask the provider to cache the prompt prefixes other calls share
    (``CallOptions.cache_points``), and so may pay for cache writes: Anthropic agents unless their option
    ``prompt_cache`` is false. The other providers cache on their own."""
    return config.provider == "anthropic" and config.options.get("prompt_cache", True) is not False


def caches_for_an_hour(config: AgentConfig) -> bool:
    """Whether this agent's cache writes ask for the one-hour cache (priced ``Price.cache_write_1h_per_mtok``):
    Anthropic agents with ``prompt_cache_ttl: 1h``."""
    return caches_on_request(config) and config.options.get("prompt_cache_ttl") == "1h"


def provider_for(agent: str, config: AgentConfig) -> Provider:
    """Providers are reused per process (they hold HTTP connection pools), keyed by their full config."""
    return _cached(agent, config.model_dump_json())


@lru_cache(maxsize=128)
def _cached(agent: str, config_json: str) -> Provider:
    return build_provider(agent, AgentConfig.model_validate_json(config_json))

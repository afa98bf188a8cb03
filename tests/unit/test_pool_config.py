"""Pool files: every bad entry is named in one clear error; names from requests never become paths."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from conductor.pool.base import CallOptions, Message
from conductor.pool.config import AgentConfig, PoolError, Price, load_pool, resolve_pool_path
from conductor.pool.registry import build_provider
from conductor.settings import SHIPPED_POOLS_DIR


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["research", "local", "sim"])
def test_shipped_pools_load(name: str) -> None:
    pool = load_pool(SHIPPED_POOLS_DIR / f"{name}.yaml")
    assert pool.worker_names and pool.planner not in pool.worker_names


def test_every_bad_entry_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, """
agents:
  good: {provider: sim}
  nomodel: {provider: openai}
  hot: {provider: sim, temperature: 9}
  leaky: {provider: openai, model: m, api_key_env: "sk-live-123"}
  typo: {provider: sim, temprature: 0.1}
  alien: {provider: nope, model: m}
""")
    with pytest.raises(PoolError) as info:
        load_pool(path)
    msg = str(info.value)
    assert str(path) in msg
    for where in ("agents.nomodel", "agents.hot.temperature", "agents.leaky.api_key_env", "agents.typo.temprature",
                  "agents.alien.provider"):
        assert where in msg, where
    assert "never a key" in msg and "sk-live-123" not in msg  # a key pasted by mistake is not echoed


def test_defaults_and_prices(tmp_path: Path) -> None:
    pool = load_pool(write(tmp_path, "agents:\n  a: {provider: sim, price: {input_per_mtok: 2, output_per_mtok: 8}}\n"))
    a = pool.agents["a"]
    assert a.temperature == 0.2 and a.max_tokens == 4096
    assert a.price.cost(1_000_000, 500_000) == pytest.approx(6.0)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("agents: {}\n", "at least one agent"),
        ("agents:\n  conductor: {provider: sim}\n", "reserved"),
        ("planner: ghost\nagents:\n  a: {provider: sim}\n", "planner 'ghost'"),
        ("fallback: a\nagents:\n  a: {provider: sim}\n", "fallback must be a template"),
        ("agents: [\n", "not valid YAML"),
        ("- just a list\n", "must be a mapping"),
    ],
)
def test_pool_level_mistakes(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(PoolError, match=needle):
        load_pool(write(tmp_path, text))


def test_unreadable_file() -> None:
    with pytest.raises(PoolError, match="cannot read pool file"):
        load_pool(Path("/nonexistent/pool.yaml"))


def test_request_pool_names_cannot_be_paths(tmp_path: Path) -> None:
    secret = write(tmp_path, "agents:\n  a: {provider: sim}\n")
    dirs = [SHIPPED_POOLS_DIR]
    for name in (str(secret), "../../etc/passwd", "a/b"):
        with pytest.raises(PoolError, match="unknown pool"):
            resolve_pool_path(name, default_file=SHIPPED_POOLS_DIR / "research.yaml", pools_dirs=dirs)
    assert resolve_pool_path(str(secret), default_file=secret, pools_dirs=dirs, allow_path=True) == secret
    assert resolve_pool_path("local", default_file=secret, pools_dirs=dirs) == SHIPPED_POOLS_DIR / "local.yaml"


def test_agents_naming_one_rate_limit_bucket_share_it_and_must_agree_on_its_rpm(tmp_path: Path) -> None:
    pool = load_pool(write(tmp_path, "planner: p\nagents:\n  p: {provider: sim, rpm: 50, rpm_bucket: w}\n"
                                     "  w: {provider: sim, rpm: 50}\n  x: {provider: sim, rpm: 50}\n"))
    assert [pool.agents[n].bucket(n) for n in ("p", "w", "x")] == ["w", "w", "x"]
    for text in ("agents:\n  p: {provider: sim, rpm: 60, rpm_bucket: w}\n  w: {provider: sim, rpm: 50}\n",
                 "agents:\n  p: {provider: sim, rpm_bucket: w}\n  w: {provider: sim, rpm: 50}\n",
                 "agents:\n  p: {provider: sim, rpm: 5, rpm_bucket: b}\n  q: {provider: sim, rpm: 6, rpm_bucket: b}\n"):
        with pytest.raises(PoolError, match=r"rate-limit bucket '[wb]' must give the same rpm"):
            load_pool(write(tmp_path, text))
    with pytest.raises(PoolError, match="rpm_bucket"):
        load_pool(write(tmp_path, "agents:\n  p: {provider: sim, rpm: 5, rpm_bucket: 'a b'}\n"))


def test_a_pool_snapshot_leaves_out_an_unset_bucket(tmp_path: Path) -> None:
    # a job stores its pool as JSON; workers of the release before this field (a rolling deploy) read it with
    # extra fields forbidden, so the field is written only where a pool sets it
    pool = load_pool(write(tmp_path, "planner: p\nagents:\n  p: {provider: sim, rpm: 5, rpm_bucket: w}\n"
                                     "  w: {provider: sim, rpm: 5}\n"))
    dumped = pool.model_dump(mode="json")
    assert dumped["agents"]["p"]["rpm_bucket"] == "w" and "rpm_bucket" not in dumped["agents"]["w"]
    assert type(pool).model_validate(dumped) == pool


def test_cached_input_tokens_cost_the_cached_price_and_are_part_of_the_input() -> None:
    price = Price(input_per_mtok=1.25, cached_input_per_mtok=0.125, output_per_mtok=10.0)
    assert price.cost(1_000_000, 100_000, 800_000) == pytest.approx(0.2 * 1.25 + 0.8 * 0.125 + 0.1 * 10.0)
    assert price.cost(1_000_000, 100_000) == pytest.approx(1.25 + 1.0)  # none cached: all at the input price
    # at most all the input is cached; a negative count is none
    assert price.cost(1000, 0, 5000) == pytest.approx(price.cost(1000, 0, 1000)) == pytest.approx(1000 * 0.125 / 1e6)
    assert price.cost(1000, 0, -5) == pytest.approx(price.cost(1000, 0))


def test_without_a_cached_price_cached_tokens_cost_the_input_price() -> None:
    price = Price(input_per_mtok=2.0, output_per_mtok=8.0)
    assert price.cached_input_per_mtok is None
    assert price.cost(1_000_000, 500_000, 900_000) == pytest.approx(price.cost(1_000_000, 500_000))
    assert price.cost(1_000_000, 500_000) == pytest.approx(6.0)
    free_cache = Price(input_per_mtok=2.0, cached_input_per_mtok=0.0)  # 0 is a price, not "unset"
    assert free_cache.cost(1_000_000, 0, 250_000) == pytest.approx(1.5)


def test_a_pool_file_with_a_cached_price_loads_and_a_negative_one_is_named(tmp_path: Path) -> None:
    pool = load_pool(write(tmp_path, "agents:\n  a: {provider: sim, price: {input_per_mtok: 3, "
                                     "cached_input_per_mtok: 0.3, output_per_mtok: 15}}\n"))
    assert pool.agents["a"].price.cached_input_per_mtok == 0.3
    assert pool.agents["a"].price.cost(1_000_000, 0, 1_000_000) == pytest.approx(0.3)
    with pytest.raises(PoolError, match=r"agents\.a\.price\.cached_input_per_mtok"):
        load_pool(write(tmp_path, "agents:\n  a: {provider: sim, price: {cached_input_per_mtok: -1}}\n"))


class _PriceOfAnOlderRelease(BaseModel):
    """``Price`` as workers of the release before ``cached_input_per_mtok`` read it: extra keys forbidden."""

    model_config = ConfigDict(extra="forbid")
    input_per_mtok: float = 0.0
    output_per_mtok: float = 0.0


@pytest.mark.parametrize("mode", ["python", "json"])
def test_a_pool_snapshot_leaves_out_an_unset_cached_price(tmp_path: Path, mode: str) -> None:
    # a job stores its pool as JSON; workers of the release before this field (a rolling deploy) read it with
    # extra fields forbidden, so the field is written only where a pool sets it
    agent = AgentConfig(provider="sim", price=Price(input_per_mtok=1.0, output_per_mtok=2.0))
    dumped = agent.model_dump(mode=mode)
    assert "cached_input_per_mtok" not in dumped["price"] and "cache_write_per_mtok" not in dumped["price"]
    assert _PriceOfAnOlderRelease.model_validate(dumped["price"]).input_per_mtok == 1.0
    assert AgentConfig.model_validate(dumped) == agent

    pool = load_pool(write(tmp_path, "agents:\n  plain: {provider: sim, price: {input_per_mtok: 1}}\n  cached: "
                                     "{provider: sim, price: {input_per_mtok: 1, cached_input_per_mtok: 0.1}}\n"))
    snapshot = pool.model_dump(mode=mode)
    assert "cached_input_per_mtok" not in snapshot["agents"]["plain"]["price"]
    assert snapshot["agents"]["cached"]["price"]["cached_input_per_mtok"] == 0.1
    assert type(pool).model_validate(snapshot) == pool


@pytest.mark.parametrize("name", ["research", "local", "local-gemma", "sim"])
def test_no_shipped_pool_sets_a_cached_price_yet(name: str) -> None:
    """Their jobs' snapshots must stay readable by the workers of the release before the field, which refuse
    an unknown price key: a shipped pool sets it one release later (research.yaml says which prices)."""
    pool = load_pool(SHIPPED_POOLS_DIR / f"{name}.yaml")
    prices = [a["price"] for a in pool.model_dump()["agents"].values()]
    assert all(set(p) <= {"input_per_mtok", "output_per_mtok"} for p in prices)
    # nor an anthropic agent's prompt-cache options, which workers before them refuse the same way
    assert not any(key.startswith("prompt_cache") for a in pool.agents.values() for key in a.options)


def test_a_sim_agent_reports_its_cached_input_tokens_option() -> None:
    messages = [Message("user", "x" * 400)]  # 100 estimated tokens
    for option, cached in ((30, 30), (1000, 100)):
        provider = build_provider("s", AgentConfig(provider="sim", options={"cached_input_tokens": option}))
        completion = provider.complete(messages, CallOptions())
        assert (completion.input_tokens, completion.cached_input_tokens) == (100, cached)
    assert build_provider("s", AgentConfig(provider="sim")).complete(messages, CallOptions()).cached_input_tokens == 0

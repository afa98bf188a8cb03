"""Pool files: every bad entry is named in one clear error; names from requests never become paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from conductor.pool.config import PoolError, load_pool, resolve_pool_path
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

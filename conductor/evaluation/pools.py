"""A copy of a pool file with the planner's sampling temperature changed (for rollouts)."""

from __future__ import annotations

from pathlib import Path

import yaml

from conductor.pool.config import PoolError, load_pool, resolve_pool_path
from conductor.settings import get_settings

POOLS_SUBDIR = "eval-pools"


def with_planner_temperature(pool: str | None, temperature: float, *, tag: str, data_dir: Path | None) -> Path:
    """Writes ``<data dir>/eval-pools/<pool>-<tag>.yaml``: the pool with its planner agent at
    ``temperature``. A pool planned by a template has nothing to sample: PoolError."""
    from conductor.embedded import default_pool
    from conductor.submission import pools_dirs

    settings = get_settings()
    name = pool if pool is not None else default_pool(settings, data_dir)[0]
    path = resolve_pool_path(name, default_file=settings.pool_file, pools_dirs=pools_dirs(settings, local=True),
                             allow_path=True)
    config = load_pool(path)
    planner = config.agents.get(config.planner)
    if planner is None:
        raise PoolError(f"pool {config.name} plans with {config.planner}, not a model: there is no planner "
                        "temperature to set")
    planner.temperature = temperature
    directory = (data_dir or settings.data_dir).expanduser() / POOLS_SUBDIR
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{config.name}-{tag}.yaml"
    target.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), encoding="utf-8")
    return target

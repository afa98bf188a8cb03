"""The worker pool file: which agents exist, how to reach them, what they cost."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from conductor.workflow import CONDUCTOR_AGENT

ProviderName = Literal["openai", "anthropic", "gemini", "openai_compatible", "local", "sim"]
TEMPLATE_PLANNERS = ("single", "fanout", "pev", "moa")
DEFAULT_TEMPERATURE = 0.2
DEFAULT_MAX_TOKENS = 4096
POOL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class PoolError(ValueError):
    """A pool file that cannot be used; the message names the file and every bad entry."""


CACHE_WRITE_FACTOR = 1.25
"""A prompt-cache write's price over the input price when the pool gives none: Anthropic's rate for its
5-minute cache, the one the Anthropic provider asks for by default (the only provider that reports writes)."""
CACHE_WRITE_1H_FACTOR = 2.0
"""A one-hour prompt-cache write's price over the input price when the pool gives none: Anthropic's rate
(``Price.cache_write_1h_per_mtok``)."""
ANTHROPIC_CACHE_READ_FACTOR = 0.1
"""An Anthropic prompt-cache read's price over the input price, for every Claude model: an ``anthropic``
agent's unset ``cached_input_per_mtok`` (``AgentConfig.billing``). Other providers' rates differ by model."""


class Price(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_per_mtok: float = Field(default=0.0, ge=0)
    output_per_mtok: float = Field(default=0.0, ge=0)
    cached_input_per_mtok: float | None = Field(default=None, ge=0)
    """The price of an input token read from the provider's prompt cache; None: ``input_per_mtok``."""
    cache_write_per_mtok: float | None = Field(default=None, ge=0)
    """The price of an input token written to the provider's prompt cache (Anthropic's 5-minute cache);
    None: ``CACHE_WRITE_FACTOR`` times ``input_per_mtok``."""
    cache_write_1h_per_mtok: float | None = Field(default=None, ge=0)
    """The price of an input token written to Anthropic's one-hour prompt cache; None: ``CACHE_WRITE_1H_FACTOR``
    times ``input_per_mtok``."""

    @property
    def write_per_mtok(self) -> float:
        """What a (5-minute) cache write costs per million tokens."""
        if self.cache_write_per_mtok is not None:
            return self.cache_write_per_mtok
        return self.input_per_mtok * CACHE_WRITE_FACTOR

    @property
    def write_1h_per_mtok(self) -> float:
        """What a one-hour cache write costs per million tokens."""
        if self.cache_write_1h_per_mtok is not None:
            return self.cache_write_1h_per_mtok
        return self.input_per_mtok * CACHE_WRITE_1H_FACTOR

    def cost(self, input_tokens: int, output_tokens: int, cached_input_tokens: int = 0,
             cache_write_tokens: int = 0, cache_write_1h_tokens: int = 0) -> float:
        """``cached_input_tokens`` (read from the cache) and ``cache_write_tokens`` (written to it) are part
        of ``input_tokens`` (together at most all of them), each priced apart; of the writes,
        ``cache_write_1h_tokens`` went to the one-hour cache (its own price)."""
        cached = min(max(cached_input_tokens, 0), input_tokens)
        written = min(max(cache_write_tokens, 0), input_tokens - cached)
        hour = min(max(cache_write_1h_tokens, 0), written)
        cached_price = self.input_per_mtok if self.cached_input_per_mtok is None else self.cached_input_per_mtok
        return ((input_tokens - cached - written) * self.input_per_mtok + cached * cached_price
                + (written - hour) * self.write_per_mtok + hour * self.write_1h_per_mtok
                + output_tokens * self.output_per_mtok) / 1_000_000

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for optional in ("cached_input_per_mtok", "cache_write_per_mtok", "cache_write_1h_per_mtok"):
            if data.get(optional) is None:  # a job's pool snapshot stays readable by older workers
                data.pop(optional, None)
        return data


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    provider: ProviderName
    model: str = ""
    base_url: str | None = None
    api_key_env: str | None = None
    temperature: float | None = Field(default=DEFAULT_TEMPERATURE, ge=0, le=2)
    """Sampling temperature; ``null``: none is sent and the model uses its own default (OpenAI's reasoning
    models, e.g. gpt-5, accept only theirs)."""
    max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=1, le=200_000)
    price: Price = Field(default_factory=Price)
    rpm: int | None = Field(default=None, ge=1)
    rpm_bucket: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")
    """The rate-limit bucket this agent's calls take their ``rpm`` slots from; by default its own name.
    Agents naming one bucket (e.g. a planner and a worker on the same provider model) share one limit, so
    together they never send past it; every agent of a pool in one bucket must give the same ``rpm``."""
    description: str = ""
    timeout_s: float | None = Field(default=None, gt=0)
    structured_output: bool = True
    """Whether to ask this backend for schema-constrained output when it plans (vLLM, OpenAI, llama.cpp)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Provider-specific options, validated by the provider (e.g. sim: latency_ms, reply, fail_times)."""

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Z_][A-Z0-9_]*", v):
            raise ValueError("must be the NAME of an environment variable (e.g. OPENAI_API_KEY), never a key")
        return v

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("rpm_bucket") is None:  # a job's pool snapshot stays readable by workers without the field
            data.pop("rpm_bucket", None)
        return data

    @property
    def billing(self) -> Price:
        """The prices its calls are costed at: ``price``, with an ``anthropic`` agent's unset cached-input price
        at Anthropic's rate (``ANTHROPIC_CACHE_READ_FACTOR``); elsewhere an unset one is the input price."""
        price = self.price
        if self.provider == "anthropic" and price.cached_input_per_mtok is None:
            read = price.input_per_mtok * ANTHROPIC_CACHE_READ_FACTOR
            return price.model_copy(update={"cached_input_per_mtok": read})
        return price

    def bucket(self, name: str) -> str:
        """The rate-limit bucket of this agent, known in its pool as ``name``."""
        return self.rpm_bucket or name

    @model_validator(mode="after")
    def _needs_model(self) -> AgentConfig:
        if self.provider != "sim" and not self.model:
            raise ValueError(f"provider '{self.provider}' needs 'model'")
        return self


class PoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "default"
    planner: str = "template:single"
    fallback: str = "template:single"
    agents: dict[str, AgentConfig]

    @model_validator(mode="after")
    def _check(self) -> PoolConfig:
        if not self.agents:
            raise ValueError("a pool needs at least one agent")
        if CONDUCTOR_AGENT in self.agents:
            raise ValueError(f"'{CONDUCTOR_AGENT}' is reserved for the planner itself; rename that agent")
        for field_name in ("planner", "fallback"):
            value = getattr(self, field_name)
            check_planner_ref(value, self.agents, field_name)
        if self.fallback not in template_refs():
            raise ValueError("fallback must be a template planner: " + ", ".join(template_refs()))
        buckets: dict[str, dict[str, int | None]] = {}
        for name, agent in self.agents.items():
            buckets.setdefault(agent.bucket(name), {})[name] = agent.rpm
        for bucket, members in buckets.items():
            if len(set(members.values())) > 1:
                given = ", ".join(f"{name} rpm {rpm}" for name, rpm in members.items())
                raise ValueError(f"agents sharing rate-limit bucket '{bucket}' must give the same rpm: {given}")
        return self

    @property
    def worker_names(self) -> list[str]:
        """Agents that may run steps, in pool order: the numbering the conductor prompt shows.

        The planner agent is not among them: a workflow reaches the planner as ``conductor``.
        """
        return [name for name in self.agents if name != self.planner] or list(self.agents)


def template_refs() -> list[str]:
    return [f"template:{t}" for t in TEMPLATE_PLANNERS]


def check_planner_ref(value: str, agents: dict[str, AgentConfig], field_name: str = "planner") -> None:
    if value in template_refs() or value in agents or value == CONDUCTOR_AGENT:
        return
    raise ValueError(
        f"{field_name} '{value}' is neither an agent of this pool nor one of {', '.join(template_refs())}"
    )


def load_pool(path: Path, name: str | None = None) -> PoolConfig:
    """Reads and validates a YAML pool file; every bad entry is named in the error.

    The file is read on every call (an edited pool takes effect at once); parsing is cached by its
    text, because pure-Python YAML costs ~40 ms and every submission resolves its pool."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise PoolError(f"cannot read pool file {path}: {exc.strerror or exc}") from exc
    return _parse_pool(text, str(path), name or path.stem).model_copy(deep=True)


@lru_cache(maxsize=32)
def _parse_pool(text: str, where: str, name: str) -> PoolConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PoolError(f"pool file {where} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise PoolError(f"pool file {where} must be a mapping with 'agents'")
    data.setdefault("name", name)
    try:
        return PoolConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(pool)'}: {err['msg']}" for err in exc.errors()
        )
        raise PoolError(f"pool file {where} is invalid: {problems}") from exc


def resolve_pool_path(
    name_or_file: str | None, *, default_file: Path, pools_dirs: list[Path], allow_path: bool = False
) -> Path:
    """A pool is named (a ``NAME.yaml`` in one of ``pools_dirs``) or, from the CLI only, a file path.

    API clients may only name pools: a path from a request would let a tenant read server files.
    """
    if not name_or_file:
        return default_file
    candidate = Path(name_or_file)
    if allow_path and candidate.suffix in (".yaml", ".yml"):
        if not candidate.exists():
            raise PoolError(f"pool file {candidate} does not exist")
        return candidate
    if not POOL_NAME_RE.fullmatch(name_or_file):
        raise PoolError(f"unknown pool '{name_or_file}': not a pool name and no such file")
    for directory in pools_dirs:
        for suffix in (".yaml", ".yml"):
            path = directory / f"{name_or_file}{suffix}"
            if path.exists():
                return path
    known = sorted({p.stem for d in pools_dirs if d.is_dir() for p in d.glob("*.y*ml")})
    raise PoolError(f"unknown pool '{name_or_file}'; known pools: {', '.join(known) or '(none)'}")

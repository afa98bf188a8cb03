"""Serving the conductor model with vLLM on the GPU node (``conductor planner serve``).

The planner reaches it as an ``openai_compatible`` agent whose model is the served name (``conductor``),
e.g. ``base_url: http://planner:8000/v1`` in the shipped research pool. Two flags matter for planning:
prefix caching, because every planning prompt starts with the same long pool description; and a
structured-output backend, so the planner can ask for its workflow JSON by schema.

Flag names are those of vLLM >= 0.11, where ``--structured-outputs-config`` replaced
``--guided-decoding-backend`` (removed in 0.12, along with the ``guided_*`` request fields).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from collections.abc import Sequence

DEFAULT_SERVED_NAME = "conductor"
DEFAULT_PORT = 8000
DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_STRUCTURED_OUTPUTS_BACKEND = "xgrammar"
"""xgrammar is vLLM's fastest JSON-schema backend; "auto" lets vLLM pick per request."""
DEFAULT_MODEL = "Qwen/Qwen2.5-7B-Instruct"
"""The base the research's 7B conductor was trained from; a fine-tuned conductor is a drop-in."""

INSTALL_HINT = (
    "vLLM is not installed: install it on the GPU node with pip install 'conductor-queue[gpu]' "
    "(vLLM needs an NVIDIA GPU with CUDA); or point the pool's planner at any OpenAI-compatible server"
)


def vllm_command(
    model: str,
    *,
    served_name: str = DEFAULT_SERVED_NAME,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    structured_outputs_backend: str = DEFAULT_STRUCTURED_OUTPUTS_BACKEND,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The ``vllm serve`` argv (program name first) for the conductor model."""
    if not model.strip():
        raise ValueError("model must name a Hugging Face model or a local path")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    return [
        "vllm",
        "serve",
        model,
        "--served-model-name",
        served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--gpu-memory-utilization",
        str(gpu_memory_utilization),
        "--enable-prefix-caching",
        "--structured-outputs-config.backend",
        structured_outputs_backend,
        *extra_args,
    ]


def _vllm_launcher() -> list[str] | None:
    """How to start vLLM here: its console script, else its module; None when it is not installed."""
    script = shutil.which("vllm")
    if script:
        return [script]
    if importlib.util.find_spec("vllm") is not None:
        return [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    return None


def serve(args: argparse.Namespace) -> int:
    """Replaces this process with ``vllm serve`` (signals and exit code are vLLM's own).
    Returns 1 with a one-line reason when vLLM is not installed."""
    launcher = _vllm_launcher()
    extra = list(args.vllm_args or [])
    if extra[:1] == ["--"]:  # argparse keeps the separator in a REMAINDER
        extra = extra[1:]
    if launcher is None:
        print(f"conductor: {INSTALL_HINT}", file=sys.stderr)
        return 1
    argv = vllm_command(
        args.model,
        served_name=args.served_name,
        host=args.host,
        port=args.port,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        structured_outputs_backend=args.structured_outputs_backend,
        extra_args=extra,
    )
    argv = [*launcher, *argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(argv[0], argv)
    except OSError as exc:
        print(f"conductor: cannot start {argv[0]}: {exc.strerror or exc}; {INSTALL_HINT}", file=sys.stderr)
        return 1
    return 0  # not reached: execv replaces the process


def port(text: str) -> int:
    """A TCP port, 1-65535 (an argparse type: Flower took 70000 modulo 65536 and listened on 4464)."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (1-65535)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``conductor planner serve``; kept here beside the command they build."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"Hugging Face id or local path ({DEFAULT_MODEL})")
    parser.add_argument("--served-name", default=DEFAULT_SERVED_NAME, help="the model name pools refer to")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, default=DEFAULT_PORT)
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    parser.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION)
    parser.add_argument("--structured-outputs-backend", default=DEFAULT_STRUCTURED_OUTPUTS_BACKEND,
                        help="xgrammar (default), guidance, outlines or auto")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER,
                        help="anything after '--' is passed to vllm serve unchanged (e.g. -- --api-key KEY: "
                        "the server has no authentication otherwise; it binds to loopback by default)")

"""Packaged local models: slices from installed packages are joined once, verified, and reused."""

from __future__ import annotations

import hashlib
import sys
import types
from pathlib import Path

import pytest

from conductor.pool import local_models
from conductor.pool.errors import ConfigError
from conductor.pool.local_models import PackagedModel, model_file


def fake_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slices: list[bytes], *,
               sha256: str | None = None) -> PackagedModel:
    modules = []
    for i, data in enumerate(slices):
        part = tmp_path / f"part{i}.bin"
        part.write_bytes(data)
        name = f"fake_model_part_{i}"
        module = types.ModuleType(name)
        module.get_part_path = lambda p=part: str(p)  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, name, module)
        modules.append(name)
    whole = b"".join(slices)
    monkeypatch.setattr(local_models, "models_dir", lambda: tmp_path / "models")
    return PackagedModel(name="fake", file_name="fake.gguf", pip_requirement="fake-part0 fake-part1",
                         chat_format="chatml", description="fake", parts=tuple(modules),
                         sha256=sha256 or hashlib.sha256(whole).hexdigest(), size=len(whole))


def test_slices_are_joined_in_order_once_and_progress_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    model = fake_model(tmp_path, monkeypatch, [b"GGUF" + b"a" * 100, b"b" * 50])
    path = model_file(model, agent="x", progress=sys.stderr)
    assert path == tmp_path / "models" / "fake.gguf"
    assert path.read_bytes() == b"GGUF" + b"a" * 100 + b"b" * 50
    assert "assembling fake.gguf: 100%" in capsys.readouterr().err
    (tmp_path / "part0.bin").unlink()  # a second call reuses the file: the slices are not read again
    assert model_file(model, agent="x") == path


def test_a_corrupt_slice_is_refused_and_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = fake_model(tmp_path, monkeypatch, [b"GGUF", b"data"], sha256="0" * 64)
    with pytest.raises(ConfigError, match=r"do not form the expected file.*pip install --force-reinstall fake-part0"):
        model_file(model, agent="x")
    assert list((tmp_path / "models").iterdir()) == []


def test_the_default_is_the_instruction_tuned_model_and_gemma_is_the_fallback() -> None:
    assert local_models.DEFAULT_MODEL == "qwen2.5-coder-1.5b-instruct-q4_k_m"
    assert local_models.FALLBACK_MODEL == "gemma-3-270m-q4_k_m"
    assert local_models.PACKAGED[local_models.DEFAULT_MODEL].chat_format == "chatml"


@pytest.mark.slow
def test_the_shipped_default_model_assembles_to_its_pinned_hash(tmp_path: Path) -> None:
    """The real chunk packages (the `local` extra) form the GGUF file whose header names the model."""
    path = model_file(local_models.QWEN_CODER_15B, agent="x")
    with path.open("rb") as f:
        header = f.read(16 << 20)  # the chat template follows the ~150k-token vocabulary
    assert header[:4] == b"GGUF"
    assert b"Qwen2.5 Coder 1.5B Instruct" in header
    assert b"<|im_start|>" in header  # the ChatML chat template travels in the file


def test_a_partial_file_of_a_killed_join_is_removed_and_a_live_ones_kept(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import subprocess

    model = fake_model(tmp_path, monkeypatch, [b"GGUF", b"data"])
    models = tmp_path / "models"
    models.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # a process that has ended
    (models / f"fake.partial-{dead}").write_bytes(b"x" * 1000)  # what a kill -9 mid-join leaves
    (models / f"fake.partial-{os.getppid()}").write_bytes(b"y")  # a live process's join in progress
    model_file(model, agent="x")
    assert sorted(p.name for p in models.iterdir()) == sorted(["fake.gguf", f"fake.partial-{os.getppid()}"])


def test_a_self_assembled_models_leftover_file_is_named_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    # the Gemma package assembles into its own cache; a first run killed mid-way left a file it refuses
    module = types.ModuleType("fake_assembler")

    def assemble() -> str:
        raise ValueError("/root/.cache/x/model.gguf already exists with an unexpected sha256; pass overwrite=True")

    module.assemble = assemble  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_assembler", module)
    model = PackagedModel(name="g", file_name="g.gguf", pip_requirement="g", chat_format="gemma",
                          description="g", assembler="fake_assembler:assemble")
    with pytest.raises(ConfigError, match=r"model\.gguf already exists.*delete it and run again"):
        model_file(model, agent="x")


def test_a_self_assembled_model_is_assembled_once_per_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # the Gemma package's assemble() re-hashes its 253 MB file at every call (about 0.25 s), and a local
    # agent looks its model's path up at every provider call: the path is kept once it was verified
    target = tmp_path / "model.gguf"
    calls: list[int] = []

    def assemble() -> str:
        calls.append(1)
        target.write_bytes(b"gguf")
        return str(target)

    module = types.ModuleType("counting_assembler")
    module.assemble = assemble  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "counting_assembler", module)
    monkeypatch.setattr(local_models, "_ASSEMBLED", {}, raising=False)
    model = PackagedModel(name="g", file_name="g.gguf", pip_requirement="g", chat_format="gemma",
                          description="g", assembler="counting_assembler:assemble")
    assert model_file(model, agent="x") == target
    assert model_file(model, agent="x") == target
    assert len(calls) == 1
    target.unlink()  # deleted meanwhile (a cache cleaned): assembled again, not a path to nothing
    assert model_file(model, agent="x") == target
    assert len(calls) == 2

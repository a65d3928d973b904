"""The packed-weight cache: a q4 model rebuilt from the file its first load wrote is the decoded one, bit for bit,
and a file that cannot be used is never trusted."""

from __future__ import annotations

import pytest
import torch

from mirrorsd import Transformer, gguf_weights, weight_cache, zoo
from tests.helpers import requires_smollm2

pytestmark = requires_smollm2


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_cache, "_folder", lambda: tmp_path)
    monkeypatch.delenv(weight_cache.ENV, raising=False)
    return tmp_path


@pytest.fixture
def decodes(monkeypatch):
    """How many times the GGUF file was decoded."""
    calls = []
    original = gguf_weights.load_gguf_weights

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(gguf_weights, "load_gguf_weights", counted)
    return calls


def _load(**kwargs) -> Transformer:
    return Transformer.from_pretrained(zoo.resolve("smollm2-135m", progress=False), weights="q4", **kwargs)


def _assert_same(a: Transformer, b: Transformer) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert list(state_a) == list(state_b)
    for name, tensor in state_a.items():
        assert tensor.dtype == state_b[name].dtype and torch.equal(tensor, state_b[name]), name
    for (name, module), (_, other) in zip(a.named_modules(), b.named_modules(), strict=True):
        assert type(module) is type(other) and module.extra_repr() == other.extra_repr(), name
    assert torch.equal(a.embed_tokens.weight, b.embed_tokens.weight)
    ids = torch.tensor([[1, 504, 3458, 282, 260, 3403, 2091, 30]])
    assert torch.equal(a(ids), b(ids))


def test_a_second_load_reads_the_packed_file_and_is_the_decoded_model_bit_for_bit(folder, decodes, monkeypatch):
    monkeypatch.setenv(weight_cache.ENV, "0")
    decoded = _load()
    assert not list(folder.iterdir())
    monkeypatch.delenv(weight_cache.ENV)
    first = _load()
    [kept] = folder.glob("*.safetensors")
    assert kept.name.startswith("smollm2-135m-") and len(decodes) == 2
    again = _load()
    assert len(decodes) == 2  # read back, not decoded
    _assert_same(decoded, first)
    _assert_same(decoded, again)
    assert again.lm_head.fast and not any(p.name.endswith(".partial") for p in folder.iterdir())


def test_a_cut_short_file_is_dropped_with_a_warning_and_written_again(folder, decodes):
    _load()
    [kept] = folder.glob("*.safetensors")
    kept.write_bytes(kept.read_bytes()[: kept.stat().st_size // 2])
    with pytest.warns(RuntimeWarning, match="ignoring the packed weights"):
        model = _load()
    assert len(decodes) == 2 and kept.stat().st_size > 0
    _assert_same(model, _load())
    assert len(decodes) == 2


def test_a_newer_file_replaces_the_models_older_one_and_orphans_go(folder, monkeypatch):
    stale = folder / "smollm2-135m-00000000-0000000000000000.safetensors"
    stale.write_bytes(b"old")
    _load()
    [kept] = folder.glob("*.safetensors")
    assert kept != stale
    monkeypatch.setattr(weight_cache, "FORMAT", "another")  # as after a code change: a new name
    _load()
    [newer] = folder.glob("*.safetensors")
    assert newer != kept
    # another install's file (a release beside a dev tree sharing the cache) stays: they removed each other's on
    # every load, and each load decoded again
    monkeypatch.setattr(weight_cache, "_CODE", "/another/install/mirrorsd")
    monkeypatch.setattr(weight_cache, "FORMAT", "a third")
    _load()
    assert newer.exists() and len(list(folder.glob("*.safetensors"))) == 2


def test_the_cache_stays_out_of_the_way_where_it_does_not_apply(folder, decodes, monkeypatch):
    gguf = zoo.resolve("smollm2-135m", progress=False) / "model.gguf"
    assert weight_cache.file_for(gguf, "dense") is None
    monkeypatch.setenv(weight_cache.ENV, "0")
    assert weight_cache.file_for(gguf, "auto") is None
    monkeypatch.delenv(weight_cache.ENV)
    assert weight_cache.file_for(gguf, "auto").parent == folder
    _load(linear="dense")
    assert not list(folder.iterdir())


def test_a_full_disk_is_a_warning_and_killed_writes_leftovers_go(folder, monkeypatch):
    """safetensors reports a failed write (a full disk) as its own SafetensorError, not an OSError: it escaped as a
    traceback after a model that had loaded fine. A killed writer's half files (ours, and safetensors' own .tmp*)
    are removed once old, never while they may be another process's write in progress."""
    import os
    import time

    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("No space left on device (os error 28)")

    with monkeypatch.context() as m:
        m.setattr(weight_cache, "_write", full)
        with pytest.warns(RuntimeWarning, match="could not keep the packed weights"):
            _load()
    old, fresh = folder / "x.safetensors.1.2.partial", folder / ".tmpAbC123"
    for leftover in (old, fresh):
        leftover.write_bytes(b"half")
    hour_ago = time.time() - weight_cache.STALE_WRITE_S - 60
    os.utime(old, (hour_ago, hour_ago))
    _load()
    assert not old.exists() and fresh.exists()


def test_a_shared_cache_keeps_its_files_readable_and_another_users_file(folder, monkeypatch):
    """The writer left 0600 files: another user of the cache could not read them, removed them under a "No such
    file" warning and wrote their own, and the two kept replacing each other."""
    import os

    _load()
    [kept] = folder.glob("*.safetensors")
    assert kept.stat().st_mode & 0o777 == folder.stat().st_mode & 0o444 | 0o200  # (readable, not writable, by all)
    real = os.access  # (safetensors reports a file it may not read as "No such file")
    monkeypatch.setattr(weight_cache.os, "access", lambda p, mode: False if p == kept else real(p, mode))
    with pytest.warns(RuntimeWarning, match="cannot read the packed weights .*permission denied"):
        assert weight_cache.load(kept) is None
    monkeypatch.setattr(weight_cache, "FORMAT", "another")
    _load()
    assert kept.exists()  # (another user's: theirs to keep)

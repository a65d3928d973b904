"""Files written whole or not at all: a kill, a full disk or a power cut leaves the old file or the new one, never
part of one (the bytes reach the disk before the name says they are there). Trained artefacts, caches and shards
are written this way: a half-written one would be read back later as if it were complete."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def replace_synced(tmp: Path, path: Path) -> None:
    """``tmp``, written whole, on disk and then named ``path``."""
    with tmp.open("rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    replace_synced(tmp, path)


def write_text(path: Path, text: str) -> None:
    write_atomic(path, text.encode("utf-8"))


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' ``save_file``, whole or not at all."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    replace_synced(tmp, path)


def save_torch(obj: object, path: Path) -> None:
    """``torch.save``, whole or not at all."""
    tmp = path.with_name(path.name + ".partial")
    torch.save(obj, tmp)
    replace_synced(tmp, path)

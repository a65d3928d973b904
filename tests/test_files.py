"""Files written whole or not at all (mirrorsd.files): what a failure mid-write leaves."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from mirrorsd.exit_heads import ExitTranslators


def test_an_exit_rewritten_in_place_survives_a_failed_write(tmp_path, monkeypatch):
    """train-exit --into rewrites an exit in place; safetensors' save_file writes straight over the file, so a full
    disk or a kill mid-write left a truncated exit that no checkpoint could rebuild."""
    ExitTranslators({3: torch.eye(2)}, {"layers": [3]}).save(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def dies(tensors, name):
        with open(name, "wb") as f:
            f.write(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", dies)
    with pytest.raises(OSError, match="No space"):
        ExitTranslators({3: 2 * torch.eye(2), 5: torch.eye(2)}, {"layers": [3, 5]}).save(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.endswith(".tmp")} == before
    assert torch.equal(ExitTranslators.load(tmp_path).layers[3], torch.eye(2))

"""Drafts distilled toward a target: a zoo model plus low-rank deltas on its top layers, merged when it loads.

A draft's weights may change freely without touching losslessness (verification decides every token), so a draft
can be fine-tuned to agree with its target (``mirrorsd train-draft``). What ships is small: a folder holding
``draft_tune.json`` (the base zoo model, the target it was distilled toward, the shape and the recipe) and
``lora.safetensors`` (``A [rank, in]`` and ``B [out, rank]`` per tuned projection). Loading adds ``B A · scale`` to
each tuned weight before quantization, so the tuned draft runs as fast as the base one: every kernel sees plain
weights. Quantized codes (``q4``: the GGUF's own K-quants) are dequantized, merged and re-quantized at the same
width and group (min-max codes with fp16 scale and offset per group), so the draft reads the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .execution import PROJECTIONS
from .files import save_tensors, write_text
from .quant import GroupQuant, quantize_groups

TUNE_FILE, LORA_FILE = "draft_tune.json", "lora.safetensors"
#: The projections a tuned layer adapts (every linear of a block), as paths below the block.
TUNED_PROJECTIONS = tuple(f"{'self_attn' if name in PROJECTIONS[:4] else 'mlp'}.{name}" for name in PROJECTIONS)


@dataclass(frozen=True)
class TuneConfig:
    base: str  # the zoo model (or folder) whose weights the deltas apply to
    target: str  # the model it was distilled toward (informative: any target of the same tokenizer can use it)
    layers: int  # the top layers that carry deltas
    rank: int
    alpha: int
    hidden_size: int
    n_layers: int
    vocab_size: int
    spd_tracks: int = 1  # > 1: trained in the spd form over that many tracks (run with --draft-tp G --draft-syncs spd)
    recipe: dict = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def first_layer(self) -> int:
        return self.n_layers - self.layers

    def weight_names(self) -> list[str]:
        """State-dict names (without HF's ``model.`` prefix) of the tuned weights."""
        return [f"layers.{i}.{p}.weight" for i in range(self.first_layer, self.n_layers) for p in TUNED_PROJECTIONS]

    def save(self, folder: Path, lora: dict[str, torch.Tensor]) -> None:
        """``lora.safetensors`` (fp16: a few MB per tuned layer set), then ``draft_tune.json``, each whole."""
        folder.mkdir(parents=True, exist_ok=True)
        save_tensors({k: v.detach().to("cpu", torch.float16).contiguous() for k, v in lora.items()}, folder / LORA_FILE)
        write_text(folder / TUNE_FILE, json.dumps(asdict(self), indent=2) + "\n")


def resolve(name_or_path: str | Path) -> Path | None:
    """``name_or_path`` as a tuned-draft folder (one holding ``draft_tune.json``); None for anything else (a zoo
    model or an HF folder)."""
    folder = Path(name_or_path)
    return folder if (folder / TUNE_FILE).is_file() else None


def load_config(folder: str | Path) -> TuneConfig:
    return TuneConfig(**json.loads((Path(folder) / TUNE_FILE).read_text()))


def deltas(folder: str | Path) -> dict[str, torch.Tensor]:
    """State-dict name → fp32 ``B A · scale`` of every tuned weight."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = load_config(folder)
    lora = load_file(str(folder / LORA_FILE))
    missing = [k for k in config.weight_names() if f"{k}.A" not in lora or f"{k}.B" not in lora]
    if missing:
        raise ValueError(f"{folder / LORA_FILE} lacks the deltas of {missing[:2]}")
    return {k: (lora[f"{k}.B"].float() @ lora[f"{k}.A"].float()) * config.scale for k in config.weight_names()}


def merge(weight: torch.Tensor | GroupQuant, delta: torch.Tensor) -> torch.Tensor | GroupQuant:
    """``weight + delta``, in the weight's own kind: a dense tensor stays dense (its dtype), quantized codes are
    re-quantized at the width and group they need (a Q5_K tensor stays 5-bit), so the draft reads no more bytes."""
    if tuple(weight.shape) != tuple(delta.shape):  # deltas trained for another model
        raise ValueError(f"delta of shape {tuple(delta.shape)} for a weight of shape {tuple(weight.shape)}")
    if isinstance(weight, GroupQuant):
        bits = max(int(weight.codes.max()).bit_length(), 1) if weight.codes.numel() else weight.bits
        return quantize_groups(weight.dequantize() + delta, bits, weight.group)
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)

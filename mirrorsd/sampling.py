"""Sampling with noise keyed by (seed, absolute position).

Gumbel-max sampling, ``argmax(logits / T + g)``, draws exactly from ``softmax(logits / T)``. We derive the
Gumbel noise ``g`` from a counter-based hash of (seed, position, vocabulary index, noise key) instead of a
stateful RNG, so the token at position ``p`` is a pure function of the target's logits there and of the
seed. Any method that commits only tokens the target itself would sample -- AR, SD with sample-and-match,
Mirror-SD -- therefore yields the *same tokens* for the same seed, no matter how many positions it
evaluates per forward or in which order. A draft that uses the same noise is "coupled" to the target and
agrees with it more often, which costs nothing in exactness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from .errors import OptionError


class Noise(IntEnum):
    """Independent noise keys, so e.g. rejection sampling's accept test never reuses the proposal's noise."""

    TARGET = 0  # the target's own draws (and a draft coupled to them)
    DRAFT = 1  # a draft's draws independent of the target (rejection sampling)
    ACCEPT = 2  # rejection sampling's accept test
    RESIDUAL = 3  # rejection sampling's residual draw



@dataclass(frozen=True)
class SamplingParams:
    """``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise OptionError("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise OptionError("top_k", f"must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise OptionError("top_p", f"must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser: a well-mixed 64-bit hash (numpy uint64 arithmetic wraps mod 2**64)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def keyed_uniforms(seed: int, positions: Sequence[int], size: int, noise: int = Noise.TARGET) -> torch.Tensor:
    """Uniforms in (0, 1), ``[len(positions), size]`` float64, a pure function of their arguments."""
    pos = np.asarray(positions, dtype=np.uint64)[:, None]
    base = _splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ _splitmix64(np.uint64(noise)))
    with np.errstate(over="ignore"):
        keys = _splitmix64(base ^ (pos * np.uint64(0xD1B54A32D192ED03)))
        bits = _splitmix64(keys + np.arange(size, dtype=np.uint64)[None, :] * np.uint64(0x9E3779B97F4A7C15))
    u = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))
    return torch.from_numpy(u)


def gumbel_noise(seed: int, positions: Sequence[int], size: int, noise: int = Noise.TARGET) -> torch.Tensor:
    return -torch.log(-torch.log(keyed_uniforms(seed, positions, size, noise)))


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to ``[n, vocab]`` logits (filtered entries become -inf)."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampler with ``params`` draws from (one-hot argmax when greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    return warp(logits, params).double().softmax(-1)


def sample(logits: torch.Tensor, positions: Sequence[int], params: SamplingParams,
           noise: int = Noise.TARGET) -> list[int]:
    """One token per row of ``[n, vocab]`` logits; row i is the token at absolute position ``positions[i]``."""
    if params.greedy:
        return logits.argmax(-1).tolist()
    gumbel = gumbel_noise(params.seed, positions, logits.shape[-1], noise).to(logits.device)
    return (warp(logits, params).double() + gumbel).argmax(-1).tolist()


def sample_from_probs(probs: torch.Tensor, positions: Sequence[int], seed: int, noise: int) -> list[int]:
    """Exact draws from explicit distributions ``[n, vocab]`` via Gumbel-max on their logs."""
    gumbel = gumbel_noise(seed, positions, probs.shape[-1], noise).to(probs.device)
    return (probs.double().log() + gumbel).argmax(-1).tolist()

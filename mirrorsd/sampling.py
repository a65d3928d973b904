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

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache
from typing import Any

import torch

from .errors import OptionError
from .transfer import send


class Noise(IntEnum):
    """Independent noise keys, so e.g. rejection sampling's accept test never reuses the proposal's noise."""

    TARGET = 0  # the target's own draws (and a draft coupled to them)
    DRAFT = 1  # a draft's draws independent of the target (rejection sampling)
    ACCEPT = 2  # rejection sampling's accept test
    RESIDUAL = 3  # rejection sampling's residual draw



SAMPLING_EPS = 1e-5  # temperatures below it are greedy


def is_integer(value: Any) -> bool:
    """An integer of any kind (numpy's too) but not a bool, which Python counts as one."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):  # (None or text failed as a TypeError inside a comparison)
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), numbers.Real):
                raise OptionError(name, f"must be a number, got {getattr(self, name)!r}")
        if not self.temperature >= 0 or self.temperature == math.inf:  # (NaN fails every comparison)
            raise OptionError("temperature", f"must be >= 0 and finite, got {self.temperature}")
        if not is_integer(self.top_k) or self.top_k < 0:  # (2.5 failed only inside torch.topk)
            raise OptionError("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise OptionError("top_p", f"must be in (0, 1], got {self.top_p}")
        for name, cast in (("temperature", float), ("top_k", int), ("top_p", float)):  # numpy's numbers too
            object.__setattr__(self, name, cast(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        """Below :data:`SAMPLING_EPS` too: logits divided by 1e-45 overflow to inf and softmax gives NaN, whose
        draws are noise; the limit of a vanishing temperature is the argmax (vLLM's ``_SAMPLING_EPS`` rule)."""
        return self.temperature < SAMPLING_EPS


def _int64(value: int) -> int:
    """A 64-bit pattern as torch's int64 holds it (two's complement)."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


_MASK64 = (1 << 64) - 1
_GOLDEN = _int64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)
_POSITION = _int64(0xD1B54A32D192ED03)


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The logical right shift of uint64 (torch's ``>>`` on int64 is arithmetic: mask the sign's copies off)."""
    return (x >> bits).bitwise_and_((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser, in place on int64 tensors holding uint64 bits: a well-mixed 64-bit hash (torch's int64
    adds and multiplies wrap mod 2**64, as uint64 arithmetic does)."""
    x.add_(_GOLDEN)
    x.bitwise_xor_(_shift(x, 30)).mul_(_MIX1)
    x.bitwise_xor_(_shift(x, 27)).mul_(_MIX2)
    return x.bitwise_xor_(_shift(x, 31))


@lru_cache(maxsize=256)
def stream_key(seed: int, noise: int) -> int:
    """The stream key of (seed, noise) as a host int: hashed once, not on every draw of a decode loop."""
    return int(_splitmix64(torch.tensor(_int64(seed)) ^ _splitmix64(torch.tensor(_int64(noise)))))


def window_seed(seed: int, start: int) -> int:
    """The seed of a rejection-sampled draft's window that starts at text position ``start``: after a rejection at P
    the next window drafts P + 1 again, where a discarded token was drawn, and keyed by position alone it would reuse
    that draw's noise, which what chose the window (its length, a gate's timing) may have read. Windows start at
    distinct positions (each step commits a token), and Mirror-SD's branch rooted at P drafts with the seed of the
    window that would start at P + 1: the tokens vanilla SD draws there (the paper's parity, App. B)."""
    return stream_key(seed, -1 - start)  # (every Noise kind is >= 0)


def window_keys(seed: int, starts: Sequence[int], noise: int) -> torch.Tensor:
    """``[len(starts)]`` :func:`stream_key` values of :func:`window_seed` and ``noise``, hashed in one go (a tree
    rollout's branches each start their own window)."""
    seeds = _splitmix64(_splitmix64(torch.tensor([-1 - s for s in starts], dtype=torch.long)) ^ _int64(seed))
    return _splitmix64(seeds ^ int(_splitmix64(torch.tensor(_int64(noise)))))


def keyed_uniforms(seed: int, positions: Sequence[int] | torch.Tensor, size: int, noise: int = Noise.TARGET,
                   device: torch.device | str | None = None, key: torch.Tensor | None = None) -> torch.Tensor:
    """Uniforms in (0, 1), ``[len(positions), size]`` float64, a pure function of their arguments.

    Torch ops on ``device`` (default: the positions' own if a tensor, else the CPU), so a GPU draws its noise where
    its logits are: the host hashes only each row's key, never its ``size`` ids, and copies no noise; with the
    positions as a device tensor a CUDA graph can capture it whole. ``key``: the :func:`stream_key` of ``(seed,
    noise)`` as a device tensor beside such positions (then ``seed`` and ``noise`` are not read), so a graph that
    draws for one request replays for another with another seed; or one key per row (:func:`window_keys`)."""
    base = stream_key(seed, noise) if key is None else key.view(-1, 1) if key.dim() else key
    if key is not None and not isinstance(positions, torch.Tensor):
        raise ValueError("a device stream key goes with positions on the device")
    if isinstance(positions, torch.Tensor):
        pos = positions.to(device=positions.device if device is None else device, dtype=torch.long)
        keys = _splitmix64((pos.reshape(-1, 1) * _POSITION).bitwise_xor_(base))
    else:  # the row keys on the host, then one copy that does not wait for the device's queue
        keys = _splitmix64((torch.tensor(list(positions), dtype=torch.long).reshape(-1, 1) * _POSITION) ^ base)
        if device is not None:
            keys = send(keys, device)
    bits = _splitmix64(torch.arange(size, device=keys.device).mul_(_GOLDEN) + keys)
    return _shift(bits, 11).double().add_(0.5).mul_(1.0 / (1 << 53))


def gumbel_noise(seed: int, positions: Sequence[int] | torch.Tensor, size: int, noise: int = Noise.TARGET,
                 device: torch.device | str | None = None, key: torch.Tensor | None = None) -> torch.Tensor:
    return -torch.log(-torch.log(keyed_uniforms(seed, positions, size, noise, device, key)))


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
        drop_sorted[..., 0] = False  # and the likeliest always (a top_p below float32's least value dropped all)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampler with ``params`` draws from (one-hot argmax when greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    return warp(logits, params).double().softmax(-1)


def choose(logits: torch.Tensor, positions: Sequence[int] | torch.Tensor, params: SamplingParams,
           noise: int = Noise.TARGET, key: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`sample`'s tokens as a tensor on the logits' device (no host read: a caller reads many rows at once);
    ``key``: see :func:`keyed_uniforms`."""
    if params.greedy:
        return logits.argmax(-1)
    gumbel = gumbel_noise(params.seed, positions, logits.shape[-1], noise, logits.device, key)
    return (warp(logits, params).double() + gumbel).argmax(-1)


GREEDY_CHOICE = ("argmax",)  # what a greedy choice bakes in: nothing but the argmax


def graph_choice(params: SamplingParams, noise: int = Noise.TARGET) -> tuple:
    """What a captured :func:`choose` bakes in, to key its graph by: nothing for greedy (an argmax), the warp's
    parameters and the noise for sampling. The seed is not in it: the graph reads it as its ``key`` tensor."""
    return GREEDY_CHOICE if params.greedy else (params.temperature, params.top_k, params.top_p, int(noise))


def sample(logits: torch.Tensor, positions: Sequence[int] | torch.Tensor, params: SamplingParams,
           noise: int = Noise.TARGET) -> list[int]:
    """One token per row of ``[n, vocab]`` logits; row i is the token at absolute position ``positions[i]``."""
    return choose(logits, positions, params, noise).tolist()


def rows_apart(logits: torch.Tensor | torch.device, params: SamplingParams) -> bool:
    """Whether :func:`choose` on many rows at once gives each row the token it gets alone, and is cheap enough that
    drawing rows past a window's first disagreement costs less than reading them one by one: greedy (an argmax),
    and off the CPU sampling without top-p (elementwise, a top-k threshold and an argmax per row; top-p sorts and
    sums, whose order a kernel may choose by the row count). On the CPU, each sampled row's noise costs ~1 ms."""
    device = logits if isinstance(logits, torch.device) else logits.device
    return params.greedy or (params.top_p == 1.0 and device.type != "cpu")


def sample_from_probs(probs: torch.Tensor, positions: Sequence[int], seed: int, noise: int) -> list[int]:
    """Exact draws from explicit distributions ``[n, vocab]`` via Gumbel-max on their logs."""
    gumbel = gumbel_noise(seed, positions, probs.shape[-1], noise, probs.device)
    return (probs.double().log() + gumbel).argmax(-1).tolist()

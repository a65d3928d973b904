"""Group-quantized weights: the one format every quantized linear layer uses.

A weight ``W[N, K]`` is stored as small unsigned integer codes with a scale and an offset per group of
``group`` consecutive input features::

    W[n, k] = scales[n, k // group] * codes[n, k] + offsets[n, k // group]

Every GGUF block type we load (Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0) maps onto it exactly (Q8_0 codes are
shifted by 128, Q5_0 by 16, Q6_K by 32, and the shift goes into the offset), and so does our own per-group
int8 quantization of fp32 weights. ``bits`` says how many bits the codes need (4 → two codes per byte).

The K-quants (Q4_K, Q5_K, Q6_K) store each group's scale (and Q4_K/Q5_K's offset) as a small integer times one
fp16 value per 256 weights; ``super_scales``/``super_offsets`` keep those per-256 values, so the kernels can store
the integers in a byte instead of an fp16 per group (:func:`mirrorsd.kernels.pack_quant`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GroupQuant:
    """Codes ``uint8 [N, K]`` (values below ``2**bits``), scales and offsets ``float32 [N, K // group]``.

    Optional ``super_scales``/``super_offsets`` ``float32 [N, K // super_group]``: each scale (offset) is its super
    value times an integer, exactly (a K-quant's d and -dmin); a symmetric K-quant (Q6_K) has no super offsets."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group: int
    bits: int
    super_scales: torch.Tensor | None = None
    super_offsets: torch.Tensor | None = None
    super_group: int = 0

    def select_rows(self, index: torch.Tensor) -> GroupQuant:
        """The rows ``index`` (output features) of this weight, super values included."""
        pick = [None if t is None else t.index_select(0, index)  # index_select: ~100x faster than t[index] on uint8
                for t in (self.codes, self.scales, self.offsets, self.super_scales, self.super_offsets)]
        return GroupQuant(*pick[:3], self.group, self.bits, *pick[3:], self.super_group)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight this quantization stands for."""
        n, k = self.codes.shape
        codes = self.codes.view(n, k // self.group, self.group).float()
        return (codes * self.scales[..., None] + self.offsets[..., None]).reshape(n, k)


def quantize_q8(weight: torch.Tensor, group: int = 32) -> GroupQuant:
    """Symmetric int8 per group of ``group`` inputs, like GGUF's Q8_0 (fp16 scale = absmax / 127)."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group}")
    w = weight.float().view(n, k // group, group)
    scale = (w.abs().amax(-1) / 127.0).half().float()
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = (torch.round(w * inv[..., None]).clamp(-127, 127) + 128).to(torch.uint8).view(n, k)
    return GroupQuant(codes, scale, -128.0 * scale, group, 8)


def quantize_groups(weight: torch.Tensor, bits: int, group: int = 32) -> GroupQuant:
    """Asymmetric ``bits``-bit codes per group of ``group`` inputs (fp16 scale and offset: min-max, like GGUF's
    Q4_1): re-quantizes a weight at the width it was shipped in after something changed it."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group}")
    w = weight.float().view(n, k // group, group)
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / (2**bits - 1)).half().float()
    offset = low.half().float()
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round((w - offset[..., None]) * inv[..., None]).clamp(0, 2**bits - 1).to(torch.uint8).view(n, k)
    return GroupQuant(codes, scale, offset, group, bits)

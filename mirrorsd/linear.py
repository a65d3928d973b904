"""The linear-layer seam.

Every projection in :mod:`mirrorsd.model` is built by :func:`make_linear`, so a faster or quantized weight
format (int8/int4 weight-only, prepacked GEMMs, CUDA paths) replaces this one function and nothing in the
decoding methods changes. A linear module takes ``[..., in_features]`` and returns ``[..., out_features]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DenseLinear(nn.Module):
    """Plain dense weights: ``y = x @ W.T + b`` through PyTorch's stock GEMM."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """Build the linear module for one projection (the single place a weight format is chosen)."""
    return DenseLinear(weight, bias)

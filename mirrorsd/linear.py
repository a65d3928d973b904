"""The linear-layer seam: every projection in :mod:`mirrorsd.model` is built by :func:`make_linear`.

Which module a weight becomes depends on its format and device, never on the decoding method:

* a :class:`~mirrorsd.quant.GroupQuant` on CPU → :class:`QuantLinear` (int8 activations × 4/5/6/8-bit codes,
  VNNI kernel; ``split_activations`` gives each activation a second int8 plane for its remainder);
* fp32 on CPU with the kernels built → :class:`PackedLinear` (weights interleaved once so a k-row product
  streams them once: an 8-token verification costs about what one token does);
* anything else (CUDA, bf16/fp16, ``linear="dense"``, no kernels) → :class:`DenseLinear`, PyTorch's GEMM
  (cuBLAS on GPU). A GroupQuant headed for CUDA is dequantized.
* a :class:`PackedWeight` (what a QuantLinear holds, read back by :mod:`mirrorsd.weight_cache`) → that
  :class:`QuantLinear` again, without repacking.

The fast modules are batch-invariant (row m's sum runs in the same order whatever M is; PackedLinear hands
prefills of more than PACKED_MAX_ROWS rows to a batched GEMM unless its model is quantized), so a
verification window and one-token decoding see bit-identical projections. On CUDA, DenseLinear gets the same
property from :func:`in_fixed_rows`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .quant import GroupQuant

#: Linear implementations: ``auto`` picks by format and device (above); ``dense`` always PyTorch's GEMM.
LINEAR_IMPLS = ("auto", "dense")
#: Above this many rows (prefill) the packed fp32 weight is multiplied with a batched GEMM instead.
PACKED_MAX_ROWS = 32


#: Rows of every GEMM and norm call on CUDA (:func:`in_fixed_rows`).
FIXED_ROWS = 64


_INVARIANT = ContextVar("mirrorsd_batch_invariant", default=True)


def fixed_shapes(x: torch.Tensor) -> bool:
    """Whether ``x``'s device needs :func:`in_fixed_rows` for batch invariance: CUDA. cuBLAS picks its kernel
    (tiles, split-K, so the order of a row's sums) by the product's shape, and PyTorch its reduction layout by the
    number of rows: a 1-row and an 8-row bf16 product round a row differently, and on a 7B-shaped model that
    turned a verification window's tokens away from one-token decoding's."""
    return x.is_cuda and _INVARIANT.get()


@contextmanager
def batch_invariance(enabled: bool) -> Iterator[None]:
    """``batch_invariance(False)``: natural shapes and batched attention on CUDA, for work whose results never
    meet one-token decoding's (training's state caches and stream rows), where they are what is fast."""
    token = _INVARIANT.set(enabled)
    try:
        yield
    finally:
        _INVARIANT.reset(token)


def in_fixed_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` (row-wise) over ``x``'s rows in slabs of exactly :data:`FIXED_ROWS`, zero-padded in a fresh buffer:
    every call then has one shape, layout and alignment, so a row's result cannot depend on how many rows came
    with it or where it sat among them."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    slabs = -(-n // FIXED_ROWS)
    padded = rows.new_zeros(slabs * FIXED_ROWS, rows.shape[1])
    padded[:n] = rows
    out = fn(padded) if slabs == 1 else torch.cat([fn(slab) for slab in padded.split(FIXED_ROWS)])
    return out[:n].reshape(*x.shape[:-1], out.shape[-1])


class DenseLinear(nn.Module):
    """Plain dense weights: ``y = x @ W.T + b`` through PyTorch's stock GEMM (at fixed shapes on CUDA)."""

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
        if fixed_shapes(x):
            return in_fixed_rows(lambda rows: F.linear(rows, self.weight, self.bias), x)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


class PackedLinear(nn.Module):
    """fp32 weights interleaved in 16-feature blocks for the small-M kernel."""

    split_activations = False  # fp32 rows are not quantized (QuantBlock's callers read this of every down_proj)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", kernels.pack_f32(weight))
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())
        self.row_exact = False  # set on the row-exact path: every row count then takes the batch-invariant kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        if rows.shape[0] <= PACKED_MAX_ROWS or self.row_exact:
            y = kernels.linear_f32(rows, self.packed, self.bias, self.out_features)
        else:  # prefill: one small GEMM per 16-feature block, batched
            y = torch.matmul(rows, self.packed).transpose(0, 1).reshape(rows.shape[0], -1)[:, : self.out_features]
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class PackedWeight(NamedTuple):
    """A quantized projection already in the kernel layout: all :class:`QuantLinear` keeps of a GroupQuant. The
    packed-weight cache (:mod:`mirrorsd.weight_cache`) builds models from these, so a load skips the repacking."""

    packed: kernels.PackedQuant
    shape: tuple[int, int]
    bits: int
    group: int


class QuantLinear(nn.Module):
    """Group-quantized weights (4/5/6/8-bit codes, fp16 scales/offsets) computed without dequantizing.

    Activations are int8 per 32 features; with ``split_activations`` each row also sends the int8 quantization of
    its remainder through the same weights (~15-bit activations, for models whose answers int8 noise flips)."""

    def __init__(self, weight: GroupQuant | PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.split_activations = False
        if isinstance(weight, PackedWeight):
            self.bits, self.group, self.fast = weight.bits, weight.group, True
            packed = weight.packed
        else:
            self.bits, self.group = kernels.packed_bits(weight), weight.group
            self.fast = kernels.available()
            packed = kernels.pack_quant(weight, self.bits) if self.fast else None
        if packed is None:
            self.quant = weight
        else:
            self.zero = packed.zero  # symmetric: offsets follow from the scales
            for name in PACKED_BUFFERS:
                self.register_buffer(name, getattr(packed, name))
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    def packed_weight(self) -> PackedWeight:
        """What a model is rebuilt from without repacking (a fast layer's only)."""
        packed = kernels.PackedQuant(*(getattr(self, name) for name in PACKED_BUFFERS), self.zero)
        return PackedWeight(packed, (self.out_features, self.in_features), self.bits, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        if self.fast:
            y = kernels.ops().linear_quant(rows, self.codes, self.planes, self.scales, self.offsets,
                                           self.super_scales, self.super_offsets, self.bias, self.out_features,
                                           self.bits, self.group, self.split_activations, self.zero)
        else:
            y = kernels.linear_quant_reference(rows, self.quant, self.bias, split=self.split_activations)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        acts = "int8x2" if self.split_activations else "int8"
        return f"in={self.in_features}, out={self.out_features}, q{self.bits}/g{self.group}, {acts}, fast={self.fast}"


HUGE_PAGE = 2 << 20  # bytes of an x86-64 transparent huge page
PACKED_BUFFERS = ("codes", "planes", "scales", "offsets", "super_scales", "super_offsets")


def on_huge_pages(module: nn.Module) -> None:
    """Move the packed weights of ``module``'s fast quantized linears into one anonymous mapping advised for
    transparent huge pages (Linux ``MADV_HUGEPAGE``; where the kernel's setting is ``madvise``, as here, torch's own
    allocations get 4 KB pages). A decoding step streams every weight once: on 4 KB pages the hardware prefetcher
    stops at each page and every page costs a TLB walk. Same bytes, so the same results; with the kernel's L2
    prefetch it took ~4 ms (~10%) off the 1.5B's one-token body on a 2-core Xeon VM (docs/benchmarks.md). Does
    nothing where the OS offers no such advice."""
    import mmap

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    owners = [(m, name) for m in module.modules() if isinstance(m, QuantLinear) and m.fast
              for name in PACKED_BUFFERS if getattr(m, name) is not None]
    sizes = [-(-getattr(m, name).nbytes // 64) * 64 for m, name in owners]  # each tensor 64-byte aligned
    if sum(sizes) < HUGE_PAGE:
        return
    arena = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        arena.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages
        return
    raw = torch.frombuffer(arena, dtype=torch.uint8)  # keeps the mapping alive as long as a tensor uses it
    offset = -raw.data_ptr() % HUGE_PAGE
    for (m, name), size in zip(owners, sizes, strict=True):
        old = getattr(m, name)
        new = raw[offset : offset + old.nbytes].view(old.dtype).view(old.shape)
        new.copy_(old)
        setattr(m, name, new)  # a registered buffer: the module keeps it
        offset += size


def release_freed_heap() -> None:
    """Hand the freed heap back to the OS (glibc's ``malloc_trim``): what loading a model converted and dropped,
    and the copies :func:`on_huge_pages` left behind, stay in the process otherwise (the q4 1.5B loaded at 3.0 GB
    RSS, 2.4 GB after this)."""
    import contextlib
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):  # AttributeError: a C library without it (not glibc)
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def make_linear(weight: torch.Tensor | GroupQuant | PackedWeight, bias: torch.Tensor | None = None,
                linear: str = "auto") -> nn.Module:
    """Build the linear module for one projection (the single place a weight format meets a kernel)."""
    if linear not in LINEAR_IMPLS:
        raise ValueError(f"linear must be one of {LINEAR_IMPLS}, got {linear!r}")
    if isinstance(weight, PackedWeight):
        if linear != "auto" or not kernels.available():
            raise ValueError("a packed weight needs linear='auto' and the CPU kernels")
        return QuantLinear(weight, bias)
    if isinstance(weight, GroupQuant):
        if (weight.codes.device.type == "cpu" and linear == "auto" and weight.shape[1] % kernels.ACT_GROUP == 0
                and (weight.bits, weight.group) in kernels.LAYOUTS):
            return QuantLinear(weight, bias)
        weight = weight.dequantize()
    fast = (linear == "auto" and weight.device.type == "cpu" and weight.dtype == torch.float32
            and kernels.available())
    return PackedLinear(weight, bias) if fast else DenseLinear(weight, bias)

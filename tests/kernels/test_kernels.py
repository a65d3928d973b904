"""The small-M CPU kernels against reference math, on random shapes (hypothesis), plus the fallbacks.

Tolerances: the fp32 kernel differs from ``F.linear`` only in summation order, so |Δ| ≤ 1e-5·√K·max|x||w|
row-scaled; the quantized kernel computes exact integer group dots and differs from the PyTorch reference
only in the order its fp32 group terms are added (relative 1e-5 of the output scale).
"""

from __future__ import annotations

import functools
import os
import pickle
import subprocess
import sys
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mirrorsd import kernels
from mirrorsd.linear import DenseLinear, PackedLinear, QuantLinear, make_linear, on_huge_pages
from mirrorsd.quant import GroupQuant, quantize_q8

requires_kernels = pytest.mark.skipif(not kernels.available(), reason="fast CPU kernels unavailable here")


def random_quant(n: int, k: int, bits: int, group: int, seed: int) -> GroupQuant:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.02).half().float()
    offsets = (torch.randn(n, k // group, generator=g) * 0.05).half().float()
    return GroupQuant(codes, scales, offsets, group, bits)


@requires_kernels
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 70), k=st.integers(1, 200), bias=st.booleans(), seed=st.integers(0, 99))
def test_f32_kernel_matches_linear(m, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    out = kernels.linear_f32(x, kernels.pack_f32(w), b, n)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.shape == (m, n)
    assert (out.double() - ref).abs().max().item() <= 1e-5 * k**0.5 * (1 + ref.abs().max().item())


@requires_kernels
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 70), groups=st.integers(1, 8),
       layout=st.sampled_from(kernels.LAYOUTS), bias=st.booleans(), seed=st.integers(0, 99))
@example(m=15, n=1, groups=1, layout=(4, 32), bias=False, seed=81)  # row 12 scales to a tie, 70.5 (found by CI)
def test_quant_kernel_matches_reference(m, n, groups, layout, bias, seed):
    """Every packed width (4; 5 and 6 as nibbles + bit planes; 8) and group size against the reference."""
    bits, group = layout
    k = 32 * groups
    q = random_quant(n, k, bits, group, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4  # uneven channel scales
    b = torch.randn(n, generator=g) if bias else None
    packed = kernels.pack_quant(q, bits)
    assert (packed.planes is None) == (bits in (4, 8))
    out = kernels.linear_quant(x, packed, b, n, bits, group)
    ref = kernels.linear_quant_reference(x, q, b)
    assert out.shape == (m, n)
    assert (out - ref).abs().max().item() <= 1e-5 * (1 + ref.abs().max().item())


@requires_kernels
@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 40), groups=st.integers(1, 6),
       layout=st.sampled_from(kernels.LAYOUTS), bias=st.booleans(), seed=st.integers(0, 99))
def test_split_activations_match_reference_and_stay_batch_invariant(m, n, groups, layout, bias, seed):
    """int8x2 (a second int8 plane for each activation's remainder), also with a massive activation in a group:
    the kernel equals the reference, any grouping of rows gives the same bits, and the error to the exact product
    stays within what the second plane's step allows, a bound 254× tighter than one plane's."""
    bits, group = layout
    k = 32 * groups
    q = random_quant(n, k, bits, group, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g)
    x[0, 0] = 300.0  # an attention-sink-like outlier: int8 alone zeroes the rest of its group
    b = torch.randn(n, generator=g) if bias else None
    packed = kernels.pack_quant(q, bits)
    out = kernels.linear_quant(x, packed, b, n, bits, group, True)
    ref = kernels.linear_quant_reference(x, q, b, split=True)
    assert (out - ref).abs().max().item() <= 1e-5 * (1 + ref.abs().max().item())
    rows = torch.cat([kernels.linear_quant(x[i : i + 1].contiguous(), packed, b, n, bits, group, True)
                      for i in range(m)])
    assert torch.equal(rows, out)
    # Each activation is off by at most half its last plane's step (absmax / 127 of its group), and the
    # remainder's absmax is at most half the first step, so the second step is at most 1/254 of the first.
    _, scales = kernels.quantize_activations(x, True)
    steps = scales.view(m, 2, groups).repeat_interleave(32, dim=2).double()
    assert (steps[:, 1] <= steps[:, 0] / 254 * (1 + 1e-5)).all()
    w = q.dequantize().double()  # random_quant's scales are fp16 already: the weights the kernel holds
    exact = F.linear(x.double(), w, None if b is None else b.double())
    fp32_slack = 1e-5 * (x.double().abs() @ w.abs().T + (0 if b is None else b.double().abs()))
    assert ((out.double() - exact).abs() <= steps[:, 1] / 2 @ w.abs().T * (1 + 1e-5) + fp32_slack).all()


@requires_kernels
def test_split_activations_cut_the_error_by_orders_of_magnitude():
    """On a layer-sized product (many terms, so errors average) int8x2's error to the exact product is under 2%
    of int8's: the statistical side of the bound above, on fixed data."""
    m, n, k = 8, 256, 1024
    q = random_quant(n, k, 4, 32, 7)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8))
    x[:, 0] = 300.0  # a massive activation in the first group of every row
    packed = kernels.pack_quant(q, 4)
    exact = F.linear(x.double(), q.dequantize().double())
    split = kernels.linear_quant(x, packed, None, n, 4, 32, True).double()
    single = kernels.linear_quant(x, packed, None, n, 4, 32).double()
    assert (split - exact).norm() < 0.02 * (single - exact).norm()


def test_quant_reference_is_close_to_dequantized_matmul():
    """Activation quantization (int8 per 32) costs well under a percent on a realistic layer."""
    q = random_quant(64, 256, 4, 32, 0)
    x = torch.randn(5, 256)
    ref = F.linear(x, q.dequantize())
    err = (kernels.linear_quant_reference(x, q) - ref).norm() / ref.norm()
    assert err.item() < 0.01


@pytest.mark.parametrize("n", [904, 1000, 1105, 4864])
def test_the_plain_pytorch_fallback_is_batch_invariant(n):
    """Where the C++ kernels cannot run (no compiler, MIRRORSD_KERNELS=off, not x86) a quantized layer runs
    ``linear_quant_reference``: its rows too must not depend on how many share the call (a draft vocabulary's head
    has any row count; with 1000 rows up to 131 outputs differed)."""
    torch.manual_seed(n)
    q, x = quantize_q8(torch.randn(n, 256)), torch.randn(8, 256)
    together = kernels.linear_quant_reference(x, q)
    for i in range(8):
        assert torch.equal(kernels.linear_quant_reference(x[i : i + 1], q), together[i : i + 1])


@requires_kernels
@pytest.mark.parametrize("make", ["f32", "q4", "q8"])
def test_kernels_are_batch_invariant(make):
    """Row m's result must not depend on how many rows share the call: verification == one-token decoding."""
    n, k = 48, 320
    x = torch.randn(16, k)
    if make == "f32":
        layer = PackedLinear(torch.randn(n, k), torch.randn(n))
    else:
        layer = QuantLinear(random_quant(n, k, 4, 32, 3) if make == "q4" else quantize_q8(torch.randn(n, k)))
    together = layer(x)
    for rows in (1, 3, 8, 9):
        assert torch.equal(layer(x[:rows]), together[:rows])
    alone = torch.cat([layer(x[i : i + 1]) for i in range(16)])
    assert torch.equal(alone, together)


@requires_kernels
def test_weights_moved_onto_huge_pages_give_the_same_bits():
    layers = torch.nn.Sequential(QuantLinear(random_quant(1024, 1024, 4, 32, 3)),
                                 QuantLinear(quantize_q8(torch.randn(1024, 2048))))  # > 2 MB of packed weights
    x = torch.randn(3, 1024)
    before = [layers[0](x), layers[1](torch.randn(3, 2048, generator=torch.Generator().manual_seed(1)))]
    on_huge_pages(layers)
    after = [layers[0](x), layers[1](torch.randn(3, 2048, generator=torch.Generator().manual_seed(1)))]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    storages = {layer.codes.untyped_storage().data_ptr() for layer in layers}
    assert len(storages) == 1 and all(layer.codes.data_ptr() % 64 == 0 for layer in layers)  # one arena, aligned
    assert layers[0].codes.data_ptr() % (2 << 20) == 0  # the arena starts on a huge-page boundary
    assert pickle.loads(pickle.dumps(layers))[1](x.new_ones(1, 2048)).shape == (1, 1024)


def test_quantize_q8_roundtrip():
    w = torch.randn(40, 96)
    q = quantize_q8(w)
    assert q.codes.dtype == torch.uint8 and q.bits == 8 and q.group == 32
    step = q.scales.repeat_interleave(32, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_q8(torch.randn(4, 33))


def test_make_linear_picks_by_format_and_linear_impl():
    w = torch.randn(16, 64)
    assert isinstance(make_linear(w, linear="dense"), DenseLinear)
    assert isinstance(make_linear(w.double()), DenseLinear)
    assert isinstance(make_linear(w), PackedLinear if kernels.available() else DenseLinear)
    assert isinstance(make_linear(quantize_q8(w)), QuantLinear)
    assert isinstance(make_linear(quantize_q8(w), linear="dense"), DenseLinear)
    with pytest.raises(ValueError, match="linear must be one of"):
        make_linear(w, linear="fast")


@requires_kernels
def test_packed_linear_prefill_path_matches():
    """Above PACKED_MAX_ROWS the packed weight goes through a batched GEMM; same numbers up to fp32 order."""
    w, b = torch.randn(50, 96), torch.randn(50)
    layer = PackedLinear(w, b)
    x = torch.randn(2, 40, 96)
    assert torch.allclose(layer(x), F.linear(x, w, b), atol=1e-4)


def test_fallback_when_kernels_disabled():
    """MIRRORSD_KERNELS=off: one clear warning, then the PyTorch fallbacks compute the same layer."""
    code = """
import warnings, torch
from mirrorsd import kernels
from mirrorsd.linear import make_linear, DenseLinear, QuantLinear
from mirrorsd.quant import quantize_q8
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert not kernels.available()
assert any("MIRRORSD_KERNELS" in str(w.message) for w in caught), [str(w.message) for w in caught]
w = torch.randn(20, 64)
assert isinstance(make_linear(w), DenseLinear)
layer = make_linear(quantize_q8(w))
assert isinstance(layer, QuantLinear) and not layer.fast
x = torch.randn(3, 64)
ref = torch.nn.functional.linear(x, quantize_q8(w).dequantize())
assert (layer(x) - ref).abs().max() < 0.02 * ref.abs().max()  # int8 activations: a small, bounded error
assert torch.equal(layer(x[:1]), layer(x)[:1])  # exact integer group dots keep the fallback batch-invariant
print("ok")
"""
    env = {**__import__("os").environ, "MIRRORSD_KERNELS": "off"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_tiny_activation_groups_quantize_to_zero_not_nan():
    x = torch.zeros(2, 64)
    x[0, 3] = 1e-39  # subnormal: 127 / amax would overflow to inf
    codes, scales = kernels.quantize_activations(x)
    assert torch.isfinite(codes).all() and torch.isfinite(scales).all() and codes.abs().sum() == 0
    if kernels.available():
        q = quantize_q8(torch.randn(16, 64))
        out = kernels.linear_quant(x, kernels.pack_quant(q), None, 16, 8, 32)
        assert torch.isfinite(out).all() and out.abs().max() == 0


@requires_kernels
def test_kernel_input_checks():
    q = quantize_q8(torch.randn(16, 64))
    packed = kernels.pack_quant(q)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernels.linear_quant(x, packed, torch.zeros(3), 16, 8, 32)
    with pytest.raises(RuntimeError, match="unsupported quantized layout"):
        kernels.linear_quant(x, packed, None, 16, 4, 16)
    six = kernels.pack_quant(random_quant(16, 64, 6, 32, 0), 6)
    with pytest.raises(RuntimeError, match="bit planes"):
        kernels.linear_quant(x, six._replace(planes=None), None, 16, 6, 32)
    base = random_quant(16, 64, 6, 32, 0)
    symmetric = kernels.pack_quant(GroupQuant(base.codes, base.scales, -32 * base.scales, 32, 6), 6)
    with pytest.raises(RuntimeError, match="two-level scales need a K-quant layout"):  # 6-bit codes in groups of 32
        kernels.linear_quant(x, symmetric._replace(scales=symmetric.scales.to(torch.int8),
                                                   super_scales=torch.ones(1, 1, 16).half()), None, 16, 6, 32)
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.linear_f32(x.double(), kernels.pack_f32(torch.randn(16, 64)), None, 16)
    with pytest.raises(NotImplementedError):  # no kernel for other devices: the dispatcher says so
        kernels.linear_f32(x.to("meta"), kernels.pack_f32(torch.randn(16, 64)).to("meta"), None, 16)


def test_packed_bits_picks_the_narrowest_width():
    for top, expected in ((15, 4), (31, 5), (63, 6), (255, 8)):
        q = GroupQuant(torch.full((16, 64), top, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(16, 2), 32, 8)
        assert kernels.packed_bits(q) == min(b for b in kernels.code_widths() if b >= expected)


def test_avx2_keeps_five_and_six_bit_codes_in_whole_bytes(monkeypatch):
    monkeypatch.setattr(kernels, "isa", lambda: "avx2")
    assert kernels.code_widths() == (4, 8)
    monkeypatch.setattr(kernels, "isa", lambda: "avx512-vnni")
    assert kernels.code_widths() == (4, 5, 6, 8)


@pytest.mark.parametrize("bits", [5, 6])
def test_bit_planes_hold_each_codes_high_bits(bits):
    """Plane b of a step of 64 codes holds bit 4 + b of code i at bit i (bit 63 is the int64's sign bit)."""
    codes = torch.randint(0, 2**bits, (3, 7, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    planes = kernels._bit_planes(codes, bits)
    assert planes.shape == (3, 7, bits - 4) and planes.dtype == torch.int64
    for b in range(bits - 4):
        want = sum(((codes[..., i].long() >> (4 + b)) & 1) << i for i in range(64))
        assert torch.equal(planes[..., b], want)


def test_unsupported_quant_layout_falls_back_to_dense():
    q = GroupQuant(torch.randint(0, 16, (16, 64), dtype=torch.uint8), torch.rand(16, 4), torch.rand(16, 4), 16, 4)
    layer = make_linear(q)
    assert not isinstance(layer, QuantLinear)
    x = torch.randn(2, 64)
    assert torch.allclose(layer(x), F.linear(x, q.dequantize()), atol=1e-4)


def test_seam_keeps_stock_gemm_off_cpu():
    """Non-CPU weights (CUDA in practice; meta here, as CI has no GPU) get PyTorch's GEMM (cuBLAS on CUDA),
    and a quantized weight headed there is dequantized rather than run through the CPU kernel."""
    w = torch.randn(16, 64, device="meta")
    assert isinstance(make_linear(w), DenseLinear)
    q = quantize_q8(torch.randn(16, 64))
    meta_q = GroupQuant(q.codes.to("meta"), q.scales.to("meta"), q.offsets.to("meta"), q.group, q.bits)
    layer = make_linear(meta_q)
    assert isinstance(layer, DenseLinear) and layer.weight.device.type == "meta"


def _sdpa_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    index = seen.nonzero().squeeze(1)
    return F.scaled_dot_product_attention(q, k.index_select(2, index), v.index_select(2, index), enable_gqa=True)


@requires_kernels
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 3), kv_heads=st.integers(1, 3), group=st.integers(1, 7), t=st.integers(1, 12),
       past=st.integers(0, 40), dim=st.sampled_from([16, 48, 64, 128]), masked=st.booleans(), seed=st.integers(0, 99))
def test_attention_kernel_matches_sdpa_and_is_batch_invariant(rows, kv_heads, group, t, past, dim, masked, seed):
    """Every query equals SDPA over the keys it sees (to fp32 rounding) and, bit for bit, the kernel's own
    one-query call on just those keys: so a k-token window reproduces one-token decoding exactly."""
    g = torch.Generator().manual_seed(seed)
    heads, total = kv_heads * group, past + t
    q = torch.randn(rows, heads, t, dim, generator=g)
    cache_k = torch.randn(rows, kv_heads, total + 5, dim, generator=g)  # a cache view: strided, longer buffer
    cache_v = torch.randn(rows, kv_heads, total + 5, dim, generator=g)
    k, v = cache_k[:, :, :total], cache_v[:, :, :total]
    if masked:  # a tree: each query sees a random subset, always including key 0
        mask = torch.rand(rows, t, total, generator=g) > 0.5
        mask[..., 0] = True
    else:
        mask = None
    out = kernels.attend(q, k, v, mask)
    for r in range(rows):
        for i in range(t):
            seen = mask[r, i] if masked else torch.arange(total) < past + i + 1
            qi = q[r : r + 1, :, i : i + 1].contiguous()
            ref = _sdpa_one(qi, k[r : r + 1], v[r : r + 1], seen)
            assert (out[r : r + 1, :, i : i + 1] - ref).abs().max() < 1e-5
            index = seen.nonzero().squeeze(1)
            alone = kernels.attend(qi, k[r : r + 1].index_select(2, index), v[r : r + 1].index_select(2, index), None)
            assert torch.equal(out[r : r + 1, :, i : i + 1], alone)


@requires_kernels
def test_attention_kernel_ignores_thread_count():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 12, 9, 128, generator=g)
    k, v = torch.randn(2, 2, 70, 128, generator=g), torch.randn(2, 2, 70, 128, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.attend(q, k, v, None)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(kernels.attend(q, k, v, None), one)
    finally:
        torch.set_num_threads(threads)


@requires_kernels
def test_attention_kernel_input_checks():
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 5, 16)
    with pytest.raises(RuntimeError, match="fp32 only"):
        kernels.attend(q.double(), k.double(), k.double(), None)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.attend(torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), None)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        kernels.attend(torch.randn(1, 3, 2, 16), k, k, None)
    with pytest.raises(RuntimeError, match="mask must be"):
        kernels.attend(q, k, k, torch.ones(1, 2, 4, dtype=torch.bool))


@requires_kernels
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 9), k=st.integers(1, 70), seed=st.integers(0, 99))
def test_rms_norm_kernel_matches_torch_and_is_row_local(rows, k, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g) * 3, torch.randn(k, generator=g)
    out = kernels.rms_norm(x, w, 1e-6)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    for r in range(rows):
        assert torch.equal(kernels.rms_norm(x[r : r + 1], w, 1e-6), out[r : r + 1])


@requires_kernels
@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 70), scale=st.sampled_from([1.0, 10.0, 100.0]), seed=st.integers(0, 99))
def test_silu_mul_kernel_matches_torch_and_is_position_free(n, scale, seed):
    """silu(gate) * up with our exp (shared by the fused block and the Python MLP): within float rounding of
    PyTorch's, finite for large gates, and an element's value does not depend on where it sits in the vector."""
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(2, n, generator=g) * scale, torch.randn(2, n, generator=g)
    out = kernels.silu_mul(gate, up)
    ref = torch.nn.functional.silu(gate.double()) * up.double()
    assert torch.isfinite(out).all() and torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-30)
    for i in range(n):
        assert torch.equal(kernels.silu_mul(gate[:, i : i + 1], up[:, i : i + 1]), out[:, i : i + 1])
    assert torch.equal(kernels.silu_mul(gate.t().contiguous().t(), up), out)  # any strides: computed contiguously
    with pytest.raises(RuntimeError, match="same shape"):
        kernels.silu_mul(gate, up[:1])


@requires_kernels
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 3), t=st.integers(1, 9), heads=st.integers(1, 4), dim=st.sampled_from([8, 16, 64, 128]),
       shared_angles=st.booleans(), seed=st.integers(0, 99))
def test_rope_kernel_matches_torch_and_is_row_local(rows, t, heads, dim, shared_angles, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, t, heads, dim, generator=g)
    angles = torch.rand(1 if shared_angles else rows, t, dim // 2, generator=g) * 50
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos(), emb.sin()
    out = kernels.rope(x, cos, sin)
    xt, c, s = x.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1)
    ref = xt * c + torch.cat([-xt[..., dim // 2 :], xt[..., : dim // 2]], -1) * s
    assert out.shape == (rows, heads, t, dim) and torch.allclose(out, ref, atol=1e-6)
    for r in range(rows):
        for i in range(t):
            pick = slice(0, 1) if shared_angles else slice(r, r + 1)
            one = kernels.rope(x[r : r + 1, i : i + 1], cos[pick, i : i + 1], sin[pick, i : i + 1])
            assert torch.equal(one, out[r : r + 1, :, i : i + 1])


@requires_kernels
@pytest.mark.parametrize(("zero", "bits", "group"), [(128, 8, 32), (32, 6, 16), (16, 5, 32), (8, 4, 32)])
def test_symmetric_formats_drop_offsets_and_dot_exactly(zero, bits, group):
    """Q8_0/Q6_K/Q5_0/Q4_0-style weights (offset = -Z·scale) run without their offsets: the zero point is taken in
    the integer dot, sum((code - Z)·a), so only the scales are rounded in fp32. That is closer to the exact product
    of the quantized operands than the two float terms of an explicit offset, and stays batch-invariant."""
    base = random_quant(48, 128, bits, group, 5)
    q = GroupQuant(base.codes, base.scales, -zero * base.scales, group, bits)
    assert kernels.symmetric_zero(q) == zero and kernels.symmetric_zero(base) == 0
    dropped = kernels.pack_quant(q)
    assert dropped.offsets is None and dropped.zero == zero
    kept = dropped._replace(offsets=(dropped.scales.float() * -zero).half(), zero=0)
    width = kernels.packed_bits(q)
    x = torch.randn(5, 128) * torch.rand(1, 128) * 4
    folded = kernels.linear_quant(x, dropped, None, 48, width, group)
    offset = kernels.linear_quant(x, kept, None, 48, width, group)
    xq, xs = kernels.quantize_activations(x, False)
    dots = torch.einsum("mgk,ngk->mng", xq.double().view(5, -1, group),
                        (q.codes.double() - zero).view(48, -1, group))
    scales = q.scales.half().double()  # the fp16 scales the packed weight holds
    exact = (dots * scales * xs.double().repeat_interleave(32 // group, 1)[:, None]).sum(-1)
    assert (folded.double() - exact).norm() <= (offset.double() - exact).norm()
    assert (folded - offset).abs().max().item() <= 1e-5 * (1 + offset.abs().max().item())
    alone = torch.cat([kernels.linear_quant(x[i : i + 1], dropped, None, 48, width, group) for i in range(5)])
    assert torch.equal(alone, folded)
    split = kernels.linear_quant(x, dropped, None, 48, width, group, True)  # int8x2: the remainder rows fold too
    assert (split - kernels.linear_quant(x, kept, None, 48, width, group, True)).abs().max().item() <= \
        1e-5 * (1 + offset.abs().max().item())
    assert torch.equal(split, torch.cat([kernels.linear_quant(x[i : i + 1], dropped, None, 48, width, group, True)
                                         for i in range(5)]))
    layer = QuantLinear(q)
    assert layer.offsets is None and torch.equal(layer(x), folded)
    with pytest.raises(RuntimeError, match="symmetric format"):
        kernels.linear_quant(x, dropped._replace(zero=0), None, 48, width, group)


def k_quant(n: int, k: int, bits: int, group: int, symmetric: bool, seed: int) -> GroupQuant:
    """A K-quant-like weight: every group scale (offset) an integer times an fp16 value per 256 weights."""
    g = torch.Generator().manual_seed(seed)
    supers = k // 256
    d = (torch.rand(n, supers, generator=g) * 1e-3).half().float()
    sub = torch.randint(-128 if symmetric else 0, 128 if symmetric else 64, (n, k // group), generator=g).float()
    scales = d.repeat_interleave(256 // group, 1) * sub
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    if symmetric:  # Q6_K: offset = -32 * scale
        return GroupQuant(codes, scales, -32 * scales, group, bits, d, None, 256)
    dmin = -(torch.rand(n, supers, generator=g) * 1e-3).half().float()
    mins = torch.randint(0, 64, (n, k // group), generator=g).float()
    return GroupQuant(codes, scales, dmin.repeat_interleave(256 // group, 1) * mins, group, bits, d, dmin, 256)


@requires_kernels
@pytest.mark.parametrize(("bits", "group", "symmetric"), [(4, 32, False), (5, 32, False), (6, 16, True)])
def test_two_level_scales_match_reference_exactly_scaled(bits, group, symmetric):
    """Q4_K/Q5_K/Q6_K keep int8 sub-scales times fp16 per-256 values: lighter than fp16 per group, equal to the
    reference computed with the exact fp32 scales (not their fp16 roundings), and batch-invariant."""
    n, k = 40, 512
    q = k_quant(n, k, bits, group, symmetric, bits)
    packed = kernels.pack_quant(q, bits)
    one_level = kernels.pack_quant(q, bits, two_level=False)
    assert packed.scales.dtype == torch.int8 and packed.super_scales.shape == (3, k // 256, 16)
    assert (packed.offsets is None) == symmetric == (packed.zero == 32)

    def nbytes(p: kernels.PackedQuant) -> int:
        return sum(t.numel() * t.element_size() for t in p[:6] if t is not None)

    assert nbytes(packed) < nbytes(one_level)
    x = torch.randn(9, k) * torch.rand(1, k) * 4
    out = kernels.linear_quant(x, packed, None, n, bits, group)
    ref = kernels.linear_quant_reference(x, q)
    assert (out - ref).abs().max().item() <= 1e-5 * (1 + ref.abs().max().item())
    alone = torch.cat([kernels.linear_quant(x[i : i + 1], packed, None, n, bits, group) for i in range(9)])
    assert torch.equal(alone, out)
    layer = QuantLinear(q)
    assert layer.scales.dtype == torch.int8 and torch.equal(layer(x), out)
    plain = GroupQuant(q.codes, q.scales, q.offsets, group, bits)  # no super values: fp16 scales per group
    assert not torch.equal(kernels.linear_quant(x, one_level, None, n, bits, group), out)
    assert torch.equal(kernels.linear_quant(x, one_level, None, n, bits, group),
                       kernels.linear_quant(x, kernels.pack_quant(plain, bits), None, n, bits, group))


@requires_kernels
@pytest.mark.parametrize(("bits", "group", "symmetric"), [(5, 32, False), (6, 16, True)])
def test_k_quant_codes_in_whole_bytes_give_the_planes_bits(bits, group, symmetric):
    """Q5_K/Q6_K codes packed as whole bytes (AVX2's width, kernels.code_widths) give the bit-plane packing's bits,
    for every row count."""
    n, k = 40, 512
    q = k_quant(n, k, bits, group, symmetric, bits + 10)
    planes, whole = kernels.pack_quant(q, bits), kernels.pack_quant(q, 8)
    assert whole.planes is None and whole.super_scales is not None
    for m in (1, 3, 4, 9):
        x = torch.randn(m, k) * torch.rand(1, k) * 4
        assert torch.equal(kernels.linear_quant(x, whole, None, n, 8, group),
                           kernels.linear_quant(x, planes, None, n, bits, group))
    wide = GroupQuant(q.codes | 0x40, q.scales, q.offsets, group, 8, q.super_scales, q.super_offsets, 256)
    assert kernels.pack_quant(wide, 8).super_scales is None  # codes of 64 and up: one-level fp16 scales


def test_two_level_scales_must_be_exact():
    q = k_quant(16, 256, 4, 32, False, 0)
    bad = GroupQuant(q.codes, q.scales * 1.0001, q.offsets, 32, 4, q.super_scales, q.super_offsets, 256)
    with pytest.raises(ValueError, match="exactly"):
        kernels.pack_quant(bad, 4)
    rows = torch.tensor([3, 0, 7])
    picked = q.select_rows(rows)
    assert torch.equal(picked.super_scales, q.super_scales[rows]) and torch.equal(picked.codes, q.codes[rows])


@requires_kernels
def test_blocks_in_one_op_call_give_the_per_block_bits():
    """run_layers sends all bound blocks of a range to one op call (blocks_forward); with one block unbound it runs
    them one by one, and a range split in two (Mirror-SD's exit) continues the same cache: the same bits each way."""
    from mirrorsd.loading import _is_projection
    from mirrorsd.model import Transformer
    from tests.helpers import tiny_hf

    hf = tiny_hf("qwen2", layers=3, seed=4)
    state = {k.removeprefix("model."): v.detach() for k, v in hf.state_dict().items()}
    model = Transformer.from_state(hf.config, {k: quantize_q8(v) if _is_projection(k) else v for k, v in state.items()})
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    calls = []
    real = torch.ops.mirrorsd.blocks_forward.default

    def run(split_at: int | None, unbound: int | None) -> list[torch.Tensor]:
        for i, block in enumerate(model.layers):
            block.use_kernel = i != unbound
        cache = model.new_cache(capacity=4)
        with torch.inference_mode():
            model.prefill(ids[:, :7], cache)
            positions = torch.arange(7, 10).unsqueeze(0)
            hidden = model.embed(ids[:, 7:10])
            for start, end in ((0, split_at), (split_at, 3)) if split_at else ((0, 3),):
                hidden = model.run_layers(hidden, positions, cache, start=start, end=end)
        assert cache.lengths == [10, 10, 10]
        return [hidden, *(buffer[:, :, :10] for buffer in (*cache.keys, *cache.values))]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.ops.mirrorsd.blocks_forward, "default",
                      lambda blocks, *args: calls.append(len(blocks)) or real(blocks, *args))
        whole, split, one_unbound = run(None, None), run(1, None), run(None, 1)
    # per run, the prefill then the window: whole [3], [3]; split [3], [1, 2]; one unbound: blocks 0 and 2 alone
    assert calls == [3, 3, 3, 1, 2, 1, 1, 1, 1]
    for other in (split, one_unbound):
        assert all(torch.equal(a, b) for a, b in zip(whole, other, strict=True))


@requires_kernels
def test_block_kernel_scratch_grows_without_changing_bits():
    """The fused block keeps its intermediates in per-thread scratch memory that grows in chunks: one token, then a
    prompt of several MB of intermediates (new chunks), then one token again give the Python path's bits, on two
    threads (the prompt's norms, SiLU and adds split over them) and on one."""
    from mirrorsd.loading import _is_projection
    from mirrorsd.model import Transformer
    from tests.helpers import tiny_hf

    hf = tiny_hf("qwen2", layers=2, seed=5)
    state = {k.removeprefix("model."): v.detach() for k, v in hf.state_dict().items()}
    model = Transformer.from_state(hf.config, {k: quantize_q8(v) if _is_projection(k) else v for k, v in state.items()})
    ids = torch.randint(0, 64, (1, 700), generator=torch.Generator().manual_seed(2))

    def run(kernel: bool) -> list[torch.Tensor]:
        for block in model.layers:
            block.use_kernel = kernel
        with torch.inference_mode():
            first = model(ids[:, :1], cache=model.new_cache(capacity=4))
            cache = model.new_cache(capacity=8)
            prompt = model(ids[:, :699], cache=cache, last=4)  # 512 + 187 tokens: ~2.5 KB of scratch a token
            step = model(ids[:, 699:], cache=cache)
        return [first, prompt, step, *cache.keys, *cache.values]

    python = run(False)
    assert all(torch.equal(a, b) for a, b in zip(run(True), python, strict=True))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert all(torch.equal(a, b) for a, b in zip(run(True), python, strict=True))
    finally:
        torch.set_num_threads(threads)


@requires_kernels
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("activations", ["int8", "int8x2", "fp32"])
def test_block_kernel_gives_the_python_paths_bits(arch, activations):
    """The whole-block C++ op (cpu_block.cpp) against the per-op Python path of the same model: equal logits and
    cache contents for a prompt (with cache growth), a tree-masked window, a single token and a two-row batch with
    per-row positions and masks; biases (qwen2), q/k norms (qwen3), split activations and fp32 weights on the
    row-exact path included."""
    from mirrorsd.loading import _is_projection
    from mirrorsd.model import Transformer
    from tests.helpers import tiny_hf

    hf = tiny_hf(arch, layers=2, seed=3)
    state = {k.removeprefix("model."): v.detach() for k, v in hf.state_dict().items()}
    if activations == "fp32":
        model = Transformer.from_state(hf.config, state)
        assert not model.row_exact and not any(block.use_kernel for block in model.layers)
        assert model.make_row_exact()
    else:
        state = {k: quantize_q8(v) if _is_projection(k) else v for k, v in state.items()}
        model = Transformer.from_state(hf.config, state).use_activations(activations)
    assert all(block.use_kernel for block in model.layers)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    tree = torch.ones(1, 3, 12, dtype=torch.bool)  # nodes 1 and 2 are siblings: node 2 does not see node 1
    tree[0, 2, 10] = False
    tree[0, 0, 10:] = tree[0, 1, 11] = False
    pair = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    pair_mask = torch.ones(2, 2, 11, dtype=torch.bool).tril(9)
    pair_mask[1, :, 3] = False

    def run(kernel: bool) -> list[torch.Tensor]:
        for block in model.layers:
            block.use_kernel = kernel
        cache = model.new_cache(capacity=4)
        with torch.inference_mode():
            out = [model(ids[:, :9], cache=cache),
                   model(ids[:, 9:12], torch.tensor([9, 10, 10]), cache=cache, mask=tree)]
            cache.truncate(10)
            out.append(model(ids[:, 11:12], cache=cache))
            # two rows: per-row positions (cos/sin not shared) and a per-row mask
            pair_cache = model.new_cache(rows=2, capacity=4)
            out.append(model(pair[:, :9], cache=pair_cache))
            out.append(model(pair[:, 9:11], torch.tensor([[9, 10], [12, 13]]), cache=pair_cache, mask=pair_mask))
        return [*out, *(buffer[:, :, :11] for buffer in (*cache.keys, *cache.values, *pair_cache.keys,
                                                         *pair_cache.values))]

    fused, python = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(fused, python, strict=True))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # Mirror-SD's threads backend lowers the target's count while the draft runs
    try:
        one_thread = run(True)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(fused, one_thread, strict=True))
    assert all(block._kernel is not None for block in model.layers)  # the op did run
    model.share_memory()  # moves every storage (the processes backend does this): a bound block must follow
    assert all(torch.equal(a, b) for a, b in zip(run(True), python, strict=True))
    clone = pickle.loads(pickle.dumps(model))  # the processes backend sends models to other processes
    assert all(block.use_kernel and block._kernel is None for block in clone.layers)
    for block in model.layers:
        block.use_kernel = True
    with torch.inference_mode():
        assert torch.equal(clone(ids[:, :9], cache=clone.new_cache(capacity=16)),
                           model(ids[:, :9], cache=model.new_cache(capacity=16)))


# Every kernel on fixed inputs, for test_every_build_gives_the_same_bits: run here (the host's best build) and in a
# process that builds another flavour the host can run (MIRRORSD_KERNEL_ISA), which must give the same bits. Every
# packed layout (one- and two-level scales, symmetric and with offsets, narrow and whole-byte codes), row counts
# 1-64 across the kernels' 4/8/16-row tiles (the AMX build takes every row count, one included, through its tiles),
# the fp32 linear, attention, the elementwise ops and the whole fused block.
CROSS_BUILD_OUTPUTS = '''
import torch
from transformers import Qwen2Config

from mirrorsd import kernels
from mirrorsd.loading import _is_projection
from mirrorsd.model import Transformer
from mirrorsd.quant import GroupQuant, quantize_q8

ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 48, 64)


def quant_weights(g):
    n, k = 40, 512
    weights = {}
    for bits, group, top, two in ((4, 32, 15, True), (5, 32, 31, True), (6, 16, 63, True), (8, 32, 255, False)):
        codes = torch.randint(0, top + 1, (n, k), dtype=torch.uint8, generator=g)
        d = (torch.rand(n, 2, generator=g) * 1e-3).half().float()
        sub = torch.randint(-128, 128, (n, k // group), generator=g).float()
        scales = d.repeat_interleave(256 // group, 1) * sub
        if two and bits != 6:  # asymmetric, with two-level offsets (Q4_K, Q5_K)
            dmin = -(torch.rand(n, 2, generator=g) * 1e-3).half().float()
            offsets = dmin.repeat_interleave(256 // group, 1) * torch.randint(0, 64, (n, k // group), generator=g)
            weights[f"{bits}/{group} two-level"] = GroupQuant(codes, scales, offsets, group, bits, d, dmin, 256)
        elif two:  # Q6_K
            weights[f"{bits}/{group} two-level"] = GroupQuant(codes, scales, -32 * scales, group, bits, d, None, 256)
        else:  # Q8_0
            weights[f"{bits}/{group} one-level"] = GroupQuant(codes, scales.half().float(),
                                                              -128 * scales.half().float(), group, bits)
    # one-level scales: Q4_0, Q5_0 (symmetric), Q4_1 (offsets), 6-bit codes in groups of 32, 8-bit in groups of 16
    for bits, group, zero in ((4, 32, 8), (5, 32, 16), (4, 32, 0), (6, 32, 32), (8, 16, 128)):
        codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=g)
        scales = (torch.rand(n, k // group, generator=g) * 1e-2).half().float()
        offsets = -zero * scales if zero else (-torch.rand(n, k // group, generator=g) * 1e-1).half().float()
        weights[f"{bits}/{group} one-level zero {zero}"] = GroupQuant(codes, scales, offsets, group, bits)
    return weights


def block_outputs(g):
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    state = {"embed_tokens.weight": torch.randn(64, 64, generator=g), "norm.weight": torch.rand(64, generator=g) + .5,
             "lm_head.weight": torch.randn(64, 64, generator=g) * 0.3}
    shapes = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
              "gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128)}
    for layer in range(2):
        prefix = f"layers.{layer}."
        for name, shape in shapes.items():
            part = "self_attn" if name[0] in "qkvo" else "mlp"
            state[f"{prefix}{part}.{name}.weight"] = torch.randn(*shape, generator=g) * 0.3
            if name in ("q_proj", "k_proj", "v_proj"):
                state[f"{prefix}{part}.{name}.bias"] = torch.randn(shape[0], generator=g) * 0.1
        state[f"{prefix}input_layernorm.weight"] = torch.rand(64, generator=g) + .5
        state[f"{prefix}post_attention_layernorm.weight"] = torch.rand(64, generator=g) + .5
    state = {k: quantize_q8(v) if _is_projection(k) else v for k, v in state.items()}
    out = {}
    ids = torch.randint(0, 64, (1, 40), generator=g)
    tree = torch.ones(1, 3, 40, dtype=torch.bool)
    tree[0, 2, 37] = False
    tree[0, 0, 37:] = tree[0, 1, 38] = False
    for activations in ("int8", "int8x2"):
        model = Transformer.from_state(cfg, state).use_activations(activations)
        cache = model.new_cache(capacity=8)
        with torch.inference_mode():
            out[f"block {activations} prompt"] = model(ids[:, :37], cache=cache)
            out[f"block {activations} tree"] = model(ids[:, 37:40], torch.tensor([37, 38, 38]), cache=cache,
                                                     mask=tree)
            cache.truncate(38)
            out[f"block {activations} step"] = model(ids[:, 39:40], cache=cache)
        out[f"block {activations} cache"] = torch.cat([b[:, :, :38] for b in (*cache.keys, *cache.values)])
    return out


def outputs():
    previous = kernels.set_amx_min_rows(1)  # the AMX build: every call through the tiles (others: -1, no change)
    try:
        return all_outputs()
    finally:
        if previous > 0:
            kernels.set_amx_min_rows(previous)


def all_outputs():
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, q in quant_weights(g).items():
        for width in sorted({q.bits, 8}):
            if (width, q.group) not in kernels.LAYOUTS:
                continue
            for two_level in {False, kernels.uses_two_level(q, width)}:
                packed = kernels.pack_quant(q, width, two_level)
                for m in ROWS:
                    x = torch.randn(m, 512, generator=g) * torch.rand(1, 512, generator=g) * 4
                    bias = torch.randn(40, generator=g) if m % 2 else None
                    for split in (False, True):
                        out[f"linear {name} @{width} two-level {two_level} m{m} {split}"] = kernels.linear_quant(
                            x, packed, bias, 40, width, q.group, split)
    w = torch.randn(37, 200, generator=g)
    packed = kernels.pack_f32(w)
    for m in ROWS:
        out[f"linear_f32 m{m}"] = kernels.linear_f32(torch.randn(m, 200, generator=g), packed,
                                                     torch.randn(37, generator=g) if m % 2 else None, 37)
    for dim in (64, 128):
        q = torch.randn(2, 4, 5, dim, generator=g)
        k, v = torch.randn(2, 2, 30, dim, generator=g), torch.randn(2, 2, 30, dim, generator=g)
        out[f"attend causal {dim}"] = kernels.attend(q, k, v, None)
        out[f"attend tree {dim}"] = kernels.attend(q, k, v, torch.rand(2, 5, 30, generator=g) > 0.4)
    x = torch.randn(7, 1000, generator=g) * 3
    out["rms_norm"] = kernels.rms_norm(x, torch.randn(1000, generator=g), 1e-6)
    out["silu_mul"] = kernels.silu_mul(x * 10, torch.randn(7, 1000, generator=g))
    angles = torch.rand(1, 5, 32, generator=g) * 50
    emb = torch.cat([angles, angles], -1)
    out["rope"] = kernels.rope(torch.randn(2, 5, 3, 64, generator=g), emb.cos(), emb.sin())
    for rank, k, n in ((16, 512, 40), (5, 100, 37)):
        x, a = torch.randn(3, k, generator=g), torch.randn(rank, k, generator=g)
        out[f"lora_delta {rank}"] = kernels.lora_delta(x, a, torch.randn(rank, n, generator=g), 0.7)
    out.update(block_outputs(g))
    return out
'''


@pytest.fixture(scope="session")
def build_outputs(tmp_path_factory) -> Callable[[str], dict[str, torch.Tensor]]:
    """CROSS_BUILD_OUTPUTS from a process that runs a given build: built once into the kernel cache (keyed by its
    flags, so later runs reuse it), run once per flavour and test session."""
    made: dict[str, dict[str, torch.Tensor]] = {}

    def outputs(flavour: str) -> dict[str, torch.Tensor]:
        if flavour not in made:
            script = CROSS_BUILD_OUTPUTS + "\nimport sys\ntorch.save(outputs(), sys.argv[1])\n"
            path = tmp_path_factory.mktemp(flavour) / "outputs.pt"
            env = {**os.environ, "MIRRORSD_KERNEL_ISA": flavour}
            subprocess.run([sys.executable, "-c", script, str(path)], check=True, env=env, timeout=900)
            made[flavour] = torch.load(path)
        return made[flavour]

    return outputs


@requires_kernels
@pytest.mark.parametrize("flavour", [name for name in kernels.ISAS if name != "avx512-amx"])
def test_every_build_gives_the_same_bits(build_outputs, flavour):
    """Every build this host can run gives the host's best build's bits: cpu_avx2.h runs the AVX-512 sources on pairs
    of AVX2 registers (exact integer dots, the same IEEE ops per lane, GCC's reduction trees), and the AMX build's
    tiles make the same int32 group sums as VNNI, then run VNNI's epilogue. Every kernel, layout and row count."""
    if flavour == kernels.isa() or flavour not in kernels.usable_isas():
        pytest.skip(f"compares the {flavour} build with a better one: this host's best is {kernels.isa()}")
    namespace: dict = {}
    exec(CROSS_BUILD_OUTPUTS, namespace)
    here = namespace["outputs"]()
    other = build_outputs(flavour)
    assert here.keys() == other.keys()
    assert len(here) > 500
    differ = [key for key in here if not torch.equal(here[key], other[key])]
    assert not differ, (f"{len(differ)} of {len(here)} outputs differ between the {kernels.isa()} and {flavour} "
                        f"builds, e.g. {differ[:5]}")


@requires_kernels
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 20), k=st.integers(1, 300), rank=st.integers(1, 40), n=st.integers(1, 70),
       seed=st.integers(0, 99))
def test_lora_delta_matches_the_two_products_row_by_row(rows, k, rank, n, seed):
    """The stream adapters' delta in one call: ((x A^T) B^T) · scale up to rounding, and each row's bits whatever
    rows share the call (any shape: masked tails of k, rank and n)."""
    g = torch.Generator().manual_seed(seed)
    x, a, bt = torch.randn(rows, k, generator=g), torch.randn(rank, k, generator=g), torch.randn(rank, n, generator=g)
    out = kernels.lora_delta(x, a, bt, 0.5)
    ref = (x.double() @ a.double().T) @ bt.double() * 0.5
    assert out.shape == (rows, n)
    assert (out.double() - ref).abs().max().item() <= 1e-5 * (k * rank) ** 0.5 * (1 + ref.abs().max().item())
    for r in range(rows):
        assert torch.equal(kernels.lora_delta(x[r:r + 1], a, bt, 0.5), out[r:r + 1])


@requires_kernels
def test_amx_build_runs_multi_row_calls_through_its_tiles():
    """On an AMX host the default build is the AMX one, from 32 rows on (the measured crossover); elsewhere the op says
    there are no tiles."""
    previous = kernels.set_amx_min_rows(3)
    try:
        if kernels.isa() == "avx512-amx":
            assert previous == 32
            assert kernels.set_amx_min_rows(previous) == 3
            with pytest.raises(RuntimeError, match="at least 1 row"):
                kernels.set_amx_min_rows(0)
        else:
            assert previous == -1
    finally:
        if previous > 0:
            kernels.set_amx_min_rows(previous)


def test_amx_denied_by_linux_falls_back_to_vnni_with_one_warning(monkeypatch):
    """A kernel that refuses the tile state (arch_prctl XTILEDATA) leaves the AMX build out of the usable ones, with
    one warning, and a forced MIRRORSD_KERNEL_ISA=avx512-amx names what this process can run."""
    import ctypes
    import errno

    class RefusingLibc:
        def syscall(self, *args: int) -> int:
            assert args == (kernels.SYS_ARCH_PRCTL, kernels.ARCH_REQ_XCOMP_PERM, kernels.XFEATURE_XTILEDATA)
            return -1

    monkeypatch.setattr(ctypes, "CDLL", lambda *args, **kwargs: RefusingLibc())
    monkeypatch.setattr(ctypes, "get_errno", lambda: errno.EPERM)
    monkeypatch.setattr(kernels, "_amx_denied", functools.cache(kernels._amx_denied.__wrapped__))
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: frozenset({*kernels.ISAS["avx512-amx"][0], "avx2"}))
    monkeypatch.setattr(kernels.platform, "system", lambda: "Linux")
    with pytest.warns(RuntimeWarning, match="Linux refused AMX tile state .*Operation not permitted.*avx512-vnni"):
        assert kernels.usable_isas() == ["avx512-vnni", "avx2"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked once per process: no second warning
        assert kernels.isa() == "avx512-vnni"
    monkeypatch.setenv("MIRRORSD_KERNEL_ISA", "avx512-amx")
    with pytest.raises(RuntimeError, match=r"MIRRORSD_KERNEL_ISA=avx512-amx: this CPU runs \['avx512-vnni', 'avx2'\]"):
        kernels.isa()


def test_kernel_entry_points_load_the_extension_in_a_fresh_process():
    """A script whose first mirrorsd call is a kernel entry point: the extension loads (building if needed) on that
    call; where the kernels cannot run, the error names the build instead of torch's missing-attribute error."""
    script = ("import torch\nfrom mirrorsd import kernels\n"
              "w = torch.randn(20, 64)\n"
              "y = kernels.linear_f32(torch.ones(2, 64), kernels.pack_f32(w), None, 20)\n"
              "print(torch.allclose(y, torch.ones(2, 64) @ w.T, atol=1e-4))\n")
    if kernels.available():
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == "True"
    off = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MIRRORSD_KERNELS": "off"})
    assert off.returncode != 0
    assert "mirrorsd CPU kernels cannot run here (kernel build 'off': disabled by MIRRORSD_KERNELS)" in off.stderr


@requires_kernels
def test_kernel_isa_override_must_be_runnable(monkeypatch):
    monkeypatch.setenv("MIRRORSD_KERNEL_ISA", "avx512-vnni-and-more")
    with pytest.raises(RuntimeError, match="MIRRORSD_KERNEL_ISA"):
        kernels.isa()


def test_a_failed_build_says_the_compilers_error():
    """torch's build error ends with ninja's "build stopped" line, which was all the warning said."""
    log = ("Error building extension 'mirrorsd_cpu': [1/3] c++ -O3 -c cpu_linear.cpp\nFAILED: cpu_linear.o\n"
           "cpu_linear.cpp:12:10: fatal error: immintrin.h: No such file or directory\ncompilation terminated.\n"
           "ninja: build stopped: subcommand failed.")
    assert kernels.build_failure(RuntimeError(log)) == \
        "cpu_linear.cpp:12:10: fatal error: immintrin.h: No such file or directory"
    assert kernels.build_failure(RuntimeError("ninja: not found")) == "ninja: not found"
    assert kernels.build_failure(OSError()) == "OSError()"


def test_a_forced_isa_is_ignored_where_the_kernels_are_off(monkeypatch):
    """MIRRORSD_KERNEL_ISA names a build to load; with the kernels switched off it made packing a layer raise."""
    monkeypatch.setenv("MIRRORSD_KERNELS", "off")
    monkeypatch.setenv("MIRRORSD_KERNEL_ISA", "no-such-isa")
    assert kernels.code_widths() in ((4, 8), (4, 5, 6, 8))
    monkeypatch.delenv("MIRRORSD_KERNELS")
    with pytest.raises(RuntimeError, match="MIRRORSD_KERNEL_ISA=no-such-isa"):
        kernels.code_widths()


@requires_kernels
def test_a_finished_build_in_a_read_only_cache_is_loaded(monkeypatch):
    """A prepared cache mounted read-only (a container image, another user's cache) lost its built kernels: the
    build wanted to write its lock, and the PyTorch fallbacks decoded ~22x slower."""
    built = kernels.build_dir(kernels.isa())
    assert (built / kernels.DONE_STAMP).exists()  # (this process loaded the kernels from there)
    real = os.access
    monkeypatch.setattr(kernels.os, "access", lambda path, mode, **kw: False if mode & os.W_OK else real(path, mode))
    monkeypatch.setattr(kernels, "build_extension", lambda *a, **k: pytest.fail("built (or locked) again"))
    assert kernels._load.__wrapped__() is None


def test_the_installed_package_carries_every_file_the_kernels_build_from():
    """The wheel packed the sources but not the headers they include: an installed mirrorsd failed to load any model
    (FileNotFoundError from the build key), where the checkout worked."""
    import fnmatch
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(kernels.__file__).parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["mirrorsd.kernels"]
    for path in (*kernels.SOURCES, *kernels.HEADERS):
        assert any(fnmatch.fnmatch(path.name, p) for p in patterns), path.name


def test_a_missing_kernel_source_is_a_reason_to_fall_back_not_a_crash(monkeypatch):
    from pathlib import Path

    monkeypatch.setattr(kernels, "HEADERS", (*kernels.HEADERS, Path(kernels.__file__).with_name("gone.h")))
    monkeypatch.delenv("MIRRORSD_KERNELS", raising=False)
    reason = kernels._why_unavailable()
    assert reason is not None and "gone.h missing from" in reason and "reinstall mirrorsd" in reason
    assert kernels.isa_label() == "off"


def test_the_ninja_package_builds_where_its_environment_is_not_on_path(monkeypatch):
    """torch runs the bare `ninja`; a venv's mirrorsd run by its path (pipx, a service unit) has its ninja off PATH,
    and the kernels fell back ~20x slower advising to install the ninja it had."""
    ninja = pytest.importorskip("ninja")
    import shutil

    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(shutil, "which", lambda name, *args, **kwargs: None)
    kernels.ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR

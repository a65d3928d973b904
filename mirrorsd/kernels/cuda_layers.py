"""The elementwise and row-wise parts of a decoder layer for CUDA (Triton), each one launch for every row of a call.

Why: the eager batch-invariant layer issued ~50 kernels (padding copies, eight ops per RMSNorm, ten for the rotary
embedding, three per projection), and a graphed one-token step of the 1.5B shape cost ~8x what its weights take to
read. With these three kernels and cuBLAS GEMMs on merged weights (:func:`mirrorsd.execution.fused_layers`) a
layer is nine launches.

Batch invariance: every program computes one row (one query head, one activation block) from that row alone, with
the same sums in the same order whatever the row count, so a token's bits cannot depend on the call it came in.
Integer arguments are never specialised (Triton would compile other code for a row count of 1 or for strides
divisible by 16). Each kernel computes in fp32 and rounds where the eager layer rounds, so it stays within a
rounding step of that layer; it is the CUDA reference from here on, bit for bit between 1-row and k-row calls.
"""

from __future__ import annotations

from functools import cache

import torch


@cache
def _kernels():  # noqa: ANN202 - Triton JITFunctions
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["width", "sx", "so"])
    def rms_norm(x_ptr, w_ptr, o_ptr, width, sx, so, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        j = tl.arange(0, BLOCK)
        inside = j < width
        x = tl.load(x_ptr + row * sx + j, mask=inside, other=0.0).to(tl.float32)
        scale = tl.rsqrt(tl.sum(x * x, axis=0) / width + eps)
        w = tl.load(w_ptr + j, mask=inside, other=0.0).to(tl.float32)
        y = (x * scale).to(o_ptr.dtype.element_ty).to(tl.float32) * w  # as the eager ``weight * x.to(dtype)``
        tl.store(o_ptr + row * so + j, y.to(o_ptr.dtype.element_ty), mask=inside)

    @triton.jit(do_not_specialize=["t", "n_q", "n_kv", "sx", "sc", "sq_f", "sq_h", "sk_r", "sk_h", "sk_l",
                                   "sv_r", "sv_h", "sv_l", "k_off", "v_off"])
    def rope_write(x_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slots_ptr, qw_ptr, kw_ptr, t, n_q, n_kv,
                   sx, sc, sq_f, sq_h, sk_r, sk_h, sk_l, sv_r, sv_h, sv_l, k_off, v_off, eps,
                   D: tl.constexpr, QK_NORM: tl.constexpr):
        f = tl.program_id(0)  # the call's row r * t + i
        h = tl.program_id(1)  # a query head, then a key/value head
        d = tl.arange(0, D)
        partner = (d + D // 2) % D
        kv = h - n_q
        if h < n_q:
            base = x_ptr + f * sx + h * D
            w_ptr = qw_ptr
        else:
            base = x_ptr + f * sx + k_off + kv * D
            w_ptr = kw_ptr
        x = tl.load(base + d).to(tl.float32)
        xr = tl.load(base + partner).to(tl.float32)
        dt = q_ptr.dtype.element_ty
        if QK_NORM:  # Qwen3's per-head RMSNorm before the rotation, rounded where the eager one rounds
            scale = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            x = ((x * scale).to(dt).to(tl.float32) * tl.load(w_ptr + d).to(tl.float32)).to(dt).to(tl.float32)
            xr = ((xr * scale).to(dt).to(tl.float32) * tl.load(w_ptr + partner).to(tl.float32)).to(dt)
            xr = xr.to(tl.float32)
        cos = tl.load(cos_ptr + f * sc + d).to(tl.float32)
        sin = tl.load(sin_ptr + f * sc + d).to(tl.float32)
        out = (x * cos + tl.where(d < D // 2, -xr, xr) * sin).to(dt)
        if h < n_q:
            tl.store(q_ptr + f * sq_f + h * sq_h + d, out)
        else:
            r = f // t
            slot = tl.load(slots_ptr + f % t)
            tl.store(k_ptr + r * sk_r + kv * sk_h + slot * sk_l + d, out)
            value = tl.load(x_ptr + f * sx + v_off + kv * D + d)
            tl.store(v_ptr + r * sv_r + kv * sv_h + slot * sv_l + d, value)

    @triton.jit(do_not_specialize=["width", "sx", "so"])
    def silu_mul(x_ptr, o_ptr, width, sx, so, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = j < width
        gate = tl.load(x_ptr + row * sx + j, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * sx + width + j, mask=inside, other=0.0).to(tl.float32)
        dt = o_ptr.dtype.element_ty
        silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # as the eager ``F.silu(gate) * up``
        tl.store(o_ptr + row * so + j, (silu * up).to(dt), mask=inside)

    return rms_norm, rope_write, silu_mul


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
    """``out[i] = weight * normalize(x[i])`` for every row of the 2-D ``x`` (one program per row)."""
    rows, width = x.shape
    _kernels()[0][(rows,)](x, weight, out, width, x.stride(0), out.stride(0), eps, BLOCK=_next_pow2(width))
    return out


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, slots: torch.Tensor, t: int, n_heads: int, n_kv_heads: int,
               qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> None:
    """From a QKV projection's rows ``qkv [n, (H + 2 KV) D]`` (row ``r * t + i`` is query ``i`` of cache row ``r``):
    the rotated queries into ``q [n, H, D]``, the rotated keys and the values into cache row ``r``'s ``slots[i]``
    (``keys``/``values [rows, KV, capacity, D]``). ``qk_norm``: Qwen3's per-head ``(q weight, k weight, eps)``."""
    n = q.shape[0]
    dim = q.shape[-1]
    qw, kw, eps = qk_norm if qk_norm is not None else (q, q, 0.0)
    _kernels()[1][(n, n_heads + n_kv_heads)](
        qkv, cos, sin, q, keys, values, slots, qw, kw, t, n_heads, n_kv_heads, qkv.stride(0), cos.stride(0),
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1),
        values.stride(2), n_heads * dim, (n_heads + n_kv_heads) * dim, eps, D=dim, QK_NORM=qk_norm is not None)


#: Activations per program of :func:`silu_mul`.
SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[i] = silu(gate) * up`` for each row ``gate_up[i] = [gate | up]`` (the merged gate/up projection's
    output)."""
    rows, width = gate_up.shape[0], out.shape[1]
    grid = (rows, -(-width // SILU_BLOCK))
    _kernels()[2][grid](gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=SILU_BLOCK)
    return out

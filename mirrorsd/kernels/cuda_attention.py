"""Batch-invariant attention for CUDA (Triton): one launch per layer for a whole prompt, window or tree, and every
query computed exactly as one-token decoding computes it.

Why not SDPA: its flash kernels pick tiles and KV splits by the query count, so a query in an 8-token window and
the same query decoded alone round differently, and a tree row's visible keys sit at other places than in the
cache one-token decoding builds. Here each program is one (row, query, head) and one of :data:`SPLITS` splits of
that query's visible keys (flash-decoding: the keys are walked by many programs at once, not by one chain of
dependent loads). A split walks its blocks of :data:`BLOCK_KEYS` keys, gathered through an index list in position
order, with an fp32 online softmax. A query with more than one split stores its partial results; the split that
finishes last merges all of them in one fixed reduction and resets its ticket. Which blocks a split walks depends
only on the query's own key count, and the merge's order is fixed, so neither the query count nor the order in
which programs finish can change a bit. Integer arguments are never specialised: Triton would otherwise compile
a separate kernel for a query count of 1 or for strides divisible by 16, whose reductions it may lay out
differently.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from functools import cache, lru_cache

import torch

#: Keys per block of the online softmax.
BLOCK_KEYS = 64
#: Programs per query (flash-decoding's key split): split ``p`` walks the query's key blocks ``p``, ``p + SPLITS``,
#: ... so a query of up to ``SPLITS`` blocks is one block deep, and a long one ``blocks / SPLITS``.
SPLITS = 16


@cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def applies(q: torch.Tensor) -> bool:
    """Whether :func:`attend` serves these queries: CUDA, Triton installed, a power-of-two head size."""
    return serves(q.device, q.shape[-1])


def serves(device: torch.device, head_dim: int) -> bool:
    """:func:`applies` for a device and head size."""
    return device.type == "cuda" and head_dim & (head_dim - 1) == 0 and _triton_installed()


@cache
def _kernel():  # noqa: ANN202 - a Triton JITFunction
    import triton
    import triton.language as tl

    runtime = ["rows_t", "heads", "group", "sq_r", "sq_h", "sq_t", "sk_r", "sk_h", "sk_l", "sv_r", "sv_h", "sv_l",
               "so_r", "so_h", "so_t", "si_r", "si_t", "sn_r", "splits"]

    @triton.jit(do_not_specialize=runtime)
    def attend(q_ptr, k_ptr, v_ptr, o_ptr, index_ptr, count_ptr, part_ptr, ticket_ptr, rows_t, heads, group,
               sq_r, sq_h, sq_t, sk_r, sk_h, sk_l, sv_r, sv_h, sv_l, so_r, so_h, so_t, si_r, si_t, sn_r, splits, scale,
               D: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        h = pid % heads
        i = (pid // heads) % rows_t
        r = pid // heads // rows_t
        kv = h // group
        d = tl.arange(0, D)
        n = tl.load(count_ptr + r * sn_r + i)
        blocks = tl.cdiv(n, BLOCK)
        parts = tl.minimum(blocks, SPLITS)
        if split < parts:
            q = tl.load(q_ptr + r * sq_r + h * sq_h + i * sq_t + d).to(tl.float32)
            m = tl.full([], float("-inf"), tl.float32)
            total = tl.full([], 0.0, tl.float32)
            acc = tl.zeros([D], tl.float32)
            for block in range(split, blocks, SPLITS):  # this split's blocks: split, split + SPLITS, ...
                j = block * BLOCK + tl.arange(0, BLOCK)
                valid = j < n
                key = tl.load(index_ptr + r * si_r + i * si_t + j, mask=valid, other=0)
                keys = tl.load(k_ptr + r * sk_r + kv * sk_h + key[:, None] * sk_l + d[None, :],
                               mask=valid[:, None], other=0.0).to(tl.float32)
                values = tl.load(v_ptr + r * sv_r + kv * sv_h + key[:, None] * sv_l + d[None, :],
                                 mask=valid[:, None], other=0.0).to(tl.float32)
                s = tl.where(valid, tl.sum(keys * q[None, :], axis=1) * scale, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=0))
                alpha = tl.exp(m - m_new)
                p = tl.exp(s - m_new)
                total = total * alpha + tl.sum(p, axis=0)
                acc = acc * alpha + tl.sum(p[:, None] * values, axis=0)
                m = m_new
            out = o_ptr + r * so_r + h * so_h + i * so_t + d
            if parts == 1:
                tl.store(out, (acc / total).to(o_ptr.dtype.element_ty))
            else:
                # A split's partials, [acc (D) | max | sum] at part[pid, split]; the last split to finish merges.
                base = part_ptr + pid * splits * (D + 2)
                tl.store(base + split * (D + 2) + d, acc)
                tl.store(base + split * (D + 2) + D, m)
                tl.store(base + split * (D + 2) + D + 1, total)
                tl.debug_barrier()  # every thread's partials are written before the ticket is taken
                if tl.atomic_add(ticket_ptr + pid, 1, sem="acq_rel") == parts - 1:
                    each = tl.arange(0, SPLITS)
                    held = each < parts
                    at = base + each * (D + 2)
                    maxima = tl.load(at + D, mask=held, other=float("-inf"), cache_modifier=".cg")
                    sums = tl.load(at + D + 1, mask=held, other=0.0, cache_modifier=".cg")
                    accs = tl.load(at[:, None] + d[None, :], mask=held[:, None], other=0.0, cache_modifier=".cg")
                    weight = tl.where(held, tl.exp(maxima - tl.max(maxima, axis=0)), 0.0)
                    total = tl.sum(sums * weight, axis=0)
                    acc = tl.sum(accs * weight[:, None], axis=0)
                    tl.store(out, (acc / total).to(o_ptr.dtype.element_ty))
                    tl.atomic_xchg(ticket_ptr + pid, 0)  # ready for the next layer and the next replay

    return attend


def visible_keys(mask: torch.Tensor | None, t: int, total: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, count): per (row, query), the positions of the keys it sees in order, and how many. ``mask=None``
    is a causal window over the cache: one shared ``arange`` (zero strides) and counts ``total - t + i + 1``."""
    if mask is None:
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        return _causal_keys(t, total, device, stream)
    hidden = (~mask).to(torch.int8)  # a stable sort puts the visible keys first, in position order
    index = torch.argsort(hidden, dim=-1, stable=True).to(torch.int32)
    return index, mask.sum(-1, dtype=torch.int32)


@lru_cache(maxsize=8)
def _causal_keys(t: int, total: int, device: torch.device, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Made once per forward, not once per layer (every layer sees the same window); keyed by the CUDA stream too,
    so a draft on another stream never reads tensors still being written on this one."""
    index = torch.arange(total, device=device, dtype=torch.int32).expand(1, t, total)
    count = torch.arange(total - t + 1, total + 1, device=device, dtype=torch.int32).unsqueeze(0)
    return index, count


def tickets(programs: int, device: torch.device) -> torch.Tensor:
    """Zeroed tickets for :func:`attend` calls of up to ``programs`` (row, query, head) programs. Each call leaves
    them zero, so one buffer serves every layer of a forward, but never two calls at once."""
    return torch.zeros(programs, dtype=torch.int32, device=device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, count: torch.Tensor,
           out: torch.Tensor | None = None, ticket: torch.Tensor | None = None) -> torch.Tensor:
    """``q [rows, H, t, D]`` over ``k``/``v [rows, KV, total, D]`` (grouped-query heads: ``H % KV == 0``), each
    query seeing ``k[index[r, i, :count[r, i]]]`` (``index``/``count`` with one row broadcast to all). ``out``: a
    ``[rows, H, t, D]`` view to write into (the fused layer's output projection input), else a new tensor.
    ``ticket``: a :func:`tickets` buffer this call may use (a forward passes one to all its layers), else its own."""
    rows, heads, t, dim = q.shape
    if dim & (dim - 1) or any(x.stride(-1) != 1 for x in (q, k, v)) or (out is not None and out.stride(-1) != 1):
        raise ValueError("attention needs a power-of-two head size and contiguous head vectors")
    out = torch.empty_like(q) if out is None else out
    index = index.expand(rows if index.shape[0] > 1 else 1, t, index.shape[-1])
    count = count.expand(rows if count.shape[0] > 1 else 1, t).contiguous()
    programs = rows * t * heads
    splits = min(SPLITS, -(-index.shape[-1] // BLOCK_KEYS))  # the most any query can use (a graph's: the capacity)
    ticket = tickets(programs, q.device) if ticket is None else ticket
    if ticket.numel() < programs:
        raise ValueError(f"{ticket.numel()} tickets for {programs} programs")
    part = q.new_empty(programs * splits * (dim + 2) if splits > 1 else 1, dtype=torch.float32)

    def stride(x: torch.Tensor, dim: int) -> int:
        return x.stride(dim) if x.shape[dim] > 1 else 0

    # Triton launches on the current device's stream: the tensors' device made current (a model on another GPU)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _kernel()[(programs, splits)](
            q, k, v, out, index, count, part, ticket, t, heads, heads // k.shape[1],
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            stride(index, 0), stride(index, 1), stride(count, 0), splits,
            1.0 / math.sqrt(dim), D=dim, BLOCK=BLOCK_KEYS, SPLITS=SPLITS)
    return out

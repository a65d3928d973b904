"""How a :class:`~mirrorsd.model.Transformer`'s blocks run besides the eager path (which :mod:`mirrorsd.model`
keeps beside the math): as bound C++ blocks, and as CUDA-graph replays.

Why apart: the eager path is the reference the others must match bit for bit; these are the fast paths, each with
its own preconditions. ``run_layers`` still dispatches to them inline: a 1-token forward is priced at the ~10 µs
level, so there is no extra layer of calls between it and these.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import cuda_graphs, kernels
from .kernels import cuda_attention
from .kv_cache import KVCache
from .linear import FIXED_ROWS, PACKED_BUFFERS, DenseLinear, PackedLinear, QuantLinear, fixed_shapes
from .sampling import GREEDY_CHOICE, SamplingParams, choose, graph_choice, stream_key

if TYPE_CHECKING:
    from torch import nn

    from .model import SSDeltas, SSRows, Transformer

#: A QuantLinear's packed tensors, in the order ``cpu_block.cpp``'s QuantBlock takes them.
_PACKED_FIELDS = (*PACKED_BUFFERS, "bias")
_F32_BITS = 32  # what QuantBlock reads as "an fp32 PackedLinear"
#: A block's linears (attention's four, then the MLP's), in the order the C++ block binds them.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def row_local(linear: nn.Module) -> bool:
    """Whether a linear computes each row with bits that do not depend on the others in the call: a fast quantized
    one, or fp32 packed weights on the row-exact path (``Transformer.make_row_exact``)."""
    return (isinstance(linear, QuantLinear) and linear.fast) or (isinstance(linear, PackedLinear) and linear.row_exact)


def _block_tensors(linear: nn.Module) -> tuple[list[torch.Tensor | None], list[int]]:
    """One linear's tensors and ints as QuantBlock takes them."""
    if isinstance(linear, PackedLinear):
        tensors = [linear.packed, *([None] * (len(_PACKED_FIELDS) - 2)), linear.bias]
        return tensors, [linear.out_features, _F32_BITS, 0, 0]
    tensors = [getattr(linear, name) for name in _PACKED_FIELDS]
    return tensors, [linear.out_features, linear.bits, linear.group, linear.zero]


def attention_backends(device: torch.device) -> AbstractContextManager:
    """SDPA on CUDA without its cuDNN backend: PyTorch builds a new cuDNN graph for every new key length, so in
    decoding each call costs ~2.3 ms of host time (on an H200 that was 65 of a bf16 step's 92 ms, 1.5B shape);
    the flash and memory-efficient kernels need no plan."""
    if device.type != "cuda":
        return nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class KernelBinding:
    """The C++ side of a decoder block (mixed into :class:`~mirrorsd.model.Block`): the whole block as one
    ``QuantBlock`` op (``cpu_block.cpp``) when every projection is row-local (:func:`row_local`)."""

    use_kernel: bool  # the whole block in one C++ call (bind_kernel)
    _kernel: torch.ScriptObject | None
    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def bind_kernel(self) -> None:
        """Run this block as one C++ ``QuantBlock`` op (``cpu_block.cpp``) when every projection is row-local (all
        quantized or all fp32) and the fused norms/attention are on: a window (with stream rows too, outside
        training) then costs one op call instead of ~17 (the same kernels in the same order, so the same bits). The
        weights are bound at the next forward; call again after swapping one."""
        self._kernel = None
        linears = self._linears()
        self.use_kernel = self.self_attn.fused and all(row_local(x) for x in linears) \
            and len({isinstance(x, PackedLinear) for x in linears}) == 1

    def _linears(self) -> tuple[nn.Module, ...]:
        return tuple(getattr(self.self_attn if name in PROJECTIONS[:4] else self.mlp, name) for name in PROJECTIONS)

    def _quant_block(self) -> torch.ScriptObject:
        attn = self.self_attn
        linears = self._linears()
        parts = [_block_tensors(x) for x in linears]
        tensors = [t for ts, _ in parts for t in ts]
        tensors += [self.input_layernorm.weight, self.post_attention_layernorm.weight,
                    *(None if n is None else n.weight for n in (attn.q_norm, attn.k_norm))]
        ints = [v for _, vs in parts for v in vs]
        ints += [attn.n_heads, attn.n_kv_heads, attn.head_dim]
        return torch.classes.mirrorsd.QuantBlock(tensors, ints, self.input_layernorm.eps)

    def __getstate__(self) -> dict:
        """Pickling (the processes backend sends the draft model) drops the bound C++ object; the next forward
        binds it again."""
        return {**self.__dict__, "_kernel": None, "merged": None}

    def kernel(self) -> torch.ScriptObject | None:
        """The bound C++ block when this block runs as one op (bound on first use), else None."""
        if not (self.use_kernel and self.self_attn.fused):
            return None
        if self._kernel is None:
            kernels.available()  # loads the extension (a fresh process may not have yet)
            self._kernel = self._quant_block()
        return self._kernel


def run_kernels(bound: list[torch.ScriptObject], layers: list[int], split: bool, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, cache: KVCache, mask: torch.Tensor | None,
                streams: SSRows | None = None) -> torch.Tensor:
    """Bound C++ blocks (:meth:`KernelBinding.kernel`) of ``layers`` in turn, in one op call (``cpu_block.cpp``'s
    ``blocks_forward``: the Python between 28 calls cost a 1-token forward ~1.8 ms), advancing each layer's cache.

    ``streams``: the window's trailing stream rows take their adapters' deltas inside the op
    (``stream_blocks_forward``; 4 Python blocks cost an ``ss`` pass ~11 ms). Their keys and values land in the
    buffers past the main rows, where this forward's attention reads them, and the cache's lengths leave them out."""
    t = x.shape[1]
    kept = t - (streams.count if streams is not None else 0)
    starts = [cache.lengths[layer] for layer in layers]
    buffers = [cache.buffers(layer, start + t) for layer, start in zip(layers, starts, strict=True)]
    keys, values = [k for k, _ in buffers], [v for _, v in buffers]
    # With __torch_function__ dispatch on, the op looks the attribute up on the C++ block objects, which throws and
    # catches a C++ exception per block (SmolLM2's 1-token forward: 6.18 ms with it, 5.88 without).
    with torch._C.DisableTorchFunction():
        if kept == t:
            out = torch.ops.mirrorsd.blocks_forward.default(bound, x, cos, sin, keys, values, starts, mask, split)
        else:
            a, b, scale = streams.adapters.weight_lists(layers)
            out = torch.ops.mirrorsd.stream_blocks_forward.default(bound, x, cos, sin, keys, values, starts, mask,
                                                                   split, a, b, scale, t - kept)
    for layer, start in zip(layers, starts, strict=True):
        cache.lengths[layer] = start + kept
    return out


@functools.cache
def _omp_pause() -> Callable[[int], int] | None:
    """GNU OpenMP's ``omp_pause_resource_all``, from the copy Linux wheels of torch ship and load, or None (builds
    that link LLVM's or Intel's runtime are left alone: their pause acts on the whole process)."""
    gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    try:
        return getattr(ctypes.CDLL(str(gomp)), "omp_pause_resource_all", None) if gomp.exists() else None
    except OSError:
        return None


def release_thread_team() -> None:
    """End the calling thread's idle OpenMP worker team, if it has one; its next parallel region starts a new one.

    Why: each thread that runs parallel work keeps a team of its own, and libgomp lets workers spin between parallel
    regions only while it manages no more threads than there are cores. One idle team elsewhere (the thread that
    loaded the models, a thread whose forwards now run on a batcher's engine) puts every other team's workers to sleep
    after each region, and waking them costs a 1-token forward ~25% (Qwen2.5-Coder-1.5B q4 on 2 Zen 3 cores:
    31 → 39 ms, ~270 futex wakes). So a thread whose parallel work moves elsewhere calls this."""
    pause = _omp_pause()
    if pause is not None:
        pause(1)  # omp_pause_soft: libgomp ends only the caller's pool, and refuses inside a parallel region


class ForwardBatcher(Protocol):
    """Where a thread's forwards go while it takes part in continuous batching (:mod:`mirrorsd.batching`):
    each call waits there and returns what it returns alone, bit for bit."""

    def run_layers(self, model: Transformer, call: LayerCall, start: int, end: int) -> torch.Tensor: ...

    def head(self, model: Transformer, hidden: torch.Tensor, head: nn.Module | None) -> torch.Tensor: ...


_batching = threading.local()


def batcher() -> ForwardBatcher | None:
    """This thread's :class:`ForwardBatcher`, or None when its forwards run as they come."""
    return getattr(_batching, "hook", None)


@contextmanager
def batched_by(hook: ForwardBatcher | None) -> Iterator[None]:
    """Send this thread's batchable forwards to ``hook`` (None: run them here) for the block."""
    old = batcher()
    _batching.hook = hook
    try:
        yield
    finally:
        _batching.hook = old


def head_batchable(model: Transformer, hidden: torch.Tensor, head: nn.Module | None = None) -> bool:
    """Whether the final norm and the head (``model.lm_head``, or ``head``, a module computing through a ``linear``:
    a draft's reduced vocabulary) are row-local on ``hidden``: the C++ norm and a :func:`row_local` product, or on
    CUDA the norm and a dense product in fixed-row slabs (:func:`~mirrorsd.linear.in_fixed_rows`)."""
    linear = model.lm_head if head is None else getattr(head, "linear", None)
    return hidden.dim() == 3 and hidden.shape[0] == 1 and linear is not None and not torch.is_grad_enabled() and (
        (model.norm.fused and row_local(linear)) or (fixed_shapes(hidden) and isinstance(linear, DenseLinear)))


@dataclass(eq=False)
class LayerCall:
    """One sequence's window for :func:`ragged_layers`: what ``Transformer.run_layers`` takes for one row."""

    hidden: torch.Tensor  # [1, T, hidden]
    positions: torch.Tensor  # [1, T]
    cache: KVCache
    mask: torch.Tensor | None = None  # bool [1, T, past + T], or None: causal
    streams: SSRows | None = None


def ragged_blocks(model: Transformer, start: int, end: int) -> list[torch.ScriptObject] | None:
    """Blocks ``[start, end)`` bound to the C++ op with one activation format, or None when any is not: the windows of
    several sequences then run through :func:`ragged_layers` with the bits each gets alone."""
    blocks = list(model.layers)[start:end]
    bound = [block.kernel() for block in blocks]
    if not bound or any(kernel is None for kernel in bound):
        return None
    return bound if len({block.mlp.down_proj.split_activations for block in blocks}) == 1 else None


def fused_batches(model: Transformer) -> bool:
    """Whether ``model``'s blocks run as :func:`fused_layers` (a GPU): their rows are batch-invariant, so several
    sequences' windows share one call of them too (:func:`ragged_layers`)."""
    with torch.no_grad():
        return fused_applies(model, model.norm.weight)


def ragged_applies(model: Transformer, start: int, end: int) -> bool:
    """Whether :func:`ragged_layers` takes blocks ``[start, end)``: bound to the C++ op, or the fused CUDA layers."""
    return ragged_blocks(model, start, end) is not None or fused_batches(model)


def batches(model: Transformer) -> bool:
    """Whether ``model``'s forwards can share a continuous batch with the bits each gets alone."""
    return ragged_applies(model, 0, model.config.n_layers)


def ragged_layers(model: Transformer, calls: list[LayerCall], start: int, end: int) -> list[torch.Tensor]:
    """Blocks ``[start, end)`` on several sequences' windows in one call: the linears read their weights once for
    every row, while rotary embedding, the cache writes and attention run per sequence over its own cache. A
    sequence's outputs have the bits it gets alone (the linears and norms are row-local and its attention is the
    same call), so batching cannot change a token. Advances each cache's lengths. On a CPU that call is the C++
    ``ragged_blocks_forward``; on a GPU the fused layers (:func:`fused_layers`), eagerly (a batch's shapes change
    every step, so no graph would be replayed twice)."""
    adapters = {id(c.streams.adapters): c.streams.adapters for c in calls if c.streams is not None and c.streams.count}
    if len(adapters) > 1:
        raise ValueError("ragged_layers: the stream rows of one call must share their adapters")
    lengths = [c.hidden.shape[1] for c in calls]
    bound = ragged_blocks(model, start, end)
    if bound is None:
        if not fused_batches(model):
            raise ValueError("ragged_layers needs every block of the range bound to the C++ op, or the fused CUDA "
                             "layers")
        return list(_ragged_fused(model, calls, start, end, next(iter(adapters.values()), None))
                    .unsqueeze(0).split(lengths, dim=1))
    layers = range(start, end)
    split = model.layers[start].mlp.down_proj.split_activations
    streams = [c.streams.count if c.streams is not None else 0 for c in calls]
    starts = [c.cache.lengths[layer] for layer in layers for c in calls]
    buffers = [c.cache.buffers(layer, c.cache.lengths[layer] + t) for layer in layers
               for c, t in zip(calls, lengths, strict=True)]
    angles = [model.rope(c.positions) for c in calls]
    cos = torch.cat([a[0][0] for a in angles])
    sin = torch.cat([a[1][0] for a in angles])
    x = torch.cat([c.hidden[0] for c in calls])
    masks = [None if c.mask is None else c.mask[0] for c in calls]
    a = b = scale = []
    if adapters:
        a, b, scale = next(iter(adapters.values())).weight_lists(layers)
    with torch._C.DisableTorchFunction():  # (see run_kernels)
        out = torch.ops.mirrorsd.ragged_blocks_forward.default(
            bound, x, cos, sin, lengths, streams, [k for k, _ in buffers], [v for _, v in buffers], starts, masks,
            split, a, b, scale)
    i = 0
    for layer in layers:
        for c, t, s in zip(calls, lengths, streams, strict=True):
            c.cache.lengths[layer] = starts[i] + t - s
            i += 1
    return list(out.unsqueeze(0).split(lengths, dim=1))


def fused_applies(model: Transformer, hidden: torch.Tensor) -> bool:
    """Whether blocks run as :func:`fused_layers`: the batch-invariant CUDA path (Triton installed, a power-of-two
    head size) outside autograd. Everywhere it applies it is the only path, so every method's windows, trees and
    rollouts meet one-token decoding's bits."""
    return fixed_shapes(hidden) and not torch.is_grad_enabled() and isinstance(model.lm_head, DenseLinear) \
        and cuda_attention.serves(hidden.device, model.config.head_dim)


@dataclass(frozen=True)
class MergedWeights:
    """One block's weights as the fused layer reads them: one QKV and one gate/up matrix (the projections' own
    weights become views into them, so no byte is held twice)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    norm_in: torch.Tensor
    norm_post: torch.Tensor
    eps: float
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None


def _merge(linears: tuple[nn.Module, ...]) -> torch.Tensor:
    merged = torch.cat([x.weight for x in linears])
    offset = 0
    for x in linears:
        rows = x.weight.shape[0]
        x.weight.data = merged[offset : offset + rows]
        offset += rows
    return merged


_MERGING = threading.Lock()


def merged_weights(block: nn.Module) -> MergedWeights:
    """``block``'s :class:`MergedWeights`, made on first use (under a lock: Mirror-SD's draft may share the
    target's blocks and run on another thread)."""
    if block.merged is not None:
        return block.merged
    # Normal tensors even when first used under inference mode: training later runs autograd through these weights.
    with _MERGING, torch.inference_mode(False), torch.no_grad():
        if block.merged is not None:
            return block.merged
        attn, mlp = block.self_attn, block.mlp
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        biases = [x.bias for x in qkv]
        qkv_bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else x.weight.new_zeros(x.out_features) for b, x in zip(biases, qkv, strict=True)])
        qk_norm = None if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
        block.merged = MergedWeights(
            qkv=_merge(qkv), qkv_bias=qkv_bias, o=attn.o_proj.weight, o_bias=attn.o_proj.bias,
            gate_up=_merge((mlp.gate_proj, mlp.up_proj)), down=mlp.down_proj.weight,
            norm_in=block.input_layernorm.weight, norm_post=block.post_attention_layernorm.weight,
            eps=block.input_layernorm.eps, qk_norm=qk_norm)
    return block.merged


def _slabs(n: int) -> list[slice]:
    return [slice(a, a + FIXED_ROWS) for a in range(0, n, FIXED_ROWS)]


def fused_layers(model: Transformer, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache | None,
                 mask: torch.Tensor | None, start: int, end: int, streams: SSRows | None = None,
                 static: cuda_graphs.StaticStep | None = None) -> torch.Tensor:
    """Blocks ``[start, end)`` as nine launches each: RMSNorm (Triton), the QKV GEMM with its bias, RoPE with the
    cache write (Triton), attention over each query's gather list (Triton), the output GEMM adding into the
    residual, RMSNorm, the gate/up GEMM, SiLU·up (Triton), the down GEMM adding into the residual.

    Batch-invariant: the hidden states sit in slabs of exactly :data:`~mirrorsd.linear.FIXED_ROWS` zero-padded rows
    (every GEMM has one shape), and every Triton program computes one row alone. ``static``: a captured graph's
    device-side inputs (the cache slots, gather lists and counts; its caller advances the lengths). ``cache=None``
    attends within the window through a scratch cache. ``streams``: the trailing stream rows get their adapters'
    deltas, and their keys and values are written past the cache's length (attended now, never kept)."""
    rows, t, width = hidden.shape
    if cache is None:
        cache = model.new_cache(rows=rows, capacity=t)
    cos, sin = (c.reshape(rows * t, -1) for c in model.rope(positions.expand(rows, t)))
    window = _Window(0, rows, t, cache, mask, streams.count if streams is not None else 0)
    out = _on_device(hidden, lambda: _fused_windows(model, hidden.reshape(rows * t, width), cos, sin, [window], start,
                                                    end, streams.adapters if streams is not None else None, static))
    return out.view(rows, t, width)


def _ragged_fused(model: Transformer, calls: list[LayerCall], start: int, end: int, adapters: SSDeltas | None
                  ) -> torch.Tensor:
    """:func:`ragged_layers` on the fused CUDA layers: every call's rows, one after another, ``[n, width]``."""
    windows, offset = [], 0
    for c in calls:
        t = c.hidden.shape[1]
        windows.append(_Window(offset, 1, t, c.cache, c.mask, c.streams.count if c.streams is not None else 0))
        offset += t
    cos, sin = (torch.cat(parts) for parts in zip(*(
        (c.reshape(-1, c.shape[-1]) for c in model.rope(call.positions)) for call in calls), strict=True))
    hidden = torch.cat([c.hidden[0] for c in calls])
    return _on_device(hidden, lambda: _fused_windows(model, hidden, cos, sin, windows, start, end, adapters, None))


def _on_device(hidden: torch.Tensor, work: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``work`` with ``hidden``'s device current: Triton launches on the current device's stream, whatever the
    tensors' device, so a model on another GPU (a draft on a second one, the devices backend's worker thread) makes
    its own device current first."""
    with torch.cuda.device(hidden.device) if hidden.is_cuda else nullcontext():
        return work()


@dataclass
class _Window:
    """One cache's window inside a fused call: the call's rows ``[offset, offset + rows * t)``, row ``r * t + i``
    being query ``i`` of cache row ``r``; ``streams``: the trailing stream rows of each cache row."""

    offset: int
    rows: int
    t: int
    cache: KVCache
    mask: torch.Tensor | None
    streams: int

    @property
    def span(self) -> slice:
        return slice(self.offset, self.offset + self.rows * self.t)

    def stream_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s rows of this window's stream rows, ``[rows, streams, width]`` (a view: written in place)."""
        return x[self.span].view(self.rows, self.t, -1)[:, self.t - self.streams :]


def _fused_windows(model: Transformer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   windows: list[_Window], start: int, end: int, adapters: SSDeltas | None,
                   static: cuda_graphs.StaticStep | None) -> torch.Tensor:
    """:func:`fused_layers` on the rows ``hidden [n, width]`` of one or more windows, each over its own cache
    (continuous batching: :func:`ragged_layers`). The norms and GEMMs run on all rows at once, each row with the bits
    it gets alone; RoPE with the cache write and attention run per window, over its cache. ``static``: one window's
    graph inputs."""
    from .kernels import cuda_layers

    n, width = hidden.shape
    cfg = model.config
    heads, kv_heads, dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    padded = -(-n // FIXED_ROWS) * FIXED_ROWS
    slabs = _slabs(padded)
    h = hidden.new_zeros(padded, width)
    h[:n] = hidden
    x = torch.zeros_like(h)  # the norms and SiLU write only the call's rows: the padding stays zero
    qkv = hidden.new_empty(padded, (heads + 2 * kv_heads) * dim)
    q = hidden.new_empty(n, heads, dim)
    attn = hidden.new_zeros(padded, heads * dim)
    gate_up = hidden.new_empty(padded, 2 * cfg.intermediate_size)
    act = hidden.new_zeros(padded, cfg.intermediate_size)
    streamed = [w for w in windows if w.streams]
    # every attention call hands its tickets back: one buffer for the largest window serves them all
    ticket = cuda_attention.tickets(max(w.rows * w.t for w in windows) * heads, h.device)
    visible: list[dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [{} for _ in windows]  # by length

    def add_deltas(layer: int, names: tuple[str, ...], bounds: list[tuple[int, int]], out: torch.Tensor,
                   inputs: torch.Tensor) -> None:
        for w in streamed:
            rows = w.stream_rows(out)
            for name, (a, b) in zip(names, bounds, strict=True):
                rows[..., a:b] += adapters.delta(layer, name, w.stream_rows(inputs)).to(h.dtype)

    qkv_bounds = _bounds(heads * dim, kv_heads * dim)
    inter = cfg.intermediate_size
    for layer in range(start, end):
        w = merged_weights(model.layers[layer])
        cuda_layers.rms_norm(h[:n], w.norm_in, w.eps, x)
        for slab in slabs:
            _linear(x[slab], w.qkv, w.qkv_bias, qkv[slab])
        add_deltas(layer, ("q_proj", "k_proj", "v_proj"), qkv_bounds, qkv, x)
        lengths = []
        for window, seen in zip(windows, visible, strict=True):
            cache, t, span = window.cache, window.t, window.span
            if static is not None:
                keys, values = cache.keys[layer], cache.values[layer]
                slots, index, count = static.slots, static.index, static.count
            else:
                length = cache.lengths[layer]
                lengths.append(length)
                keys, values = cache.buffers(layer, length + t)
                if length not in seen:
                    slots = torch.arange(length, length + t, device=h.device)
                    seen[length] = (slots, *cuda_attention.visible_keys(window.mask, t, length + t, h.device))
                slots, index, count = seen[length]
            cuda_layers.rope_write(qkv[span], cos[span], sin[span], q[span], keys, values, slots, t, heads, kv_heads,
                                   w.qk_norm)
            cuda_attention.attend(q[span].view(window.rows, t, heads, dim).transpose(1, 2), keys, values, index,
                                  count, out=attn[span].view(window.rows, t, heads, dim).transpose(1, 2),
                                  ticket=ticket)
        for slab in slabs:
            _add_product(h[slab], attn[slab], w.o)
        if w.o_bias is not None:
            h += w.o_bias
        add_deltas(layer, ("o_proj",), [(0, width)], h, attn)
        cuda_layers.rms_norm(h[:n], w.norm_post, w.eps, x)
        for slab in slabs:
            torch.mm(x[slab], w.gate_up.t(), out=gate_up[slab])
        add_deltas(layer, ("gate_proj", "up_proj"), [(0, inter), (inter, 2 * inter)], gate_up, x)
        cuda_layers.silu_mul(gate_up[:n], act)
        for slab in slabs:
            _add_product(h[slab], act[slab], w.down)
        add_deltas(layer, ("down_proj",), [(0, width)], h, act)
        if static is None:  # (under static inputs the caller advances them)
            for window, length in zip(windows, lengths, strict=True):
                window.cache.lengths[layer] = length + window.t - window.streams
    return h[:n]


def _bounds(q_width: int, kv_width: int) -> list[tuple[int, int]]:
    return [(0, q_width), (q_width, q_width + kv_width), (q_width + kv_width, q_width + 2 * kv_width)]


def _add_product(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``residual += x @ weight.T`` as one GEMM with the residual in its epilogue (one rounding; the same view as
    input and output, so PyTorch copies nothing first)."""
    torch.addmm(residual, x, weight.t(), out=residual)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:  # one cuBLASLt call with the bias in its epilogue
        torch.addmm(bias, x, weight.t(), out=out)


GRAPH_KINDS = ("draft", "stream draft", "stream pass")  # the first item of a static_graph key


def static_graph(model: Transformer, cache: KVCache, key: tuple, needed: int,
                 make: Callable[[tuple | None], cuda_graphs.Captured]) -> cuda_graphs.Captured | None:
    """The graph ``key`` names over ``cache`` (``key[0]``: one of :data:`GRAPH_KINDS`, ``key[1]``: the model,
    ``key[-1]``: the choice it bakes in), made by ``make(pool)`` on the key's second sight, with the cache's buffers
    grown to ``needed`` positions first (a growth drops graphs). Where one applies: the fused CUDA layers with graphs
    on, no continuous batching, a one-row cache with every layer at one length. None otherwise, and on the key's
    first sight (a one-off, such as a prompt, costs no static buffers)."""
    if key[0] not in GRAPH_KINDS:  # (kinds share a cache's graph set: a misspelt one would evict another's graphs)
        raise ValueError(f"unknown graph kind {key[0]!r}: one of {', '.join(GRAPH_KINDS)}")
    if not cuda_graphs.enabled() or batcher() is not None or cache.rows != 1 or len(set(cache.lengths)) != 1 \
            or not fused_applies(model, model.norm.weight):  # (not a quantized embedding: it dequantizes)
        return None
    for layer in range(cache.n_layers):  # the buffers the graph writes into: grown first (a growth drops graphs)
        cache.buffers(layer, needed)
    graphs = cache.graphs()
    # keyed by what the choice bakes in (e.g. DraftSampler.choice): requests share their graphs whatever their seed
    graph = graphs.get(key)
    if graph is None:
        # another request's choice (other sampling parameters) or model (the bench's oracle drafts share their
        # caches): one set of each kind at a time
        for old in [k for k in graphs if k[0] == key[0] and (k[1], k[-1]) != (key[1], key[-1])]:
            del graphs[old]
        graphs[key] = False  # seen once
        return None
    if graph is False:
        pool = next((g.pool for g in graphs.values() if g), None)
        graph = graphs[key] = make(pool)
    return graph


def _layer_graph(model: Transformer, inputs: torch.Tensor, cache: KVCache | None, mask: torch.Tensor | None,
                 start: int, end: int, last: int | None, choice: tuple | None = None
                 ) -> tuple[cuda_graphs.LayerGraph, int, tuple[torch.Tensor, torch.Tensor] | None] | None:
    """The :class:`~mirrorsd.cuda_graphs.LayerGraph` for this window shape over blocks ``[start, end)`` (``last``:
    a whole forward's, keeping that many rows' logits; ``choice``: what its token choice bakes in,
    :func:`~mirrorsd.sampling.graph_choice`), its cache length and a masked window's visible keys; None where graphs
    do not apply, and on a shape's first sight."""
    rows, t = inputs.shape[:2]
    if cache is None or rows * t > FIXED_ROWS or not cuda_graphs.enabled() or not fused_applies(model, inputs) \
            or cache.rows != rows:
        return None
    lengths = set(cache.lengths[start:end])
    length = lengths.pop() if len(lengths) == 1 else -1
    capacity = min(cache.keys[layer].shape[2] for layer in range(start, end))  # layers grow one by one
    if not 0 <= length <= capacity - t or (mask is not None and not (
            mask.dtype == torch.bool and mask.shape[-2:] == (t, length + t) and mask.shape[0] in (1, rows))):
        return None
    captured = cache.graphs()
    key = (model, start, end, t, None if mask is None else mask.shape[0], last, choice)  # (weights are baked in)
    graph = captured.get(key)
    if graph is None:
        if choice not in (None, GREEDY_CHOICE):  # greedy's graphs and one sampled setting's at a time (memory)
            for old in [k for k in captured
                        if len(k) == len(key) and k[0] is model and k[-1] not in (None, GREEDY_CHOICE, choice)]:
                del captured[old]
        captured[key] = False  # seen once
        return None
    if graph is False:
        pool = next((g.pool for g in captured.values() if g), None)
        graph = captured[key] = cuda_graphs.LayerGraph(inputs, capacity, key[4], pool)
    visible = None if mask is None else cuda_attention.visible_keys(mask, t, length + t, inputs.device)
    return graph, length, visible


def replay(model: Transformer, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache | None,
           mask: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """Blocks ``[start, end)`` through this shape's :class:`~mirrorsd.cuda_graphs.LayerGraph` of
    :func:`fused_layers`, where one applies: that path, at most one fixed-row slab, those layers at one cache
    length with room for the window in each, and a mask (if any) over exactly the cache and the window. None
    otherwise, and the first time a shape is seen (a one-off costs no static buffers): the caller runs the
    layers without a graph."""
    found = _layer_graph(model, hidden, cache, mask, start, end, None)
    if found is None:
        return None
    graph, length, visible = found

    def layers(static: cuda_graphs.StaticStep) -> torch.Tensor:
        return fused_layers(model, graph.inputs, static.positions, cache, None, start, end, static=static)

    out = graph(hidden, positions.expand(hidden.shape[:2]), length, visible, layers)
    cache.lengths[start:end] = [length + hidden.shape[1]] * (end - start)
    return out


def replay_forward(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | None,
                   mask: torch.Tensor | None, last: int, choice: tuple[SamplingParams, int] | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """A whole forward's logits (embedding, every block, final norm and LM head on the last ``last`` rows) as one
    graph, where :func:`replay` would replay its layers and no :func:`batcher` takes the forward: the embedding's
    and the head's kernels then run without the host issuing them one by one. ``choice`` (sampling parameters and
    a noise key): the graph also chooses each kept row's token (:func:`~mirrorsd.sampling.choose`, keyed by the
    position after the row's) and returns ``(logits, tokens)``; the seed is an input, so every request with the same
    parameters replays it. None otherwise."""
    if batcher() is not None:
        return None
    end = model.config.n_layers
    found = _layer_graph(model, tokens, cache, mask, 0, end, last, None if choice is None else graph_choice(*choice))
    if found is None:
        return None
    graph, length, visible = found

    def forward(static: cuda_graphs.StaticStep) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        hidden = fused_layers(model, model.embed(graph.inputs), static.positions, cache, None, 0, end, static=static)
        logits = model.logits(hidden[:, -last:])
        if choice is None:
            return logits
        at = static.positions[:, -last:] + 1
        own = choose(logits.reshape(-1, logits.shape[-1]), at.reshape(-1), *choice, key=graph.stream_key)
        return logits, own.view(at.shape)

    key = None if choice is None or choice[0].greedy else stream_key(choice[0].seed, choice[1])
    out = graph(tokens, positions.expand(tokens.shape), length, visible, forward, key)
    cache.lengths[:end] = [length + tokens.shape[1]] * end
    return out

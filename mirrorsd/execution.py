"""How a :class:`~mirrorsd.model.Transformer`'s blocks run besides the eager path (which :mod:`mirrorsd.model`
keeps beside the math): as bound C++ blocks, and as CUDA-graph replays.

Why apart: the eager path is the reference the others must match bit for bit; these are the fast paths, each with
its own preconditions. ``run_layers`` still dispatches to them inline: a 1-token forward is priced at the ~10 µs
level, so there is no extra layer of calls between it and these.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import cuda_graphs, kernels
from .kernels import cuda_attention
from .kv_cache import KVCache
from .linear import FIXED_ROWS, PACKED_BUFFERS, QuantLinear, fixed_shapes

if TYPE_CHECKING:
    from torch import nn

    from .model import StreamRows, Transformer

#: A QuantLinear's packed tensors, in the order ``cpu_block.cpp``'s QuantBlock takes them.
_PACKED_FIELDS = (*PACKED_BUFFERS, "bias")
#: A block's linears (attention's four, then the MLP's), in the order the C++ block binds them.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def attention_backends(device: torch.device) -> AbstractContextManager:
    """SDPA on CUDA without its cuDNN backend: PyTorch builds a new cuDNN graph for every new key length, so in
    decoding each call costs ~2.3 ms of host time (on an H200 that was 65 of a bf16 step's 92 ms, 1.5B shape);
    the flash and memory-efficient kernels need no plan."""
    if device.type != "cuda":
        return nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class KernelBinding:
    """The C++ side of a decoder block (mixed into :class:`~mirrorsd.model.Block`): the whole block as one
    ``QuantBlock`` op (``cpu_block.cpp``) when every projection is a fast QuantLinear."""

    use_kernel: bool  # the whole block in one C++ call (bind_kernel)
    _kernel: torch.ScriptObject | None
    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def bind_kernel(self) -> None:
        """Run this block as one C++ ``QuantBlock`` op (``cpu_block.cpp``) when every projection is a fast
        QuantLinear and the fused norms/attention are on: a window (with stream rows too, outside training) then costs
        one op call instead of ~17 (the same kernels in the same order, so the same bits). The weights are bound at
        the next forward; call again after swapping one."""
        self._kernel = None
        self.use_kernel = self.self_attn.fused and all(isinstance(x, QuantLinear) and x.fast for x in self._linears())

    def _linears(self) -> tuple[nn.Module, ...]:
        return tuple(getattr(self.self_attn if name in PROJECTIONS[:4] else self.mlp, name) for name in PROJECTIONS)

    def _quant_block(self) -> torch.ScriptObject:
        attn = self.self_attn
        linears = self._linears()
        tensors = [getattr(x, name) for x in linears for name in _PACKED_FIELDS]
        tensors += [self.input_layernorm.weight, self.post_attention_layernorm.weight,
                    *(None if n is None else n.weight for n in (attn.q_norm, attn.k_norm))]
        ints = [v for x in linears for v in (x.out_features, x.bits, x.group, x.zero)]
        ints += [attn.n_heads, attn.n_kv_heads, attn.head_dim]
        return torch.classes.mirrorsd.QuantBlock(tensors, ints, self.input_layernorm.eps)

    def __getstate__(self) -> dict:
        """Pickling (the processes backend sends the draft model) drops the bound C++ object; the next forward
        binds it again."""
        return {**self.__dict__, "_kernel": None}

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
                streams: StreamRows | None = None) -> torch.Tensor:
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
            a, b, scale = zip(*(streams.adapters.weights(layer, name) for layer in layers for name in PROJECTIONS),
                              strict=True)
            out = torch.ops.mirrorsd.stream_blocks_forward.default(bound, x, cos, sin, keys, values, starts, mask,
                                                                   split, list(a), list(b), list(scale), t - kept)
    for layer, start in zip(layers, starts, strict=True):
        cache.lengths[layer] = start + kept
    return out


def replay(model: Transformer, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache | None,
             mask: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """Blocks ``[start, end)`` through this shape's :class:`~mirrorsd.cuda_graphs.LayerGraph`, where one
    applies: the batch-invariant CUDA path, no grad, at most one fixed-row slab, those layers at one cache
    length with room for the window in each, and a mask (if any) over exactly the cache and the window. None
    otherwise, and the first time a shape is seen (a one-off costs no static buffers): the caller runs the
    layers eagerly."""
    rows, t, _ = hidden.shape
    if cache is None or rows * t > FIXED_ROWS or not cuda_graphs.enabled() or not fixed_shapes(hidden) \
            or model.fused or torch.is_grad_enabled() or cache.rows != rows \
            or not cuda_attention.serves(hidden.device, model.config.head_dim):
        return None
    lengths = set(cache.lengths[start:end])
    length = lengths.pop() if len(lengths) == 1 else -1
    capacity = min(cache.keys[layer].shape[2] for layer in range(start, end))  # layers grow one by one
    if not 0 <= length <= capacity - t or (mask is not None and not (
            mask.dtype == torch.bool and mask.shape[-2:] == (t, length + t) and mask.shape[0] in (1, rows))):
        return None
    captured = cache.graphs()
    key = (model, start, end, t, None if mask is None else mask.shape[0])  # (weights are baked into a graph)
    graph = captured.get(key)
    if graph is None:
        captured[key] = False  # seen once
        return None
    if graph is False:
        pool = next((g.pool for g in captured.values() if g), None)
        graph = captured[key] = cuda_graphs.LayerGraph(hidden, capacity, key[-1], pool)
    visible = None if mask is None else cuda_attention.visible_keys(mask, t, length + t, hidden.device)

    def layers() -> torch.Tensor:
        out, (cos, sin) = graph.hidden, model.rope(graph.static.positions)
        with attention_backends(out.device):
            for block in list(model.layers)[start:end]:
                out = block(out, cos, sin, cache, None)
        return out

    out = graph(hidden, positions.expand(hidden.shape[:2]), length, visible, layers)
    cache.lengths[start:end] = [length + t] * (end - start)
    return out

"""A per-layer key/value cache with the operations speculative decoding needs.

Buffers are preallocated (and grown by doubling) so appending a window is a slice write, not a
``torch.cat`` of the whole history. Each layer keeps its own length because layer-wise execution (run
layers ``[0, l)`` now, ``[l, N)`` later) fills the lower layers first. Rows (the batch dimension) hold
independent sequences or branches that share one length; per-branch differences are expressed with
attention masks, never with ragged buffers.
"""

from __future__ import annotations

import torch

from .transfer import send


class KVCache:
    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        rows: int = 1,
        capacity: int = 256,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (rows, n_kv_heads, max(capacity, 1), head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = [0] * n_layers
        self._graphs: dict = {}
        self._graphs_over: tuple[int, ...] = ()

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def __len__(self) -> int:
        """Length of the sequence every layer holds (the committed part)."""
        return min(self.lengths)

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a window ``[rows, heads, T, dim]`` after this layer's history; return views of all of it."""
        start = self.lengths[layer]
        end = start + key.shape[2]
        keys, values = self.buffers(layer, end)
        keys[:, :, start:end] = key
        values[:, :, start:end] = value
        self.lengths[layer] = end
        return keys[:, :, :end], values[:, :, :end]

    def graphs(self) -> dict:
        """Layer-range graphs over the current buffers (:mod:`mirrorsd.cuda_graphs`), by model, layer range and
        window shape: once the buffers change (a growth), the graphs captured over the old ones are dropped."""
        over = tuple((t.data_ptr(), t.shape[2]) for t in (*self.keys, *self.values))
        if over != self._graphs_over:
            self._graphs, self._graphs_over = {}, over
        return self._graphs

    def buffers(self, layer: int, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's whole key and value buffers, grown to hold at least ``needed`` positions (for a kernel that
        writes a window itself; the caller then sets ``lengths[layer]``)."""
        if needed > self.keys[layer].shape[2]:
            self._grow(layer, needed)
        return self.keys[layer], self.values[layer]

    def _grow(self, layer: int, needed: int) -> None:
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k.is_cuda:  # the copy below runs on this thread's stream (a rollout's side stream, say), which may not
            # be the one the old buffers came from: without this the caching allocator could hand their memory to
            # that other stream as soon as they are dropped, before the copy has read them
            stream = torch.cuda.current_stream(old_k.device)
            old_k.record_stream(stream)
            old_v.record_stream(stream)
        new_cap = max(needed, 2 * old_k.shape[2])
        shape = (*old_k.shape[:2], new_cap, old_k.shape[3])
        self.keys[layer] = old_k.new_zeros(shape)
        self.values[layer] = old_v.new_zeros(shape)
        length = self.lengths[layer]
        self.keys[layer][:, :, :length] = old_k[:, :, :length]
        self.values[layer][:, :, :length] = old_v[:, :, :length]

    def truncate(self, length: int) -> None:
        """Roll back every layer to at most ``length`` positions (rejected draft tokens vanish)."""
        if length < 0:
            raise ValueError(f"cannot truncate to a negative length ({length})")
        self.lengths = [min(n, length) for n in self.lengths]

    def keep(self, positions: list[int]) -> None:
        """Keep only ``positions`` (in that order) in every layer: compaction after tree verification."""
        self.compact(0, positions)

    def compact(self, start: int, offsets: list[int], layers: range | None = None) -> None:
        """Keep ``[0, start)`` and then the entries at ``start + offsets`` (in that order) in ``layers``: tree
        compaction that moves only the tail. Speculative Streaming passes leave different trees in the layers
        below and above the pruning layer, so each group is compacted with its own offsets. Entries already in
        place (offsets that begin 0, 1, 2, ...: a path through the tree's first nodes, the root alone, or a kept
        prefix) are not copied, so most passes copy nothing."""
        last = start + max(offsets, default=-1)
        moved = next((i for i, offset in enumerate(offsets) if offset != i), len(offsets))
        # (a list is sent without a host sync)
        layers = layers if layers is not None else range(self.n_layers)
        for layer in layers:  # every layer checked before any moves: a refusal leaves them all as they were
            if max(last, start - 1) >= self.lengths[layer]:
                raise IndexError(f"position {max(last, start - 1)} is past layer {layer}'s length "
                                 f"{self.lengths[layer]}")
        index = send([start + o for o in offsets[moved:]], self.keys[0].device) if moved < len(offsets) else None
        for layer in layers:
            end = start + len(offsets)
            if index is not None:  # (index_select copies first, so overlapping ranges are safe)
                self.keys[layer][:, :, start + moved:end] = self.keys[layer].index_select(2, index)
                self.values[layer][:, :, start + moved:end] = self.values[layer].index_select(2, index)
            self.lengths[layer] = end

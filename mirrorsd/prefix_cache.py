"""Keys and values of finished requests, kept so that a request starting with the same tokens prefills only the
rest: a conversation's next turn (its prompt is the last turn's prompt and answer, then the new message) or a
shared system prompt. vLLM calls it automatic prefix caching, llama.cpp's server ``cache_prompt``.

It is used only where it cannot change a token: on the batch-invariant C++ path (:attr:`Transformer.fused`) a
position's keys and values are a function of the tokens up to it, whatever forward computed them (a prefill chunk,
a verification window, a batch), so a restored prefix holds the bits a fresh prefill would write. Elsewhere
(stock torch GEMMs, CUDA) it stays off.

Entries are whole sequences, copied out of a request's cache when it ends and copied into a new request's cache
(a memcpy: ~57 KB a token on the 1.5B, against ~20 ms a token of prefill on two CPU cores). A sequence that
extends a stored one replaces it; the least recently used go first when the byte budget is full.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .kv_cache import KVCache
from .model import Transformer


@dataclass
class _Entry:
    tokens: np.ndarray
    keys: list[torch.Tensor]  # per layer [heads, n, dim]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def common_prefix(a: np.ndarray | list[int], b: np.ndarray | list[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


class PrefixCache:
    """Finished requests' keys and values for one model, within ``max_bytes``; safe to share between threads.

    ``queried_tokens`` and ``hit_tokens`` count the tokens :meth:`restore` was asked for and found (vLLM's
    ``prefix_cache_queries`` and ``prefix_cache_hits``).
    """

    def __init__(self, model: Transformer, max_bytes: int = 1 << 30) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.model, self.max_bytes = model, max_bytes
        self.enabled = model.fused and getattr(model, "tp_size", 1) == 1 and max_bytes > 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self._lock = threading.Lock()
        self.queried_tokens = self.hit_tokens = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def restore(self, tokens: Sequence[int], cache: KVCache) -> int:
        """Copy the longest stored prefix of ``tokens`` into the empty ``cache``; return its length (0: none)."""
        if not self.enabled or not tokens or len(cache) or cache.rows != 1:
            return 0
        query = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            self.queried_tokens += len(query)
            best, length = None, 0
            for key, entry in self._entries.items():
                n = common_prefix(entry.tokens, query)
                if n > length:
                    best, length = key, n
            if best is None:
                return 0
            entry = self._entries[best]
            self._entries.move_to_end(best)
            self.hit_tokens += length
            for layer in range(cache.n_layers):
                keys, values = cache.buffers(layer, length)
                keys[0, :, :length] = entry.keys[layer][:, :length]
                values[0, :, :length] = entry.values[layer][:, :length]
                cache.lengths[layer] = length
        return length

    def store(self, tokens: Sequence[int], cache: KVCache) -> None:
        """Keep ``cache``'s first ``len(cache)`` positions, which hold ``tokens[:len(cache)]``."""
        n = min(len(cache), len(tokens))
        if not self.enabled or n == 0 or cache.rows != 1:
            return
        ids = np.asarray(tokens[:n], dtype=np.int64)
        per_position = sum(t[0, :, :1].numel() * t.element_size() for t in (*cache.keys, *cache.values))
        if n * per_position > self.max_bytes:  # before anything is dropped: a shorter entry it extends stays
            return
        with self._lock:
            for key, entry in list(self._entries.items()):
                shared = common_prefix(entry.tokens, ids)
                if shared == n:  # already held (as this or a longer sequence)
                    self._entries.move_to_end(key)
                    return
                if shared == len(entry.tokens):  # the new sequence extends it
                    del self._entries[key]
            self._entries[self._next] = _Entry(ids, [k[0, :, :n].clone() for k in cache.keys],
                                               [v[0, :, :n].clone() for v in cache.values])
            self._next += 1
            total = sum(e.nbytes for e in self._entries.values())
            while total > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                total -= old.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

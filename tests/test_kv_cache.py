"""KV cache operations, alone and as used by the model (rollback, compaction, branches)."""

from __future__ import annotations

import pytest
import torch

from mirrorsd import Transformer
from mirrorsd.kv_cache import KVCache
from tests.helpers import tiny_hf


def kv(t: int, fill: float, rows: int = 1) -> torch.Tensor:
    return torch.full((rows, 2, t, 4), fill)


def test_append_truncate_keep_and_growth():
    c = KVCache(n_layers=2, n_kv_heads=2, head_dim=4, capacity=2)
    for layer in range(2):
        k, v = c.append(layer, kv(3, 1.0), kv(3, -1.0))
        assert k.shape[2] == 3 and c.capacity >= 3
    c.append(0, kv(2, 2.0), kv(2, -2.0))
    assert c.lengths == [5, 3] and len(c) == 3
    c.truncate(4)
    assert c.lengths == [4, 3]
    c.append(1, kv(1, 3.0), kv(1, -3.0))
    c.keep([3, 0])
    assert c.lengths == [2, 2]
    assert c.keys[0][0, 0, :2, 0].tolist() == [2.0, 1.0]
    assert c.values[1][0, 0, :2, 0].tolist() == [-3.0, -1.0]
    with pytest.raises(IndexError):
        c.keep([0, 5])
    c.append(0, kv(2, 4.0), kv(2, -4.0))  # layer 0 holds 4, layer 1 holds 2
    before = [k.clone() for k in c.keys]
    with pytest.raises(IndexError, match="layer 1's length 2"):
        c.keep([0, 3])  # (layer 0 was compacted before layer 1 refused)
    assert c.lengths == [4, 2] and all(torch.equal(a, b) for a, b in zip(before, c.keys, strict=True))
    with pytest.raises(IndexError, match="position 4 is past layer 0's length 4"):
        c.compact(5, [])  # (slots never written would have become history)
    with pytest.raises(ValueError):
        c.truncate(-1)


def test_rollback_then_continue_equals_fresh_decode():
    model = Transformer.from_hf(tiny_hf(vocab=100, std=0.1))
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        ref = model(ids)[0, -1]
        cache = model.new_cache()
        model(ids[:, :8], cache=cache)
        model(torch.randint(0, 100, (1, 5)), cache=cache)  # a rejected draft window
        cache.truncate(8)
        out = model(ids[:, 8:], cache=cache)[0, -1]
    assert (out - ref).abs().max().item() < 1e-5


def test_compaction_after_tree_keeps_the_accepted_path():
    """Score a two-branch tree, keep the prefix + branch B's positions, continue: equals plain decoding."""
    model = Transformer.from_hf(tiny_hf(vocab=100, std=0.1))
    prefix, branch_a, branch_b, nxt = [1, 2, 3], [40, 41], [50, 51], [60]
    with torch.no_grad():
        ref = model(torch.tensor([prefix + branch_b + nxt]))[0, -1]
        cache = model.new_cache()
        model(torch.tensor([prefix]), cache=cache)
        mask = torch.zeros(1, 4, 7, dtype=torch.bool)
        mask[..., :3] = True
        for i, j in [(0, 0), (1, 0), (1, 1), (2, 2), (3, 2), (3, 3)]:
            mask[0, i, 3 + j] = True
        model(torch.tensor([branch_a + branch_b]), torch.tensor([[3, 4, 3, 4]]), cache, mask)
        cache.keep([0, 1, 2, 5, 6])
        out = model(torch.tensor([nxt]), cache=cache)[0, -1]
    assert (out - ref).abs().max().item() < 1e-5


def test_leased_caches_come_back_to_the_next_request_that_fits(monkeypatch):
    """On CUDA a request's cache (and the graphs captured over it) serves the next request that fits; the pool's
    bookkeeping, run here with the device check and the synchronize stood in for."""
    model = Transformer.from_hf(tiny_hf(layers=2))
    assert model.lease_cache(90).capacity == 90 and not model.spare_caches  # a CPU keeps no caches
    monkeypatch.setattr(Transformer, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(Transformer, "new_cache", lambda self, rows=1, capacity=256: KVCache(
        2, 2, 4, rows=rows, capacity=capacity))
    first = model.lease_cache(90)
    assert first.capacity == 256  # a power of two, at least 256
    first.append(0, kv(5, 1.0), kv(5, 1.0))
    model.return_cache(first)
    assert model.lease_cache(300).capacity == 512  # too small: a new one
    again = model.lease_cache(200)
    assert again is first and again.lengths == [0, 0]  # emptied
    caches = [model.lease_cache(100) for _ in range(3)]
    for cache in caches:
        model.return_cache(cache)
    assert model.spare_caches == caches[-2:]  # the last two are kept
    model.return_cache(KVCache(2, 2, 4, rows=3))
    assert len(model.spare_caches) == 2  # only one-row caches come back


@pytest.mark.parametrize("offsets", [[], [0], [0, 1, 2], [0, 1, 3], [0, 2, 4], [1], [2, 0], [0, 2, 2, 3],
                                     [0, 1, 2, 3, 4, 5]])
def test_compaction_moves_only_what_moved(monkeypatch, offsets):
    """``compact`` gives what copying every kept entry gives, in the layers it is asked for only, and copies
    nothing for the entries already in place (its leading 0, 1, 2, ...)."""
    c = KVCache(n_layers=3, n_kv_heads=2, head_dim=4, capacity=16)
    for layer in range(3):
        c.append(layer, torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4))
    want_k = [k.clone() for k in c.keys]
    want_v = [v.clone() for v in c.values]
    for layer in (0, 2):
        index = torch.tensor([3 + o for o in offsets], dtype=torch.long)
        want_k[layer][:, :, 3:3 + len(offsets)] = want_k[layer].index_select(2, index)
        want_v[layer][:, :, 3:3 + len(offsets)] = want_v[layer].index_select(2, index)
    copied = []
    real = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda self, dim, index: copied.append(index.tolist()) or
                        real(self, dim, index))
    c.compact(3, offsets, range(0, 3, 2))
    moved = next((i for i, o in enumerate(offsets) if o != i), len(offsets))
    assert copied == ([[3 + o for o in offsets[moved:]]] * 4 if moved < len(offsets) else [])
    assert c.lengths == [3 + len(offsets), 9, 3 + len(offsets)]
    for layer in range(3):
        n = c.lengths[layer]
        assert torch.equal(c.keys[layer][:, :, :n], want_k[layer][:, :, :n])
        assert torch.equal(c.values[layer][:, :, :n], want_v[layer][:, :, :n])

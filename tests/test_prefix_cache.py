"""The prefix cache's bookkeeping: longest match, one entry per conversation, the byte budget, and staying off where
restored keys and values could differ from a prefill's (tests/decoding/test_conformance.py checks every method's
tokens and the stored bits)."""

from __future__ import annotations

import pytest
import torch

from mirrorsd import PrefixCache, Transformer, generate
from tests.helpers import row_exact, tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> Transformer:
    return row_exact(tiny_hf(layers=2, seed=5))


def prefilled(model: Transformer, tokens: list[int]):
    cache = model.new_cache(capacity=len(tokens))
    model.prefill(torch.tensor([tokens]), cache)
    return cache


def test_restores_the_longest_stored_prefix_bit_for_bit(model):
    store = PrefixCache(model)
    assert store.restore([1, 2, 3], model.new_cache()) == 0
    store.store([1, 2, 3, 4, 5], prefilled(model, [1, 2, 3, 4, 5]))
    store.store([1, 2, 9], prefilled(model, [1, 2, 9]))
    cache = model.new_cache(capacity=4)
    assert store.restore([1, 2, 3, 4, 7, 7], cache) == 4
    fresh = prefilled(model, [1, 2, 3, 4])
    assert len(cache) == 4
    for layer in range(model.config.n_layers):
        assert torch.equal(cache.keys[layer][:, :, :4], fresh.keys[layer][:, :, :4])
        assert torch.equal(cache.values[layer][:, :, :4], fresh.values[layer][:, :, :4])
    assert (store.queried_tokens, store.hit_tokens) == (9, 4)
    assert store.restore([8, 1, 2], model.new_cache()) == 0  # a match must start at the first token


def test_a_conversation_keeps_one_entry(model):
    store = PrefixCache(model)
    store.store([1, 2], prefilled(model, [1, 2]))
    store.store([1, 2, 3, 4], prefilled(model, [1, 2, 3, 4]))  # the next turn replaces the last one
    store.store([1, 2, 3], prefilled(model, [1, 2, 3]))  # held already, as part of a longer sequence
    assert len(store) == 1
    assert store.restore([1, 2, 3, 4, 5], model.new_cache()) == 4


def test_the_least_recently_used_go_first_within_the_budget(model):
    one = PrefixCache(model)
    one.store([1, 2, 3], prefilled(model, [1, 2, 3]))
    store = PrefixCache(model, max_bytes=2 * one.nbytes)
    for first in (1, 2):
        store.store([first, 2, 3], prefilled(model, [first, 2, 3]))
    assert store.restore([1, 2, 3], model.new_cache()) == 3  # [1, 2, 3] is now the most recent
    store.store([3, 2, 3], prefilled(model, [3, 2, 3]))
    assert len(store) == 2 and store.nbytes <= store.max_bytes
    assert store.restore([2, 2, 3], model.new_cache()) == 0
    assert store.restore([1, 2, 3], model.new_cache()) == 3
    too_small = PrefixCache(model, max_bytes=one.nbytes - 1)
    too_small.store([1, 2, 3], prefilled(model, [1, 2, 3]))
    assert len(too_small) == 0
    too_small.store([1, 2], prefilled(model, [1, 2]))
    too_small.store([1, 2, 3], prefilled(model, [1, 2, 3]))  # too large to keep: the entry it extends stays
    assert len(too_small) == 1 and too_small.restore([1, 2, 3], model.new_cache()) == 2


def test_off_where_a_restored_prefix_could_differ_from_a_prefill():
    dense = Transformer.from_hf(tiny_hf(layers=2, seed=5))  # stock torch GEMMs: bits depend on the row count
    assert not dense.fused
    store = PrefixCache(dense)
    assert not store.enabled
    store.store([1, 2, 3], prefilled(dense, [1, 2, 3]))
    assert len(store) == 0 and store.restore([1, 2, 3], dense.new_cache()) == 0
    assert not PrefixCache(row_exact(tiny_hf(layers=2, seed=5)), max_bytes=0).enabled
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(dense, max_bytes=-1)


def test_a_store_of_another_model_is_refused(model):
    other = row_exact(tiny_hf(layers=2, seed=6))
    with pytest.raises(ValueError, match="another model"):
        generate(model, [1, 2], max_new_tokens=2, prefix_cache=PrefixCache(other))

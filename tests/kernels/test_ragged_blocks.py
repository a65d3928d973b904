"""The ragged C++ op (continuous batching's forward): each sequence's bits as it gets them alone."""

from __future__ import annotations

import pytest
import torch

from mirrorsd import kernels
from mirrorsd.execution import LayerCall, ragged_layers
from mirrorsd.model import SSRows, causal_mask

from ..helpers import random_adapters, row_exact, tiny_hf

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")


def _prefilled(model, prompt: list[int]):
    cache = model.new_cache(capacity=4)  # small: ragged_layers must grow it
    model.prefill(torch.tensor([prompt]), cache)
    return cache


def _window(model, cache, tokens: list[int]):
    past = len(cache)
    return model.embed(torch.tensor([tokens])), torch.arange(past, past + len(tokens)).unsqueeze(0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_sequences_get_their_own_bits(arch: str) -> None:
    model = row_exact(tiny_hf(arch, seed=3))
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], list(range(12, 40))]
    windows = [[7], [8, 9, 10], [11, 12], [13] * 6]
    alone, batched, calls = [], [], []
    for prompt, window in zip(prompts, windows, strict=True):
        cache = _prefilled(model, prompt)
        hidden, positions = _window(model, cache, window)
        with torch.inference_mode():
            alone.append((model.run_layers(hidden, positions, cache), [k.clone() for k in cache.keys],
                          list(cache.lengths)))
        cache = _prefilled(model, prompt)
        calls.append(LayerCall(hidden, positions, cache))
    with torch.inference_mode():
        batched = ragged_layers(model, calls, 0, model.config.n_layers)
    for (want, keys, lengths), got, call in zip(alone, batched, calls, strict=True):
        assert torch.equal(got, want)
        assert call.cache.lengths == lengths
        for k, w in zip(call.cache.keys, keys, strict=True):
            assert torch.equal(k[:, :, : lengths[0]], w[:, :, : lengths[0]])


def test_masks_layer_ranges_and_stream_rows() -> None:
    """A tree mask, partial layer ranges and (over the adapted layers) Speculative Streaming stream rows, beside a
    plain sequence."""
    model = row_exact(tiny_hf("qwen2", seed=4))
    adapters = random_adapters(model, streams=2, layers=2)
    tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])

    def calls(streams: bool):
        a, b, c = _prefilled(model, [1, 2, 3, 4]), _prefilled(model, [9, 8]), _prefilled(model, [5, 6, 7])
        ha, pa = _window(model, a, [5, 6, 7])
        mask_a = torch.cat([torch.ones(3, 4, dtype=torch.bool), tree], 1).unsqueeze(0)
        hb, pb = _window(model, b, [3])
        hc, pc = _window(model, c, [1, 2, 3])
        mask_c = causal_mask(3, 3)
        return [LayerCall(ha, pa, a, mask_a), LayerCall(hb, pb, b),
                LayerCall(hc, pc, c, mask_c, SSRows(2, adapters) if streams else None)]

    with torch.inference_mode():
        for start, end in ((0, 3), (0, 2), (1, 3)):
            streams = start >= 1  # the adapters sit in the top two layers
            want_calls, got_calls = calls(streams), calls(streams)
            want = [model.run_layers(c.hidden, c.positions, c.cache, c.mask, start, end, c.streams) for c in want_calls]
            got = ragged_layers(model, got_calls, start, end)
            for w, g, wc, gc in zip(want, got, want_calls, got_calls, strict=True):
                assert torch.equal(g, w), (start, end)
                assert gc.cache.lengths == wc.cache.lengths


def test_refuses_a_model_off_the_c_path() -> None:
    model = tiny_hf("llama")
    from mirrorsd.model import Transformer

    dense = Transformer.from_hf(model)
    cache = dense.new_cache()
    with pytest.raises(ValueError, match="C\\+\\+ op"):
        ragged_layers(dense, [LayerCall(dense.embed(torch.tensor([[1]])), torch.tensor([[0]]), cache)], 0, 1)

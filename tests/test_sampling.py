"""Position-keyed sampling: determinism, independence, and exact distributions."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from mirrorsd.sampling import (
    Noise,
    SamplingParams,
    keyed_uniforms,
    probabilities,
    sample,
    warp,
)


def test_keyed_uniforms_are_a_pure_function_of_their_key():
    a = keyed_uniforms(7, [3, 4], 1000)
    assert torch.equal(a, keyed_uniforms(7, [3, 4], 1000))
    assert torch.equal(a[1], keyed_uniforms(7, [4], 1000)[0])  # row depends on its own position only
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(a, keyed_uniforms(8, [3, 4], 1000))
    assert not torch.equal(a, keyed_uniforms(7, [3, 4], 1000, Noise.DRAFT))
    assert a.min() > 0 and a.max() < 1
    u = keyed_uniforms(1, range(200), 500).flatten()
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005


def test_gumbel_max_draws_from_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = SamplingParams(temperature=0.7, seed=11)
    n = 20000
    counts = torch.zeros(6)
    for pos in range(n):
        counts[sample(logits, [pos], params)[0]] += 1
    expected = (logits[0] / 0.7).softmax(-1) * n
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_greedy_is_argmax_and_ignores_noise():
    logits = torch.randn(5, 30)
    assert sample(logits, range(5), SamplingParams()) == logits.argmax(-1).tolist()


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = warp(logits, SamplingParams(temperature=1.0, top_k=2)).isfinite()[0].tolist()
    assert kept == [True, True, False, False]
    kept = warp(logits, SamplingParams(temperature=1.0, top_p=0.7)).isfinite()[0].tolist()
    assert kept == [True, True, False, False]  # 0.5 < 0.7, adding 0.3 crosses it: keep both
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))[0]
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64))


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_k": -2}, {"top_p": 0}, {"top_p": 1.5}])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_noise_keys_are_independent_of_the_target_key():
    a = keyed_uniforms(0, [5], 64, Noise.TARGET)[0]
    b = keyed_uniforms(0, [5], 64, Noise.DRAFT)[0]
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.4

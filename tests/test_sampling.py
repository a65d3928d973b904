"""Position-keyed sampling: determinism, independence, and exact distributions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from mirrorsd.sampling import (
    Noise,
    SamplingParams,
    choose,
    keyed_uniforms,
    probabilities,
    rows_apart,
    sample,
    warp,
)
from mirrorsd.verify import verify_match, verify_tree


def _numpy_uniforms(seed: int, positions: list[int], size: int, noise: int) -> torch.Tensor:
    """The keyed noise as first written, in numpy's uint64 (logical shifts, wrapping products): seeded outputs
    of every earlier release depend on these exact bits."""

    def mix(x):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))

    with np.errstate(over="ignore"):
        pos = np.asarray(positions, dtype=np.uint64)[:, None]
        base = mix(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ mix(np.uint64(noise)))
        keys = mix(base ^ (pos * np.uint64(0xD1B54A32D192ED03)))
        bits = mix(keys + np.arange(size, dtype=np.uint64)[None, :] * np.uint64(0x9E3779B97F4A7C15))
    return torch.from_numpy(((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53)))


@pytest.mark.parametrize("seed", [0, 11, 2**63 + 5, -3, 2**64 - 1])
def test_keyed_uniforms_keep_their_bits(seed):
    positions = [0, 5, 1000, 2**40, 2**62]
    for noise in Noise:
        want = _numpy_uniforms(seed, positions, 3000, noise)
        assert torch.equal(keyed_uniforms(seed, positions, 3000, noise), want)
        assert torch.equal(keyed_uniforms(seed, torch.tensor(positions), 3000, noise), want)  # as a graph feeds them


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
    for tiny in (1e-300, 1e-40):  # below float32's least value every token was dropped, and id 0 came out
        kept = warp(logits[:, [2, 0, 1, 3]], SamplingParams(temperature=1.0, top_p=tiny)).isfinite()[0].tolist()
        assert kept == [False, True, False, False]  # the likeliest alone


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_k": -2}, {"top_p": 0}, {"top_p": 1.5}])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_noise_keys_are_independent_of_the_target_key():
    a = keyed_uniforms(0, [5], 64, Noise.TARGET)[0]
    b = keyed_uniforms(0, [5], 64, Noise.DRAFT)[0]
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.4


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=3),
                                    SamplingParams(temperature=1.2, top_k=20, seed=4),
                                    SamplingParams(temperature=0.9, top_p=0.8, seed=5)])
def test_many_rows_at_once_give_each_row_its_own_token(params):
    """What lets a verifier read a whole window's tokens in one host read: a row's draw depends on nothing else."""
    logits = torch.randn(9, 500) * 3
    positions = list(range(40, 49))
    alone = [sample(logits[i:i + 1], positions[i:i + 1], params)[0] for i in range(9)]
    assert choose(logits, positions, params).tolist() == alone
    assert rows_apart(logits, params) == params.greedy  # the CPU samples lazily, row by row


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)])
def test_verifiers_give_the_same_verdict_reading_rows_at_once_or_one_by_one(params, monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    own = [sample(logits[i:i + 1], [7 + i], params)[0] for i in range(6)]
    parents = [-1, -1, 0, 2, 1]  # a tree: two children of the root, a chain of two under the first
    depth = [1, 1, 2, 3, 2]
    tree_own = [sample(logits[i:i + 1], [7 + ([0, *depth])[i]], params)[0] for i in range(6)]
    tokens = [tree_own[0], (tree_own[0] + 1) % 50, tree_own[1], tree_own[3], 0]
    verdicts = []
    for apart in (True, False):
        monkeypatch.setattr("mirrorsd.verify.rows_apart", lambda *_, apart=apart: apart)
        verdicts.append([verify_match(own[:3] + [(own[3] + 1) % 50, 0], logits, range(7, 13), params),
                         verify_match(own[:5], logits, range(7, 13), params),
                         verify_tree(tokens, parents, logits, 7, params)])
    assert verdicts[0] == verdicts[1]
    assert verdicts[0][0].accepted == 3 and verdicts[0][1].accepted == 5
    assert verdicts[0][2].path == (0, 2, 3)


def test_a_rows_window_key_draws_what_its_windows_seed_draws_alone():
    """A tree rollout's branches each draw with the key of the window they start (one op for all rows, on a GPU);
    row by row (the CPU's way, :func:`~mirrorsd.verify.verify_tree`) each draws with that window's seed: the same
    tokens. Windows at other starts draw other noise."""
    from mirrorsd.sampling import Noise, choose, window_keys, window_seed

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)).double()
    params = SamplingParams(temperature=1.5, seed=2**63 + 11)
    starts, positions = [9, 9, 12, 40], torch.tensor([9, 10, 12, 41])
    together = choose(logits, positions, params, Noise.DRAFT, window_keys(params.seed, starts, Noise.DRAFT))
    alone = [choose(logits[r:r + 1], [int(positions[r])], SamplingParams(temperature=1.5, seed=window_seed(
        params.seed, starts[r])), Noise.DRAFT).item() for r in range(4)]
    assert together.tolist() == alone
    noise = [keyed_uniforms(window_seed(params.seed, s), [20], 50, Noise.DRAFT) for s in (9, 12)]
    assert not torch.equal(noise[0], noise[1])

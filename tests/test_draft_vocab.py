"""Reduced-vocabulary drafts: the subset head, losslessness (greedy equality and the target's distribution under
rejection sampling, with the draft's mass confined to the subset), and the shipped tables."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from mirrorsd import Transformer, generate
from mirrorsd import draft_vocab as dv
from mirrorsd.decoding.engine import DecodeRequest, GenerationStats, new_state
from mirrorsd.decoding.proposers import ModelProposer
from mirrorsd.sampling import SamplingParams

from .conftest import tiny_hf
from .test_decoding import _exact_pair_distribution
from .test_mirror import row_exact


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """Frequency tables for the random models' vocabularies (a fixed shuffle: any ranking is a valid table)."""
    for vocab in (8, 64):
        torch.save(torch.randperm(vocab, generator=torch.Generator().manual_seed(vocab)).int(),
                   tmp_path / f"vocab{vocab}.pt")
    monkeypatch.setattr(dv, "table_path", lambda vocab: tmp_path / f"vocab{vocab}.pt")


def test_subset_head_scores_only_its_ids(tables):
    model = row_exact(tiny_hf(layers=2, seed=1))
    head = dv.subset_head(model, 16)
    hidden = torch.randn(3, model.config.hidden_size)
    full, sub = model.logits(hidden), head.full(model.norm(hidden))
    ids = dv.load_table(64)[:16].long()
    outside = torch.ones(64, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(sub[:, outside]).all() and torch.isfinite(sub[:, ids]).all()
    # the subset head re-quantizes the head's rows to q8: close to the full head, not bit-equal
    assert torch.allclose(sub[:, ids], full[:, ids], atol=0.05 * full.abs().max().item())


def test_missing_table_says_how_to_build_one(tmp_path, monkeypatch):
    monkeypatch.setattr(dv, "table_path", lambda vocab: tmp_path / "none.pt")
    with pytest.raises(FileNotFoundError, match="python -m mirrorsd.draft_vocab"):
        dv.load_table(64)


@pytest.mark.parametrize("method", ["sd", "mirror"])
def test_greedy_with_a_reduced_draft_vocabulary_equals_ar(tables, method):
    target = row_exact(tiny_hf(layers=4, seed=1))
    draft = row_exact(tiny_hf(layers=2, seed=2))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = generate(target, prompt, method="ar", max_new_tokens=24).token_ids
    options = {"kappa": 2, "gamma": 3} if method == "mirror" else {"gamma": 4}
    got = generate(target, prompt, method=method, draft=draft, max_new_tokens=24, draft_vocab=8, **options)
    assert got.token_ids == want


def test_draft_distribution_is_confined_to_the_subset(tables):
    target = Transformer.from_hf(tiny_hf(vocab=8, layers=2, seed=3, std=0.5))
    draft = Transformer.from_hf(tiny_hf(vocab=8, layers=1, seed=4, std=0.5))
    params = SamplingParams(temperature=1.0, seed=0)
    request = DecodeRequest(target, [5, 6], 8, params, GenerationStats("sd"), draft)
    proposer = ModelProposer(draft, 8, params, 3, rejection=True, vocab=4)
    window = proposer.propose(new_state(request))
    allowed = dv.load_table(8)[:4].long()
    outside = torch.ones(8, dtype=torch.bool)
    outside[allowed] = False
    assert window.probs[:, outside].sum() == 0 and torch.allclose(window.probs.sum(-1), torch.ones(3).double())
    assert all(t in allowed.tolist() for t in window.tokens)


@pytest.mark.parametrize("method", ["sd", "mirror"])
def test_rejection_sampling_with_a_reduced_draft_vocabulary_keeps_the_target_distribution(tables, method):
    """The chi-square test of the conformance suite, with the draft restricted to 4 of the 8 tokens: the target
    must still produce tokens the draft can never propose, at their exact rates."""
    target = Transformer.from_hf(tiny_hf(vocab=8, layers=2, seed=3, std=0.5))
    draft = Transformer.from_hf(tiny_hf(vocab=8, layers=1, seed=4, std=0.5))
    prompt, n = [5, 6], 1500
    exact = _exact_pair_distribution(target, prompt, 1.0).flatten()
    counts = torch.zeros(64)
    windows = Counter()
    options = {"kappa": 2, "confidence": 0.0} if method == "mirror" else {"confidence": 0.0, "model_gate": "always"}
    for seed in range(n):
        g = generate(target, prompt, method=method, draft=draft, gamma=3, acceptance="rejection", temperature=1.0,
                     seed=seed, max_new_tokens=4, draft_vocab=4, **options)
        counts[g.token_ids[0] * 8 + g.token_ids[1]] += 1
        windows[g.stats.drafted[0]] += 1
    assert max(windows) >= 2
    allowed = set(dv.load_table(8)[:4].tolist())
    outside = [i for i in range(64) if i // 8 not in allowed]
    assert counts[outside].sum() > 0  # tokens the draft cannot propose still come, from the residual
    keep = exact * n >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([exact[keep] * n, (exact[~keep] * n).sum()[None]])
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3

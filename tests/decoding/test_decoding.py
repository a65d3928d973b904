"""Lossless decoding: every speculative configuration equals the target alone."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from mirrorsd import Transformer, generate
from mirrorsd.sampling import SamplingParams
from mirrorsd.verify import verify_match, verify_rejection, verify_tree
from tests.helpers import HostReads, exact_pair_distribution, row_exact, tiny_hf


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    gamma=st.integers(1, 7),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    seed=st.integers(0, 2**31),
    prompt=st.lists(st.integers(0, 63), min_size=1, max_size=12),
    max_new=st.integers(1, 30),
    self_draft=st.booleans(),
    top_p=st.sampled_from([1.0, 0.9]),
    confidence=st.sampled_from([0.0, 0.4, 0.9]),
    schedule=st.sampled_from(["constant", "heuristic"]),
)
def test_sd_match_equals_ar(tiny_pair, gamma, temperature, seed, prompt, max_new, self_draft, top_p, confidence,
                            schedule):
    target, other = tiny_pair
    draft = target.prefix_model(2) if self_draft else other
    kw = dict(temperature=temperature, seed=seed, max_new_tokens=max_new, top_p=top_p)
    ar = generate(target, prompt, method="ar", **kw)
    sd = generate(target, prompt, method="sd", draft=draft, gamma=gamma, confidence=confidence, schedule=schedule,
                  **kw)
    assert sd.token_ids == ar.token_ids
    assert len(sd.token_ids) == max_new
    stats = sd.stats
    assert stats.target_forwards == (len(prompt) > 1) + stats.steps
    assert sum(a + 1 for a in stats.accepted) == max_new
    assert all(0 <= a <= d for a, d in zip(stats.accepted, stats.drafted, strict=True))
    if schedule == "constant":
        assert all(d <= gamma for d in stats.drafted)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gamma=st.integers(1, 6), seed=st.integers(0, 1000), max_new=st.integers(1, 25))
def test_rejection_acceptance_at_temperature_zero_is_greedy(tiny_pair, gamma, seed, max_new):
    target, draft = tiny_pair
    ar = generate(target, [3, 1, 4], method="ar", max_new_tokens=max_new)
    sd = generate(target, [3, 1, 4], method="sd", draft=draft, gamma=gamma, acceptance="rejection",
                  max_new_tokens=max_new, seed=seed)
    assert sd.token_ids == ar.token_ids


def test_identity_draft_accepts_everything(tiny_pair):
    target, _ = tiny_pair
    for temperature in (0.0, 1.0):
        g = generate(target, [1, 2, 3], method="sd", draft=target, gamma=4, confidence=0, max_new_tokens=21,
                     temperature=temperature, seed=5, suffix_match=0)  # the draft model's windows only
        assert g.stats.accepted == [4, 4, 4, 4, 0] and g.stats.drafted == [4, 4, 4, 4, 0]
        assert g.stats.mean_accepted_length == 21 / 5
        assert g.stats.per_position_acceptance == [1.0] * 4
        assert g.stats.target_forwards == 1 + 5  # prefill + 4 windows + the last single-token step


def test_verify_match_rules():
    logits = torch.full((4, 10), -5.0)
    for row, tok in enumerate([3, 7, 2, 9]):
        logits[row, tok] = 5.0
    greedy = SamplingParams()
    v = verify_match([3, 7, 2], logits, range(4), greedy)
    assert (v.accepted, v.next_token, list(v.nodes)) == (3, 9, [0, 1, 2])
    v = verify_match([3, 1, 2], logits, range(4), greedy)
    assert (v.accepted, v.next_token) == (1, 7)
    v = verify_match([], logits[:1], [0], greedy)
    assert (v.accepted, v.next_token) == (0, 3)


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), max_size=6), temperature=st.sampled_from([0.0, 1.0]),
       seed=st.integers(0, 1000))
def test_tree_walk_on_a_chain_is_match(tokens, temperature, seed):
    logits = torch.randn(len(tokens) + 1, 6, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(temperature=temperature, seed=seed)
    chain = verify_match(tokens, logits, range(10, 11 + len(tokens)), params)
    tree = verify_tree(tokens, list(range(-1, len(tokens) - 1)), logits, 10, params)
    assert (tree.accepted, tree.next_token, list(tree.nodes)) == (chain.accepted, chain.next_token, list(chain.nodes))


def test_tree_walk_follows_the_targets_choice_at_each_node():
    # root -> {0: token 4, 1: token 7}; node 1 -> {2: token 5, 3: token 2}. Row i + 1 follows node i.
    tokens, parents = [4, 7, 5, 2], [-1, -1, 1, 1]
    logits = torch.full((5, 10), -5.0)
    for row, choice in enumerate([7, 0, 2, 0, 8]):  # root picks 7 (node 1), node 1 picks 2 (node 3), node 3 picks 8
        logits[row, choice] = 5.0
    v = verify_tree(tokens, parents, logits, 0, SamplingParams())
    assert (v.accepted, list(v.nodes), v.next_token) == (2, [1, 3], 8)


def test_rejection_rule_with_one_hot_distributions_is_exact_match():
    logits = torch.full((3, 10), -5.0)
    for row, tok in enumerate([3, 7, 2]):
        logits[row, tok] = 5.0
    greedy = SamplingParams()
    q = torch.nn.functional.one_hot(torch.tensor([3, 1]), 10).double()
    v = verify_rejection([3, 1], q, logits, [0, 1, 2], greedy)
    assert (v.accepted, v.next_token) == (1, 7)
    v = verify_rejection([3, 7], torch.nn.functional.one_hot(torch.tensor([3, 7]), 10).double(), logits, [0, 1, 2],
                         greedy)
    assert (v.accepted, v.next_token) == (2, 2)


def test_rejection_rule_preserves_the_target_distribution():
    """One position, fixed p and a deliberately bad q: committed tokens follow p (chi-square)."""
    vocab, n = 6, 6000
    target_logits = torch.tensor([[1.5, 0.2, -0.3, 0.9, -2.0, 0.0], [0.0] * vocab])
    q = torch.tensor([0.05, 0.4, 0.3, 0.05, 0.15, 0.05], dtype=torch.float64)
    params = SamplingParams(temperature=1.0, seed=123)
    gen = torch.Generator().manual_seed(0)
    proposals = torch.multinomial(q.float(), n, replacement=True, generator=gen).tolist()
    counts = torch.zeros(vocab)
    for pos, x in enumerate(proposals):
        v = verify_rejection([x], q[None], target_logits, [pos, pos + 1], params)
        counts[x if v.accepted else v.next_token] += 1
    expected = target_logits[0].softmax(-1) * n
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.parametrize(
    ("prompt", "first_windows"),
    [
        ([1, 2], {0}),  # the draft's top probability here is 0.72 < 0.75: the first window is always empty
        ([5, 6], {2, 3}),  # 0.80 here, then 0.30-0.86: windows cut after a doubtful 2nd token, or full
    ],
)
def test_sd_rejection_sampling_matches_target_distribution_end_to_end(prompt, first_windows):
    """Joint law of the first two tokens under rejection sampling with windows of up to 3 and the
    confidence cut active in both forms (a doubtful first token is not proposed; a doubtful later one is
    proposed and ends the window)."""
    target = Transformer.from_hf(tiny_hf(vocab=8, layers=2, seed=3, std=0.5))
    draft = Transformer.from_hf(tiny_hf(vocab=8, layers=1, seed=4, std=0.5))
    temperature, n = 1.0, 2500
    exact = exact_pair_distribution(target, prompt, temperature).flatten()
    counts = torch.zeros(64)
    seen = Counter()
    for seed in range(n):
        g = generate(target, prompt, method="sd", draft=draft, gamma=3, acceptance="rejection", confidence=0.75,
                     temperature=temperature, seed=seed, max_new_tokens=4, model_gate="always")  # the model's windows
        counts[g.token_ids[0] * 8 + g.token_ids[1]] += 1
        seen[g.stats.drafted[0]] += 1
    assert set(seen) == first_windows and min(seen.values()) > 100, seen  # every branch was exercised
    keep = exact * n >= 5  # chi-square needs expected counts >= 5; pool the rare cells
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([exact[keep] * n, (exact[~keep] * n).sum()[None]])
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3


def test_draft_with_a_smaller_padded_vocabulary(tiny_pair):
    """Qwen2.5-7B pads its embedding past the tokenizer; a 0.5B draft with fewer rows must still work."""
    target, _ = tiny_pair
    small = Transformer.from_hf(tiny_hf(vocab=60, layers=1, seed=9))
    for temperature, rule in [(0.0, "match"), (0.9, "match"), (0.9, "rejection")]:
        kw = dict(temperature=temperature, seed=4, max_new_tokens=25)
        ar = generate(target, [1, 2, 3], method="ar", **kw)
        sd = generate(target, [1, 2, 3], method="sd", draft=small, acceptance=rule, confidence=0, gamma=3, **kw)
        assert len(sd.token_ids) == 25 and sum(sd.stats.drafted) > 0
        if rule == "match":
            assert sd.token_ids == ar.token_ids


@pytest.mark.usefixtures("one_thread")  # (1,500 tiny generations: two threads on two busy cores crawl)
def test_a_smaller_draft_vocabulary_keeps_the_targets_distribution_under_rejection():
    """The draft's q over 6 ids is padded with zeros to the target's 8: the joint law of the first two tokens must
    still be the target's (the ids only the target has are reached through the residual)."""
    target = Transformer.from_hf(tiny_hf(vocab=8, layers=2, seed=3, std=0.5))
    small = Transformer.from_hf(tiny_hf(vocab=6, layers=1, seed=4, std=0.5))
    prompt, n = [5, 4], 1500
    exact = exact_pair_distribution(target, prompt, 1.0).flatten()
    counts, drafted = torch.zeros(64), 0
    for seed in range(n):
        g = generate(target, prompt, method="sd", draft=small, gamma=3, acceptance="rejection", confidence=0,
                     temperature=1.0, seed=seed, max_new_tokens=4, model_gate="always", suffix_match=0)
        counts[g.token_ids[0] * 8 + g.token_ids[1]] += 1
        drafted += g.stats.drafted[0]
    assert drafted == 3 * n and counts.view(8, 8)[6:].sum() > 0  # full windows, and ids the draft lacks came out
    keep = exact * n >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([exact[keep] * n, (exact[~keep] * n).sum()[None]])
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("bad", [{"gamma": 0}, {"acceptance": "typical"}, {"beta": 1}, {"confidence": 1.0},
                                 {"schedule": "random"}])
def test_sd_rejects_bad_options(tiny_pair, bad):
    target, draft = tiny_pair
    with pytest.raises(ValueError):
        generate(target, [1, 2], method="sd", draft=draft, max_new_tokens=3, **bad)


def test_sd_needs_a_matching_draft(tiny_pair):
    target, _ = tiny_pair
    with pytest.raises(ValueError, match="needs a draft"):
        generate(target, [1, 2], method="sd")
    larger_vocab = Transformer.from_hf(tiny_hf(vocab=65))
    with pytest.raises(ValueError, match="vocabulary"):
        generate(target, [1, 2], method="sd", draft=larger_vocab)


def test_a_context_limited_draft_keeps_its_cache_aligned_with_the_text(tiny_pair):
    """``draft_context``: the draft's prefill reads the prompt's sink and last N tokens; after every verdict its
    cache plus the skipped tokens plus ``pending`` is exactly the committed text, and it drafts what the draft model
    gives on that shortened text."""
    from mirrorsd.decoding.drafting import SINK_TOKENS
    from mirrorsd.decoding.engine import DecodeRequest, GenerationStats, RequestState
    from mirrorsd.decoding.proposers import ModelProposer

    target, draft = tiny_pair
    prompt = [(7 * i) % 60 + 1 for i in range(40)]
    request = DecodeRequest(target, prompt, 16, SamplingParams(), GenerationStats("sd"), draft)
    state = RequestState(request, list(prompt), target.new_cache(), draft.new_cache(capacity=64), list(prompt))
    proposer = ModelProposer(draft, target.config.vocab_size, SamplingParams(), gamma=3, context=8)
    shortened = prompt[:SINK_TOKENS] + prompt[-8:]
    drafted = proposer.propose(state).tokens
    assert proposer.skipped == len(prompt) - SINK_TOKENS - 8
    assert drafted == generate(draft, shortened, method="ar", max_new_tokens=3).token_ids
    state.tokens += [drafted[0], 59]  # one accepted, then the target's own token
    ModelProposer.rollback(state, 1, proposer.skipped)
    assert len(state.draft_cache) + proposer.skipped + len(state.pending) == len(state.tokens)
    assert state.pending == [59]
    assert proposer.propose(state).tokens == generate(draft, [*shortened, drafted[0], 59], method="ar",
                                                       max_new_tokens=3).token_ids


def test_sd_with_a_context_limited_draft_equals_ar(tiny_pair):
    target, draft = tiny_pair
    prompt = [(5 * i) % 60 + 1 for i in range(30)]
    for temperature in (0.0, 0.9):
        kw = dict(max_new_tokens=24, temperature=temperature, seed=2)
        want = generate(target, prompt, method="ar", **kw).token_ids
        got = generate(target, prompt, method="sd", draft=draft, gamma=4, draft_context=6, model_gate="always", **kw)
        assert got.token_ids == want and got.stats.draft_forwards > 0


@pytest.mark.parametrize("params", [{}, {"temperature": 0.8, "seed": 3}, {"temperature": 1.0, "top_p": 0.9, "seed": 4}])
def test_running_ahead_gives_ar_its_own_tokens(monkeypatch, params):
    """CUDA's ``ar`` queues each next forward before the host reads a token (``RunAheadScorer``); it runs the same
    on the CPU, forced here: the same tokens, the same forwards, and a request stopped early leaves a cache that a
    prefix cache can keep and a later request restores from."""
    from mirrorsd import api
    from mirrorsd.decoding import ar
    from mirrorsd.decoding.engine import RunAheadScorer
    from mirrorsd.prefix_cache import PrefixCache

    target = row_exact(tiny_hf(layers=2, seed=5))  # (a prefix cache keeps row-exact models' caches)
    prompt = [5, 9, 2, 7]
    alone = generate(target, prompt, method="ar", max_new_tokens=12, **params)
    monkeypatch.setattr(ar, "ChainScorer", lambda model, whole_prompt: RunAheadScorer(model))
    ahead = generate(target, prompt, method="ar", max_new_tokens=12, **params)
    assert ahead.token_ids == alone.token_ids
    assert ahead.stats.target_forwards == alone.stats.target_forwards == 12  # the prefill and 11 run ahead

    store = PrefixCache(target)
    steps = api.stream(target, prompt, method="ar", max_new_tokens=12, prefix_cache=store, **params).deltas()
    for _ in range(5):  # stopped after 5 tokens (as EOS would): the forward run ahead of the 5th is wasted
        next(steps)
    steps.close()
    assert len(store) == 1
    longer = prompt + alone.token_ids[:5]
    again = generate(target, longer, method="ar", max_new_tokens=7, prefix_cache=store, **params)
    assert again.stats.cached_tokens == len(longer) - 1
    assert again.token_ids == alone.token_ids[5:]

    from mirrorsd.batching import Batcher

    with Batcher().member():  # a server's request: its forwards wait for the batch's step, none is run ahead
        batched = generate(target, prompt, method="ar", max_new_tokens=12, **params)
    assert batched.token_ids == alone.token_ids  # (the second step raised: nothing had been run ahead)


@pytest.mark.parametrize("params", [{}, {"temperature": 0.8, "seed": 3}])
def test_a_fixed_sd_window_reads_the_host_once_per_step(tiny_pair, monkeypatch, params):
    """At ``confidence=0`` the draft's window stays on the device (``DrawnChain``): the target's forward takes it as
    it is, and the verdict reads it together with the target's own tokens. Greedy, a step then reads the host once
    (a sampled step too on a GPU; the CPU reads sampled rows one by one, see ``rows_apart``): on a GPU a read between
    the draft's forwards and the target's would drain the queue mid-step. The tokens stay ``ar``'s."""
    from mirrorsd.decoding.engine import ChainScorer
    from mirrorsd.decoding.proposers import ModelProposer

    target, draft = tiny_pair
    host, per_step = HostReads(monkeypatch), []
    propose, commit = ModelProposer.propose, ChainScorer.commit

    def started(self, *args, **kwargs):  # a step begins with the draft's window ...
        host.start()
        return propose(self, *args, **kwargs)

    def ended(self, *args, **kwargs):  # ... and ends with the target's cache rolled back after the verdict
        reads = host.stop()
        if reads is not None:
            per_step.append(reads)
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(ModelProposer, "propose", started)
    monkeypatch.setattr(ChainScorer, "commit", ended)
    kw = dict(max_new_tokens=24, **params)
    sd = generate(target, [3, 1, 4, 1, 5], method="sd", draft=draft, gamma=4, confidence=0.0, suffix_match=0, **kw)
    monkeypatch.undo()
    assert sd.token_ids == generate(target, [3, 1, 4, 1, 5], method="ar", **kw).token_ids
    assert len(per_step) == sd.stats.steps > 3
    if not params:
        assert all(r == ["tolist"] for r in per_step), per_step  # (the last step drafts nothing: its own row)
    else:  # the window's tokens (when there is one), then the target's rows one by one to the first disagreement
        tolists = [r.count("tolist") for r in per_step]
        assert tolists == [(d > 0) + a + 1 for d, a in zip(sd.stats.drafted, sd.stats.accepted, strict=True)]


def test_drafts_share_their_graphs_whatever_their_seed(tiny_pair):
    """A draft graph is keyed by what a step's choice bakes in (``DraftSampler.choice``): the head, and for sampling
    the warp and the noise, never the seed, which the graph reads as a device tensor. Every request draws a seed, so
    keyed by it each request would capture its own graphs and evict the last's."""
    from mirrorsd.decoding.drafting import DraftSampler

    _, draft = tiny_pair
    vocab = draft.config.vocab_size

    def choice(**params):
        return DraftSampler(draft, vocab, SamplingParams(**params)).choice

    assert choice(seed=1) == choice(seed=2) == choice(seed=1, top_k=5)  # (greedy: an argmax)
    assert choice(temperature=0.8, seed=1) == choice(temperature=0.8, seed=2)
    assert choice(temperature=0.8, seed=1) != choice(temperature=0.9, seed=1)
    assert choice(temperature=0.8, seed=1) != choice(temperature=0.8, seed=1, top_k=5) != choice(seed=1)


@pytest.mark.parametrize("acceptance", ["rejection", "match"])
def test_a_rejection_sampled_draft_draws_each_window_from_noise_of_its_own(tiny_pair, acceptance):
    """After a rejection at P the next window drafts P + 1 again, where the last window drew a discarded token: under
    speculative sampling it must not reuse that draw's noise (whatever chose the window may have read it), so over the
    same text the two draws at P + 1 differ for some seed. Sample-and-match drafts stay coupled to the target's
    noise: the same token."""
    from mirrorsd.decoding.engine import DecodeRequest, GenerationStats, RequestState
    from mirrorsd.decoding.proposers import ModelProposer

    target, draft = tiny_pair
    prompt, differs = [3, 1, 4, 1, 5], []
    for seed in range(8):
        params = SamplingParams(temperature=1.5, seed=seed)
        windows = []
        for text in (prompt, None):
            text = text or [*prompt, windows[0][0]]  # the first window's first token kept, the rest discarded
            request = DecodeRequest(target, text, 16, params, GenerationStats("sd"), draft)
            state = RequestState(request, list(text), target.new_cache(), draft.new_cache(capacity=64), list(text))
            proposer = ModelProposer(draft, target.config.vocab_size, params, gamma=3,
                                     rejection=acceptance == "rejection")
            windows.append(proposer.propose(state).tokens)
        differs.append(windows[0][1] != windows[1][0])
    assert any(differs) if acceptance == "rejection" else not any(differs)

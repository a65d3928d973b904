"""Mirror-SD: lossless on random and real models, parity with vanilla SD, reuse rules, real overlap, and a
draft that fails mid-generation."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mirrorsd
from mirrorsd import Transformer, generate
from mirrorsd.decoding.engine import Proposal
from mirrorsd.decoding.mirror import (
    ChannelMessage,
    RootBudget,
    RootScorer,
    Tree,
    resolve_exit_layer,
    select_roots,
)
from mirrorsd.runtime import write_chrome_trace
from mirrorsd.runtime.trace import overlap
from tests.helpers import HostReads, assert_same_or_near_tie, requires_smollm2, row_exact, tiny_hf

_perf_counter = time.perf_counter  # (the host's clock, before a test replaces it)


@pytest.fixture(scope="module")
def exact_pair() -> tuple[Transformer, Transformer]:
    return row_exact(tiny_hf(layers=4, seed=1)), row_exact(tiny_hf(layers=2, seed=2))


# -- lossless and parity on random models ------------------------------------------------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    gamma=st.integers(1, 5),
    kappa=st.integers(1, 6),
    exit_layer=st.sampled_from([1, 2, 3, 0.5]),
    roots=st.sampled_from(["paper", "budget"]),
    backend=st.sampled_from(["serial", "threads"]),
    temperature=st.sampled_from([0.0, 0.7, 1.5]),
    seed=st.integers(0, 2**31),
    prompt=st.lists(st.integers(0, 63), min_size=1, max_size=10),
    max_new=st.integers(1, 24),
    self_draft=st.booleans(),
    confidence=st.sampled_from([0.0, 0.5]),
    candidates=st.sampled_from(["exit", "draft"]),
    budget=st.sampled_from([None, 3]),
)
def test_mirror_equals_ar(tiny_pair, gamma, kappa, exit_layer, roots, backend, temperature, seed, prompt, max_new,
                          self_draft, confidence, candidates, budget):
    target, other = tiny_pair
    draft = target.prefix_model(2) if self_draft else other
    kw = dict(temperature=temperature, seed=seed, max_new_tokens=max_new)
    ar = generate(target, prompt, method="ar", **kw)
    fixed = {"budget": budget} if roots == "budget" and budget else {}
    m = generate(target, prompt, method="mirror", draft=draft, gamma=gamma, kappa=kappa, exit_layer=exit_layer,
                 roots=roots, backend=backend, confidence=confidence, candidates=candidates, **fixed, **kw)
    assert m.token_ids == ar.token_ids
    stats = m.stats
    assert sum(a + 1 for a in stats.accepted) == max_new
    assert stats.target_forwards == (len(prompt) > 1) + stats.steps
    steps = stats.extra["mirror"].steps
    assert len(steps) == stats.steps
    if roots == "paper" and candidates == "exit":
        assert all(s.roots == (s.drafted + 1) * kappa for s in steps if s.hit is not None)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    gamma=st.integers(1, 6),
    kappa=st.integers(1, 8),
    temperature=st.sampled_from([0.0, 1.0]),
    acceptance=st.sampled_from(["match", "rejection"]),
    seed=st.integers(0, 2**31),
    max_new=st.integers(2, 30),
    self_draft=st.booleans(),
    confidence=st.sampled_from([0.0, 0.6]),
    backend=st.sampled_from(["serial", "threads"]),
    candidates=st.sampled_from(["exit", "draft"]),
    budget=st.sampled_from([{}, {"budget": 2}, {"roots": "paper"}]),
)
def test_accepted_lengths_equal_vanilla_sd(exact_pair, gamma, kappa, temperature, acceptance, seed, max_new,
                                          self_draft, confidence, backend, candidates, budget):
    """The paper's parity claim (App. B): the window a hit reuses is exactly what vanilla SD's draft proposes
    after that step, so every step accepts the same number of tokens -- and with rejection sampling even the
    drawn tokens agree, since both methods key the noise by position."""
    target, other = exact_pair
    draft = target.prefix_model(2) if self_draft else other
    kw = dict(temperature=temperature, seed=seed, max_new_tokens=max_new, acceptance=acceptance,
              confidence=confidence, gamma=gamma)
    sd = generate(target, [5, 9, 2, 7], method="sd", draft=draft, suffix_match=0, **kw)  # mirror has no suffix
    m = generate(target, [5, 9, 2, 7], method="mirror", draft=draft, kappa=kappa, backend=backend,
                 candidates=candidates, **budget, **kw)
    assert m.token_ids == sd.token_ids
    assert m.stats.accepted == sd.stats.accepted
    assert m.stats.drafted == sd.stats.drafted
    if acceptance == "match":
        assert m.token_ids == generate(target, [5, 9, 2, 7], method="ar", temperature=temperature, seed=seed,
                                       max_new_tokens=max_new).token_ids


def test_identity_draft_hits_every_step(exact_pair):
    """The target as its own draft accepts every window, so the reusable root is the bonus token at the last
    position (full acceptance); with κ = the whole vocabulary it is always a candidate, so every step hits."""
    target, _ = exact_pair
    m = generate(target, [1, 2, 3], method="mirror", draft=target, gamma=4, kappa=64, roots="paper",
                 confidence=0.0, max_new_tokens=21)
    assert m.token_ids == generate(target, [1, 2, 3], method="ar", max_new_tokens=21).token_ids
    assert m.stats.accepted == [4, 4, 4, 4, 0]
    assert [s.hit for s in m.stats.extra["mirror"].steps] == [True, True, True, True, None]


@pytest.mark.parametrize(("temperature", "confidence", "candidates", "reads"),
                         [(0.0, 0.0, "exit", []), (1.0, 0.6, "draft", ["tolist"])])
def test_a_tree_rollout_reads_the_host_only_after_its_last_step(exact_pair, monkeypatch, temperature, confidence,
                                                                 candidates, reads):
    """Each step's drawn tokens feed the next forward where they were drawn; the tokens, top probabilities,
    runner-ups and the roots' ids are read together at the end (on a GPU a read per step would stall the draft's
    queue every step). With nothing but the tokens wanted (the paper's fixed γ, the exit's candidates), the rollout
    reads nothing: the verdict picks the branch on the device and reads it with its own tokens (``BranchPick``)."""
    from mirrorsd.decoding.mirror.draft import LocalDraft

    target, draft = exact_pair
    host, seen = HostReads(monkeypatch), []
    rollout = LocalDraft._rollout

    def counted(self, *args):
        host.start()
        try:
            return rollout(self, *args)
        finally:
            seen.append((args[-1], host.stop()))

    monkeypatch.setattr(LocalDraft, "_rollout", counted)
    kw = dict(temperature=temperature, seed=3, max_new_tokens=30)
    m = generate(target, [3, 1, 4, 1, 5], method="mirror", draft=draft, gamma=5, kappa=3, roots="paper",
                 confidence=confidence, candidates=candidates, **kw)
    assert m.token_ids == generate(target, [3, 1, 4, 1, 5], method="ar", **kw).token_ids
    assert any(steps > 1 for steps, _ in seen)
    assert all(r == reads for _, r in seen), seen  # tokens, top probabilities, runner-ups and roots: one read


def test_a_mirror_step_reads_the_host_once(exact_pair, monkeypatch):
    """Paper roots, the exit's candidates, a fixed γ: the window, the exit's top-κ and the rollouts stay on the
    device, and the verdict's one read carries the kept branch too (picked on the device, ``BranchPick``), which
    the next step feeds as it is. On a GPU each further read would drain the queue mid-step."""
    from mirrorsd.decoding.engine import ChainScorer
    from mirrorsd.decoding.mirror.draft import BranchProposer

    target, draft = exact_pair
    host, per_step = HostReads(monkeypatch), []
    propose, commit = BranchProposer.propose, ChainScorer.commit

    def started(self, *args):  # a step begins with the window (a kept branch, or a fresh rollout) ...
        host.start()
        return propose(self, *args)

    def ended(self, *args):  # ... and ends with the target's cache rolled back after the verdict
        reads = host.stop()
        if reads is not None:
            per_step.append(reads)
        return commit(self, *args)

    monkeypatch.setattr(BranchProposer, "propose", started)
    monkeypatch.setattr(ChainScorer, "commit", ended)
    m = generate(target, [3, 1, 4, 1, 5], method="mirror", draft=draft, gamma=4, kappa=3, roots="paper",
                 confidence=0.0, max_new_tokens=40)
    monkeypatch.undo()
    assert m.token_ids == generate(target, [3, 1, 4, 1, 5], method="ar", max_new_tokens=40).token_ids
    hits = [s.hit for s in m.stats.extra["mirror"].steps]
    assert True in hits and False in hits, hits  # kept branches and fresh rollouts both
    assert len(per_step) == len(hits) and all(r == ["tolist"] for r in per_step), per_step
    # the serial rollout runs when the verdict joins it, and still counts as the draft's time (the goodput rule's)
    assert m.stats.draft_s >= sum(s.seconds for s in m.stats.spans if s.lane == "draft") > 0


def test_the_device_branch_pick_is_the_hosts():
    """``BranchPick`` on the device keeps the branch :meth:`Tree.branch` picks on the host, for every verdict: each
    root, a correction that is a candidate of another position, and one that is no candidate at all."""
    from mirrorsd.decoding.mirror.channel import ExitTopK
    from mirrorsd.decoding.mirror.draft import BranchPick
    from mirrorsd.decoding.mirror.roots import DeviceRoots

    ids = torch.tensor([[7, 3, 4], [5, 8, 6], [9, 1, 3]])
    roots = DeviceRoots(ExitTopK(ids=ids, logprobs=torch.zeros(3, 3)))
    tree = Tree(roots=roots, tokens=torch.zeros(9, 2, dtype=torch.long), top_probs=None, q=None, entries=[[0]] * 9,
                forwards=1)
    for accepted in range(3):
        for correction in (*range(10), 63):
            pick = BranchPick(lambda: tree)
            pick.read([t.tolist() for t in pick.tensors(torch.tensor([accepted]), torch.tensor([correction]))])
            assert pick.taken and pick.branch == tree.branch(accepted, correction), (accepted, correction)
    assert tree.branch(2, 3) == 8 and tree.branch(0, 3) == 1 and tree.branch(1, 3) is None


def test_a_ragged_rollouts_branch_rides_the_verdicts_read(exact_pair):
    """A graphed stream rollout's branches end with their own counts (:mod:`~mirrorsd.decoding.streams.rollout_graph`):
    ``BranchPick`` reads every count and the kept branch's entries with the verdict, so keeping it reads nothing
    more; the window is its count, cut at γ, and the draft cache keeps the spine and the branch's inputs; the
    kept branches set the pass count. A rollout that read its roots on the host leaves the pick to the host."""
    from mirrorsd.decoding.engine import DecodeRequest, DrawnChain, GenerationStats, RequestState
    from mirrorsd.decoding.mirror.channel import ExitTopK
    from mirrorsd.decoding.mirror.draft import BranchPick, LocalDraft, fresh_proposer
    from mirrorsd.decoding.mirror.options import MirrorOptions
    from mirrorsd.decoding.mirror.roots import DeviceRoots
    from mirrorsd.sampling import SamplingParams

    target, draft = exact_pair
    roots = DeviceRoots(ExitTopK(ids=torch.tensor([[7, 3], [5, 8]]), logprobs=torch.zeros(2, 2)))
    tokens = torch.arange(40).view(4, 10)
    entries = torch.arange(100, 140).view(4, 10)
    tree = Tree(roots=roots, tokens=tokens, top_probs=None, q=None, entries=entries, forwards=3,
                counts=torch.tensor([3, 7, 4, 9]))
    pick = BranchPick(lambda: tree)
    pick.read([t.tolist() for t in pick.tensors(torch.tensor([1]), torch.tensor([8]))])
    assert pick.taken and pick.branch == 3 and tree.read_counts == [3, 7, 4, 9]
    assert tree.kept(3) == (9, list(range(130, 140))) and tree.depth(5) == (3 + 5 + 4 + 5) / 4

    opts = MirrorOptions(gamma=5)
    side = LocalDraft(None, fresh_proposer(draft, target.config.vocab_size, SamplingParams(), opts))  # (no run)
    request = DecodeRequest(target, [1, 2], 32, SamplingParams(), GenerationStats("mirror"), draft)
    state = RequestState(request, list(range(1, 8)), target.new_cache(), draft.new_cache(capacity=160))
    state.draft_cache.lengths[:] = [140] * draft.config.n_layers
    for branch, window in ((3, 5), (0, 3)):  # cut at γ; ended short
        tree.read_entries.pop(0, None)
        kept = side.keep_branch(state, tree, branch)
        assert isinstance(kept, DrawnChain) and kept.ids.tolist() == tokens[branch, :window].tolist()
        assert len(state.draft_cache) == len(state.tokens) - 1 + window
        state.draft_cache.lengths[:] = [140] * draft.config.n_layers
    assert side.streamed == [8 + 2, 2 + 2]  # what the kept branches' guessing passes made: J's estimate
    assert [side.passes(g) for g in (1, 2, 5, 7)] == [1, 2, 3, 4]  # J = 1 + ⌈(γ - 1)/η̄'⌉, η̄' = 2.5

    host = Tree(roots=[(0, 7), (0, 3)], tokens=[[1], [2]], top_probs=None, q=None, entries=[[0], [1]], forwards=1)
    pick = BranchPick(lambda: host)
    pick.read([t.tolist() for t in pick.tensors(torch.tensor([0]), torch.tensor([3]))])
    assert not pick.taken


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_with_every_candidate_a_root_nothing_is_read_before_the_upper_layers(exact_pair, monkeypatch, temperature):
    """``roots="paper"``: the exit's top-κ stay on the device as the rollouts' roots (``DeviceRoots``), and a fresh
    window as the draft drew it (``DrawnChain``): the host queues the lower layers, the exit and the upper layers
    without waiting for any of them (on a GPU a read there would stall the device until the host queues more)."""
    from mirrorsd.decoding.mirror.target import EarlyExitScorer

    target, draft = exact_pair
    host, before_upper = HostReads(monkeypatch), []
    score, run_layers = EarlyExitScorer.score, Transformer.run_layers

    def scoring(self, *args):
        host.start()
        return score(self, *args)

    def layers(self, *args, **kwargs):
        if self is target and kwargs.get("start", 0) > 0:  # the upper layers
            before_upper.append(host.stop())
        return run_layers(self, *args, **kwargs)

    monkeypatch.setattr(EarlyExitScorer, "score", scoring)
    monkeypatch.setattr(Transformer, "run_layers", layers)
    kw = dict(temperature=temperature, seed=3, max_new_tokens=30)
    m = generate(target, [3, 1, 4, 1, 5], method="mirror", draft=draft, gamma=4, kappa=2, roots="paper",
                 confidence=0.0, **kw)
    monkeypatch.undo()
    assert m.token_ids == generate(target, [3, 1, 4, 1, 5], method="ar", **kw).token_ids
    steps = m.stats.extra["mirror"].steps
    assert len(before_upper) == len(steps) and any(s.hit for s in steps) and any(s.hit is False for s in steps)
    assert all(reads == [] for reads in before_upper), before_upper


# -- reuse rules, root selection and the budget on hand-built cases -------------------------------------


def _message() -> ChannelMessage:
    # window d = [7, 8]; row j holds the candidates for slot j+1 (position 0 predicts slot 1, ...)
    return ChannelMessage(ids=[[7, 3, 4], [5, 8, 6], [9, 1, 2]],
                          logprobs=[[-0.1, -2.5, -3.0], [-0.7, -0.9, -3.0], [-0.2, -1.9, -2.3]])


def test_reuse_hit_rules():
    """With paper roots, a hit is exactly the paper's rule: c is a candidate of position A (Π⁺ ∈ Paths_τ(T))."""
    roots = select_roots(_message(), [7, 8], "paper")
    tree = Tree(roots=roots, tokens=[[0]] * len(roots), top_probs=None, q=None, entries=[[10]] * len(roots),
                forwards=1)
    hit = lambda accepted, correction: tree.branch(accepted, correction) is not None  # noqa: E731
    assert hit(0, 3)  # rejected at slot 1, correction among position 0's candidates
    assert not hit(0, 5)  # a candidate of another position does not count
    assert hit(1, 5) and not hit(1, 9)
    assert hit(2, 9)  # full acceptance: the bonus token against the last position
    assert not hit(2, 7)
    assert roots[tree.branch(2, 9)] == (2, 9)
    budget = Tree(roots=[(0, 3), (2, 9)], tokens=[[1], [2]], top_probs=None, q=None, entries=[[10], [11]], forwards=1)
    assert budget.branch(2, 9) == 1 and budget.branch(0, 3) == 0 and budget.branch(1, 5) is None


def test_draft_candidates_replace_the_exit_at_drafted_positions_only():
    """candidates=draft: a drafted position's candidates are the draft's runner-ups (its own token left out, κ
    kept); the bonus slot keeps the exit's. Paper roots then roll out exactly those."""
    draft = Proposal([7, 8], alternatives=[[7, 2, 3, 4], [1, 8, 5, 6]])
    msg = _message().with_draft(draft, kappa=3)
    assert msg.runner_ups == [[2, 3, 4], [1, 5, 6]]
    assert msg.candidates([7, 8], 0) == [2, 3, 4] and msg.candidates([7, 8], 1) == [1, 5, 6]
    assert msg.candidates([7, 8], 2) == [9, 1, 2]  # the bonus slot: the exit's top-κ
    assert select_roots(msg, [7, 8], "paper") == [(0, 2), (0, 3), (0, 4), (1, 1), (1, 5), (1, 6), (2, 9), (2, 1),
                                                  (2, 2)]
    assert _message().with_draft(Proposal([7, 8]), kappa=3) == _message()  # a suffix window has no runner-ups


def test_draft_runner_ups_are_read_where_the_window_was_drafted(exact_pair, monkeypatch):
    """Greedy: the first of a position's likeliest tokens is the drafted token itself, in fresh rollouts and in
    the branches a hit keeps (which would catch runner-ups shifted by a position); κ = the vocabulary covers
    every correction, so every step with a tree hits."""
    target, draft = exact_pair
    seen: list[tuple[list[int], list[list[int]] | None]] = []
    original = ChannelMessage.with_draft

    def record(self, window, kappa):
        seen.append((list(window.tokens), window.alternatives))
        return original(self, window, kappa)

    monkeypatch.setattr(ChannelMessage, "with_draft", record)
    vocab = target.config.vocab_size
    m = generate(target, [3, 1, 4, 1, 5], method="mirror", draft=draft, gamma=4, kappa=vocab, roots="paper",
                 candidates="draft", max_new_tokens=40)
    assert m.token_ids == generate(target, [3, 1, 4, 1, 5], method="ar", max_new_tokens=40).token_ids
    hits = [s.hit for s in m.stats.extra["mirror"].steps if s.hit is not None]
    assert hits and all(hits)
    assert len(seen) >= 2
    for tokens, alternatives in seen:
        assert alternatives is not None and len(alternatives) == len(tokens)
        assert [alt[0] for alt in alternatives] == tokens
        assert all(len(alt) == vocab for alt in alternatives)  # κ + 1 ids, capped by the vocabulary


def test_paper_roots_are_all_candidates_of_all_positions():
    roots = select_roots(_message(), [7, 8], "paper")
    assert len(roots) == 9 and roots[:3] == [(0, 7), (0, 3), (0, 4)]


def test_budget_roots_rank_by_first_rejection_times_correction_rank():
    msg, window = _message(), [7, 8]
    assert msg.candidates(window, 0) == [3, 4] and msg.candidates(window, 2) == [9, 1, 2]
    scorer = RootScorer(kappa=3)
    # Priors: a draft token that is the exit's top-1 is accepted 3/4 of the time, else 1/4; ranks weigh 1, 1/2,
    # 1/4 (+1/8 for "not a candidate"). d_1 = 7 is position 0's top-1, d_2 = 8 is not. P(A = j):
    # j=0: 1/4; j=1: 3/4 · 3/4 = 9/16; j=2: 3/4 · 1/4 = 3/16.
    roots = select_roots(msg, window, "budget", scorer, budget=8)
    assert roots == [(1, 5), (1, 6), (0, 3), (2, 9), (0, 4), (2, 1), (2, 2)]
    assert (0, 7) not in roots and (1, 8) not in roots  # the draft's own tokens can never be the correction
    assert select_roots(msg, window, "budget", scorer, budget=2) == [(1, 5), (1, 6)]
    for _ in range(20):  # windows keep being accepted whole and the bonus token is the exit's second candidate
        scorer.observe(msg, window, accepted=2, correction=1)
    # Now P(A = 2) = 23/24 · 21/24 and rank 1 carries 20.5 of 21.875 pseudo-counts: (2, 1) first, then rank 1
    # of position 1 (P(A = 1) = 23/24 · 3/24) before rank 0 of position 2.
    assert select_roots(msg, window, "budget", scorer, budget=2) == [(2, 1), (1, 6)]


def test_root_budget_fits_rollouts_into_delta():
    budget = RootBudget(start=8, most=64)
    budget.observe(roots=8, steps=4, draft_s=0.08, delta_s=0.02)  # 20 ms per step for 8 roots -> 2.5 ms/root
    assert budget.current == 2  # 4 steps must fit in 20 ms: 5 ms per step
    budget.observe(roots=2, steps=4, draft_s=0.04, delta_s=0.02)  # two widths: 10 ms/step = 6.67 + 1.67·R
    assert budget.current == 1  # nothing but the floor fits
    roomy = RootBudget(start=8, most=16)
    roomy.observe(roots=8, steps=2, draft_s=0.002, delta_s=1.0)
    assert roomy.current == 16  # capped at (γ+1)·κ


def test_serial_budget_rolls_out_nothing_unless_told(exact_pair):
    """On the serial backend a rollout is never hidden, so the fitted budget is zero roots: no early exit, no
    tree, a fresh rollout every step (vanilla SD's). ``budget=N`` still forces N roots there; threads fit Δ."""
    target, draft = exact_pair
    kw = dict(draft=draft, max_new_tokens=16, gamma=3)
    fitted = generate(target, [5, 9, 2, 7], method="mirror", **kw)
    stats = fitted.stats.extra["mirror"]
    assert [s.roots for s in stats.steps] == [0] * fitted.stats.steps
    assert all(s.hit is None and s.t_ee == 0.0 for s in stats.steps)
    assert stats.to_dict()["fallback_frequency"] is None
    sd = generate(target, [5, 9, 2, 7], method="sd", confidence=0.0, suffix_match=0, **kw)
    assert fitted.token_ids == sd.token_ids and fitted.stats.accepted == sd.stats.accepted
    forced = generate(target, [5, 9, 2, 7], method="mirror", budget=2, **kw).stats.extra["mirror"].steps
    assert all(s.roots == 2 for s in forced if s.hit is not None) and any(s.hit is not None for s in forced)
    threads = generate(target, [5, 9, 2, 7], method="mirror", backend="threads", **kw).stats.extra["mirror"].steps
    assert all(s.roots >= 1 for s in threads if s.hit is not None) and any(s.hit is not None for s in threads)


def test_serial_budget_warns_about_rollout_options_it_ignores(exact_pair):
    """κ, the candidate source and the exit shape rollouts the serial backend does not make by default: say so."""
    target, draft = exact_pair
    with pytest.warns(UserWarning, match="change nothing: kappa, candidates; give budget=N"):
        generate(target, [5, 9, 2, 7], method="mirror", draft=draft, max_new_tokens=4, kappa=4, candidates="draft")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for told in ({"budget": 2}, {"roots": "paper"}, {"backend": "threads"}, {}):
            generate(target, [5, 9, 2, 7], method="mirror", draft=draft, max_new_tokens=4,
                     **({"kappa": 4} if told else {}), **told)


def test_exit_layer_resolution_and_bad_options(tiny_pair):
    assert resolve_exit_layer(0.5, 24) == 12 and resolve_exit_layer(0.25, 28) == 7 and resolve_exit_layer(3, 4) == 3
    for bad in (0, 4, 1.5, -0.5):
        with pytest.raises(ValueError, match="exit_layer"):
            resolve_exit_layer(bad, 4)
    target, draft = tiny_pair
    for options, match in [({"kappa": 0}, "kappa"), ({"kappa": 65}, "kappa"), ({"gamma": 0}, "gamma"),
                           ({"roots": "all"}, "roots"), ({"roots": "paper", "budget": 3}, "budget"),
                           ({"backend": "mpi"}, "backend"),
                           ({"backend": "cuda-streams"}, "CUDA"), ({"backend": "devices"}, "another device"),
                           ({"threads": "1"}, "threads"), ({"exit_layer": 9}, "exit_layer"),
                           ({"beam": 2}, "not an option"), ({"backend": "serial", "threads": "1,1"}, "threads"),
                           ({"candidates": "draft", "draft_streams": "ADAPTER"}, "candidates")]:
        with pytest.raises(ValueError, match=match):
            generate(target, [1, 2], method="mirror", draft=draft, max_new_tokens=4, **options)


# -- concurrency, failure, tracing ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def heavy_pair() -> tuple[Transformer, Transformer]:
    """Big enough that the target's suffix lasts milliseconds, so a thread hand-off fits inside it."""
    target = Transformer.from_hf(tiny_hf(vocab=256, layers=8, hidden=512, seed=3, std=0.05))
    return target, target.prefix_model(2)


def test_threads_backend_overlaps_draft_with_target_suffix(heavy_pair, tmp_path):
    target, draft = heavy_pair
    m = generate(target, list(range(20)), method="mirror", draft=draft, backend="threads", gamma=4, kappa=4,
                 max_new_tokens=24)
    assert m.token_ids == generate(target, list(range(20)), method="ar", max_new_tokens=24).token_ids
    spans = m.stats.spans
    suffixes = [s for s in spans if s.lane == "target" and s.name.startswith("layers ≥")]
    rollouts = [s for s in spans if s.lane == "draft" and s.name == "rollout"]
    assert rollouts and suffixes
    overlapped = [r for r in rollouts if any(overlap(r, s) > 0 for s in suffixes)]
    assert len(overlapped) >= len(rollouts) // 2, "draft rollouts should run during the target's suffix"
    assert m.stats.to_dict()["mirror"]["hidden_draft_fraction"] > 0
    serial = generate(target, list(range(20)), method="mirror", draft=draft, backend="serial", gamma=4, kappa=4,
                      max_new_tokens=24)
    assert serial.stats.to_dict()["mirror"]["hidden_draft_fraction"] == 0  # the reference: no overlap
    trace = json.loads(write_chrome_trace(spans, tmp_path / "t.json").read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert lanes == {"target", "draft"}
    assert all(e["dur"] >= 0 for e in trace["traceEvents"] if e["ph"] == "X")


@pytest.mark.parametrize("roots, temperature", [("paper", 0.0), ("budget", 0.0), ("paper", 0.7)])
def test_an_inline_executor_issues_the_rollouts_after_the_target_and_stays_lossless(tiny_pair, monkeypatch, roots,
                                                                                     temperature):
    """``draft_issue="inline"``: no worker thread; the target's thread issues the rollouts onto the second stream
    right after its upper layers (on a GPU both then run side by side). On the CPU the executor runs the job in
    place, so the order shows on the host's clock, and every step accepts what the serial backend's does."""
    from mirrorsd.decoding.mirror import method as mirror_method
    from mirrorsd.runtime.executors import InlineStreamExecutor

    target, draft = tiny_pair
    prompt = list(range(3, 23))
    options = dict(method="mirror", draft=draft, gamma=4, kappa=3, roots=roots, max_new_tokens=20,
                   temperature=temperature, seed=5, **({"budget": 3} if roots == "budget" else {}))
    serial = generate(target, prompt, **options)
    monkeypatch.setattr(mirror_method, "make_executor", lambda *a, **k: InlineStreamExecutor(torch.device("cpu")))
    inline = generate(target, prompt, **options)
    assert inline.token_ids == serial.token_ids == generate(target, prompt, method="ar", max_new_tokens=20,
                                                            temperature=temperature, seed=5).token_ids
    assert inline.stats.accepted == serial.stats.accepted
    spans = inline.stats.spans
    uppers = [s for s in spans if s.name == "layers ≥ ℓe"]
    rollouts = [s for s in spans if s.name == "rollout"]
    assert rollouts and inline.stats.extra["mirror"].backend == "cuda-streams"
    for rollout in rollouts:  # each step's rollout began after that step's upper layers were issued
        assert any(u.end <= rollout.start and rollout.start - u.end < 0.05 for u in uppers)


def test_an_inline_stream_waits_for_the_target_before_its_upper_layers_not_after(monkeypatch):
    """The second stream must wait for the target's stream as it stood before the work the job overlaps (the
    draft's cache was last written there), never for its tail, which would queue the rollouts behind the upper
    layers; and the target's stream follows the job before it touches the draft's cache again. Checked with stand-in
    streams that log what waits on what."""
    from mirrorsd.runtime.executors import InlineStreamExecutor

    log: list[tuple] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name, self.device = name, "cuda:0"

        def wait_event(self, event) -> None:
            log.append((self.name, "waits for", event.at))

        def wait_stream(self, other) -> None:
            log.append((self.name, "waits for", f"{other.name} tail"))

    class Event:
        def record(self, stream) -> None:
            self.at = f"{stream.name} at {len(log)}"
            log.append((stream.name, "records", self.at))

    target_stream, current = Stream("target"), []

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream("draft"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1] if current else target_stream)
    executor = InlineStreamExecutor(torch.device("cuda"))
    with executor.overlapping():
        log.append(("target", "runs", "upper layers"))
    future = executor.submit(lambda: log.append((current[-1].name, "runs", "rollout")) or "tree")
    assert future.result() == "tree"
    assert log == [("target", "records", "target at 0"), ("target", "runs", "upper layers"),
                   ("draft", "waits for", "target at 0"), ("draft", "runs", "rollout"),
                   ("target", "waits for", "draft tail")]

    def fails():  # a rollout that raises after queuing work: the target's stream still follows what it queued
        log.append((current[-1].name, "runs", "half a rollout"))
        raise RuntimeError("draft failed")

    log.clear()
    with pytest.raises(RuntimeError, match="draft failed"):
        executor.submit(fails).result()
    assert log[-2:] == [("draft", "runs", "half a rollout"), ("target", "waits for", "draft tail")]


def test_draft_issue_is_an_option_of_the_cuda_streams_backend(tiny_pair):
    target, draft = tiny_pair
    with pytest.raises(ValueError, match="draft_issue"):
        generate(target, [1, 2, 3], method="mirror", draft=draft, backend="threads", draft_issue="inline",
                 max_new_tokens=2)


class _HalfSpeedEvent:
    """A stand-in for ``torch.cuda.Event`` on the CPU: a device clock that runs at half the host's speed, so a span
    on it lasts half its host time. An event takes the time its thread last read from the host's clock (the span's
    own start or end, read just before the tracer records the event), so another thread that runs in between
    (the threads backend's other lane, on a loaded machine) does not shift it."""

    last = threading.local()

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    @classmethod
    def host_clock(cls) -> float:
        cls.last.t = _perf_counter()
        return cls.last.t

    streams: list[object] = []  # what each event was recorded on

    def record(self, stream: object = None) -> None:
        self.t = 0.5 * self.last.t
        self.streams.append(stream)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _HalfSpeedEvent) -> float:
        return (end.t - self.t) * 1e3


def test_eq10_terms_come_from_device_events_where_the_tracer_records_them(tiny_pair, monkeypatch):
    """On one CUDA device (serial or cuda-streams) the tracer records events at each span's ends and the step's
    Eq. 10 terms are read off the spans after they are put on the device's clock; the host's durations stay in
    the spans' args. Faked here with a device clock at half speed: every target term is then its span's device
    time (half the host's), and the final rendezvous is the host's branch selection alone."""
    from mirrorsd.decoding.mirror import stats as mirror_stats
    from mirrorsd.runtime import Tracer

    monkeypatch.setattr(torch.cuda, "Event", _HalfSpeedEvent)
    monkeypatch.setattr(_HalfSpeedEvent, "streams", [])
    monkeypatch.setattr(time, "perf_counter", _HalfSpeedEvent.host_clock)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    monkeypatch.setattr(mirror_stats, "Tracer", lambda device=None: Tracer(torch.device("cuda")))
    target, draft = tiny_pair
    prompt = list(range(3, 23))
    m = generate(target, prompt, method="mirror", draft=draft, backend="threads", gamma=4, kappa=3, roots="paper",
                 max_new_tokens=20)
    assert m.token_ids == generate(target, prompt, method="ar", max_new_tokens=20).token_ids
    stats = m.stats.extra["mirror"]
    assert stats.device_times and stats.to_dict()["device_times"]
    # every span's events on the tracer's device (the current device's stream was cuda:0's, whatever it traced)
    assert set(_HalfSpeedEvent.streams[1:]) == {("stream of", torch.device("cuda"))}
    spans = m.stats.spans
    by_name = {name: [s for s in spans if s.name == name] for name in ("layers < ℓe", "early exit", "layers ≥ ℓe")}
    for span in [s for group in by_name.values() for s in group]:
        assert span.seconds == pytest.approx(0.5 * span.args["host_ms"] / 1e3, rel=0.05, abs=1e-4)
    assert [s.t_pre for s in stats.steps] == [s.seconds for s in by_name["layers < ℓe"]]
    assert [s.delta for s in stats.steps] == [s.seconds for s in by_name["layers ≥ ℓe"]]
    assert [s.t_ee for s in stats.steps if s.roots] == [s.seconds for s in by_name["early exit"]]
    selects = [s for s in spans if s.name == "select"]
    host = sum(s.args["host_ms"] / 1e3 if "host_ms" in s.args else s.seconds for s in selects)
    assert sum(s.t_fv for s in stats.steps) == pytest.approx(host, rel=0.01, abs=1e-5)
    assert all(s.predicted_s == s.eq10_s + s.t_fallback for s in stats.steps)


class _FailingDraft:
    """Makes a draft raise on its ``n``-th layer run (inside a rollout or a fresh window)."""

    def __init__(self, model: Transformer, n: int) -> None:
        self.calls, self.n, self.run_layers = 0, n, model.run_layers
        model.run_layers = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls >= self.n:
            raise RuntimeError("draft device lost")
        return self.run_layers(*args, **kwargs)


@pytest.mark.parametrize("roots", [{}, {"roots": "paper", "confidence": 0.0, "kappa": 2}])  # (paper: BranchPick)
@pytest.mark.parametrize("backend", ["serial", "threads"])
@pytest.mark.parametrize("fail_at", [1, 3, 12])
def test_failing_draft_degrades_to_target_only(tiny_pair, backend, fail_at, roots):
    target, _ = tiny_pair
    draft = target.prefix_model(3)
    failing = _FailingDraft(draft, fail_at)
    with pytest.warns(RuntimeWarning, match="draft failed"):
        m = generate(target, [4, 4, 2], method="mirror", draft=draft, backend=backend, gamma=3, max_new_tokens=30,
                     **roots)
    assert failing.calls == fail_at  # never called again after the failure
    assert m.token_ids == generate(target, [4, 4, 2], method="ar", max_new_tokens=30).token_ids
    assert sum(a + 1 for a in m.stats.accepted) == 30
    assert "draft device lost" in m.stats.extra["mirror"].draft_failed


@requires_smollm2
def test_cli_generate_mirror_with_trace(tmp_path, capsys):
    from mirrorsd.cli import main

    trace = tmp_path / "trace.json"
    code = main(["generate", "--target", "smollm2-135m", "--draft", "self:0.25", "--method", "mirror",
                 "--prompt", "def add(a, b):", "--raw", "--max-new-tokens", "12", "--kappa", "4", "--exit-layer",
                 "0.5", "--roots", "budget", "--backend", "threads", "--trace", str(trace), "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["mirror"]["exit_layer"] == 15 and out["stats"]["mirror"]["backend"] == "threads"
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["cat"] for e in events if e["ph"] == "X"} == {"target", "draft"}


@requires_smollm2  # (it loads smollm2-135m through the CLI: without the package it failed instead of skipping)
def test_cli_says_when_the_serial_budget_rolled_nothing_out(capsys):
    from mirrorsd.cli import main

    code = main(["generate", "--target", "smollm2-135m", "--draft", "self:0.25", "--method", "mirror",
                 "--prompt", "def add(a, b):", "--raw", "--max-new-tokens", "8"])
    assert code == 0
    said = " ".join(capsys.readouterr().err.split())  # (rich wraps the line)
    assert "no branch rolled out (the serial backend's budget: nothing overlaps)" in said


# -- real weights ---------------------------------------------------------------------------------------------


PROMPTS = ["The history of the printing press begins", "def quicksort(arr):"]


@requires_smollm2
@pytest.mark.parametrize("prompt", PROMPTS)
def test_smollm2_greedy_equals_ar_and_hf_with_several_drafts(smollm2, prompt):
    ours, hf = smollm2
    ids = ours.tokenizer(prompt)["input_ids"]
    ar = generate(ours, prompt, method="ar", max_new_tokens=32, raw=True)
    with torch.no_grad():
        hf_tokens = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32, min_new_tokens=32,
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    q4 = mirrorsd.load_model("smollm2-135m", weights="q4", progress=False)
    drafts = {"first-8-layers": ours.model.prefix_model(8), "q4-copy": q4.model}
    for name, draft in drafts.items():
        for options in ({}, {"roots": "budget", "backend": "threads", "exit_layer": 0.25, "kappa": 2}):
            m = generate(ours, prompt, method="mirror", draft=draft, max_new_tokens=32, raw=True, **options)
            assert_same_or_near_tie(ours.model, ids, m.token_ids, ar.token_ids)
            assert_same_or_near_tie(ours.model, ids, m.token_ids, hf_tokens)
            if name == "q4-copy":
                assert m.stats.mean_accepted_length > 2, name


@requires_smollm2
def test_smollm2_seeded_sampling_equals_ar_and_parity_on_q8():
    q8 = mirrorsd.load_model("smollm2-135m", weights="q8", progress=False)
    draft = q8.model.prefix_model(10)
    for seed in (0, 1):
        kw = dict(temperature=0.8, top_p=0.95, seed=seed, max_new_tokens=32)
        ar = generate(q8, PROMPTS[0], method="ar", **kw)
        sd = generate(q8, PROMPTS[0], method="sd", draft=draft, gamma=5, confidence=0, suffix_match=0, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the draft must not fail
            m = generate(q8, PROMPTS[0], method="mirror", draft=draft, gamma=5, kappa=2, backend="threads",
                         confidence=0, **kw)
        assert m.token_ids == ar.token_ids == sd.token_ids
        assert m.stats.accepted == sd.stats.accepted


def test_quantized_attention_ignores_the_callers_thread_count(monkeypatch):
    """The ``threads`` backend lowers the target's intra-op thread count while the draft runs. CPU SDPA splits
    its work (and so its rounding) by thread count and a quantized model turns that into different tokens
    (Qwen2.5-1.5B q4 diverged from ar at token 10 with a 0.07 logit gap), so quantized attention runs on one
    thread whatever the caller's count."""


    import mirrorsd.model as model_module

    hf = tiny_hf("qwen2", vocab=64, layers=1, hidden=1536, std=0.02)  # Qwen2.5-1.5B's 12 heads × 128, 2 KV heads
    hf.config.num_attention_heads, hf.config.num_key_value_heads = 12, 2
    hf = type(hf)(hf.config).eval()
    model = row_exact(hf)
    ids = torch.randint(0, 64, (1, 301), generator=torch.Generator().manual_seed(0))

    for block in model.layers:  # the Python path, whose o_proj input is observable (the block kernel's equals it)
        block.use_kernel = False
    seen = []  # what attention hands to o_proj: int8 quantization there may round a 1e-8 difference either way
    model.layers[0].self_attn.o_proj.register_forward_hook(lambda module, args, out: seen.append(args[0].clone()))

    def decode(threads: int) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.inference_mode():
                cache = model.new_cache(capacity=320)
                model.prefill(ids[:, :-1], cache)
                model(ids[:, -1:], cache=cache)
                return seen[-1]
        finally:
            torch.set_num_threads(before)

    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores")
    assert torch.equal(decode(1), decode(2))
    monkeypatch.setattr(model_module, "_one_thread", contextlib.nullcontext)
    if torch.equal(decode(1), decode(2)):
        pytest.skip("this CPU's SDPA happens to give the same bits at 1 and 2 threads: the test has no power here")


def test_the_draft_worker_runs_with_the_callers_settings():
    """cuda_graphs and batch_invariance are context variables, which a pool's thread does not inherit: with
    ``graphs`` the worker ran with the defaults, not "as the caller has them"."""
    from mirrorsd import cuda_graphs as graphs
    from mirrorsd.linear import _INVARIANT, batch_invariance
    from mirrorsd.runtime.executors import WorkerExecutor

    worker = WorkerExecutor("threads", torch.device("cpu"), None, None, graphs=True)
    try:
        with graphs.cuda_graphs(False), batch_invariance(False):
            assert worker.submit(lambda: (graphs.enabled(), _INVARIANT.get())).result() == (False, False)
        with graphs.cuda_graphs(True):
            assert worker.submit(graphs.enabled).result() is True
    finally:
        worker.close()


@pytest.mark.parametrize("backend, refused", [("threads", True), ("serial", False), ("processes", False)])
def test_a_self_draft_on_a_sharded_target_needs_no_shared_group(backend, refused):
    """A self-draft shares the sharded target's blocks: a worker thread would run its all-reduces beside the
    target's on one group. The processes backend's draft rank builds its own, so it stays allowed (a documented
    torchrun command was refused)."""
    from mirrorsd.decoding import get_method

    opts = get_method("mirror").options.parse({"backend": backend, "roots": "paper"}, "mirror")
    if refused:
        with pytest.raises(ValueError, match="use backend='serial'"):
            opts.check_tensor_parallel(self_draft=True)
    else:
        opts.check_tensor_parallel(self_draft=True)


@pytest.mark.parametrize("acceptance", ["rejection", "match"])
def test_a_branch_drafts_the_window_vanilla_sd_would_start_after_its_root(exact_pair, acceptance):
    """A branch rooted at P drafts the window that starts at P + 1: vanilla SD's window there, token for token, under
    both rules (the paper's parity, App. B). Under speculative sampling that is not the draft's last window's
    continuation through P, whose draw at P + 1 was discarded (its noise is not reused); coupled, it is."""
    from mirrorsd.decoding.engine import DecodeRequest, GenerationStats, RequestState
    from mirrorsd.decoding.mirror.draft import LocalDraft, fresh_proposer
    from mirrorsd.decoding.mirror.options import MirrorOptions
    from mirrorsd.sampling import SamplingParams

    target, draft = exact_pair
    prompt, differs = [3, 1, 4, 1, 5], []

    def state_of(text: list[int], params: SamplingParams) -> RequestState:
        request = DecodeRequest(target, text, 32, params, GenerationStats("mirror"), draft)
        state = RequestState(request, list(text), target.new_cache(), draft.new_cache(capacity=64), text[-1:])
        draft.prefill(torch.tensor([text[:-1]]), state.draft_cache)
        return state

    for seed in range(8):
        params = SamplingParams(temperature=1.5, seed=seed)
        opts = MirrorOptions(gamma=3, confidence=0.0, acceptance=acceptance)
        side = LocalDraft(None, fresh_proposer(draft, target.config.vocab_size, params, opts))  # (no run)
        window = side.proposer.propose(state_of(prompt, params)).tokens  # drafted from P = len(prompt)
        tree = side._rollout(state_of(prompt, params), len(prompt), 0, prompt[-1:], [(0, window[0])], 3)
        branch = list(tree.tokens[0])
        assert branch == side.proposer.propose(state_of([*prompt, window[0]], params)).tokens  # SD's next window
        differs.append(branch[0] != window[1])
    assert any(differs) if acceptance == "rejection" else not any(differs)

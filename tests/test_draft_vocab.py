"""Reduced-vocabulary drafts: the subset head, losslessness (greedy equality and the target's distribution under
rejection sampling, with the draft's mass confined to the subset), and the shipped tables."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from mirrorsd import Transformer, generate
from mirrorsd import draft_vocab as dv
from mirrorsd import vocab_tables as vt
from mirrorsd.decoding.engine import DecodeRequest, GenerationStats, new_state
from mirrorsd.decoding.proposers import ModelProposer, StreamProposer
from mirrorsd.sampling import SamplingParams
from mirrorsd.verify import Verdict
from tests.helpers import exact_pair_distribution, random_adapters, row_exact, tiny_hf


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """Frequency tables for the random models' vocabularies (a fixed shuffle: any ranking is a valid table)."""
    for vocab in (8, 64):
        torch.save(torch.randperm(vocab, generator=torch.Generator().manual_seed(vocab)).int(),
                   tmp_path / f"vocab{vocab}.pt")
    monkeypatch.setattr(dv, "table_path", lambda vocab, kind="corpus": tmp_path / dv.TABLE_FILES[kind].format(vocab))
    return tmp_path


@pytest.fixture
def draft_tables(tables):
    """Draft tables next to the corpus ones, ranked differently (the reversed corpus ranking)."""
    for vocab in (8, 64):
        torch.save(dv.load_table(vocab).flip(0), tables / f"draft{vocab}.pt")


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
    monkeypatch.setattr(dv, "table_path", lambda vocab, kind="corpus": tmp_path / "none.pt")
    with pytest.raises(FileNotFoundError, match="python -m mirrorsd.vocab_tables"):
        dv.load_table(64)
    with pytest.raises(FileNotFoundError, match="--answers-of"):
        dv.load_table(64, "draft")


def test_drafts_read_the_draft_table_where_one_ships(draft_tables):
    """A reduced draft takes its ids from the draft table (ranked by the target's answers); the exits and streams
    keep the corpus table they were trained on."""
    target = row_exact(tiny_hf(layers=4, seed=1))
    draft = row_exact(tiny_hf(layers=2, seed=2))
    assert dv.draft_table_kind(64) == "draft" and dv.draft_table_kind(96) == "corpus"
    proposer = ModelProposer(draft, 64, SamplingParams(), 6, vocab=8)
    assert set(proposer.subset.ids.tolist()) == set(dv.load_table(64, "draft")[:8].tolist())
    assert set(dv.optional_head(target, 8).ids.tolist()) == set(dv.load_table(64)[:8].tolist())
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = generate(target, prompt, method="ar", max_new_tokens=24).token_ids
    assert generate(target, prompt, method="sd", draft=draft, max_new_tokens=24, draft_vocab=8).token_ids == want


def test_answers_rank_the_draft_table(monkeypatch):
    """Tokens the target says rise above corpus-frequent ones it never says; special tokens stay first."""

    class Tokenizer:
        all_special_ids = [7]

    corpus = Counter({0: 100, 1: 90, 2: 80, 3: 5})
    table = vt.ranked(vt.merged_counts(corpus, [[3, 3, 4], [3]], weight=1.0), Tokenizer(), 8)
    # the answers (4 tokens) weigh as much as the corpus (275): each said token counts 275 / 4
    assert table.tolist() == [7, 3, 0, 1, 2, 4, 5, 6]
    assert vt.ranked(corpus, Tokenizer(), 8).tolist() == [7, 0, 1, 2, 3, 4, 5, 6]


def test_shipped_draft_table_keeps_everyday_words_the_corpus_table_drops():
    """The zoo's draft table (corpus + English word frequencies + the 1.5B's answers) holds the prose tokens chat
    answers use, which the library-source corpus table ranks below 32k."""
    words = [3607, 3220, 2932, 7589, 19828]  # Qwen2.5's ids of ' food', ' money', ' She', ' Tuesday', ' flour'
    corpus, draft = (set(dv.load_table(151936, kind)[:32768].tolist()) for kind in ("corpus", "draft"))
    assert not set(words) <= corpus and set(words) <= draft


def test_shipped_prompts_are_ours_not_spec_bench_and_no_prompt_is_in_two_sets():
    from mirrorsd.specbench import load_questions

    theirs = {turn for q in load_questions() for turn in q.turns}
    seen: set[str] = set()
    for prompt_set in vt.PROMPT_SETS:
        ours = vt.prompts(prompt_set)
        assert len(ours) >= 100 and all(p["prompt"] and p["category"] for p in ours)
        texts = {p["prompt"] for p in ours}
        assert len(texts) == len(ours) and not theirs & texts and not seen & texts
        seen |= texts


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
    exact = exact_pair_distribution(target, prompt, 1.0).flatten()
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


@pytest.mark.parametrize("method", ["sd", "mirror"])
def test_an_ss_draft_with_a_reduced_vocabulary_proposes_the_ar_drafts_windows(tables, method):
    """``draft_vocab`` with ``draft_streams``: the passes' main rows read the reduced head the AR draft's steps read,
    so the SS draft still proposes the AR draft's windows (the same acceptance, fewer forwards), and only subset ids:
    greedy (with the confidence rule too: it reads the same top probabilities), sample-and-match and rejection
    sampling; Mirror-SD's branch rollouts and fresh windows alike."""
    target, draft = row_exact(tiny_hf(layers=4, seed=1)), row_exact(tiny_hf(layers=2, seed=2))
    adapters = random_adapters(draft, streams=3, layers=1, std=0.1)
    allowed = set(dv.load_table(64)[:8].tolist())
    options = ({"gamma": 5, "kappa": 2, "roots": "paper", "backend": "serial"} if method == "mirror"
               else {"gamma": 6, "suffix_match": 0, "draft_context": 0})
    for temperature, acceptance, confidence in ((0.0, "match", 0.0), (0.0, "match", 0.3), (1.0, "match", 0.0),
                                                (1.0, "rejection", 0.0)):
        kwargs = {"temperature": temperature, "seed": 5, "max_new_tokens": 32, "confidence": confidence, "draft": draft,
                  "draft_vocab": 8, "acceptance": acceptance, **options}
        plain = generate(target, [7, 8, 9], method=method, **kwargs)
        got = generate(target, [7, 8, 9], method=method, draft_streams=adapters, **kwargs)
        if acceptance == "match":
            assert got.token_ids == plain.token_ids == generate(
                target, [7, 8, 9], method="ar", temperature=temperature, seed=5, max_new_tokens=32).token_ids
        assert got.token_ids == plain.token_ids and got.stats.accepted == plain.stats.accepted
        assert got.stats.drafted == plain.stats.drafted and got.stats.draft_forwards <= plain.stats.draft_forwards
        if method == "mirror":
            m, p = got.stats.extra["mirror"], plain.stats.extra["mirror"]
            assert [(s.hit, s.accepted) for s in m.steps] == [(s.hit, s.accepted) for s in p.steps]
    request = DecodeRequest(target, [7, 8, 9], 8, SamplingParams(), GenerationStats("sd"), draft)
    window = StreamProposer(draft, adapters, 64, SamplingParams(), 6, vocab=8).propose(new_state(request))
    assert len(window.tokens) == 6 and set(window.tokens) <= allowed


# -- restricted heads beyond the draft: the early exit and the streams (compute only the rows they read) --------


def test_subset_head_columns_map_back_to_token_ids(tables):
    model = row_exact(tiny_hf(layers=2, seed=1))
    head = dv.subset_head(model, 16)
    assert dv.subset_head(model, 16) is head  # built once per model and size, shared by every request
    normed = model.norm(torch.randn(3, model.config.hidden_size))
    sub = head(normed)
    assert sub.shape == (3, 16)  # only the subset's rows are computed
    assert torch.equal(head.full(normed)[:, head.ids], sub)
    assert torch.equal(head.index[head.ids], torch.arange(16)) and (head.index >= 0).sum() == 16
    logprobs, ids = dv.top_tokens(sub, head.ids, 4)
    want = head.full(normed).log_softmax(-1).topk(4, dim=-1)
    assert torch.equal(ids, want.indices) and torch.allclose(logprobs, want.values)


def test_a_model_keeps_a_few_subset_heads_not_one_per_size_ever_asked(tables):
    """A server's clients may send any draft_vocab / exit_vocab / stream_vocab: each new size built a head that was
    kept for the life of the process (18 MB a size on SmolLM2, 734 MB after 40 sizes in a review's run)."""
    model = row_exact(tiny_hf(layers=2, seed=1))
    often = dv.subset_head(model, 16)
    for size in range(2, 40):
        dv.subset_head(model, size)
        assert dv.subset_head(model, 16) is often  # the one in use stays
    assert dv._HEADS.held(model) == dv.KEPT_HEADS


def test_subset_heads_asked_for_by_many_threads_at_once(tables):
    """A server's requests ask for heads at once: one's eviction between another's lookup and read was a KeyError
    (18 in 24,688 calls of 4 threads in a review's run), a 500 to the client."""
    import sys
    import threading
    import time

    model = row_exact(tiny_hf(layers=2, seed=1))
    errors, sizes, until = [], [8, 12, 16, 20, 24, 28, 32], time.perf_counter() + 3.0
    start = threading.Barrier(4)

    def ask(i: int) -> None:
        start.wait()
        while time.perf_counter() < until:
            size = sizes[i % len(sizes)]
            i += 1
            try:
                assert len(dv.subset_head(model, size).ids) == size
            except Exception as error:  # noqa: BLE001 (any of them is the defect)
                errors.append(repr(error))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (threads switch often: the race shows in seconds, not minutes)
    try:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert dv._HEADS.held(model) <= dv.KEPT_HEADS


def test_optional_head_defaults_to_the_full_vocabulary_where_no_larger_table_ships(tables, monkeypatch):
    model = row_exact(tiny_hf(layers=2, seed=1))  # vocabulary 64, smaller than the 32k default
    assert dv.optional_head(model, None) is None and dv.optional_head(model, 0) is None
    assert dv.optional_head(model, 64) is None and len(dv.optional_head(model, 16).ids) == 16
    monkeypatch.setattr(dv, "DEFAULT_SIZE", 32)
    assert len(dv.optional_head(model, None).ids) == 32
    other = row_exact(tiny_hf(vocab=96, layers=1, seed=1))  # no table for a 96-token vocabulary
    assert dv.optional_head(other, None) is None
    with pytest.raises(FileNotFoundError, match="python -m mirrorsd.vocab_tables"):
        dv.optional_head(other, 16)


def test_greedy_reduced_drafts_propose_only_subset_ids(tables):
    target = row_exact(tiny_hf(layers=4, seed=1))
    draft = row_exact(tiny_hf(layers=2, seed=2))
    request = DecodeRequest(target, [3, 1, 4, 1, 5], 8, SamplingParams(), GenerationStats("sd"), draft)
    proposer = ModelProposer(draft, 64, SamplingParams(), 6, vocab=8)
    window = proposer.propose(new_state(request))
    allowed = set(dv.load_table(64)[:8].tolist())
    assert len(window.tokens) == 6 and set(window.tokens) <= allowed
    full = generate(draft, [3, 1, 4, 1, 5], method="ar", max_new_tokens=1).token_ids[0]
    if full in allowed:  # the subset's argmax is the full row's argmax whenever the latter is in the subset
        assert window.tokens[0] == full


def test_mirror_with_a_restricted_exit_equals_ar_and_reads_subset_candidates(tables):
    from mirrorsd.decoding.mirror import early_exit

    target = row_exact(tiny_hf(layers=4, seed=1))
    draft = row_exact(tiny_hf(layers=2, seed=2))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for sampling in ({}, {"temperature": 0.9, "seed": 4}):
        want = generate(target, prompt, method="ar", max_new_tokens=24, **sampling).token_ids
        for vocab in (0, 8, 32):
            got = generate(target, prompt, method="mirror", draft=draft, max_new_tokens=24, kappa=4, gamma=3,
                           budget=2, exit_vocab=vocab, **sampling)  # (the serial backend's fitted budget is 0)
            assert got.token_ids == want and sum(s.roots for s in got.stats.extra["mirror"].steps) > 0
    message = early_exit(target, torch.randn(1, 3, target.config.hidden_size), 4, SamplingParams(),
                         head=dv.subset_head(target, 8))
    allowed = set(dv.load_table(64)[:8].tolist())
    assert all(len(row) == 4 and set(row) <= allowed for row in message.ids)
    with pytest.raises(ValueError, match="exit_vocab"):
        generate(target, prompt, method="mirror", draft=draft, exit_vocab=-1)


def test_ss_with_restricted_stream_heads_equals_ar_and_keeps_edges_they_cannot_score(tables):
    from mirrorsd.decoding.streams import passes as streaming
    from tests.helpers import random_adapters

    model = row_exact(tiny_hf(layers=4, seed=1))
    adapters = random_adapters(model, layers=2)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for sampling in ({}, {"temperature": 0.9, "seed": 4}):
        want = generate(model, prompt, method="ar", max_new_tokens=20, **sampling).token_ids
        for vocab in (0, 8):
            got = generate(model, prompt, method="ss", streams=adapters, max_new_tokens=20, tree_k=2,
                           threshold=0.01, stream_vocab=vocab, **sampling)
            assert got.token_ids == want
    head = adapters.head(model, 8)
    inside = head.ids.tolist()
    outside = [t for t in range(64) if t not in inside]
    with torch.inference_mode():
        cache = model.new_cache()
        model.prefill(torch.tensor([[1, 2, 3]]), cache)
        tree = streaming.guess_tree([[inside[0], outside[0]], [inside[1], outside[1]]])
        kept = {}
        for name, which in (("full", None), ("restricted", head)):
            forward = streaming.fused_forward(model, adapters, cache, [4], tree, threshold=1e-6, head=which)
            kept[name] = {tree.tokens[i - 1] for i in forward.kept[1:]}
            cache.truncate(3)
    assert outside[0] in kept["full"]
    # the restricted exit scores only its ids; an edge it cannot score stays (only a suffix chain holds such tokens)
    assert inside[0] in kept["restricted"] and {outside[0], outside[1]} <= kept["restricted"]
    candidates = streaming.next_guesses(model, adapters, forward, Verdict(0, 0), 3, head)
    assert all(len(row) == 3 and set(row) <= set(inside) for row in candidates.tokens)


def test_answers_resume_past_a_line_cut_short(tmp_path, monkeypatch):
    """The answers file is appended a line per prompt; a kill mid-line left one json.loads refused on every later
    run. Such a line is skipped (its prompt answered again), the rest kept."""
    import json

    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path))
    rows = vt.prompts()
    path = tmp_path / "draft_vocab" / "answers-m-8.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps({**r, "answer_ids": [i]}) + "\n" for i, r in enumerate(rows))
                    + '{"prompt": "cut sho', encoding="utf-8")
    monkeypatch.setattr("mirrorsd.api.load_model", lambda name: pytest.fail("every prompt was answered already"))
    assert vt.answers_of("m", 8) == [[i] for i in range(len(rows))]


def test_local_models_of_one_folder_name_keep_their_answers_apart(tmp_path, monkeypatch):
    """Answers were cached under the folder's name alone: run-a/model and run-b/model shared one file, and each
    trained on the other's answers."""
    a, b = tmp_path / "run-a" / "model", tmp_path / "run-b" / "model"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    assert vt.answers_key(str(a)) != vt.answers_key(str(b)) and vt.answers_key(str(a)).startswith("model-")
    assert vt.answers_key(str(a)) == vt.answers_key(str(tmp_path / "run-a" / ".." / "run-a" / "model"))
    assert vt.answers_key("qwen2.5-coder-1.5b") == "qwen2.5-coder-1.5b"  # (a zoo name: the shipped caches' names)
    (tmp_path / "smollm2-135m").mkdir()  # a fine-tune saved under a zoo name: the name still loads the zoo model
    monkeypatch.chdir(tmp_path)
    assert vt.answers_key("smollm2-135m") == "smollm2-135m" != vt.answers_key("./smollm2-135m")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert vt.answers_key("~/run-a/model") == vt.answers_key(str(a)) != vt.answers_key("~/run-b/model")

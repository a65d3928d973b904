"""Speculative Streaming: MSA masks, the frozen-main guarantee, ``ss`` equal to ``ar`` (random and real models),
pruning, KV compaction, the SS draft inside Mirror-SD, training and the shipped adapters."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mirrorsd
from mirrorsd import Transformer, generate, kernels
from mirrorsd.decoding.engine import DecodeRequest, GenerationStats, Proposal, RequestState
from mirrorsd.decoding.proposers import ModelProposer, StreamProposer
from mirrorsd.decoding.streams import passes as streaming
from mirrorsd.decoding.streams.adapters import StreamAdapters, StreamConfig, load_adapters, msa_mask, shipped_adapter
from mirrorsd.exit_heads import ExitTranslators, tuned_exit
from mirrorsd.kv_cache import KVCache
from mirrorsd.sampling import SamplingParams
from tests.helpers import HostReads, assert_same_or_near_tie, random_adapters, requires_smollm2, row_exact, tiny_hf


@pytest.fixture(scope="module")
def exact_model() -> Transformer:
    return row_exact(tiny_hf(layers=4, seed=1))


@pytest.fixture(scope="module")
def dense_model() -> Transformer:
    return Transformer.from_hf(tiny_hf(layers=4, seed=1))


# -- masks and trees -------------------------------------------------------------------------------------------


def test_tree_is_the_cartesian_product_with_ancestor_mask():
    tokens, parents, depths = streaming.build_tree([7], [[1, 2], [3, 4], [5, 6]])
    assert len(tokens) == 1 + 2 + 4 + 8
    assert tokens[:3] == [7, 1, 2] and parents[:3] == [-1, 0, 0]
    assert [tokens[i] for i in range(3, 7)] == [3, 4, 3, 4] and parents[3:7] == [1, 1, 2, 2]
    assert depths == [0, 1, 1, 2, 2, 2, 2] + [3] * 8
    anc = streaming.ancestors(parents)
    leaf = 7  # under node 3, under node 1, under the root
    assert anc[leaf].nonzero().flatten().tolist() == [0, 1, 3, 7]
    # A trunk of committed tokens is a chain the tree hangs from.
    tokens, parents, depths = streaming.build_tree([4, 5, 6], [[1, 2]])
    assert tokens == [4, 5, 6, 1, 2] and parents == [-1, 0, 1, 2, 2] and depths == [0, 1, 2, 3, 3]


def test_budget_tree_keeps_the_most_likely_nodes_parents_first():
    lp = math.log
    candidates = streaming.StreamGuesses([[1, 2], [3, 4], [5, 6]], [[lp(0.6), lp(0.4)], [lp(0.9), lp(0.1)],
                                                                  [lp(0.5), lp(0.5)]])
    def paths(draft: Proposal) -> set[tuple[int, ...]]:
        def path(node: int) -> tuple[int, ...]:
            parent = draft.parents[node]
            return (*(path(parent) if parent >= 0 else ()), draft.tokens[node])
        return {path(node) for node in range(len(draft.tokens))}

    assert candidates.tree(3, 0) == streaming.guess_tree(candidates.tokens)
    whole = candidates.tree(3, 20)  # the whole tree fits: the same 14 nodes, most likely first
    assert len(whole.tokens) == 14 and paths(whole) == paths(streaming.guess_tree(candidates.tokens))
    assert candidates.tree(2, 0) == streaming.guess_tree(candidates.tokens[:2])
    # Path probabilities: 1 .6, 1-3 .54, 2 .4, 2-3 .36, 1-3-5 .27, 1-3-6 .27, 2-3-5 .18, ...
    tree = candidates.tree(3, 5)
    assert tree.tokens == [1, 3, 2, 3, 5] and tree.parents == [-1, 0, -1, 2, 1]
    tree = candidates.tree(3, 4)
    assert tree.tokens == [1, 3, 2, 3] and tree.parents == [-1, 0, -1, 2]
    assert candidates.tree(1, 1) == Proposal([1], [-1])
    assert candidates.tree(0, 3) == Proposal([], [])
    assert streaming.StreamGuesses().tree(3, 3).tokens == []


def test_msa_mask_streams_see_their_node_ancestors_and_lower_streams_only():
    anc = streaming.ancestors([-1, 0, 0])  # root with two children
    mask = msa_mask(anc, past=2, streams=2)[0]
    m, gamma = 3, 2
    assert mask.shape == (m + m * gamma, 2 + m + m * gamma)
    assert mask[:, :2].all()  # the cache
    main = mask[:m]
    assert torch.equal(main[:, 2:2 + m], anc) and not main[:, 2 + m:].any()  # v1: main sees no stream
    stream = lambda node, j: mask[m + node * gamma + j - 1]  # noqa: E731
    # Stream (2, 1) sees the root and node 2 (not its sibling), itself, and no other stream.
    assert stream(2, 1)[2:2 + m].tolist() == [True, False, True]
    assert stream(2, 1)[2 + m:].nonzero().flatten().tolist() == [2 * gamma]
    # Stream (2, 2) also sees stream (2, 1); stream (1, 2) sees streams (1, 1..2) only.
    assert stream(2, 2)[2 + m:].nonzero().flatten().tolist() == [2 * gamma, 2 * gamma + 1]
    assert stream(1, 2)[2 + m:].nonzero().flatten().tolist() == [gamma, gamma + 1]


def test_cache_compaction_moves_only_the_tail():
    model = Transformer.from_hf(tiny_hf(layers=2))
    cache = model.new_cache(capacity=4)
    for layer in range(2):
        keys = torch.arange(10.0).view(1, 1, 10, 1).expand(1, cache.keys[0].shape[1], 10, cache.keys[0].shape[3])
        cache.append(layer, keys, keys + 100)
    cache.compact(3, [0, 4, 6], range(1))
    cache.compact(3, [1], range(1, 2))
    assert cache.lengths == [6, 4]
    assert cache.keys[0][0, 0, :6, 0].tolist() == [0, 1, 2, 3, 7, 9]
    assert cache.values[1][0, 0, :4, 0].tolist() == [100, 101, 102, 104]
    with pytest.raises(IndexError):
        cache.compact(3, [5], range(1, 2))


# -- the frozen-main guarantee -----------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["exact", "dense"])
def test_main_logits_identical_with_and_without_streams(which, exact_model, dense_model):
    """Main rows use the base weights and never attend to streams, so adding streams (with random adapters)
    cannot change the target's own logits: bit for bit on the row-exact model, to float reordering on fp32."""
    model = exact_model if which == "exact" else dense_model
    adapters = random_adapters(model)
    ids = torch.tensor([[3, 9, 27, 14, 5, 60, 2, 33]])
    n, gamma, split = ids.shape[1], adapters.config.streams, adapters.first_layer
    with torch.inference_mode():
        plain = model(ids)[0]
        positions = torch.arange(n)[None]
        hidden = model.run_layers(model.embed(ids), positions, None, None, 0, split)
        x = adapters.insert(hidden)
        pos = torch.cat([positions[0], positions[0].repeat_interleave(gamma)])[None]
        mask = msa_mask(torch.ones(n, n, dtype=torch.bool).tril(), 0, gamma)
        out = model.run_layers(x, pos, None, mask, split, None, streams=adapters.rows(n * gamma))
        with_streams = model.logits(out[0, :n])
        stream_logits = model.logits(out[0, n:])
    if which == "exact":
        assert torch.equal(with_streams, plain)
    else:
        torch.testing.assert_close(with_streams, plain, rtol=0, atol=1e-5)
    assert not torch.allclose(stream_logits[::gamma], plain, atol=1e-2)  # the streams did change


def _python_blocks_too(model: Transformer, first: int, run: Callable[[], tuple[torch.Tensor, KVCache]]
                       ) -> tuple[list[int], tuple[torch.Tensor, KVCache], tuple[torch.Tensor, KVCache]]:
    """``run`` with the top layers in the C++ blocks (counting ``stream_blocks_forward`` calls), then in Python."""
    top, calls = list(model.layers)[first:], []
    real = torch.ops.mirrorsd.stream_blocks_forward.default
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.ops.mirrorsd.stream_blocks_forward, "default",
                          lambda *args: calls.append(args[-1]) or real(*args))
            fused = run()
            for block in top:
                block.use_kernel = False
            python = run()
    finally:
        for block in top:
            block.use_kernel = True
    return calls, fused, python


def _same_cache(a: KVCache, b: KVCache) -> bool:
    return a.lengths == b.lengths and all(
        torch.equal(x[layer][:, :, :length], y[layer][:, :, :length])
        for layer, length in enumerate(a.lengths) for x, y in ((a.keys, b.keys), (a.values, b.values)))


@pytest.mark.skipif(not kernels.available(), reason="needs the C++ CPU kernels")
@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_stream_rows_in_the_cpp_blocks_give_the_python_blocks_bits(exact_model, threshold):
    """The top layers run stream rows inside the C++ blocks (``stream_blocks_forward``: the adapters' deltas added
    after each product, the stream keys and values attended but left out of the cache's length): the same bits as
    the Python blocks, for main and stream rows, and the same cache, with or without pruning."""
    model = exact_model
    adapters = random_adapters(model, streams=2, layers=2, seed=3)
    ids = torch.tensor([[3, 9, 27, 14, 5, 60, 2, 33, 7, 41]])
    tree = Proposal([11, 22, 33, 44], [-1, 0, 0, 1])

    def run() -> tuple[torch.Tensor, KVCache]:
        cache = model.new_cache(capacity=4)  # grows inside the forward, stream rows included
        with torch.inference_mode():
            model.prefill(ids, cache)
            forward = streaming.fused_forward(model, adapters, cache, [ids[0, -1].item()], tree, threshold)
        return forward.out, cache

    calls, (fused, fused_cache), (python, python_cache) = _python_blocks_too(model, adapters.first_layer, run)
    kept = fused.shape[1] // 3  # main rows, then 2 stream rows each
    assert calls == [2 * kept] and (kept < 5) == (threshold > 0)  # one op call; pruning kept fewer of the 5 nodes
    assert torch.equal(fused, python) and _same_cache(fused_cache, python_cache)
    first = adapters.first_layer  # the bottom layers hold every node until compaction, the top ones the kept nodes
    assert fused_cache.lengths == [ids.shape[1] + 5] * first + [ids.shape[1] + kept] * (model.config.n_layers - first)


@pytest.mark.skipif(not kernels.available(), reason="needs the C++ CPU kernels")
@pytest.mark.parametrize("main", [3, 0])
def test_stream_rows_of_two_rows_in_the_cpp_blocks_give_the_python_blocks_bits(exact_model, main):
    """Two rows at once, and a window of stream rows only (as training's evaluation runs them): every row's stream
    rows take their deltas in one product, as peft's modules do (a product's bits can depend on its height)."""
    model = exact_model
    adapters = random_adapters(model, streams=3, layers=2, seed=5)
    first, gamma, past = adapters.first_layer, adapters.config.streams, 6
    ids = torch.randint(0, 64, (2, past + 3), generator=torch.Generator().manual_seed(2))

    def run() -> tuple[torch.Tensor, KVCache]:
        cache = model.new_cache(rows=2, capacity=8)
        with torch.inference_mode():
            model.prefill(ids[:, :past], cache)
            positions = torch.arange(past, past + 3).expand(2, 3)
            hidden = model.run_layers(model.embed(ids[:, past:]), positions, cache, None, 0, first)
            x = adapters.insert(hidden)[:, 3 - main:]
            pos = torch.cat([positions, positions.repeat_interleave(gamma, 1)], 1)[:, 3 - main:]
            mask = msa_mask(torch.ones(3, 3, dtype=torch.bool).tril(), past, gamma)[:, 3 - main:]
            if not main:  # the main rows' keys cached first: the mask's columns are then [cache | stream rows]
                model.run_layers(hidden, positions, cache, None, first, None)
            out = model.run_layers(x, pos, cache, mask, first, None, streams=adapters.rows(3 * gamma))
        return out, cache

    calls, (fused, fused_cache), (python, python_cache) = _python_blocks_too(model, first, run)
    assert calls == [3 * gamma]
    assert torch.equal(fused, python) and _same_cache(fused_cache, python_cache)


# -- ss equals ar ---------------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    streams=st.integers(1, 4),
    layers=st.integers(1, 3),
    tree_k=st.integers(1, 4),
    depth=st.sampled_from([None, 0, 1, 2]),
    threshold=st.sampled_from([0.0, 0.02, 0.2]),
    budget=st.sampled_from([0, 1, 3, 6]),
    temperature=st.sampled_from([0.0, 0.8, 1.5]),
    seed=st.integers(0, 2**31),
    prompt=st.lists(st.integers(0, 63), min_size=1, max_size=10),
    max_new=st.integers(1, 24),
    adapter_seed=st.integers(0, 3),
    defer=st.sampled_from(streaming.DEFER_STREAMS),
)
def test_ss_equals_ar_on_row_exact_models(exact_model, streams, layers, tree_k, depth, threshold, budget,
                                          temperature, seed, prompt, max_new, adapter_seed, defer):
    adapters = random_adapters(exact_model, streams, layers, adapter_seed, std=0.1)
    kwargs = {"temperature": temperature, "seed": seed, "max_new_tokens": max_new}
    want = generate(exact_model, prompt, method="ar", **kwargs)
    got = generate(exact_model, prompt, method="ss", streams=adapters, tree_k=tree_k, depth=depth,
                   threshold=threshold, tree_budget=budget, defer_streams=defer, **kwargs)
    assert got.token_ids == want.token_ids
    x = got.stats.extra["ss"]
    if budget:
        assert max(x.tree_before) <= 1 + budget  # the root and at most ``budget`` nodes below it
    # one forward per pass; the first step's is the prompt's prefill (it runs only the last prompt token's streams)
    assert len(x.committed) == got.stats.target_forwards
    assert sum(x.committed) >= len(got.token_ids)
    assert all(after <= before for before, after in zip(x.tree_before, x.tree_after, strict=True))
    if threshold == 0:
        assert x.tree_after == x.tree_before
    assert all(a <= d for a, d in zip(got.stats.accepted, got.stats.drafted, strict=True))
    rows = max(1, streams if depth is None else min(depth, streams))  # a tree depth deep reads no deeper stream
    assert {s["streams"] for s in got.stats.step_log} <= {0, rows}


def test_ss_equals_ar_on_fp32_up_to_near_ties(dense_model):
    adapters = random_adapters(dense_model, std=0.1)
    for prompt in ([1, 2, 3], [40, 41, 7, 7, 9]):
        want = generate(dense_model, prompt, method="ar", max_new_tokens=32)
        got = generate(dense_model, prompt, method="ss", streams=adapters, max_new_tokens=32, threshold=0.05)
        assert_same_or_near_tie(dense_model, prompt, got.token_ids, want.token_ids)


def test_streams_that_predict_right_are_accepted_and_compaction_keeps_the_exact_cache(exact_model):
    """Tree candidates built from the target's own future tokens are accepted whole (γ+1 tokens per pass), and
    after every pass the cache equals the one a plain prefill of the committed text gives, in every layer."""
    model = exact_model
    adapters = random_adapters(model, streams=3, layers=2)
    prompt = [5, 17, 3, 44]
    future = generate(model, prompt, method="ar", max_new_tokens=30).token_ids
    seq = list(prompt)
    cache = model.new_cache()
    params = SamplingParams()
    with torch.inference_mode():
        model.prefill(torch.tensor([seq[:-1]]), cache)
        done = 0
        candidates: list[list[int]] = []
        while done < 20:
            result = streaming.ss_pass(model, adapters, cache, [seq[-1]], streaming.guess_tree(candidates),
                                        params, tree_k=2)
            new = [*result.accepted, result.next_token]
            assert new == future[done:done + len(new)]
            if candidates:
                assert len(result.accepted) == len(candidates)  # oracle candidates: everything is accepted
            seq += new
            done += len(new)
            # Oracle tree: the true next tokens first, then a decoy in each level.
            candidates = [[future[done + g], (future[done + g] + 1) % 64] for g in range(3)]
            reference = model.new_cache()
            model.prefill(torch.tensor([seq[:-1]]), reference)
            assert cache.lengths == reference.lengths == [len(seq) - 1] * model.config.n_layers
            for layer in range(model.config.n_layers):
                assert torch.equal(cache.keys[layer][:, :, :len(seq) - 1], reference.keys[layer][:, :, :len(seq) - 1])
                assert torch.equal(cache.values[layer][:, :, :len(seq) - 1],
                                   reference.values[layer][:, :, :len(seq) - 1])


def test_zero_threshold_never_prunes_and_a_high_one_keeps_the_root(exact_model):
    adapters = random_adapters(exact_model)
    with torch.inference_mode():
        for threshold, expect_all in ((0.0, True), (0.99, False)):
            cache = exact_model.new_cache()
            exact_model.prefill(torch.tensor([[1, 2, 3]]), cache)
            tree = streaming.guess_tree([[5, 6, 7], [8, 9, 10]])
            forward = streaming.fused_forward(exact_model, adapters, cache, [4], tree, threshold=threshold)
            assert forward.nodes == 13
            kept = len(forward.kept)
            assert (kept == 13) is expect_all and kept >= 1
            assert len(forward.draft.tokens) == kept - 1 == forward.main_logits.shape[0] - 1


def test_pruning_keeps_an_edge_its_restricted_vocabulary_cannot_score(exact_model):
    """Only a suffix chain's tokens can lie outside the vocabulary the streams guess from; the exit cannot score
    them, and a rare token copied from the context is what a suffix match is for, so pruning keeps them."""
    from mirrorsd.draft_vocab import SubsetHead

    model = exact_model
    adapters = random_adapters(model)
    head = SubsetHead(model.lm_head, model.embed_tokens.weight, torch.arange(0, 40), model.config.tie_word_embeddings)
    chain = Proposal([50, 51, 7], [-1, 0, 1])  # 50 and 51 outside the 40 ids, then 7 inside
    with torch.inference_mode():
        cache = model.new_cache()
        model.prefill(torch.tensor([[1, 2, 3]]), cache)
        forward = streaming.fused_forward(model, adapters, cache, [4], chain, threshold=0.99, head=head)
    assert forward.draft.tokens == [50, 51]  # unscored edges stay; the exit's unlikely in-vocabulary one goes


def test_a_tuned_prune_exit_scores_the_edges_and_keeps_ss_equal_to_ar(exact_model, tmp_path):
    """``prune_exit=FOLDER``: the tuned exit's translator at layer N - N_s scores tree edges instead of the
    pruning adapter. A translator with zero weights sends every state to its bias, so every parent has the same
    exit distribution and a threshold between two tokens' probabilities keeps exactly the likelier one."""
    adapters = random_adapters(exact_model)
    d, layer = exact_model.config.hidden_size, adapters.first_layer
    bias = torch.randn(d, generator=torch.Generator().manual_seed(5))
    ExitTranslators({layer: torch.cat([torch.zeros(d, d), bias[None]])}, {}).save(tmp_path / "exit")
    probs = exact_model.logits(bias[None]).softmax(-1)[0]
    likely, unlikely = int(probs.argmax()), int(probs.argmin())
    translate = tuned_exit(exact_model, str(tmp_path / "exit"), layer, "prune_exit")
    with torch.inference_mode():
        cache = exact_model.new_cache()
        exact_model.prefill(torch.tensor([[1, 2, 3]]), cache)
        tree = streaming.guess_tree([[unlikely, likely]])
        threshold = float(probs[likely] + probs[unlikely]) / 2
        forward = streaming.fused_forward(exact_model, adapters, cache, [4], tree, threshold, prune_exit=translate)
    assert [tree.tokens[i - 1] for i in forward.kept[1:]] == [likely]
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for sampling in ({}, {"temperature": 0.9, "seed": 4}):
        want = generate(exact_model, prompt, method="ar", max_new_tokens=20, **sampling).token_ids
        got = generate(exact_model, prompt, method="ss", streams=adapters, max_new_tokens=20, tree_k=2,
                       threshold=0.01, prune_exit=str(tmp_path / "exit"), **sampling)
        assert got.token_ids == want
    ExitTranslators({1: torch.cat([torch.eye(d), torch.zeros(1, d)])}, {}).save(tmp_path / "other")
    with pytest.raises(ValueError, match=f"not layer {layer}; ss prunes at layer N - N_s = {layer}: fit one with "
                                         f"`mirrorsd train-exit --layers {layer}`"):  # a translator for another layer
        generate(exact_model, prompt, method="ss", streams=adapters, prune_exit=str(tmp_path / "other"))
    with pytest.raises(ValueError, match="prune_exit=FOLDER"):  # no zoo name, so no shipped exit
        generate(exact_model, prompt, method="ss", streams=adapters, prune_exit="tuned")
    with pytest.raises(ValueError, match="threshold 0 never prunes"):  # the exit would never be read
        generate(exact_model, prompt, method="ss", streams=adapters, prune_exit=str(tmp_path / "exit"), threshold=0)


def test_requests_starting_at_once_share_one_attached_adapter(tmp_path, monkeypatch):
    """Two requests that start together (a server's batch) get one copy of the adapter: a batched call takes the
    stream rows of one adapter only, and two copies attached at once failed both requests. (The file's read is slowed
    so that every thread is inside the attach at once.)"""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import safetensors.torch

    model = Transformer.from_hf(tiny_hf(layers=4, seed=5))
    random_adapters(model).save(tmp_path)
    read = safetensors.torch.load_file
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: (time.sleep(0.2), read(*a, **k))[1])
    with ThreadPoolExecutor(8) as pool:
        loaded = list(pool.map(lambda _: load_adapters(model, tmp_path), range(8)))
    assert all(a is loaded[0] for a in loaded)


def test_ss_bad_options_and_missing_adapters(exact_model, tmp_path):
    adapters = random_adapters(exact_model)
    for bad in ({"tree_k": 0}, {"threshold": 1.0}, {"depth": -1}, {"beam": 2}):
        with pytest.raises(ValueError):
            generate(exact_model, [1, 2], method="ss", streams=adapters, **bad)
    with pytest.raises(ValueError, match="no shipped stream adapter"):
        generate(exact_model, [1, 2], method="ss")
    with pytest.raises(FileNotFoundError, match="train-streams"):
        generate(exact_model, [1, 2], method="ss", streams=str(tmp_path))
    adapters.save(tmp_path / "a")
    other = Transformer.from_hf(tiny_hf(layers=5, seed=3))
    with pytest.raises(ValueError, match="trained for"):
        load_adapters(other, tmp_path / "a")
    with pytest.raises(ValueError, match="does not use a draft"):
        generate(exact_model, [1, 2], method="ss", streams=adapters, draft=exact_model)


def test_saved_adapter_round_trips(exact_model, tmp_path):
    adapters = random_adapters(exact_model)
    adapters.save(tmp_path)
    loaded = load_adapters(exact_model, tmp_path)
    for key, value in adapters.adapter_state().items():
        torch.testing.assert_close(loaded.adapter_state()[key], value.half().float())  # stored as fp16
    assert load_adapters(exact_model, str(tmp_path)) is loaded  # attached once per model and file
    retrained = random_adapters(exact_model, seed=1)
    retrained.save(tmp_path)  # a new file version is attached afresh
    reloaded = load_adapters(exact_model, tmp_path)
    assert reloaded is not loaded and load_adapters(exact_model, tmp_path) is reloaded
    assert len(mirrorsd.decoding.streams.adapters._ATTACHED[exact_model]) == 1  # the stale one replaced
    for key, value in retrained.adapter_state().items():
        torch.testing.assert_close(reloaded.adapter_state()[key], value.half().float())


def test_the_kept_weight_lists_follow_a_changed_b(exact_model):
    """The C++ stream blocks' weight lists are kept between passes; training (an in-place step on B) must not leave
    them stale."""
    adapters = random_adapters(exact_model)
    layers = range(adapters.first_layer, exact_model.config.n_layers)
    first = adapters.weight_lists(layers)
    assert adapters.weight_lists(layers) is first  # kept
    one = [adapters.weights(layer, name) for layer in layers for name in mirrorsd.execution.PROJECTIONS]
    assert all(torch.equal(b, w[1]) for b, w in zip(first[1], one, strict=True))
    b = adapters.lora[f"{adapters.first_layer}_v_proj"].lora_B["default"].weight
    with torch.no_grad():
        b.add_(1.0)
    again = adapters.weight_lists(layers)
    assert again is not first and torch.equal(again[1][2], b.t())  # (v_proj: the third projection)


def test_an_adapter_made_under_inference_mode_decodes(exact_model):
    """Code that wraps everything in ``torch.inference_mode()`` attaches the adapter there too: its tensors then keep
    no version counter, which the kept copies of B must not ask for."""
    want = generate(exact_model, [5, 6, 7], method="ar", max_new_tokens=12).token_ids
    with torch.inference_mode():
        adapters = random_adapters(exact_model, std=0.1)
        layers = range(adapters.first_layer, exact_model.config.n_layers)
        assert adapters.weight_lists(layers) is adapters.weight_lists(layers)
        got = generate(exact_model, [5, 6, 7], method="ss", streams=adapters, max_new_tokens=12)
    assert got.token_ids == want


def test_a_warm_start_may_grow_n_s_keeping_the_saved_layers(exact_model, tmp_path):
    from mirrorsd.train_streams import warm_start

    saved = random_adapters(exact_model, layers=2)
    saved.save(tmp_path)
    cfg = exact_model.config
    deeper = StreamAdapters(exact_model, StreamConfig(streams=3, layers=3, hidden_size=cfg.hidden_size,
                                                      n_layers=cfg.n_layers, vocab_size=cfg.vocab_size))
    fresh = {k: v.detach().clone() for k, v in deeper.adapter_state().items()}
    warm_start(exact_model, deeper, tmp_path)
    got, kept = deeper.adapter_state(), saved.adapter_state()
    assert set(kept) < set(got)
    for key, value in kept.items():  # the saved top layers, embeddings and pruning adapter, as stored (fp16)
        torch.testing.assert_close(got[key], value.half().float())
    new = [k for k in got if k not in kept]
    assert new and all(k.startswith(f"lora.{cfg.n_layers - 3}_") for k in new)
    for key in new:  # the new lowest layer starts as peft initialises it: B = 0, the base layer's own output
        torch.testing.assert_close(got[key], fresh[key])
        if key.endswith(".B"):
            assert not got[key].any()


def test_a_wrong_init_adapter_is_refused_before_the_cache_is_built(exact_model, tmp_path):
    """``--init`` of another rank was refused only once the whole state cache was built (68 s in a review's tiny
    run, hours at scale)."""
    from mirrorsd.train_streams import train

    random_adapters(exact_model, layers=2).save(tmp_path / "init")
    text = tmp_path / "corpus.txt"
    text.write_text("".join(chr(65 + (i * 7) % 29) for i in range(2400)))
    tokenizer = lambda text, add_special_tokens=False: {"input_ids": [ord(c) % 64 for c in text]}  # noqa: E731
    dense = Transformer.from_hf(tiny_hf(layers=4, seed=1))
    with pytest.raises(ValueError, match="--init adapter has streams/rank"):
        train(dense, exact_model, tokenizer, [str(text)], tmp_path / "out", model_name="m", decode_format="fp32",
              rank=4, layers=2, steps=1, chunks=4, seq_len=32, held_out=2, init=tmp_path / "init", progress=False)
    assert not list((tmp_path / "out" / "cache").glob("*.safetensors"))


# -- the SS draft inside Mirror-SD ---------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pending=st.integers(1, 4),
    window=st.integers(1, 9),
    temperature=st.sampled_from([0.0, 1.0]),
    confidence=st.sampled_from([0.0, 0.3]),
    rejection=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_ss_rollout_equals_the_drafts_own_rollout(exact_model, pending, window, temperature, confidence, rejection,
                                                  seed):
    model = exact_model
    adapters = random_adapters(model, streams=3, layers=2, std=0.1)
    seq = [3, 1, 4, 1, 5, 9, 2, 6][: 4 + pending]
    params = SamplingParams(temperature=temperature, seed=seed)
    vocab = model.config.vocab_size
    kw = dict(confidence=confidence, rejection=rejection)
    with torch.inference_mode():
        results: list[tuple[Proposal, int]] = []
        for proposer in (ModelProposer(model, vocab, params, window, **kw),
                         StreamProposer(model, adapters, vocab, params, window, **kw)):
            cache = model.new_cache()
            model.prefill(torch.tensor([seq[: len(seq) - pending]]), cache)
            request = DecodeRequest(model, seq, 64, params, GenerationStats("test"))
            state = RequestState(request, list(seq), model.new_cache(), cache, seq[len(seq) - pending:])
            results.append((proposer.propose(state), len(cache)))
    (plain, plain_len), (streamed, streamed_len) = results
    assert streamed.tokens == plain.tokens and streamed_len == plain_len
    assert (streamed.probs is None) == (plain.probs is None)
    if plain.probs is not None:
        torch.testing.assert_close(streamed.probs, plain.probs)
    assert streamed.forwards <= plain.forwards


@pytest.mark.parametrize("rejection", [True, False])
def test_a_stream_draft_draws_each_window_from_noise_of_its_own_under_rejection(exact_model, rejection):
    """As a plain draft (test_decoding's twin): a window that drafts P + 1 again, over the same text, draws it with
    fresh noise under speculative sampling and with the target's coupled noise under sample-and-match."""
    adapters = random_adapters(exact_model, streams=3, layers=2, std=0.1)
    seq, vocab, differs = [3, 1, 4, 1, 5], exact_model.config.vocab_size, []
    with torch.inference_mode():
        for seed in range(8):
            params = SamplingParams(temperature=1.5, seed=seed)
            windows: list[list[int]] = []
            for text in (seq, None):
                text = text or [*seq, windows[0][0]]  # the first window's first token kept, the rest discarded
                proposer = StreamProposer(exact_model, adapters, vocab, params, 4, rejection=rejection)
                cache = exact_model.new_cache()
                exact_model.prefill(torch.tensor([text[:-1]]), cache)
                request = DecodeRequest(exact_model, text, 64, params, GenerationStats("test"))
                state = RequestState(request, list(text), exact_model.new_cache(), cache, text[-1:])
                windows.append(proposer.propose(state).tokens)
            differs.append(windows[0][1] != windows[1][0])
    assert any(differs) if rejection else not any(differs)


@pytest.mark.parametrize("streams", [1, 2])
def test_fewer_streams_are_the_first_streams_of_the_full_pass(exact_model, streams):
    """A pass over the first streams only gives their rows the bits of the full pass (stream j sees streams 1..j):
    the rows a busy batch saves change no stream it keeps."""
    adapters = random_adapters(exact_model, streams=3, layers=2, std=0.1)
    tree = streaming.StreamGuesses([[5, 6], [7, 8], [9, 3]], [[-0.1, -2.0], [-0.2, -1.5], [-0.3, -1.0]]).tree(3, 6)
    outs = {}
    with torch.inference_mode():
        for n in (None, streams):
            cache = exact_model.new_cache()
            exact_model.prefill(torch.tensor([[3, 1, 4, 1]]), cache)
            outs[n] = streaming.fused_forward(exact_model, adapters, cache, [5], tree, streams=n)
    full, few = outs[None], outs[streams]
    m = len(full.kept)
    assert few.streams == streams and full.streams == 3 and few.kept == full.kept
    assert torch.equal(few.out[0, :m], full.out[0, :m])  # main rows
    for node in range(m):
        assert torch.equal(few.out[0, m + node * streams: m + (node + 1) * streams],
                           full.out[0, m + node * 3: m + node * 3 + streams])


@pytest.mark.parametrize("budget, threshold", [(6, 0.0), (6, 0.3), (2, 0.0), (0, 0.0)])
def test_deferred_streams_give_the_one_pass_bits(exact_model, budget, threshold):
    """Streams after verification (the last accepted node's only, over the cache compacted to the accepted path) see
    the keys they see beside every node in one pass, in the same order: the same next tree bit for bit, the same
    main logits and the same cache, whatever was accepted and pruned."""
    model = exact_model
    adapters = random_adapters(model, streams=3, layers=2, std=0.1)
    prompt = [5, 17, 3, 44]
    future = generate(model, prompt, method="ar", max_new_tokens=4).token_ids
    params = SamplingParams()
    for accepted in (0, 1, 3):  # the oracle's first `accepted` levels are right, then decoys
        levels = [[future[g] if g < accepted else (future[g] + 1) % 64, (future[g] + 2) % 64] for g in range(3)]
        guesses = streaming.StreamGuesses(levels, [[-0.2, -1.0]] * 3)
        runs = {}
        with torch.inference_mode():
            for defer in ("never", "always"):
                cache = model.new_cache()
                model.prefill(torch.tensor([prompt[:-1]]), cache)
                result = streaming.ss_pass(model, adapters, cache, [prompt[-1]], guesses.tree(3, budget), params,
                                           threshold=threshold, defer=defer)
                runs[defer] = result, cache
        (one, one_cache), (deferred, deferred_cache) = runs["never"], runs["always"]
        most = min(accepted, budget) if budget else accepted  # pruning may only cut the oracle's path shorter
        assert len(one.accepted) == most if not threshold else len(one.accepted) <= most
        assert (one.accepted, one.next_token) == (deferred.accepted, deferred.next_token)
        assert one.candidates == deferred.candidates  # tokens and log-probabilities, exactly
        assert torch.equal(one.path_logits, deferred.path_logits) and _same_cache(one_cache, deferred_cache)


@pytest.mark.parametrize("budget", [0, 3])
def test_a_trunk_before_the_root_gets_no_stream_rows(exact_model, budget):
    """Text the cache lacks before the root (an SS draft's prompt, or a suffix step's tokens) is verified but never
    drafts from: its rows carry no streams (on a GPU a prompt's every token used to carry γ, its mask growing with
    their square), and the pass gives what a prefill of that text and a one-token trunk give, bit for bit."""
    model = exact_model
    adapters = random_adapters(model, streams=3, layers=2, std=0.1)
    prompt = [5, 17, 3, 44, 9, 21]
    guesses = streaming.StreamGuesses([[7, 8], [9, 3], [11, 12]], [[-0.2, -1.0]] * 3)
    results = []
    with torch.inference_mode():
        for cut in (2, len(prompt) - 1):  # a trunk of four tokens; of one
            cache = model.new_cache()
            model.prefill(torch.tensor([prompt[:cut]]), cache)
            forward = streaming.fused_forward(model, adapters, cache, prompt[cut:], guesses.tree(3, budget),
                                              defer="never")
            m, root = len(forward.kept), forward.root_row
            assert forward.out.shape[1] == m + (m - root) * 3
            cache.truncate(cut)
            results.append(streaming.ss_pass(model, adapters, cache, prompt[cut:], guesses.tree(3, budget),
                                             SamplingParams(), defer="never"))
    long_trunk, one_token = results
    assert (long_trunk.accepted, long_trunk.next_token) == (one_token.accepted, one_token.next_token)
    assert long_trunk.candidates == one_token.candidates
    assert torch.equal(long_trunk.path_logits, one_token.path_logits)


def test_deferring_is_a_cpu_rule_for_trees_of_three_nodes_and_more():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert streaming.defers("auto", 3, 2, cpu) and not streaming.defers("auto", 2, 3, cpu)
    assert not streaming.defers("auto", 4, 1, cpu) and not streaming.defers("auto", 8, 3, cuda)
    assert streaming.defers("always", 1, 1, cuda) and not streaming.defers("never", 8, 3, cpu)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_pass_read_at_once_gives_the_same_passes(exact_model, monkeypatch, temperature):
    """Off the CPU a pass reads its verdict's tokens and every row's next guesses in one host read (``read_pass``),
    where it read the verdict and then the accepted node's guesses; forced here on the CPU. The same tokens, the
    same passes with the same acceptance (every row's guesses are the ones ``next_guesses`` gives), and, greedy,
    one read a pass; likewise for a draft's passes inside ``sd``."""
    from mirrorsd.decoding.ss.method import StreamGuessProposer, StreamTreeScorer

    adapters = random_adapters(exact_model, 3, 2, 1, std=0.1)
    kwargs = {"temperature": temperature, "seed": 4, "max_new_tokens": 30}
    ss = {"streams": adapters, "tree_k": 2, "tree_budget": 4, "threshold": 0.0, "defer_streams": "never",
          "suffix_match": 0, **kwargs}
    before = generate(exact_model, [5, 6, 7], method="ss", **ss)
    draft = row_exact(tiny_hf(layers=2, seed=2))
    sd = {"draft": draft, "draft_streams": random_adapters(draft, streams=3, layers=1, std=0.1), "gamma": 6,
          "confidence": 0.0, "suffix_match": 0, "draft_context": 0, "defer_streams": "never", **kwargs}
    sd_before = generate(exact_model, [5, 6, 7], method="sd", **sd)

    monkeypatch.setattr(streaming, "reads_once", lambda forward, params: forward.deferred is None)
    monkeypatch.setattr(streaming, "reads_every_row", lambda logits, params: True)  # (the first step's read_root)
    host, per_step = HostReads(monkeypatch), []
    propose, commit = StreamGuessProposer.propose, StreamTreeScorer.commit

    def started(self, *args):
        host.start()
        return propose(self, *args)

    def ended(self, *args):
        per_step.append(host.stop())
        return commit(self, *args)

    monkeypatch.setattr(StreamGuessProposer, "propose", started)
    monkeypatch.setattr(StreamTreeScorer, "commit", ended)
    after = generate(exact_model, [5, 6, 7], method="ss", **ss)
    sd_after = generate(exact_model, [5, 6, 7], method="sd", **sd)
    monkeypatch.undo()

    assert after.token_ids == before.token_ids == generate(exact_model, [5, 6, 7], method="ar", **kwargs).token_ids
    assert after.stats.accepted == before.stats.accepted and after.stats.drafted == before.stats.drafted
    assert len(per_step) == after.stats.steps
    if temperature == 0:
        assert all(r == ["tolist"] for r in per_step), per_step
    assert sd_after.token_ids == sd_before.token_ids == after.token_ids
    assert sd_after.stats.draft_forwards == sd_before.stats.draft_forwards


def test_a_pass_read_at_once_holds_every_rows_next_guesses(exact_model, monkeypatch):
    """Whichever node the verdict ends at, the guesses read with the pass are the ones :func:`next_guesses` makes
    for that verdict afterwards (the test above rarely sees a guess accepted on random adapters)."""
    from mirrorsd.verify import Verdict

    monkeypatch.setattr(streaming, "reads_once", lambda forward, params: forward.deferred is None)
    adapters = random_adapters(exact_model, 3, 2, 1, std=0.1)
    with torch.inference_mode():
        cache = exact_model.new_cache()
        exact_model.prefill(torch.tensor([[1, 2, 3]]), cache)
        forward = streaming.fused_forward(exact_model, adapters, cache, [4], streaming.guess_tree([[5, 6], [8, 9]]))
        sampled = SamplingParams(temperature=0.9, seed=1)
        read = streaming.read_pass(exact_model, forward, sampled, tree_k=3)
        parents = forward.draft.parents
        for end in range(-1, len(parents)):  # the verdict's last accepted node (-1: none)
            path: list[int] = []
            while end >= 0:
                path, end = [end, *path], parents[end]
            verdict = Verdict(len(path), 0, tuple(path))
            assert read.next_guesses(verdict) == streaming.next_guesses(exact_model, adapters, forward, verdict, 3)
    # the root (after [1, 2, 3] and the trunk's 4) predicts position 4, its children 5, theirs 6
    assert read.own == streaming.choose(forward.main_logits, [4, 5, 5, 6, 6, 6, 6], sampled).tolist()


def test_the_default_prune_threshold_prunes_only_the_whole_tree_on_a_cpu():
    from mirrorsd.decoding.ss.method import DEFAULT_THRESHOLD, SSOptions, prune_threshold

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert prune_threshold(SSOptions(), cpu) == 0.0 and prune_threshold(SSOptions(), gpu) == 0.0  # budgeted trees
    whole = SSOptions(tree_budget=0)
    assert prune_threshold(whole, cpu) == DEFAULT_THRESHOLD and prune_threshold(whole, gpu) == 0.0
    assert prune_threshold(SSOptions(threshold=0.2), gpu) == 0.2 and prune_threshold(SSOptions(threshold=0.0), cpu) == 0
    assert prune_threshold(SSOptions(prune_exit="some/exit"), gpu) == DEFAULT_THRESHOLD


def test_sd_with_ss_draft_equals_ar_with_the_ar_drafts_windows_in_fewer_forwards():
    """Fig. 4's SD × SS-draft cell: ``sd`` drafting with the draft's streams proposes the AR draft's windows (its
    main stream verifies each pass), so acceptance is unchanged and the tokens are ar's."""
    target, draft = row_exact(tiny_hf(layers=4, seed=1)), row_exact(tiny_hf(layers=2, seed=2))
    adapters = random_adapters(draft, streams=3, layers=1, std=0.1)
    for temperature in (0.0, 1.0):
        kwargs = {"temperature": temperature, "seed": 5, "max_new_tokens": 40}
        sd = {"draft": draft, "gamma": 6, "confidence": 0.0, "suffix_match": 0, "draft_context": 0, **kwargs}
        want = generate(target, [7, 8, 9], method="ar", **kwargs)
        plain = generate(target, [7, 8, 9], method="sd", **sd)
        for defer in ("never", "always"):
            got = generate(target, [7, 8, 9], method="sd", draft_streams=adapters, defer_streams=defer, **sd)
            assert got.token_ids == want.token_ids == plain.token_ids
            assert got.stats.accepted == plain.stats.accepted and got.stats.drafted == plain.stats.drafted
            assert got.stats.draft_forwards <= plain.stats.draft_forwards
    with pytest.raises(mirrorsd.decoding.OptionError, match="defer_streams"):
        generate(target, [7, 8, 9], method="sd", draft=draft, defer_streams="always")


def test_mirror_with_ss_draft_equals_ar_and_keeps_parity_with_sd():
    """Fresh rollouts and branch rollouts draft with the streams (every root rolled out: roots=paper). A branch
    is the draft's own continuation either way, so every step hits and accepts exactly as with the AR draft."""
    target, draft = row_exact(tiny_hf(layers=4, seed=1)), row_exact(tiny_hf(layers=2, seed=2))
    adapters = random_adapters(draft, streams=2, layers=1, std=0.1)
    for temperature, backend in ((0.0, "serial"), (1.0, "serial"), (0.0, "threads")):
        kwargs = {"temperature": temperature, "seed": 5, "max_new_tokens": 40}
        want = generate(target, [7, 8, 9], method="ar", **kwargs)
        mirror = {"draft": draft, "gamma": 5, "kappa": 2, "roots": "paper", "backend": backend,
                  "confidence": 0.0, **kwargs}  # full windows: a stream draft commits at least a token per forward
        plain = generate(target, [7, 8, 9], method="mirror", **mirror)
        got = generate(target, [7, 8, 9], method="mirror", draft_streams=adapters, **mirror)
        assert got.token_ids == want.token_ids
        m, p = got.stats.extra["mirror"], plain.stats.extra["mirror"]
        assert [(s.hit, s.accepted) for s in m.steps] == [(s.hit, s.accepted) for s in p.steps]
        assert any(s.hit for s in m.steps) and any(s.hit is False for s in m.steps)
        assert all(0 < s.rollout_forwards <= s.rollout_depth for s in m.steps if s.hit is not None)
        summary = m.to_dict()
        assert summary["draft_streams"] and summary["fresh_tokens_per_draft_forward"] >= 1.0
        assert summary["rollout_tokens_per_draft_forward"] >= 1.0
        assert got.stats.draft_forwards <= plain.stats.draft_forwards


@pytest.mark.parametrize("every_row", [False, True])
def test_a_stream_rollout_reads_the_host_a_fixed_number_of_times_per_pass(monkeypatch, every_row):
    """Mirror-SD's branch rollouts with the draft's streams read every branch's own tokens in one op, then the kept
    rows' next guesses in one more: two host reads a pass however many branches it carries (on a GPU each read
    waits for the draft's stream), and one for the roots' ids, which the early exit leaves on the device where
    every candidate is a root. Off the CPU (``every_row``, forced here) every row's guesses come with the own tokens:
    one read a pass, the same tokens and the same hits."""
    from mirrorsd.decoding.mirror import draft as mirror_draft
    from mirrorsd.decoding.mirror.draft import LocalDraft

    target, draft = row_exact(tiny_hf(layers=4, seed=1)), row_exact(tiny_hf(layers=2, seed=2))
    adapters = random_adapters(draft, streams=2, layers=1, std=0.1)
    options = dict(method="mirror", draft=draft, draft_streams=adapters, gamma=5, kappa=2, roots="paper",
                   confidence=0.0, temperature=0.0, max_new_tokens=30)
    plain = generate(target, [7, 8, 9], **options)
    if every_row:
        monkeypatch.setattr(mirror_draft, "reads_every_row", lambda logits, params: True)
    host = HostReads(monkeypatch)
    rollout, seen = LocalDraft._stream_rollout, []

    def counted(self, state, committed, window, spine, roots, steps):
        host.start()
        try:
            tree = rollout(self, state, committed, window, spine, roots, steps)
        finally:
            seen.append((len(roots), host.stop().count("tolist")))
        seen[-1] += (tree.forwards,)
        return tree

    monkeypatch.setattr(LocalDraft, "_stream_rollout", counted)
    got = generate(target, [7, 8, 9], **options)
    monkeypatch.undo()
    assert got.token_ids == generate(target, [7, 8, 9], method="ar", temperature=0.0, max_new_tokens=30).token_ids
    steps = lambda result: [(s.hit, s.accepted) for s in result.stats.extra["mirror"].steps]  # noqa: E731
    assert steps(got) == steps(plain) and any(hit for hit, _ in steps(got))
    assert any(roots > 2 for roots, _, _ in seen)
    per_pass = 1 if every_row else 2
    assert all(count == per_pass * passes + 1 for _, count, passes in seen), seen


# -- real weights, training, shipped adapters ----------------------------------------------------------------


@requires_smollm2
@pytest.mark.parametrize("prompt", ["Explain what a Python list comprehension is.", "Write a haiku about rain."])
def test_smollm2_ss_greedy_equals_ar_and_hf(smollm2, prompt):
    ours, hf = smollm2
    want = generate(ours, prompt, method="ar", max_new_tokens=40)
    got = generate(ours, prompt, method="ss", max_new_tokens=40)  # the shipped adapter
    ids = torch.tensor([got.prompt_ids])
    hf_ids = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    hf_new = hf_ids[0, ids.shape[1]:].tolist()
    assert_same_or_near_tie(ours.model, got.prompt_ids, got.token_ids, want.token_ids)
    assert_same_or_near_tie(ours.model, got.prompt_ids, got.token_ids, hf_new[:len(got.token_ids)])
    assert got.stats.extra["ss"].call_reduction > 1.0


@requires_smollm2
def test_smollm2_q8_ss_seeded_sampling_and_greedy_equal_ar_exactly():
    model = mirrorsd.load_model("smollm2-135m", weights="q8", progress=False)
    for temperature in (0.0, 0.9):
        kwargs = {"temperature": temperature, "seed": 11, "max_new_tokens": 48}
        want = generate(model, "Tell me about the history of tea.", method="ar", **kwargs)
        got = generate(model, "Tell me about the history of tea.", method="ss", threshold=0.02, **kwargs)
        assert got.token_ids == want.token_ids


@requires_smollm2
@pytest.mark.parametrize("draft_streams", [True, "true", "auto"])
def test_mirror_draft_streams_flag_takes_the_drafts_shipped_adapter(draft_streams):
    """`draft_streams=True` in the API, `mirror:draft_streams=true` in a bench method spec (as the docs write it)
    and `--draft-streams` alone (auto) all mean the draft's shipped adapter."""
    model = mirrorsd.load_model("smollm2-135m", weights="q8", progress=False)
    want = generate(model, "Name three colours.", method="ar", max_new_tokens=12)
    got = generate(model, "Name three colours.", method="mirror", draft=model, draft_streams=draft_streams,
                   max_new_tokens=12)
    assert got.token_ids == want.token_ids and got.stats.extra["mirror"].draft_streams
    plain = generate(model, "Name three colours.", method="mirror", draft=model, draft_streams="false",
                     max_new_tokens=12)
    assert plain.token_ids == want.token_ids and not plain.stats.extra["mirror"].draft_streams


@requires_smollm2
def test_shipped_adapter_beats_an_untrained_one_on_held_out_stream_accuracy(smollm2, tmp_path):
    from mirrorsd.train_streams import StateCache, cache_states, evaluate
    from mirrorsd.training import HELD_OUT, corpus_texts, make_chunks

    ours, _ = smollm2
    folder = shipped_adapter("smollm2-135m")
    assert folder is not None
    config = json.loads((folder / "stream_config.json").read_text())
    recipe = config["recipe"]
    total = recipe["train_chunks"] + recipe["held_out_chunks"]
    texts = corpus_texts(recipe["data"])
    held_out = make_chunks(ours.tokenizer, texts, recipe["seq_len"], total, 0)[:4]  # never trained on
    trained = load_adapters(ours.model, folder)
    untrained = StreamAdapters(ours.model, trained.config)
    cache_states(ours.model, trained.first_layer, [], held_out, tmp_path, progress=False)
    items = StateCache([tmp_path / HELD_OUT], "cpu")
    good, base = evaluate(ours.model, trained, items), evaluate(ours.model, untrained, items)
    assert all(g > b + 0.02 for g, b in zip(good["stream_accuracy"], base["stream_accuracy"], strict=True)), (
        good, base)


def test_the_chat_answers_corpus_needs_the_model_it_quotes():
    from mirrorsd.training import corpus_texts

    with pytest.raises(ValueError, match="chat-answers corpus needs the model"):
        corpus_texts(["chat-answers"])


@requires_smollm2
def test_the_chat_answers_corpus_is_the_models_own_answers_through_its_chat_template(smollm2, monkeypatch):
    """Each shipped prompt of every set with the model's own answer, rendered by the model's chat template;
    conversation i in text i mod CHAT_TEXTS, so that training windows span several conversations."""
    from mirrorsd import vocab_tables
    from mirrorsd.training import CHAT_TEXTS, corpus_texts

    tokenizer = smollm2[0].tokenizer
    sets = {"draft_vocab": range(6), "streams": range(6, 10)}
    asked = {name: [{"category": "qa", "prompt": f"Question {i}?"} for i in ids] for name, ids in sets.items()}
    answers = {name: [tokenizer(f"Answer {i}.", add_special_tokens=False)["input_ids"] for i in ids]
               for name, ids in sets.items()}
    monkeypatch.setattr(vocab_tables, "PROMPT_SETS", dict.fromkeys(sets, "unused"))
    monkeypatch.setattr(vocab_tables, "prompts", lambda prompt_set: asked[prompt_set])
    monkeypatch.setattr(vocab_tables, "answers_of", lambda model, prompt_set: answers[prompt_set])
    texts = corpus_texts(["chat-answers"], "smollm2-135m", tokenizer)

    def rendered(i: int) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": f"Question {i}?"},
                                              {"role": "assistant", "content": f"Answer {i}."}], tokenize=False)

    assert len(texts) == CHAT_TEXTS
    assert texts[0] == rendered(0) + "\n" + rendered(8) and texts[7] == rendered(7)


# -- training on the state cache -------------------------------------------------------------------------------


def test_stream_targets_are_the_models_own_tokens_j_places_ahead():
    from mirrorsd.train_streams import Cached, stream_targets

    labels = torch.arange(10, 18)  # labels[t]: the model's token after position t, i.e. token t + 1
    item = Cached(torch.zeros(8, 4), torch.zeros(1, 1, 8, 2), torch.zeros(1, 1, 8, 2), labels, loss_from=3)
    streams, prune = stream_targets(item, n_streams=2)
    assert streams.shape == (8, 2)
    # Stream j at t predicts token t + 1 + j = labels[t + j]; a target must be a completion token (>= 3) and known.
    assert streams[0].tolist() == [-100, 12] and streams[1].tolist() == [12, 13]
    assert streams[5].tolist() == [16, 17] and streams[6].tolist() == [17, -100] and streams[7].tolist() == [-100] * 2
    assert prune.tolist() == [-100, -100, 12, 13, 14, 15, 16, 17]


def test_training_head_is_the_full_head_on_its_subset(dense_model):
    from mirrorsd.training import TrainHead

    ids = torch.tensor([5, 1, 40, 7])
    head = TrainHead(dense_model, ids)
    hidden = torch.randn(3, dense_model.config.hidden_size)
    full = dense_model.logits(hidden)
    torch.testing.assert_close(head.logits(hidden), full[:, ids.sort().values])
    assert head.labels(torch.tensor([7, 2, -100, 1])).tolist() == [2, -100, -100, 0]  # outside the subset: none


def test_self_distillation_runs_as_each_shard_is_written(dense_model, tmp_path, monkeypatch):
    """--self-distill N generated all N continuations before the first shard, again on every resume (hours on the
    1.5B at scale), and a stop before the first shard lost them all. Each chunk is now distilled in its shard."""
    from mirrorsd import train_streams
    from mirrorsd.train_streams import StateCache, cache_states, freeze, self_distilled
    from mirrorsd.training import Chunk, shard_paths

    gen = torch.Generator().manual_seed(0)
    chunks = [Chunk(torch.randint(0, dense_model.config.vocab_size, (12,), generator=gen), 1) for _ in range(5)]
    calls = []

    def counting(model, chunk, prompt_len):
        calls.append(chunk)
        return self_distilled(model, chunk, prompt_len)

    monkeypatch.setattr(train_streams, "self_distilled", counting)
    cache_states(dense_model, 2, chunks[1:], chunks[:1], tmp_path, shard_size=2, progress=False, distill=3)
    assert calls == chunks[1:4]
    shards = shard_paths(tmp_path, 4, 2)
    cached = StateCache(shards, "cpu")
    want = freeze(dense_model, 2, self_distilled(dense_model, chunks[3], 6))  # (distilled: prompt of 6 of 12)
    assert torch.equal(cached[2].labels, want["labels"]) and cached[2].loss_from == 6
    assert cached[3].loss_from == 1  # (past the first 3: as read)
    calls.clear()
    shards[1].unlink()  # an interrupted build: only the missing shard's chunks are distilled again
    cache_states(dense_model, 2, chunks[1:], chunks[:1], tmp_path, shard_size=2, progress=False, distill=3)
    assert calls == [chunks[3]]


def test_state_cache_resumes_by_shard_and_refuses_other_settings(dense_model, tmp_path):
    from mirrorsd.train_streams import StateCache, cache_states
    from mirrorsd.training import HELD_OUT, Chunk, check_cache, shard_paths

    gen = torch.Generator().manual_seed(0)
    chunks = [Chunk(torch.randint(0, dense_model.config.vocab_size, (12,), generator=gen), 1) for _ in range(5)]
    meta = {"seq_len": 12, "chunks": 5}
    check_cache(tmp_path, meta)
    cache_states(dense_model, 2, chunks[1:], chunks[:1], tmp_path, shard_size=2, progress=False)
    shards = shard_paths(tmp_path, 4, 2)
    assert [p.exists() for p in shards] == [True, True] and (tmp_path / HELD_OUT).exists()
    first = StateCache(shards, "cpu")
    assert len(first) == 4 and first[0].keys.shape == (2, dense_model.config.n_kv_heads, 12,
                                                       dense_model.config.head_dim)
    # The labels are the model's own greedy tokens.
    logits = dense_model(chunks[1].ids[None])
    assert first[0].labels.tolist() == logits[0].argmax(-1).tolist()
    kept = shards[0].stat().st_mtime_ns
    shards[1].unlink()  # an interrupted run: only the missing shard is computed again
    cache_states(dense_model, 2, chunks[1:], chunks[:1], tmp_path, shard_size=2, progress=False)
    assert shards[0].stat().st_mtime_ns == kept and shards[1].exists()
    again = StateCache(shards, "cpu")
    assert all(torch.equal(a.hidden, b.hidden) and torch.equal(a.labels, b.labels)
               for a, b in zip(first, again, strict=True))
    check_cache(tmp_path, meta)  # the same settings reuse it
    with pytest.raises(ValueError, match="seq_len"):
        check_cache(tmp_path, {"seq_len": 16, "chunks": 5})


def test_held_out_accuracy_on_written_tokens_where_the_cache_marks_them(dense_model, tmp_path):
    from mirrorsd.train_streams import StateCache, cache_states, evaluate, stream_forward, stream_targets
    from mirrorsd.training import HELD_OUT, Chunk

    adapters = random_adapters(dense_model, streams=2, layers=2)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, dense_model.config.vocab_size, (16,), generator=gen)
    all_written = Chunk(ids, 1, torch.ones(16, dtype=torch.bool))
    cache_states(dense_model, adapters.first_layer, [], [all_written], tmp_path, progress=False)
    item = StateCache([tmp_path / HELD_OUT], "cpu")[0]
    got = evaluate(dense_model, adapters, [item])
    assert got["stream_accuracy_answers"] == got["stream_accuracy"]  # every token written: the same measure
    # Only the last 4 tokens written: stream j at t counts when token t + 1 + j is one of them.
    item.answer = torch.arange(16) >= 12
    hand = evaluate(dense_model, adapters, [item])["stream_accuracy_answers"]
    streams, _ = stream_targets(item, 2)
    with torch.no_grad():
        predicted = dense_model.logits(stream_forward(dense_model, adapters, item)).argmax(-1)
    for j in range(2):
        rows = [t for t in range(16) if streams[t, j] >= 0 and t + 2 + j < 16 and t + 2 + j >= 12]
        rows += [t for t in range(16) if streams[t, j] >= 0 and t + 2 + j >= 16]  # past the window: the last mark
        want = sum(int(predicted[t, j] == streams[t, j]) for t in rows) / len(rows)
        assert hand[j] == round(want, 4)
    item.answer = None  # a cache from before the marks: no such measure
    assert "stream_accuracy_answers" not in evaluate(dense_model, adapters, [item])
    # The overlap with the model's own distribution of the token a stream predicts (its logits at t + 1 + j).
    with torch.no_grad():
        p = dense_model(ids[None])[0].softmax(-1)
        q = dense_model.logits(stream_forward(dense_model, adapters, item)).softmax(-1)
    for j in range(2):
        rows = [t for t in range(16) if streams[t, j] >= 0]
        want = sum(float(torch.minimum(p[t + 1 + j], q[t, j]).sum()) for t in rows) / len(rows)
        assert 0 < got["stream_overlap"][j] <= 1 and got["stream_overlap"][j] == pytest.approx(want, abs=2e-3)


def test_training_lowers_the_loss_and_keeps_adapters_fp32_on_a_bf16_base(tmp_path):
    from mirrorsd.train_streams import StateCache, cache_states, losses
    from mirrorsd.training import HELD_OUT, Chunk, TrainHead

    model = Transformer.from_hf(tiny_hf(layers=4, seed=1))
    tower = Transformer.from_hf(tiny_hf(layers=4, seed=1).to(torch.bfloat16))
    tower.requires_grad_(False)
    cfg = tower.config
    adapters = StreamAdapters(tower, StreamConfig(streams=2, layers=2, hidden_size=cfg.hidden_size,
                                                  n_layers=cfg.n_layers, vocab_size=cfg.vocab_size))
    assert all(p.dtype == torch.float32 for p in adapters.trainable())
    ids = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(1))
    cache_states(model, adapters.first_layer, [], [Chunk(ids, 1)], tmp_path, progress=False)
    item = StateCache([tmp_path / HELD_OUT], "cpu")[0]
    head = TrainHead(tower, torch.arange(cfg.vocab_size))
    optimizer = torch.optim.Adam(adapters.trainable(), lr=1e-2)
    first = None
    for _ in range(30):
        stream_ce, prune_ce = losses(tower, adapters, item, head)
        first = first if first is not None else (stream_ce.item(), prune_ce.item())
        optimizer.zero_grad()
        (stream_ce + prune_ce).backward()
        optimizer.step()
    assert stream_ce.item() < 0.5 * first[0] and prune_ce.item() < 0.5 * first[1]


def test_kl_loss_targets_the_models_own_distribution_j_places_ahead(tmp_path):
    from mirrorsd.train_streams import StateCache, cache_states, losses, stream_targets, teacher_logits
    from mirrorsd.training import HELD_OUT, Chunk, TrainHead

    model = Transformer.from_hf(tiny_hf(layers=4, seed=3))
    model.requires_grad_(False)
    cfg = model.config
    adapters = StreamAdapters(model, StreamConfig(streams=2, layers=2, hidden_size=cfg.hidden_size,
                                                  n_layers=cfg.n_layers, vocab_size=cfg.vocab_size))
    ids = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(4))
    cache_states(model, adapters.first_layer, [], [Chunk(ids, 3)], tmp_path, progress=False)
    item = StateCache([tmp_path / HELD_OUT], "cpu")[0]
    item.hidden = item.hidden.float()  # the cache keeps bf16; compare the recomputation on the same states
    head = TrainHead(model, torch.arange(cfg.vocab_size))
    teacher = teacher_logits(model, adapters.first_layer, item, head)
    with torch.no_grad():
        final = model.run_layers(item.hidden[None], torch.arange(16)[None], model.new_cache(capacity=16), None,
                                 adapters.first_layer, None)
    torch.testing.assert_close(teacher, model.logits(final[0]))
    streams, _ = stream_targets(item, 2)
    for t, j in zip(*torch.nonzero(streams >= 0).T.tolist(), strict=True):  # the soft target's argmax is the label
        assert int(teacher[t + j + 1].argmax()) == int(streams[t, j]) == int(item.labels[t + j + 1])
    tower = Transformer.from_hf(tiny_hf(layers=4, seed=3).to(torch.bfloat16))  # trained through, as the CLI does
    tower.requires_grad_(False)
    adapters = StreamAdapters(tower, adapters.config)
    head = TrainHead(tower, torch.arange(cfg.vocab_size))
    optimizer = torch.optim.Adam(adapters.trainable(), lr=1e-2)
    first = None
    for _ in range(30):
        stream_kl, prune_ce = losses(tower, adapters, item, head, "kl")
        first = first if first is not None else stream_kl.item()
        optimizer.zero_grad()
        (stream_kl + prune_ce).backward()
        optimizer.step()
    assert 0 <= stream_kl.item() < 0.5 * first
    with pytest.raises(ValueError, match="unknown loss"):
        losses(tower, adapters, item, head, "mse")


@requires_smollm2
def test_train_streams_cli_trains_resumes_and_saves_a_small_adapter(tmp_path, capsys):
    from mirrorsd.cli import main

    out = tmp_path / "adapter"
    args = ["train-streams", "--model", "smollm2-135m", "--data", "pydoc-topics", "--out", str(out),
            "--seq-len", "32", "--held-out", "1", "--layers", "2", "--streams", "2", "--chunks", "3",
            "--eval-every", "2"]
    bad = ["--out", str(tmp_path / "bad"), "--steps", "2"]
    assert main([*args, *bad, "--chunks", "1000000"]) != 0  # more chunks than the data gives
    assert "were asked for" in capsys.readouterr().err
    assert main([*args, *bad]) == 0  # the cache that run left holds no states: it takes the new settings
    assert main([*args, "--steps", "2"]) == 0
    first = json.loads((out / "summary.json").read_text())
    cached = sorted((out / "cache").glob("*.safetensors"))
    assert len(cached) == 2  # one training shard and the held-out chunks
    stamps = [p.stat().st_mtime_ns for p in cached]
    assert main([*args, "--steps", "4"]) == 0  # resumes from step 2 and reuses the cache
    assert [p.stat().st_mtime_ns for p in cached] == stamps
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["step"] == 4 and state["curve"][0]["stream_accuracy"] == first["held_out_stream_accuracy_before"]
    assert [p["step"] for p in state["curve"]] == [0, 2, 4]
    assert (out / "learning_curve.png").stat().st_size > 0
    assert json.loads((out / "summary.json").read_text())["epochs"] == round(4 / 3, 2)
    assert (out / "adapter.safetensors").stat().st_size < 2_000_000
    assert main([("16" if a == "32" else a) for a in args] + ["--steps", "4"]) != 0  # refused, not mixed in
    assert "built with other settings (seq_len)" in capsys.readouterr().err
    meta_path = out / "cache" / "cache.json"
    meta = json.loads(meta_path.read_text())
    assert meta["model"] == "smollm2-135m" and meta["weights"]  # e.g. "q4 weights, int8x2 activations"
    meta_path.write_text(json.dumps({**meta, "model": "another-model-of-this-shape"}))
    assert main([*args, "--steps", "4"]) != 0  # another model's states are never reused
    assert "built with other settings (model)" in capsys.readouterr().err
    meta_path.write_text(json.dumps(meta))
    trained = json.loads((out / "summary.json").read_text())
    more = tmp_path / "more"  # a warm start: the curve begins where the first adapter ended
    assert main([*args, "--out", str(more), "--cache", str(out / "cache"), "--init", str(out), "--steps", "2"]) == 0
    curve = json.loads((more / "curve.json").read_text())
    assert curve[0]["train_tokens"] == trained["train_tokens"] > 0
    assert curve[0]["stream_accuracy"] == trained["held_out_stream_accuracy_after"]
    assert json.loads((more / "summary.json").read_text())["train_tokens"] > trained["train_tokens"]
    alone = tmp_path / "evaluated"  # --steps 0 evaluates an adapter and trains nothing
    assert main([*args, "--out", str(alone), "--cache", str(out / "cache"), "--init", str(out), "--steps", "0",
                 "--loss", "kl"]) == 0
    evaluated = json.loads((alone / "summary.json").read_text())
    assert len(json.loads((alone / "curve.json").read_text())) == 1 and evaluated["loss"] == "kl"
    assert evaluated["held_out_stream_accuracy_after"] == trained["held_out_stream_accuracy_after"]
    assert evaluated["held_out_stream_overlap_before"] == evaluated["held_out_stream_overlap_after"]
    assert main([*args, "--out", str(tmp_path / "other"), "--init", str(out), "--rank", "4", "--steps", "2"]) != 0
    assert "--init adapter has streams/rank/prune rank" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "shallower"), "--init", str(out), "--layers", "1", "--steps", "0"]) != 0
    assert "N_s may only grow" in capsys.readouterr().err
    model = mirrorsd.load_model("smollm2-135m", weights="q8", progress=False)
    got = generate(model, "Hi there", method="ss", streams=str(out), max_new_tokens=12)
    assert got.token_ids == generate(model, "Hi there", method="ar", max_new_tokens=12).token_ids


def test_ss_learns_from_its_suffix_windows(monkeypatch):
    """The fused pass hands back its pruned tree as a new proposal: the suffix proposer took that for another
    proposer's window and never updated its acceptance or cost model, so ss's suffix rule kept its priors."""
    from mirrorsd.decoding import lookup

    observed = []
    monkeypatch.setattr(lookup.AcceptanceModel, "observe", lambda self, *args: observed.append(args))
    target = Transformer.from_hf(tiny_hf(layers=4, seed=1))
    adapters = random_adapters(target, streams=2, layers=2, seed=0, std=0.1)
    got = generate(target, [1, 2, 3, 4, 5] * 6, method="ss", streams=adapters, suffix_match=1, max_new_tokens=40)
    assert got.token_ids == generate(target, [1, 2, 3, 4, 5] * 6, method="ar", max_new_tokens=40).token_ids
    suffix_steps = sum(1 for step in got.stats.step_log if step.get("source") == "suffix")
    assert suffix_steps and len(observed) == suffix_steps


def test_an_unbudgeted_tree_too_big_to_run_is_refused_before_the_first_pass():
    """tree_k = 64 with tree_budget = 0 asked every pass for 64 + 64² nodes with their stream rows: a 70 GB
    allocation on SmolLM2 instead of an error naming the option."""
    target = Transformer.from_hf(tiny_hf(layers=4, seed=1))
    adapters = random_adapters(target, streams=2, layers=2, seed=0, std=0.1)
    with pytest.raises(ValueError, match="tree_k 64 with tree_budget 0 runs the whole tree, 4161 nodes"):
        generate(target, [1, 2, 3], method="ss", streams=adapters, tree_k=64, tree_budget=0)
    got = generate(target, [1, 2, 3], method="ss", streams=adapters, tree_k=64, tree_budget=3, max_new_tokens=8)
    assert got.token_ids == generate(target, [1, 2, 3], method="ar", max_new_tokens=8).token_ids
    # A budget of thousands of nodes ran thousands of rows a pass (beside a batch's other requests, whose streams
    # stalled for seconds), and each chosen node pushed its tree_k children on the heap
    with pytest.raises(ValueError, match="tree_budget must be at most 4096 nodes"):
        generate(target, [1, 2, 3], method="ss", streams=adapters, tree_budget=8000)
    with pytest.raises(ValueError, match="tree_k 40 with tree_budget 2000 weighs 80000 candidate nodes"):
        generate(target, [1, 2, 3], method="ss", streams=adapters, tree_k=40, tree_budget=2000)

"""The fused CUDA layer (:func:`mirrorsd.execution.fused_layers`, :mod:`mirrorsd.kernels.cuda_layers`) on the CPU,
through Triton's interpreter (in a subprocess, which sets ``TRITON_INTERPRET=1`` before Triton loads, and forces
the CUDA path with the same patches as ``tests/kernels/test_cuda_attention.py``). ``tests/test_cuda.py`` runs the
compiled kernels on a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.helpers import REPO

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the compiled kernels (tests/test_cuda.py)"),
]

FORCE_CUDA_PATH = """
import torch
import mirrorsd.execution, mirrorsd.linear, mirrorsd.model
from mirrorsd.kernels import cuda_attention

def force(on=True):
    for module in (mirrorsd.execution, mirrorsd.linear, mirrorsd.model):
        module.fixed_shapes = (lambda x: True) if on else (lambda x: False)
    cuda_attention.applies = cuda_attention.serves = (lambda *a: True) if on else (lambda *a: False)
"""

ARCHS = FORCE_CUDA_PATH + """
from mirrorsd import Transformer
from tests.helpers import tiny_hf
from tests.helpers import assert_windows_and_trees_decode_bit_for_bit

CASES = [("qwen2", torch.float32, 1e-4, {}), ("qwen3", torch.float32, 1e-4, {}),
         ("llama", torch.bfloat16, 0.1, {"attention_bias": True})]  # (an output-projection bias too)
for arch, dtype, tol, config in CASES:
    hf = tiny_hf(arch, vocab=100, layers=2, std=0.1, **config)
    model = Transformer.from_hf(hf, linear="dense").to(dtype)
    prompt = torch.randint(0, 100, (10,)).tolist()  # (one key block either way: BLOCK_KEYS is 64)
    force(False)
    with torch.no_grad():
        eager = model(torch.tensor([prompt]), cache=model.new_cache(capacity=32))
    force(True)
    with torch.no_grad():
        fused = model(torch.tensor([prompt]), cache=model.new_cache(capacity=32))
        alone = model(torch.tensor([prompt]))
    assert model.layers[0].merged is not None, "the fused path did not run"
    assert (model.layers[0].merged.o_bias is not None) == bool(config), arch
    assert (fused - eager).abs().max() < tol * eager.abs().max(), (arch, (fused - eager).abs().max())
    assert torch.equal(fused, alone), arch
    assert_windows_and_trees_decode_bit_for_bit(model, prompt)
print("ok")
"""

LONG = FORCE_CUDA_PATH + """
import contextlib
from mirrorsd import Transformer
from tests.helpers import tiny_hf
from tests.helpers import assert_windows_and_trees_decode_bit_for_bit

force(True)
model = Transformer.from_hf(tiny_hf("qwen2", vocab=100, layers=1, std=0.1), linear="dense")
long = cuda_attention.BLOCK_KEYS * 2 + 10  # three splits (the kernel's own test walks two blocks a split)

@contextlib.contextmanager
def eager():  # the prompt through the eager layers: through the interpreter it was 95% of the time
    force(False)
    yield
    force(True)

assert_windows_and_trees_decode_bit_for_bit(model, torch.randint(0, 100, (long,)).tolist(), prefill=eager)
print("ok")
"""

METHODS = FORCE_CUDA_PATH + """
from mirrorsd import Transformer, generate
from mirrorsd.decoding.streams.adapters import StreamAdapters, StreamConfig
from tests.helpers import tiny_hf

force(True)
target = Transformer.from_hf(tiny_hf("qwen2", vocab=64, layers=2, seed=1, std=0.3), linear="dense")
draft = Transformer.from_hf(tiny_hf("qwen2", vocab=64, layers=1, seed=2, std=0.3), linear="dense")
cfg = target.config
streams = StreamAdapters(target, StreamConfig(streams=2, layers=1, hidden_size=cfg.hidden_size,
                                              n_layers=cfg.n_layers, vocab_size=cfg.vocab_size)).eval()
prompt = list(range(3, 20))
want = generate(target, prompt, method="ar", max_new_tokens=10, temperature=0.0).token_ids
for method, kwargs in [("sd", {"draft": draft}), ("suffix", {}), ("ss", {"streams": streams}),
                       ("mirror", {"draft": draft, "backend": "serial"})]:
    got = generate(target, prompt, method=method, max_new_tokens=10, temperature=0.0, **kwargs).token_ids
    assert got == want, (method, got, want)
print("ok")
"""

# a random-weight target and draft on the forced fused path, for the graph scripts below
TINY_PAIR = FORCE_CUDA_PATH + """
from mirrorsd import Transformer, generate
from mirrorsd.cuda_graphs import cuda_graphs
from tests.helpers import tiny_hf

force(True)
target = Transformer.from_hf(tiny_hf("qwen2", vocab=64, layers=2, seed=1, std=0.3), linear="dense")
draft = Transformer.from_hf(tiny_hf("qwen2", vocab=64, layers=1, seed=2, std=0.3), linear="dense")
"""

DRAFT_GRAPH = TINY_PAIR + """
from mirrorsd.decoding.mirror.draft import LocalDraft
from mirrorsd.decoding.draft_graph import DraftGraph
from mirrorsd.decoding.proposers import ModelProposer

bodies, body = [], DraftGraph.body

def counted(self, *args):
    bodies.append(self)
    return body(self, *args)

DraftGraph.body = counted
trees = []
rollout = LocalDraft.rollout

def recorded(self, *args):
    tree = rollout(self, *args)
    trees.append((tree.roots.at, tree.tokens.tolist(), len(bodies)))
    return tree

LocalDraft.rollout = recorded
windows, chain = [], ModelProposer._chain

def drafted(self, *args):
    proposal = chain(self, *args)
    windows.append(proposal.ids.clone() if proposal.length else None)  # (read later: the step reads it once)
    return proposal

ModelProposer._chain = drafted
prompt = list(range(3, 20))
for temperature in (0.0, 0.8):
    kw = dict(max_new_tokens=10, temperature=temperature, seed=3)
    want = generate(target, prompt, method="ar", **kw).token_ids
    runs = {}
    for graphs in (False, True):
        trees.clear()
        with cuda_graphs(graphs):
            m = generate(target, prompt, method="mirror", draft=draft, roots="paper", confidence=0.0, gamma=3,
                         kappa=2, backend="serial", **kw)
        assert m.token_ids == want, (temperature, graphs)
        assert m.stats.extra["mirror"].to_dict()["rollouts_as_one_graph"] == 0  # (replays: CUDA only)
        runs[graphs] = list(trees)
    eager, graphed = runs[False], runs[True]
    assert eager[-1][2] == 0 and graphed[0][2] == 0  # (a shape's first sight: step by step)
    assert graphed[-1][2] >= len(graphed) / 2, graphed  # the graph's body drew at least half the rollouts
    assert [t[:2] for t in graphed] == [t[:2] for t in eager], temperature  # the same roots, the same tokens
    bodies.clear()
    # sd's fixed window: a chain, the last fed token its one root; with a short draft context the draft skips
    # prompt tokens, and the noise's positions run that far ahead of its cache's (the graph's shift)
    for context in (128, 8):
        sd, drawn = {}, {}
        for graphs in (False, True):
            windows.clear()
            with cuda_graphs(graphs):
                sd[graphs] = generate(target, prompt, method="sd", draft=draft, confidence=0.0, gamma=3,
                                      suffix_match=0, draft_context=context, **kw)
            assert sd[graphs].token_ids == want, (temperature, context, graphs)
            drawn[graphs] = [w if w is None else w.tolist() for w in windows]
        assert drawn[False] == drawn[True], (temperature, context, drawn)  # the same windows
        assert len(bodies) >= len(sd[True].stats.accepted) / 2 and all(g.n_roots == 1 for g in bodies), len(bodies)
        bodies.clear()

# requests key their draft graphs by their choice, never their seed (a device input): greedy ones and sampled ones
# with other seeds replay a graph another request made, with their own noise; other parameters make their own (and,
# one set at a time, drop the others)
from mirrorsd.decoding.draft_graph import graphed_draft
from mirrorsd.decoding.drafting import DraftSampler
from mirrorsd.sampling import SamplingParams

def drafts(cache, **params):
    with torch.no_grad():
        out = graphed_draft(draft, cache, DraftSampler(draft, 64, SamplingParams(**params)), [3, 4, 5], [3], [6], 3)
    cache.truncate(0)
    return None if out is None else out[0].tolist()

cache, other = draft.new_cache(capacity=32), draft.new_cache(capacity=32)
assert [drafts(cache, seed=1) is None, drafts(cache, seed=1) is None, drafts(cache, seed=2) is None] == \
    [True, False, False]  # (a shape's first sight: step by step)
hot = dict(temperature=1.5)
assert drafts(cache, seed=1, **hot) is None and drafts(cache, seed=1, **hot) is not None
replayed = drafts(cache, seed=2, **hot)  # seed 1's graph, seed 2's noise
assert drafts(other, seed=2, **hot) is None and drafts(other, seed=2, **hot) == replayed  # seed 2's own graph
assert replayed != drafts(other, seed=1, **hot)  # (the noise does move these tokens)
assert drafts(cache, seed=3) is None  # the sampled graphs dropped the greedy ones
print("ok")
"""

CONFIDENT_DRAFT_GRAPH = TINY_PAIR + """
import mirrorsd.decoding.draft_graph
from mirrorsd.decoding.draft_graph import DraftGraph
from mirrorsd.decoding.mirror.draft import LocalDraft
from mirrorsd.decoding.proposers import ModelProposer

bodies, body = [], DraftGraph.body

def counted(self, *args):
    bodies.append(self)
    return body(self, *args)

DraftGraph.body = counted
proposals, propose = [], ModelProposer.propose

def proposed(self, *args, **kw):
    proposals.append(propose(self, *args, **kw))
    return proposals[-1]

ModelProposer.propose = proposed
trees, rollout = [], LocalDraft.rollout

def recorded(self, *args):
    trees.append(rollout(self, *args))
    return trees[-1]

LocalDraft.rollout = recorded
prompt = list(range(3, 20))
windows = set()
for temperature, confidences in ((0.0, (0.3, 0.5)), (0.8, (0.3,))):
    kw = dict(max_new_tokens=12, temperature=temperature, seed=3)
    want = generate(target, prompt, method="ar", **kw).token_ids
    # sd: the steps after the first doubtful token skipped on the device, the window cut there when it is read
    for confidence in confidences:
        runs = {}
        # (unconditioned: every step runs, as where PyTorch has no conditional nodes; the steps past the end change
        # nothing the window reads)
        for graphs in (False, True, "unconditioned") if confidence == 0.3 else (False, True):
            proposals.clear()
            bodies.clear()
            run_if = mirrorsd.decoding.draft_graph.run_if
            if graphs == "unconditioned":
                mirrorsd.decoding.draft_graph.run_if = lambda flag, work, warm=False: work()
            with cuda_graphs(bool(graphs)):
                out = generate(target, prompt, method="sd", draft=draft, confidence=confidence, gamma=4,
                               suffix_match=0, **kw)
            mirrorsd.decoding.draft_graph.run_if = run_if
            assert out.token_ids == want, (temperature, confidence, graphs)
            runs[graphs] = [(p.tokens, p.forwards) for p in proposals], out.stats.draft_forwards, out.stats.accepted
        assert all(run == runs[False] for run in runs.values()), (temperature, confidence, runs)  # the same windows
        windows.update(len(tokens) for tokens, _ in runs[True][0])
        assert bodies and all(g.cut for g in bodies) and len(bodies) >= len(proposals) / 2, len(bodies)
    # Mirror-SD's tree rollouts: every step's top probabilities inside the graph, each branch's window end on the
    # device (the verdict's read carries the kept one's); sampled tops are sd's above
    if temperature:
        continue
    runs = {}
    for graphs in (False, True):
        trees.clear()
        bodies.clear()
        with cuda_graphs(graphs):
            m = generate(target, prompt, method="mirror", draft=draft, roots="paper", confidence=0.3, gamma=3,
                         kappa=2, backend="serial", **kw)
        assert m.token_ids == want, (temperature, graphs)
        runs[graphs] = [{root: (row, end) for root, row, end in zip(list(t.roots), t.tokens.tolist(), t.ends.tolist())}
                        for t in trees]
    # every host-driven branch, the same in the graphed tree (a fresh window cut on the device is scored whole, so its
    # tree has roots past the cut too, which no verdict keeps)
    assert len(runs[False]) == len(runs[True]) and all(
        graphed.get(root) == branch for eager, graphed in zip(runs[False], runs[True]) for root, branch in eager.items()
    ), runs
    assert sum(g.n_roots > 1 for g in bodies) >= len(trees) / 2, len(bodies)
    assert any(g.cut and g.through_end for g in bodies)  # (a fresh rollout after a miss: read with its verdict)
    assert any(t.read_ends for t in trees)
assert {0, 1, 4} <= windows and windows & {2, 3}, windows  # (empty, cut and whole windows)
print("ok")
"""

STREAM_PASS_GRAPH = TINY_PAIR + """
from mirrorsd.decoding.engine import Proposal
from mirrorsd.decoding.streams.adapters import StreamAdapters, StreamConfig
from mirrorsd.decoding.streams.passes import StreamPassGraph, fused_forward, graphed_pass, read_pass
from mirrorsd.sampling import Noise, SamplingParams
from tests.helpers import tiny_hf

def adapters(model):
    cfg = model.config
    torch.manual_seed(4)
    made = StreamAdapters(model, StreamConfig(streams=2, layers=1, hidden_size=cfg.hidden_size,
                                              n_layers=cfg.n_layers, vocab_size=cfg.vocab_size)).eval()
    with torch.no_grad():
        made.stream_embed.normal_(0.0, 0.5)  # (zero embeddings would make the streams their node's copy)
    return made

streams = adapters(target)
# A pass as one graph (its body eager here) gives the eager pass's bits: logits, own tokens and every row's stream
# candidates, for a chain and a tree, under a trunk of one token and of three
params = SamplingParams()
for trunk, tree in (([9], Proposal([4, 5], [-1, 0])), ([7, 8, 9], Proposal([4, 5, 6], [-1, -1, 0])),
                    ([9], Proposal())):
    eager_cache, graph_cache = target.new_cache(capacity=64), target.new_cache(capacity=64)
    with torch.no_grad():
        for cache in (eager_cache, graph_cache):
            target(torch.arange(3, 13)[None], cache=cache)
        forward = fused_forward(target, streams, eager_cache, trunk, tree)
        read = read_pass(target, forward, params, 3) or None
        outs = []
        for _ in range(2):  # (a shape's first sight: None)
            outs.append(graphed_pass(target, streams, graph_cache, trunk, tree, params, Noise.TARGET, 2, 3, None))
            graph_cache.truncate(10)
    assert outs[0] is None and outs[1] is not None
    graphed, graphed_read = outs[1]
    assert torch.equal(graphed.main_logits, forward.main_logits), trunk
    own = forward.main_logits.argmax(-1).tolist()
    assert graphed_read.own == own, trunk
    out = forward.out[0]
    m = len(forward.kept)
    from mirrorsd.decoding.streams.passes import stream_tops
    ids, logprobs = stream_tops(target, out[m + (len(trunk) - 1) * 2:m + m * 2], 2, 3)
    assert [g.tokens for g in graphed_read.guesses] == ids.tolist(), trunk
    assert [g.logprobs for g in graphed_read.guesses] == logprobs.tolist(), trunk
    for layer in range(2):  # the pass's rows went where the eager pass put them
        n = len(trunk) + len(tree.tokens)
        assert torch.equal(graph_cache.keys[layer][:, :, 10:10 + n], eager_cache.keys[layer][:, :, 10:10 + n])

# ss (threshold 0: nothing pruned, as off the CPU) and sd with a draft_streams draft: passes replayed through their
# graphs from a shape's second sight, every token ar's
bodies, body = [], StreamPassGraph.body

def counted(self, *args):
    bodies.append(self)
    return body(self, *args)

StreamPassGraph.body = counted
draft2 = Transformer.from_hf(tiny_hf("qwen2", vocab=64, layers=2, seed=2, std=0.3), linear="dense")
prompt = [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]
want = generate(target, prompt, method="ar", max_new_tokens=40).token_ids
import tempfile
from pathlib import Path
from mirrorsd import draft_vocab as dv
tables = Path(tempfile.mkdtemp())  # a frequency table for the tiny vocabulary (any ranking is a valid table)
torch.save(torch.randperm(64, generator=torch.Generator().manual_seed(64)).int(), tables / "vocab64.pt")
dv.table_path = lambda vocab, kind="corpus": tables / dv.TABLE_FILES["corpus"].format(vocab)
sd_streams = {"draft": draft2, "draft_streams": adapters(draft2), "confidence": 0.0, "suffix_match": 0, "gamma": 3}
for method, kwargs in (("ss", {"streams": streams, "threshold": 0.0, "suffix_match": 0}),
                       ("sd", sd_streams), ("sd", {**sd_streams, "draft_vocab": 8})):
    bodies.clear()
    got = generate(target, prompt, method=method, max_new_tokens=40, **kwargs)
    assert got.token_ids == want, method
    assert len(bodies) >= 3, (method, len(bodies))
    # the main rows read the reduced head where draft_vocab asks (the graph's own token then a subset id)
    assert all(g.main_head is not None for g in bodies) == ("draft_vocab" in kwargs), method
print("ok")
"""

STREAM_DRAFT_GRAPH = TINY_PAIR + """
from mirrorsd.bench.gpu import ExitOracle, OracleDraft, OracleStreams
from mirrorsd.decoding.drafting import DraftSampler
from mirrorsd.decoding.mirror.draft import LocalDraft
from mirrorsd.decoding.streams.adapters import StreamConfig
from mirrorsd.decoding.streams.rollout_graph import StreamDraftGraph, graphed_stream_draft
from mirrorsd.sampling import SamplingParams
from tests.helpers import tiny_hf

draft = Transformer.from_hf(tiny_hf("qwen2", vocab=64, layers=2, seed=2, std=0.3), linear="dense")  # (N_s = 1)
cfg = draft.config
streams = OracleStreams(draft, StreamConfig(streams=2, layers=1, hidden_size=cfg.hidden_size, n_layers=cfg.n_layers,
                                            vocab_size=cfg.vocab_size)).eval()

# The device-side verdicts, on a draft whose main stream follows a reference and whose streams guess it right at a
# chosen rate: every branch's tokens are the reference after its root, each pass adds its accepted guesses and one
# token, and the entries are the slots of the branch's inputs
prompt, answer = [3, 4, 5, 6], torch.randint(0, 64, (40,)).tolist()
reference = prompt + answer
for hit, params in ((1.0, {}), (0.0, {}), (0.5, {}), (0.5, {"temperature": 0.8, "seed": 5})):
    oracle = OracleDraft.wrap(draft, prompt, answer, None, stream_hit=hit)
    sampler = DraftSampler(oracle, 64, SamplingParams(**params))
    cache = oracle.new_cache(capacity=16)
    with torch.no_grad():
        outs = []
        for _ in range(2):  # (a shape's first sight: None)
            outs.append(graphed_stream_draft(oracle, streams, cache, sampler, [3, 4, 5], [2, 3, 3], [9, 6, 7], 3, 2))
            cache.truncate(0)
    assert outs[0] is None and outs[1] is not None
    tokens, counts, entries, _ = outs[1]
    counts = counts.tolist()
    if hit == 1.0:
        assert counts == [1 + 2 * 3] * 3, counts  # the first pass has no guesses, then every one holds
    if hit == 0.0:
        assert counts == [3] * 3, counts
    for r, at in enumerate([2, 3, 3]):
        assert tokens[r, :counts[r]].tolist() == reference[at + 1:at + 1 + counts[r]], (hit, params, r)
        slots = entries[r, :counts[r]].tolist()
        assert slots[0] == 3 + r and slots == sorted(set(slots)), slots  # the root's row, then ascending
    if hit == 0.5:
        assert len(set(counts)) > 1 or counts[0] > 3, counts  # (some guesses held)

# Mirror-SD with draft_streams: graphed rollouts (from a shape's second sight) draw the tokens the host-driven ones
# do (those cut at γ, these at their counts), and the output is ar's
bodies, body = [], StreamDraftGraph.body

def counted(self, *args):
    bodies.append(self)
    return body(self, *args)

StreamDraftGraph.body = counted
trees, rollout = [], LocalDraft.rollout

def recorded(self, *args):
    tree = rollout(self, *args)
    counts = tree.counts.tolist() if tree.counts is not None else [len(t) for t in tree.tokens]
    trees.append([list(t)[:c] for t, c in zip(tree.tokens.tolist() if tree.counts is not None else tree.tokens,
                                                 counts)])
    return tree

LocalDraft.rollout = recorded
plain = OracleStreams(draft, streams.config).eval()  # (random streams: few guesses hold)
import tempfile
from pathlib import Path
from mirrorsd import draft_vocab as dv
tables = Path(tempfile.mkdtemp())  # a frequency table for the tiny vocabulary (any ranking is a valid table)
torch.save(torch.randperm(64, generator=torch.Generator().manual_seed(64)).int(), tables / "vocab64.pt")
dv.table_path = lambda vocab, kind="corpus": tables / dv.TABLE_FILES["corpus"].format(vocab)
# (greedy's device verdicts: the oracle's above; with a reduced draft vocabulary the graph's greedy choice takes the
# head's columns, which map back to ids: a sampled choice takes full rows, as without one)
for temperature, vocab in ((0.8, 0), (0.0, 16)):
    kw = dict(max_new_tokens=8, temperature=temperature, seed=3)
    want = generate(target, prompt * 3, method="ar", **kw).token_ids
    runs = {}
    for graphs in (False, True):
        trees.clear()
        bodies.clear()
        with cuda_graphs(graphs):  # (the exit oracle holds the correction half the time: kept branches and misses)
            m = generate(ExitOracle.wrap(target, prompt * 3, want, 0.5, 2), prompt * 3, method="mirror", draft=draft,
                         draft_streams=plain, roots="paper", confidence=0.0, gamma=3, kappa=2, backend="serial",
                         exit_head="lens", exit_vocab=0, draft_vocab=vocab, **kw)
        assert m.token_ids == want, (temperature, vocab, graphs)
        hits = [s.hit for s in m.stats.extra["mirror"].steps]
        assert True in hits and False in hits, hits
        runs[graphs] = list(trees)
    assert bodies and len(runs[True]) == len(runs[False]), (len(bodies), runs)
    for graphed, eager in zip(runs[True], runs[False]):
        assert all(g[:len(e)] == e[:len(g)] for g, e in zip(graphed, eager, strict=True)), (graphed, eager)
print("ok")
"""

CHOICE = TINY_PAIR + """
import mirrorsd.execution as execution
from mirrorsd.decoding import ar
from mirrorsd.decoding.engine import RunAheadScorer
from mirrorsd.sampling import SamplingParams, choose

inside, chosen_eagerly = [], execution.choose

def counted(*args, **kwargs):
    inside.append(args[2])
    return chosen_eagerly(*args, **kwargs)

execution.choose = counted  # what a whole forward's graph body chooses
ar.ChainScorer = lambda model, whole_prompt: RunAheadScorer(model)  # CUDA's ar, forced
prompt = list(range(3, 20))
for params in ({}, {"temperature": 0.8, "seed": 3}, {"temperature": 0.8, "top_k": 5, "seed": 4}):
    kw = dict(max_new_tokens=10, **params)
    with cuda_graphs(False):
        want = generate(target, prompt, method="ar", **kw).token_ids
    inside.clear()
    with cuda_graphs(True):
        assert generate(target, prompt, method="ar", **kw).token_ids == want, params
    assert len(inside) >= 7, (params, len(inside))  # 9 run ahead, each in its graph from the shape's second sight
    if not params:  # (the CPU takes a sampled window's rows one by one: rows_apart)
        inside.clear()
        with cuda_graphs(True):
            sd = generate(target, prompt, method="sd", draft=draft, confidence=0.0, gamma=3, suffix_match=0, **kw)
        assert sd.token_ids == want
        assert 0 < len(inside) >= sd.stats.steps - 3, (len(inside), sd.stats.steps)

# the seed is the graph's input: a sampled request replays another's graph, with its own noise
cache = target.new_cache(capacity=32)

def graphs(**params):
    p = SamplingParams(**params)
    with torch.no_grad():
        logits, own = target.forward_and_choose(torch.tensor([[7, 8, 9]]), p, cache=cache)
    cache.truncate(0)
    assert torch.equal(own[0], choose(logits[0], [1, 2, 3], p)), params
    return len([key for key, g in cache.graphs().items() if g and key[-1] is not None])  # whole forwards choosing

assert [graphs(seed=1), graphs(seed=2)] == [0, 1]
assert [graphs(temperature=0.8, seed=1), graphs(temperature=0.8, seed=2), graphs(temperature=0.8, seed=3)] == [1, 2, 2]
assert graphs(temperature=0.7, seed=3) == 1  # other parameters: their own graph (seen once), 0.8's dropped
assert graphs(seed=4) == 1  # (greedy's kept)
print("ok")
"""

BATCHED = TINY_PAIR + """
import threading
import mirrorsd
from mirrorsd.batching import Batcher
from mirrorsd.execution import batches
from tests.helpers import random_adapters

assert batches(target) and batches(draft)  # the fused layers: continuous batching on a GPU
adapters = random_adapters(target, 2, 1, 0, std=0.1)
RUNS = [("ar", [3, 4, 5], 0.0, 0), ("sd", list(range(3, 20)), 0.0, 0), ("suffix", [5, 6, 5, 6, 5, 6, 5], 0.0, 0),
        ("ss", [9, 8, 7, 9, 8], 0.0, 0), ("ar", [9, 8], 0.8, 3), ("sd", [7, 7, 7, 1], 0.8, 5)]

def tokens(method, prompt, temperature, seed):
    options = {"draft": draft} if method == "sd" else {"streams": adapters} if method == "ss" else {}
    return mirrorsd.generate(target, prompt, method=method, max_new_tokens=8, temperature=temperature, seed=seed,
                             **options).token_ids

alone = [tokens(*run) for run in RUNS]
batcher = Batcher(speculation="fixed")
out = [None] * len(RUNS)

def member(i, run):
    try:
        with batcher.member():
            out[i] = tokens(*run)
    except BaseException as error:
        out[i] = error

threads = [threading.Thread(target=member, args=(i, run)) for i, run in enumerate(RUNS)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(600)
assert out == alone, (out, alone)
shared = max(step.windows + step.prompts for step in batcher.steps)
assert shared >= 3, shared  # the requests' windows shared forwards
print("ok")
"""

LAUNCHES = FORCE_CUDA_PATH + """
from torch.utils._python_dispatch import TorchDispatchMode
from mirrorsd import Transformer
from mirrorsd.kernels import cuda_layers
from tests.helpers import tiny_hf

VIEWS = {"view", "_unsafe_view", "t", "transpose", "slice", "select", "expand", "as_strided", "reshape", "alias",
         "detach", "lift_fresh"}

inside_triton = []

class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS and not inside_triton:  # (the interpreter's own tensor work is no launch)
            self.ops.append(name)
        return func(*args, **(kwargs or {}))

def launch(name, real):
    def call(*args, **kwargs):
        launches.append(name)
        inside_triton.append(name)
        try:
            return real(*args, **kwargs)
        finally:
            inside_triton.pop()
    return call

launches = []
for name in ("rms_norm", "rope_write", "silu_mul"):
    setattr(cuda_layers, name, launch(name, getattr(cuda_layers, name)))
cuda_attention.attend = launch("attend", cuda_attention.attend)

force(True)
model = Transformer.from_hf(tiny_hf("qwen2", vocab=64, layers=2, std=0.1), linear="dense")
cache = model.new_cache(capacity=32)
hidden = model.embed(torch.tensor([[1, 2, 3, 4]]))
positions = torch.arange(4)[None]
with torch.no_grad():
    mirrorsd.execution.fused_layers(model, hidden, positions, cache, None, 0, 2)  # merges the weights
    cache.truncate(0)
    counts = []
    for layers in (1, 2):
        launches.clear()
        with Count() as mode:
            mirrorsd.execution.fused_layers(model, hidden, positions, cache, None, 0, layers)
        cache.truncate(0)
        counts.append(mode.ops + launches)
one, two = counts
per_layer = len(two) - len(one)
assert per_layer <= 10, (per_layer, one, two)
print("ok", per_layer, one, two)
"""


def _interpret(code: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=900, cwd=REPO)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
    return done.stdout


def test_fused_layers_match_the_eager_layers_and_decode_windows_and_trees_bit_for_bit():
    """Qwen2 (QKV biases), Qwen3 (per-head norms) and Llama with an output bias, in fp32 and bf16: logits within
    rounding of the eager layers, the same with no cache, and windows and trees bit for bit one-token decoding."""
    _interpret(ARCHS)


def test_windows_and_trees_after_a_long_context_decode_bit_for_bit():
    """After a context where each query's keys are split over programs and merged by the last split to finish:
    windows and trees still decode bit for bit."""
    _interpret(LONG)


def test_methods_on_the_fused_path_equal_ar():
    """``sd``, ``suffix``, ``ss`` (stream rows through the fused layers) and serial Mirror-SD equal ``ar``."""
    _interpret(METHODS)


def test_a_fused_layer_is_at_most_ten_launches():
    """Every op a layer dispatches (GEMMs, in-place adds) plus its Triton kernels, counted on the CPU."""
    _interpret(LAUNCHES)


@pytest.mark.slow  # (~140-240 s in Triton's interpreter; tests/test_cuda.py runs it compiled on a GPU)
def test_a_stream_pass_as_one_graph_gives_the_eager_passs_bits():
    """Issue 61 item 2 for ``ss``: a Speculative Streaming pass through
    :class:`~mirrorsd.decoding.streams.passes.StreamPassGraph` (gather lists from the tree's shape and the cache
    length on the device; the main rows' choice and every row's stream candidates inside; eager here, captured on
    CUDA) gives the eager pass's logits, tokens, candidates and cache rows bit for bit, for chains, trees and longer
    trunks; and ``ss`` and ``sd`` with a ``draft_streams`` draft run their passes through it, equal to ``ar``."""
    _interpret(STREAM_PASS_GRAPH)


@pytest.mark.slow  # (~140-240 s in Triton's interpreter; tests/test_cuda.py runs it compiled on a GPU)
def test_a_stream_rollout_as_one_graph_verifies_its_passes_on_the_device():
    """Issue 62 item 2: Mirror-SD's ``draft_streams`` rollout through
    :class:`~mirrorsd.decoding.streams.rollout_graph.StreamDraftGraph` (fixed passes, chains of stream guesses
    verified on the device; eager here, captured on CUDA). With the bench's oracle draft every branch's tokens are
    the reference after its root, its count is one token for the first pass plus the guesses that held and one token
    for each later pass, and its entries are its inputs' slots (greedy and sampled); in Mirror-SD the graphed
    rollouts draw the host-driven ones' tokens with a request's noise, and the output is ``ar``'s."""
    _interpret(STREAM_DRAFT_GRAPH)


def test_a_whole_forward_chooses_its_tokens_inside_its_graph():
    """Issue 61's one graph per step: ``ar`` run ahead and ``sd``'s verification choose each row's token inside the
    whole forward's graph body (greedy and sampled; eager here, captured on CUDA), the same tokens as without graphs,
    and a sampled graph takes the seed as an input, so another request's seed replays it."""
    _interpret(CHOICE)


def test_requests_batched_on_the_fused_layers_get_their_alone_tokens():
    """Issue 57 item 1 on CUDA: several requests' windows through one call of the fused layers (the norms and GEMMs
    on every row at once, in fixed-row slabs; RoPE, the cache writes and attention per request over its own cache,
    on per-query gather lists), and the heads through one product: every request's tokens are those it gets alone
    (``ar``, ``sd`` with its draft batched too, ``suffix``, ``ss`` with stream rows; greedy and seeded)."""
    _interpret(BATCHED)


def test_a_draft_as_one_graph_draws_the_tokens_of_its_steps_one_by_one():
    """Mirror-SD's tree rollout and ``sd``'s fixed window through :class:`~mirrorsd.decoding.draft_graph.DraftGraph`
    (the gather lists computed on the device, every step's choice inside; eager here, captured on CUDA) draw every
    branch's tokens, and the same windows, exactly as the steps issued one by one do, greedy and sampled, from a
    shape's second sight on."""
    _interpret(DRAFT_GRAPH)


def test_the_confidence_rule_inside_the_draft_graph():
    """Issue 61 item 2 under the confidence rule (``sd``'s and Mirror-SD's default on a GPU): ``sd``'s window as one
    :class:`~mirrorsd.decoding.draft_graph.DraftGraph` whose steps after the first doubtful token are skipped on the
    device (conditional nodes on CUDA; eager here), read once with the verdict and cut there; Mirror-SD's tree
    rollouts with their top probabilities inside the graph and each branch's window end computed on the device, and
    its fresh rollouts as cut chains that feed their last token too, read with the verdict. The same windows, draft
    steps and branches as the host loops' (greedy and sampled; and with every step run, as where PyTorch has no
    conditional nodes), and ``ar``'s tokens."""
    _interpret(CONFIDENT_DRAFT_GRAPH)

"""CUDA-gated tests: every path that only a GPU exercises (issue 21). Skipped without CUDA; `mirrorsd bench gpu`
runs this file first on a lent GPU machine.

Models are random weights of small shapes made on the device (`mirrorsd.bench.gpu.random_model`). On CUDA the
model runs its GEMMs and norms at fixed shapes and attends through a batch-invariant kernel, so a k-token forward
reproduces 1-token forwards bit for bit and every method must equal `ar` exactly, in bf16 too."""

from __future__ import annotations

import warnings

import pytest
import torch

from mirrorsd import generate
from mirrorsd.bench import gpu
from mirrorsd.bench.forward import forward_costs
from mirrorsd.cuda_graphs import cuda_graphs
from mirrorsd.decoding.streams.adapters import StreamAdapters, StreamConfig
from mirrorsd.linear import DenseLinear, make_linear
from mirrorsd.quant import GroupQuant, quantize_q8
from tests.helpers import assert_graphed_windows_decode_bit_for_bit, assert_windows_and_trees_decode_bit_for_bit

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
PROMPT = list(range(7, 71))
#: Long enough that every attention split walks two key blocks (BLOCK_KEYS * SPLITS is 1,024).
LONG_PROMPT = [7 + (i * 7919) % 30000 for i in range(1100)]


def _pair(dtype: torch.dtype, draft_device: torch.device = CUDA):
    target = gpu.random_model(gpu.DRY_SHAPES["qwen2.5-1.5b"], CUDA, dtype, seed=1)
    draft = gpu.random_model(gpu.DRY_SHAPES[gpu.DRAFT], draft_device,
                             dtype if draft_device.type == "cuda" else torch.float32, seed=0)
    return target, draft


def _graphs_run(monkeypatch, cls: type, method: str) -> list:
    """Every ``cls`` graph that runs (through ``method``), in order: a test reads their captures and failures."""
    made, call = [], getattr(cls, method)

    def spied(self, *args):
        made.append(self)
        return call(self, *args)

    monkeypatch.setattr(cls, method, spied)
    return made


def _assert_lossless(target, got: list[int], want: list[int]) -> None:
    assert got == want, gpu.divergence(target, PROMPT, got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method, options", [
    ("sd", {}), ("suffix", {}), ("mirror", {"backend": "serial"}), ("mirror", {"backend": "cuda-streams"}),
    ("mirror", {"backend": "cuda-streams", "roots": "budget"}),
    # every candidate a root: the exit's top-κ and a fresh window reach the worker's stream on the device
    ("mirror", {"backend": "cuda-streams", "roots": "paper", "confidence": 0.0}),
    ("mirror", {"backend": "serial", "roots": "paper", "confidence": 0.0}),
])
def test_methods_on_cuda_equal_ar(dtype, method, options):
    target, draft = _pair(dtype)
    assert target.device.type == "cuda" and target.dtype == dtype
    want = generate(target, PROMPT, method="ar", max_new_tokens=32, temperature=0.0).token_ids
    kwargs = {"draft": draft} if method in ("sd", "mirror") else {}
    got = generate(target, PROMPT, method=method, max_new_tokens=32, temperature=0.0, **kwargs, **options)
    _assert_lossless(target, got.token_ids, want)


@pytest.mark.parametrize("params", [{"temperature": 0.8}, {"temperature": 0.8, "top_k": 20},
                                    {"temperature": 0.9, "top_p": 0.8}])
def test_seeded_sampling_on_cuda_equals_ar(params):
    """``ar`` draws each token on the device as it runs ahead; ``sd`` draws a window's rows in one op (``top_p``:
    row by row): the same position-keyed noise either way."""
    target, draft = _pair(torch.float32)
    want = generate(target, PROMPT, method="ar", max_new_tokens=24, seed=5, **params).token_ids
    got = generate(target, PROMPT, method="sd", draft=draft, max_new_tokens=24, seed=5, **params).token_ids
    _assert_lossless(target, got, want)


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 5}])
def test_a_fixed_sd_window_reads_the_host_once_per_step(params):
    """At ``confidence=0`` the draft's window stays on the device until the verdict reads it with the target's own
    tokens, and the draft's cache is leased like the target's (its graphs replay from the next request's first step):
    once warm, a step syncs with the host once (issue 61, item 2)."""
    target, draft = _pair(torch.bfloat16)
    options = dict(method="sd", draft=draft, confidence=0.0, suffix_match=0, **params)
    want = generate(target, PROMPT, method="ar", max_new_tokens=48, **params).token_ids
    _assert_lossless(target, generate(target, PROMPT, max_new_tokens=48, **options).token_ids, want)  # (captures)
    assert draft.spare_caches
    syncs = gpu.host_syncs_per_step(target, PROMPT, tokens=48, **options)
    assert syncs is not None and syncs <= 1.2, syncs


def _assert_mirror_syncs_once_per_step(**options) -> None:
    """Every exit candidate a root, γ fixed: the exit's top-κ feed the rollouts on the device, the verdict picks the
    kept branch on the device and reads it with its own tokens, and the next step feeds that branch as it is: once
    warm, a step syncs with the host once (issue 62, item 1; issue 61, item 2's Mirror-SD serial path)."""
    target, draft = _pair(torch.bfloat16)
    options = dict(method="mirror", draft=draft, roots="paper", kappa=4, **{"confidence": 0.0, **options})
    want = generate(target, PROMPT, method="ar", max_new_tokens=48, temperature=0.0).token_ids
    _assert_lossless(target, generate(target, PROMPT, max_new_tokens=48, temperature=0.0, **options).token_ids, want)
    syncs = gpu.host_syncs_per_step(target, PROMPT, tokens=48, **options)
    assert syncs is not None and syncs <= 1.2, syncs


def test_a_serial_mirror_step_with_paper_roots_reads_the_host_once_per_step():
    _assert_mirror_syncs_once_per_step(backend="serial")


def test_a_serial_mirror_step_under_the_confidence_rule_reads_the_host_once_per_step():
    """The same with the rule on: each branch's window end rides the verdict's read, and a fresh rollout after a
    miss is a window cut on the device and read with its verdict."""
    _assert_mirror_syncs_once_per_step(backend="serial", confidence=_median_top(_pair(torch.bfloat16)[1]))


def test_paper_roots_issued_inline_read_the_host_once_per_step():
    """The same on ``cuda-streams`` with no worker thread; `bench gpu` runs its `paper` forced row only if it passes."""
    _assert_mirror_syncs_once_per_step(backend="cuda-streams", draft_issue="inline")


def _median_top(draft) -> float:
    """A confidence threshold that the random draft's tokens fall below now and then: the median of its top
    probabilities over the prompt that are below 1. Its logits spread ~8 (``gpu.LOGIT_STD``), so most top
    probabilities round to 1.0, the median of them all too, and the option takes [0, 1) only."""
    with torch.no_grad():
        logits = draft(torch.tensor([PROMPT], device=CUDA))[0].float()
    top = (logits.max(-1).values - logits.logsumexp(-1)).exp()
    below = top[top < 1]
    assert below.numel() >= 4, top  # some doubt to decide on
    return float(below.median())


def test_the_confidence_rule_decided_on_the_device_reads_the_host_once_per_step(monkeypatch):
    """Issue 61 item 2 under ``sd``'s default rule: the window's steps after the first doubtful token are skipped
    inside its captured graph (conditional nodes), and the window is read once, with the verdict, cut there: still
    lossless, greedy and seeded, and once warm a step syncs with the host once."""
    from mirrorsd.decoding.draft_graph import DraftGraph

    made = _graphs_run(monkeypatch, DraftGraph, "feed")
    target, draft = _pair(torch.bfloat16)
    options = dict(method="sd", draft=draft, confidence=_median_top(draft), suffix_match=0, gamma=6)
    for params in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 5}):
        made.clear()
        want = generate(target, PROMPT, method="ar", max_new_tokens=48, **params).token_ids
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = generate(target, PROMPT, max_new_tokens=48, **options, **params)
        _assert_lossless(target, got.token_ids, want)
        assert not [w for w in caught if "capture failed" in str(w.message)], [str(w.message) for w in caught]
        assert any(g.graph is not None and g.cut for g in made) and not any(g.failed for g in made), params
        syncs = gpu.host_syncs_per_step(target, PROMPT, tokens=48, **options, **params)
        assert syncs is not None and syncs <= 1.2, (params, syncs)


@pytest.mark.parametrize("options", [{"backend": "serial"}, {"backend": "cuda-streams", "draft_issue": "inline"}])
def test_drafts_replay_as_one_captured_graph(monkeypatch, options):
    """Issue 62, item 1: a rollout's γ steps and their token choices are one CUDA graph
    (:class:`~mirrorsd.decoding.draft_graph.DraftGraph`), captured without a host read inside (a read would fail the
    capture, which then warns and stays eager), replayed from a shape's third sight, and still lossless, greedy and
    seeded, under the confidence rule too (every step's top probabilities inside); so is ``sd``'s fixed window (one
    root: a chain)."""
    from mirrorsd.decoding.draft_graph import DraftGraph

    made = _graphs_run(monkeypatch, DraftGraph, "feed")
    target, draft = _pair(torch.bfloat16)
    for params in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 5}):
        want = generate(target, PROMPT, method="ar", max_new_tokens=48, **params).token_ids
        for method, kwargs in [("mirror", dict(roots="paper", confidence=0.0, kappa=4, **options)),
                               ("mirror", dict(roots="paper", confidence=_median_top(draft), kappa=4, **options)),
                               ("sd", dict(confidence=0.0, suffix_match=0))]:
            made.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = generate(target, PROMPT, method=method, draft=draft, max_new_tokens=48, **kwargs, **params)
            _assert_lossless(target, got.token_ids, want)
            assert not [w for w in caught if "capture failed" in str(w.message)], [str(w.message) for w in caught]
            replayed = [g for g in made if g.graph is not None]
            assert replayed and not any(g.failed for g in made), (method, params)
            if method == "mirror":
                assert any(g.n_roots > 1 for g in replayed), params  # the tree rollouts, not only the fresh chains
                assert got.stats.extra["mirror"].to_dict()["rollouts_as_one_graph"] >= 0.5, params


@pytest.mark.parametrize("options", [{"backend": "serial"}, {"backend": "cuda-streams", "draft_issue": "inline"}])
def test_stream_rollouts_replay_as_one_captured_graph(monkeypatch, options):
    """Issue 62, item 2: with ``draft_streams`` a tree rollout's passes are one CUDA graph
    (:class:`~mirrorsd.decoding.streams.rollout_graph.StreamDraftGraph`: J passes, each verified on the device),
    captured without a host read inside, replayed, and still lossless, greedy and seeded, with the oracle draft's
    streams guessing right half the time (so branches accept different counts) and the exit oracle holding the
    correction half the time (kept branches and misses)."""
    from mirrorsd.decoding.streams.rollout_graph import StreamDraftGraph

    made = _graphs_run(monkeypatch, StreamDraftGraph, "feed")
    target, draft = _pair(torch.bfloat16)
    streams = gpu.oracle_streams(draft)
    for params in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 5}):
        want = generate(target, PROMPT, method="ar", max_new_tokens=48, **params).token_ids
        oracle = gpu.OracleDraft.wrap(draft, PROMPT, want, 3, stream_hit=0.5)
        made.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = generate(gpu.ExitOracle.wrap(target, PROMPT, want, 0.5, 2), PROMPT, method="mirror", draft=oracle,
                           draft_streams=streams, roots="paper", confidence=0.0, kappa=2, gamma=3, exit_head="lens",
                           exit_vocab=0, max_new_tokens=48, **options, **params)
        _assert_lossless(target, got.token_ids, want)
        hits = [s.hit for s in got.stats.extra["mirror"].steps]
        assert True in hits and False in hits, hits  # kept ragged branches, and misses
        assert not [w for w in caught if "capture failed" in str(w.message)], [str(w.message) for w in caught]
        replayed = [g for g in made if g.graph is not None]
        assert replayed and not any(g.failed for g in made), params
        assert got.stats.extra["mirror"].to_dict()["rollouts_as_one_graph"] >= 0.5, params


#: (roots, κ, ℓe, γ, backend options, temperature): every root mode, κ, ℓe and γ, each backend on this device, greedy
#: and seeded (issue 62, item 7)
MIRROR_SETTINGS = [
    ("paper", 4, 0.5, 7, {"backend": "serial"}, 0.0),
    ("paper", 8, 0.25, 3, {"backend": "cuda-streams", "draft_issue": "inline"}, 0.0),
    ("paper", 1, 0.75, 1, {"backend": "cuda-streams"}, 0.8),
    ("paper", 2, 0.5, 7, {"backend": "cuda-streams", "draft_issue": "inline"}, 0.8),
    ("budget", 4, 0.5, 5, {"backend": "cuda-streams", "budget": 3}, 0.8),
    ("budget", 2, 0.75, 3, {"backend": "serial", "budget": 3}, 0.0),
]


def assert_mirror_with_oracles_equals_ar(target, draft, roots, kappa, exit_layer, gamma, options,
                                         temperature) -> None:
    """Mirror-SD with the exit oracle at a 0.5 hit rate and the oracle draft accepting 2 a window: kept branches and
    misses both, and windows cut at the end of the output (44 tokens); every token the target's."""
    kw = dict(max_new_tokens=44, temperature=temperature, seed=5)
    reference = generate(target, PROMPT, method="ar", **kw).token_ids
    got = generate(gpu.ExitOracle.wrap(target, PROMPT, reference, 0.5, kappa), PROMPT, method="mirror",
                   draft=gpu.OracleDraft.wrap(draft, PROMPT, reference, 2), gamma=gamma, kappa=kappa,
                   exit_layer=exit_layer, roots=roots, confidence=0.0, exit_head="lens", exit_vocab=0, **options, **kw)
    _assert_lossless(target, got.token_ids, reference)
    hits = [s.hit for s in got.stats.extra["mirror"].steps]
    assert True in hits and False in hits, hits
    assert got.stats.extra["mirror"].backend == options["backend"]


@pytest.mark.parametrize("roots, kappa, exit_layer, gamma, options, temperature", MIRROR_SETTINGS)
def test_mirror_with_oracles_equals_ar_in_every_setting(roots, kappa, exit_layer, gamma, options, temperature):
    target, draft = _pair(torch.bfloat16)
    assert_mirror_with_oracles_equals_ar(target, draft, roots, kappa, exit_layer, gamma, options, temperature)


def test_rejection_sampling_takes_guesses_made_on_the_host():
    """A suffix match's guesses are point masses made on the host: rejecting one on a GPU mixed devices."""
    target, draft = _pair(torch.float32)
    looped = PROMPT[:16] * 4  # (text a suffix match has continuations for)
    got = generate(target, looped, method="sd", draft=draft, acceptance="rejection", suffix_match=3,
                   max_new_tokens=48, temperature=1.0, seed=7)
    assert len(got.token_ids) == 48 and sum(got.stats.drafted) > sum(got.stats.accepted)  # (guesses rejected)


def test_requests_batched_on_cuda_get_their_alone_tokens():
    """Issue 57 item 1 on a GPU: several requests' windows through one call of the fused layers (RoPE, the cache
    writes and attention per request over its own cache), their heads through one product: every request's tokens
    are those it gets alone, in bf16, for ``ar``, ``sd`` (its draft batched too), ``suffix``, ``ss`` and Mirror-SD
    on the serial backend, greedy and seeded."""
    from mirrorsd.execution import batches

    target, draft = _pair(torch.bfloat16)
    assert batches(target) and batches(draft)
    cfg = target.config
    adapters = StreamAdapters(target, StreamConfig(streams=2, layers=1, hidden_size=cfg.hidden_size,
                                                   n_layers=cfg.n_layers, vocab_size=cfg.vocab_size))
    adapters = adapters.to(device=CUDA, dtype=torch.bfloat16).eval()
    requests = [dict(prompt=PROMPT, method="ar", temperature=0.0),
                dict(prompt=PROMPT[5:], method="sd", draft=draft, temperature=0.0),
                dict(prompt=PROMPT[:20] * 2, method="suffix", temperature=0.0),
                dict(prompt=PROMPT[3:], method="ss", streams=adapters, temperature=0.0),
                dict(prompt=PROMPT[1:], method="mirror", draft=draft, backend="serial", temperature=0.0),
                dict(prompt=PROMPT, method="ar", temperature=0.8, seed=3),
                dict(prompt=PROMPT[9:], method="sd", draft=draft, temperature=0.8, seed=5)]
    alone = [generate(target, max_new_tokens=24, **r).token_ids for r in requests]
    got, _, steps = gpu.run_batched(target, requests, 24)
    assert got == alone
    assert sum(step.windows > 1 for step in steps) >= 3  # the requests' windows shared forwards


def test_the_next_request_reuses_a_returned_cache_and_its_graphs():
    target, _ = _pair(torch.bfloat16)
    first = generate(target, PROMPT, method="ar", max_new_tokens=24, temperature=0.0)
    (cache,) = target.spare_caches
    graphs = {key: graph for key, graph in cache.graphs().items() if graph}
    assert graphs  # captured while the first request decoded
    sampled = generate(target, PROMPT[:40], method="ar", max_new_tokens=24, temperature=0.7, seed=1)
    assert target.spare_caches == [cache]
    again = generate(target, PROMPT, method="ar", max_new_tokens=24, temperature=0.0)
    assert again.token_ids == first.token_ids
    assert all(cache.graphs()[key] is graph for key, graph in graphs.items())  # replayed, not captured again
    with cuda_graphs(False):
        fresh = generate(gpu.random_model(gpu.DRY_SHAPES["qwen2.5-1.5b"], CUDA, torch.bfloat16, seed=1), PROMPT[:40],
                         method="ar", max_new_tokens=24, temperature=0.7, seed=1)
    assert sampled.token_ids == fresh.token_ids


def test_a_sampled_request_replays_the_graph_another_seed_captured():
    """``ar``'s forward run ahead chooses its token inside its graph, with the seed as an input: a request with
    another seed replays the graphs the first one captured, and its tokens are those of a run without graphs."""
    target, _ = _pair(torch.bfloat16)
    generate(target, PROMPT, method="ar", max_new_tokens=24, temperature=0.7, seed=1)
    (cache,) = target.spare_caches
    chosen = {key: graph for key, graph in cache.graphs().items() if graph and key[-1] not in (None, ("argmax",))}
    assert chosen and all(graph.graph is not None for graph in chosen.values())  # captured, none failed
    second = generate(target, PROMPT, method="ar", max_new_tokens=24, temperature=0.7, seed=2)
    assert all(cache.graphs()[key] is graph for key, graph in chosen.items())  # replayed, not captured again
    with cuda_graphs(False):
        want = generate(target, PROMPT, method="ar", max_new_tokens=24, temperature=0.7, seed=2)
    assert second.token_ids == want.token_ids


def test_ss_streams_on_cuda(monkeypatch):
    """``ss`` equals ``ar``; a pass that prunes nothing reads its verdict and every row's next guesses at once, and
    runs as one captured graph (:class:`~mirrorsd.decoding.streams.passes.StreamPassGraph`; issue 61, item 2), greedy
    and seeded."""
    from mirrorsd.decoding.streams.passes import StreamPassGraph

    made = _graphs_run(monkeypatch, StreamPassGraph, "__call__")
    target, _ = _pair(torch.bfloat16)
    cfg = target.config
    adapters = StreamAdapters(target, StreamConfig(streams=3, layers=2, hidden_size=cfg.hidden_size,
                                                   n_layers=cfg.n_layers, vocab_size=cfg.vocab_size))
    adapters = adapters.to(device=CUDA, dtype=torch.bfloat16).eval()
    want = generate(target, PROMPT, method="ar", max_new_tokens=24, temperature=0.0).token_ids
    got = generate(target, PROMPT, method="ss", streams=adapters, max_new_tokens=24, temperature=0.0).token_ids
    _assert_lossless(target, got, want)
    once = dict(method="ss", streams=adapters, threshold=0.0, suffix_match=0)
    for params in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 5}):
        made.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = generate(target, PROMPT, max_new_tokens=48, **once, **params).token_ids
        _assert_lossless(target, got, generate(target, PROMPT, method="ar", max_new_tokens=48, **params).token_ids)
        assert not [w for w in caught if "capture failed" in str(w.message)], [str(w.message) for w in caught]
        assert any(g.graph is not None for g in made) and not any(g.failed for g in made), params
    syncs = gpu.host_syncs_per_step(target, PROMPT, tokens=24, **once)
    assert syncs is not None and syncs <= 1.2, syncs


def test_devices_backend_with_the_draft_on_the_cpu():
    """Target on the GPU, draft on the host: only token ids cross between them."""
    target, draft = _pair(torch.float32, draft_device=torch.device("cpu"))
    want = generate(target, PROMPT, method="ar", max_new_tokens=24, temperature=0.0).token_ids
    got = generate(target, PROMPT, method="mirror", draft=draft, backend="devices", max_new_tokens=24,
                   temperature=0.0)
    _assert_lossless(target, got.token_ids, want)
    assert got.stats.extra["mirror"].backend == "devices"


def test_cuda_streams_overlap_the_draft():
    """The rollout runs on its own stream while the target finishes: some draft time is hidden, by the CUDA events'
    timestamps (the spans are on the device's clock, with the host's durations kept beside them)."""
    target, draft = _pair(torch.bfloat16)
    got = generate(target, PROMPT, method="mirror", draft=draft, backend="cuda-streams", max_new_tokens=48,
                   temperature=0.0)
    stats = got.stats.extra["mirror"].to_dict()
    assert stats["device_times"]
    assert all("host_ms" in s.args for s in got.stats.spans if s.name in ("rollout", "layers ≥ ℓe"))
    assert stats["hidden_draft_fraction"] is not None and stats["hidden_draft_fraction"] > 0


def test_quantized_weights_on_cuda_become_dense():
    q = quantize_q8(torch.randn(64, 96))
    layer = make_linear(GroupQuant(q.codes.to(CUDA), q.scales.to(CUDA), q.offsets.to(CUDA), q.group, q.bits))
    assert isinstance(layer, DenseLinear) and layer.weight.device.type == "cuda"


def test_forward_costs_synchronize():
    target, _ = _pair(torch.bfloat16)
    costs = forward_costs(target, (1, 8), context=32, rounds=2)
    assert set(costs) == {1, 8} and all(ms > 0 for ms in costs.values())


def test_bench_gpu_on_cuda(tmp_path, monkeypatch):
    """The validation command itself on the device, at small shapes."""
    monkeypatch.setattr(gpu, "REAL_SHAPES", gpu.DRY_SHAPES)
    monkeypatch.setattr(gpu, "TRAIN_RECIPE", gpu.TRAIN_RECIPE | gpu.DRY_TRAIN_RECIPE)
    monkeypatch.setattr(gpu, "run_cuda_tests", lambda *args, **kwargs: {"passed": []})  # (no pytest in pytest)
    report = gpu.run(tmp_path, device="cuda", tests=False, targets=("qwen2.5-1.5b",), accepts=(2,), max_new=16,
                     ks=(1, 2), progress=False, peer=False)
    assert not report["dry_run"] and report["dtype"] == "torch.bfloat16"
    for m in report["methods"]:
        assert m["equal_to_ar"], m
    assert all(r["mirror"]["backend"] == "cuda-streams" for r in report["forced"])
    assert report["train"]["qwen2.5-1.5b"]["step_ms"] > 0


class _CharTokenizer:
    """All that `train()` asks of a tokenizer (`tokenizer(text, add_special_tokens=False)["input_ids"]`), for a
    512-token random model: no tokenizer files travel to a lent GPU machine."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 512 for c in text]}


def train_streams_on(device: torch.device, tmp_path) -> None:
    """`train-streams`' `train()` unchanged on ``device``: caches states, trains, resumes, saves an adapter that
    `ss` loads onto the same device and decodes with, equal to `ar`."""
    import json

    from mirrorsd.train_streams import train

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = gpu.random_model(gpu.DRY_SHAPES["qwen2.5-1.5b"], device, dtype, seed=1)
    out = tmp_path / "adapter"
    options = {"streams": 2, "layers": 2, "rank": 4, "chunks": 3, "seq_len": 32, "held_out": 1, "vocab": 0,
               "eval_every": 2, "save_every": 1, "progress": False}
    train(model, model, _CharTokenizer(), ["pydoc-topics"], out, steps=2, **options)
    summary = train(model, model, _CharTokenizer(), ["pydoc-topics"], out, steps=4, **options)  # resumes at 2
    assert summary["steps"] == 4 and summary["dtype"] == str(dtype).removeprefix("torch.")
    assert [point["step"] for point in json.loads((out / "curve.json").read_text())] == [0, 2, 4]
    assert all(p.device.type == device.type for p in model.parameters())
    want = generate(model, PROMPT, method="ar", max_new_tokens=24, temperature=0.0).token_ids
    got = generate(model, PROMPT, method="ss", streams=str(out), max_new_tokens=24, temperature=0.0).token_ids
    _assert_lossless(model, got, want)


def test_train_streams_runs_unchanged_on_cuda(tmp_path):
    train_streams_on(CUDA, tmp_path)


def test_train_eagle_runs_on_cuda(tmp_path):
    """The head was made on the host and trained under a CPU autocast: a device mismatch at its first step."""
    from mirrorsd import Transformer
    from mirrorsd.train_eagle import train
    from tests.helpers import tiny_hf

    target = Transformer.from_hf(tiny_hf(layers=4, seed=1), linear="dense").to(CUDA)  # (packed: CPU kernels)
    text = tmp_path / "corpus.txt"
    text.write_text("".join(chr(65 + (i * 7) % 29) for i in range(1200)))

    def tokenizer(text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 64 for c in text]}

    summary = train(target, tokenizer, [str(text)], tmp_path / "out", model_name="t", decode_format="fp32",
                    chunks=8, seq_len=32, steps=4, held_out=2, vocab=0, depth=2, eval_every=4, progress=False)
    assert summary["tokens_per_pass_after"] >= 1 and (tmp_path / "out" / "eagle_head.safetensors").exists()


def test_train_costs_on_cuda():
    target, _ = _pair(torch.bfloat16)
    costs = gpu.train_costs(target, steps=2, chunks=2, recipe=gpu.DRY_TRAIN_RECIPE)
    assert costs["step_ms"] > 0 and costs["cache_ms_per_chunk"] > 0 and costs["train_tokens_per_s"] > 0


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["short", "long"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windows_and_trees_on_cuda_give_one_token_decodings_bits(dtype, prompt):
    """What every lossless check above rests on, at a shape where cuBLAS's 1-row and k-row products round
    differently: GEMMs and norms run in fixed-row slabs and attention through the batch-invariant Triton kernel,
    so a verification window or tree reproduces one-token decoding bit for bit (after a long context too, where
    each query's keys are split over programs and merged)."""
    model = gpu.random_model(gpu.Shape(1024, 2816, 4, 16, 4, 32000, False), CUDA, dtype, seed=3)
    assert_windows_and_trees_decode_bit_for_bit(model, prompt)


def test_training_opts_out_of_fixed_shapes():
    """Training's state caches and stream rows never meet one-token decoding: natural shapes there."""
    from mirrorsd.linear import batch_invariance, fixed_shapes

    x = torch.zeros(2, 8, device=CUDA)
    assert fixed_shapes(x)
    with batch_invariance(False):
        assert not fixed_shapes(x)
    assert fixed_shapes(x)


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["short", "long"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_replay_eager_windows_bit_for_bit(dtype, prompt):
    """Windows replayed as CUDA graphs: eager decoding's logits and cache, and every answer (see
    ``assert_graphed_windows_decode_bit_for_bit``), at the shape where 1-row and k-row products round apart."""
    model = gpu.random_model(gpu.Shape(1024, 2816, 4, 16, 4, 32000, False), CUDA, dtype, seed=3)
    assert_graphed_windows_decode_bit_for_bit(model, prompt, model.prefix_model(1))


def test_mirror_on_cuda_streams_with_overlap_graphs_equals_ar():
    """``overlap_graphs="on"``: graphs stay on while the two threads overlap (the draft's rollouts and the target's
    upper layers captured and replayed on their own streams). `bench gpu` measures
    the setting only if it passes."""
    model = gpu.random_model(gpu.Shape(1024, 2816, 4, 16, 4, 32000, False), CUDA, torch.bfloat16, seed=3)
    draft = model.prefix_model(1)
    want = generate(model, PROMPT, method="ar", max_new_tokens=48, temperature=0.0).token_ids
    for _ in range(2):  # the second request replays what the first captured
        got = generate(model, PROMPT, method="mirror", draft=draft, backend="cuda-streams", budget=2, exit_layer=2,
                       overlap_graphs="on", max_new_tokens=48, temperature=0.0).token_ids
        _assert_lossless(model, got, want)


def test_mirror_on_cuda_streams_issued_inline_equals_ar():
    """``draft_issue="inline"``: no worker thread; the target's thread issues the rollouts onto the second stream
    after its upper layers, graphs on for both sides (the second request replays what the first captured), and the
    step's terms are on the device's clock. `bench gpu` measures the setting only if
    it passes."""
    model = gpu.random_model(gpu.Shape(1024, 2816, 4, 16, 4, 32000, False), CUDA, torch.bfloat16, seed=3)
    draft = model.prefix_model(1)
    want = generate(model, PROMPT, method="ar", max_new_tokens=48, temperature=0.0).token_ids
    for _ in range(2):
        got = generate(model, PROMPT, method="mirror", draft=draft, backend="cuda-streams", draft_issue="inline",
                       budget=2, exit_layer=2, max_new_tokens=48, temperature=0.0)
        _assert_lossless(model, got.token_ids, want)
    stats = got.stats.extra["mirror"].to_dict()
    assert stats["device_times"] and stats["mean_roots"] > 0


def test_mirror_on_cuda_streams_with_graphs_equals_ar():
    """Mirror-SD's two threads on one GPU with CUDA graphs on (the target's thread captures and replays its
    layers; both sides run eagerly while they overlap): at real-ish shapes a capture on one thread was once
    invalidated by the other's work."""
    model = gpu.random_model(gpu.Shape(1024, 2816, 4, 16, 4, 32000, False), CUDA, torch.bfloat16, seed=3)
    draft = model.prefix_model(1)
    want = generate(model, PROMPT, method="ar", max_new_tokens=48, temperature=0.0).token_ids
    got = generate(model, PROMPT, method="mirror", draft=draft, backend="cuda-streams", budget=2, exit_layer=2,
                   max_new_tokens=48, temperature=0.0).token_ids
    _assert_lossless(model, got, want)

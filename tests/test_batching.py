"""Continuous batching (mirrorsd.batching): a request's tokens are the ones it gets alone, whoever shares
its forwards, for every registered method, greedy and seeded sampling, whenever requests arrive and leave.

Each request runs with suffix indexes of its own (``isolated_shared_indexes``): the process-wide index of earlier
answers makes a suffix proposal depend on which answers finished first, batched or not, and under rejection sampling
a different proposal draws different (equally distributed) tokens."""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mirrorsd
from mirrorsd import generate, kernels
from mirrorsd.batching import (
    PREFILL_START,
    Batcher,
    Goodput,
    ModelWork,
    StepRecord,
    StepWalls,
    model_key,
    outcomes,
)
from mirrorsd.decoding import REFERENCE, GenerationStats, get_method, methods
from mirrorsd.decoding.engine import budgeted_by
from mirrorsd.decoding.mirror.options import batch_caps
from mirrorsd.decoding.suffix_index import isolated_shared_indexes
from mirrorsd.kv_cache import KVCache
from mirrorsd.model import Transformer
from tests.helpers import random_adapters, random_head, requires_smollm2, row_exact, tiny_hf

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels"),
              pytest.mark.usefixtures("one_thread")]

METHODS = [m.name for m in methods()]


@dataclass(frozen=True)
class Req:
    method: str
    prompt: tuple[int, ...]
    max_new: int
    temperature: float
    seed: int
    arrival: int  # the batcher step it joins at (or once nothing else runs)
    stop_after: int | None  # tokens after which its client closes the stream (leaves mid-way)
    confident: bool = False  # confidence=0 for the methods that take it (random drafts are never confident)


def fp32_row_exact(hf) -> Transformer:
    """fp32 weights on the row-exact C++ path (what ``mirrorsd serve`` puts an fp32 model on to batch it)."""
    model = Transformer.from_hf(hf)
    assert model.make_row_exact()
    return model


class Pair:
    def __init__(self, make: Callable = row_exact) -> None:
        self.target = make(tiny_hf(layers=4, seed=1))
        self.draft = make(tiny_hf(layers=2, seed=2))
        self.adapters = random_adapters(self.target, 2, 2, 0, std=0.1)
        self.head = random_head(self.target)

    def tokens(self, r: Req) -> list[int]:
        needs_draft = next(m for m in methods() if m.name == r.method).needs_draft
        # ss: streams in the pass or after verification (a second, stream-only window through the batcher)
        options = {"streams": self.adapters, "defer_streams": ("never", "always")[r.seed % 2]} if r.method == "ss" \
            else {"head": self.head} if r.method == "eagle" else {}
        if r.confident and any(o.name == "confidence" for o in get_method(r.method).options.fields()):
            options["confidence"] = 0.0
        with isolated_shared_indexes():  # (see the module docstring)
            return self._tokens(r, needs_draft, options)

    def _tokens(self, r: Req, needs_draft: bool, options: dict) -> list[int]:
        stream = mirrorsd.stream(self.target, list(r.prompt), method=r.method,
                                 draft=self.draft if needs_draft else None, max_new_tokens=r.max_new,
                                 temperature=r.temperature, seed=r.seed, **options)
        out: list[int] = []
        for delta in stream.deltas():
            out.extend(delta.token_ids)
            if r.stop_after is not None and len(out) >= r.stop_after:
                stream.close()
                break
        self.last = stream.result  # (None when stopped early)
        return out


@pytest.fixture(scope="module")
def pair() -> Pair:
    return Pair()


@pytest.fixture(scope="module")
def fp32_pair() -> Pair:
    return Pair(fp32_row_exact)


def run_batched(pair: Pair, requests: list[Req], batcher: Batcher) -> list[list[int] | BaseException]:
    """Each request on a thread of its own, joining the batcher at its arrival step."""
    out: list[list[int] | BaseException] = [[] for _ in requests]
    done = threading.Event()
    started = [0]
    lock = threading.Lock()

    def work(i: int, r: Req) -> None:
        while batcher.total_steps < r.arrival and batcher.members_running + len(batcher._waiting) > 0:
            done.wait(0.001)
        try:
            with batcher.member():
                out[i] = pair.tokens(r)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out[i] = e
        with lock:
            started[0] += 1

    threads = [threading.Thread(target=work, args=(i, r)) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a batched request hung"
    return out


REQUESTS = st.builds(
    Req,
    method=st.sampled_from(METHODS),
    prompt=st.one_of(st.lists(st.integers(0, 63), min_size=1, max_size=12),
                     st.lists(st.integers(0, 4), min_size=1, max_size=40)).map(tuple),
    max_new=st.integers(1, 24),
    temperature=st.sampled_from([0.0, 1.0]),
    seed=st.integers(0, 3),
    arrival=st.integers(0, 30),
    stop_after=st.one_of(st.none(), st.integers(1, 10)),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(requests=st.lists(REQUESTS, min_size=2, max_size=17), prefill_rows=st.sampled_from([1, 4, 32, None]))
def test_a_request_gets_its_own_tokens_in_any_batch(pair: Pair, requests: list[Req], prefill_rows: int | None) -> None:
    alone = [pair.tokens(r) for r in requests]
    batcher = Batcher(prefill_rows)
    got = run_batched(pair, requests, batcher)
    for r, g, a in zip(requests, got, alone, strict=True):
        assert not isinstance(g, BaseException), g
        if r.stop_after is not None:  # closed after the step that reached it: how many tokens that step committed
            assert len(g) >= min(r.stop_after, r.max_new)  # depends on the window, which the batch's budget may cap
            g, a = g[: r.stop_after], a[: r.stop_after]
        assert g == a, r
    assert batcher.members_running == 0 and not batcher._waiting
    assert max(s.windows + s.prompts for s in batcher.steps) >= 1


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(REQUESTS, min_size=2, max_size=8))
def test_fp32_weights_on_the_row_exact_path_batch_with_their_alone_bits(fp32_pair: Pair, requests: list[Req]) -> None:
    """PyTorch's GEMM gives a row bits that depend on the call's row count; on the row-exact path (the C++ fp32
    linear for every row count, in the C++ blocks) fp32 requests share forwards and keep their tokens."""
    alone = [fp32_pair.tokens(r) for r in requests]
    batcher = Batcher()
    got = run_batched(fp32_pair, requests, batcher)
    for r, g, a in zip(requests, got, alone, strict=True):
        assert not isinstance(g, BaseException), g
        if r.stop_after is not None:
            g, a = g[: r.stop_after], a[: r.stop_after]
        assert g == a, r
    assert max(s.windows + s.prompts for s in batcher.steps) >= 1


@pytest.mark.parametrize("weights", ["pair", "fp32_pair"])
def test_forwards_are_shared(weights: str, request: pytest.FixtureRequest) -> None:
    """The rows of several requests do go through one forward (what makes batching pay), q8 or fp32."""
    pair = request.getfixturevalue(weights)
    requests = [Req("ar", (1, 2, 3, i), 16, 0.0, 0, 0, None) for i in range(8)]
    batcher = Batcher()
    got = run_batched(pair, requests, batcher)
    assert got == [pair.tokens(r) for r in requests]
    assert max(s.windows for s in batcher.steps) >= 4
    assert batcher.total_steps < sum(len(g) for g in got)


def until(condition, seconds: float = 10.0) -> bool:
    """Polls ``condition`` until it holds or ``seconds`` pass; its last value."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        threading.Event().wait(0.001)
    return bool(condition())


def second_joins(pair: Pair, batcher: Batcher, requests: list[Req], joins) -> list[list[int]]:
    """The first request decodes as a member alone until ``joins()`` holds, then the second joins; their tokens."""
    got: list[list[int]] = [[], []]

    def work(i: int) -> None:
        with batcher.member():
            got[i] = pair.tokens(requests[i])

    first = threading.Thread(target=work, args=(0,))
    first.start()
    until(lambda: joins() or not first.is_alive())
    second = threading.Thread(target=work, args=(1,))
    second.start()
    for t in (first, second):
        t.join(60)
    return got


def test_a_lone_member_steps_itself_until_another_joins(pair: Pair, monkeypatch) -> None:
    """Alone, a member runs its steps on its own thread (no hand-over to the engine: a lone request at its own
    speed); a second member's first forward waits for the first member's next one, and from there they share the
    engine's steps; once one is left, the engine thread ends and it steps itself again. Each keeps its own tokens."""
    batcher = Batcher(speculation="fixed")
    steps: list[tuple[str, int]] = []
    ended: list[bool] = []
    real = Batcher._step

    def step(self, work):
        name = threading.current_thread().name
        if name != "mirrorsd-batch":
            if len(steps) == 8:  # the first member's 9th step waits for the second to wait
                until(lambda: self._waiting)
            if not ended and any(n == "mirrorsd-batch" for n, _ in steps):  # alone again after shared steps
                ended.append(until(lambda: self._engine is None))
        steps.append((name, len(work)))
        return real(self, work)

    monkeypatch.setattr(Batcher, "_step", step)
    requests = [Req("ar", (1, 2, 3), 40, 0.0, 0, 0, None), Req("sd", (4, 5, 6), 12, 1.0, 1, 0, None)]
    got = second_joins(pair, batcher, requests, lambda: len(steps) >= 8)
    assert got == [pair.tokens(r) for r in requests]
    names = {name for name, _ in steps[:8]}
    assert len(names) == 1 and "mirrorsd-batch" not in names  # the first request's steps, on its own thread
    assert any(name == "mirrorsd-batch" and n == 2 for name, n in steps)  # then both in one step
    assert ended == [True]  # the one left steps itself, with the engine gone
    assert batcher.members_running == 0 and not batcher._waiting


def test_a_lone_members_long_prompt_makes_room_for_a_member_that_joins(pair: Pair, monkeypatch) -> None:
    """A lone member prefills its long prompt chunk by chunk itself; a member that joins meanwhile waits one chunk, not
    the whole prompt: the rest goes to the engine beside the newcomer's rows. Both keep their tokens."""
    import mirrorsd.batching as batching

    monkeypatch.setattr(batching, "PREFILL_CHUNK", 4)  # a 60-token prompt: 15 chunks
    real = Batcher._step
    lone_steps = [0]

    def held_step(self, work):  # the prompt's third chunk waits for the second member to wait
        if threading.current_thread().name != "mirrorsd-batch":
            lone_steps[0] += 1
            if lone_steps[0] == 3:
                until(lambda: self._waiting)
        return real(self, work)

    monkeypatch.setattr(Batcher, "_step", held_step)
    batcher = Batcher(speculation="fixed")
    requests = [Req("ar", tuple(range(1, 61)), 4, 0.0, 0, 0, None), Req("ar", (7, 8, 9), 8, 0.0, 0, 0, None)]
    got = second_joins(pair, batcher, requests, lambda: batcher.total_steps >= 2)
    assert got == [pair.tokens(r) for r in requests]
    assert any(s.prompts and s.windows for s in batcher.steps)  # a chunk of the prompt beside the newcomer's rows


def test_members_a_half_step_apart_fall_back_into_one_forward(pair: Pair, monkeypatch) -> None:
    """One member runs an LM head alone first (as a draft's extra forward or a prompt chunk puts it out of step):
    the heads-first rule brings it back, so the two members' plain steps still share their layer forwards. (A lone
    member runs its forwards itself, and the first one here would run that head before the other joins: off.)"""
    monkeypatch.setattr(Batcher, "_claim_solo", lambda self, me: False)
    batcher = Batcher()
    d = pair.target.config.hidden_size
    out: list[list[int]] = [[], []]
    both = threading.Barrier(2)  # (both members before either decodes: a loaded host may start one thread late)

    def work(i: int) -> None:
        with batcher.member():
            both.wait(60)
            if i:
                pair.target.logits(torch.zeros(1, 1, d))
            out[i] = pair.tokens(Req("ar", (1, 2, 3 + i), 24, 0.0, 0, 0, None))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == [pair.tokens(Req("ar", (1, 2, 3 + i), 24, 0.0, 0, 0, None)) for i in range(2)]
    layer_steps = [s for s in batcher.steps if s.rows]
    assert sum(s.windows == 2 for s in layer_steps) >= 20  # both plain steps in one forward, nearly every time


def test_no_cache_outlives_its_request_after_thousands_of_rejections(pair: Pair, monkeypatch) -> None:
    """A draft that is mostly wrong: thousands of rejections and rollbacks across batched requests, then every
    cache is freed and the batcher holds nothing."""
    alive: list[weakref.ref] = []
    init = KVCache.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        alive.append(weakref.ref(self))

    monkeypatch.setattr(KVCache, "__init__", tracked)
    requests = [Req("sd", (i % 7, 3, 1), 160, 1.0, i, i % 5, None) for i in range(12)]
    batcher = Batcher(speculation="fixed")  # every window drafted: the goodput rule, timing-driven, may cap them
    got = run_batched(pair, requests, batcher)
    assert all(len(g) == 160 for g in got)
    rejected = sum(s.rows for s in batcher.steps) - sum(s.windows for s in batcher.steps)
    assert rejected > 1000
    gc.collect()
    assert alive and not [ref for ref in alive if ref() is not None]
    assert batcher.members_running == 0 and not batcher._waiting


def test_a_member_woken_by_another_waits_until_the_engine_counts_it(pair: Pair, monkeypatch) -> None:
    """A member woken by another thread's notify while its forward is computed but not yet published stays waiting:
    leaving then took the running count below zero (CI saw -1 after a two-request batch)."""
    batcher = Batcher()
    real = Batcher._step
    seen: list[int] = []

    def step_then_stray_notify(self, work):
        record = real(self, work)
        with self._cond:
            self._cond.notify_all()  # what another member's new forward does while the engine is outside the lock
        threading.Event().wait(0.05)  # time for a wrongly woken member to leave
        seen.append(self.members_running)
        return record

    monkeypatch.setattr(Batcher, "_step", step_then_stray_notify)
    requests = [Req("ar", (1, 2, i), 3, 0.0, 0, 0, None) for i in range(2)]
    assert run_batched(pair, requests, batcher) == [pair.tokens(r) for r in requests]
    assert seen and min(seen) >= 0
    assert batcher.members_running == 0 and not batcher._waiting


def test_a_failing_step_callback_is_logged_and_stops_nobody(pair: Pair, caplog) -> None:
    """``on_step`` (the server's metrics) raising must neither end the engine with its members waiting nor fail a
    lone member's computed forward."""
    def broken(record) -> None:
        raise RuntimeError("metrics down")

    requests = [Req("ar", (1, 2, i), 6, 0.0, 0, 0, None) for i in range(3)]
    assert run_batched(pair, requests, Batcher(on_step=broken)) == [pair.tokens(r) for r in requests]
    assert "on_step callback failed" in caplog.text


def test_a_failing_forward_reaches_only_its_request(pair: Pair, monkeypatch) -> None:
    """A forward that fails runs each of its members alone: the member whose window is at fault gets the error on its
    thread, the others their own tokens; the batcher stays usable."""
    batcher = Batcher()
    calls, at_fault = [0], []
    real = Batcher._layers

    def flaky(members):
        calls[0] += 1
        if calls[0] == 3:
            at_fault.append(members[0][0])  # this member's window fails, batched or alone
        if any(w is bad for bad in at_fault for w, _ in members):
            raise RuntimeError("boom")
        return real(members)

    monkeypatch.setattr(Batcher, "_layers", staticmethod(flaky))
    requests = [Req("ar", (1, 2, i), 8, 0.0, 0, 0, None) for i in range(3)]
    got = run_batched(pair, requests, batcher)
    assert sum(isinstance(g, RuntimeError) for g in got) == 1
    assert all(g == pair.tokens(r) for g, r in zip(got, requests, strict=True) if not isinstance(g, RuntimeError))
    monkeypatch.setattr(Batcher, "_layers", staticmethod(real))
    assert run_batched(pair, requests, batcher) == [pair.tokens(r) for r in requests]


@pytest.mark.real
@requires_smollm2
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_real_weights_batched_equal_alone(temperature: float) -> None:
    """SmolLM2-135M's real q8 weights: ar, suffix, sd (a 10-layer self-draft), mirror, eagle (a random head) and ss
    (the shipped adapter: its main, pruning and stream heads go to the engine as `[T, h]` rows) side by side."""
    model = mirrorsd.load_model("smollm2-135m", weights="q8", progress=False)
    draft = model.model.prefix_model(10)
    head = random_head(model.model)
    prompts = ["Write a haiku about the sea.", "def fibonacci(n):", "The capital of France is",
               "List three prime numbers:"]
    cases = [(m, p) for p in prompts for m in ("ar", "suffix", "sd", "mirror", "eagle", "ss")]

    def one(method: str, prompt: str) -> list[int]:
        with isolated_shared_indexes():
            return generate(model, prompt, method=method, draft=draft if method in ("sd", "mirror") else None,
                            max_new_tokens=16, temperature=temperature, seed=7,
                            **({"head": head} if method == "eagle" else {})).token_ids

    alone = [one(m, p) for m, p in cases]
    batcher = Batcher()
    got: list[list[int]] = [[] for _ in cases]

    def work(i: int) -> None:
        with batcher.member():
            got[i] = one(*cases[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == alone
    assert max(s.windows for s in batcher.steps) >= 4


@pytest.mark.real
@requires_smollm2
def test_a_members_heads_on_rows_of_one_sequence_go_to_the_engine() -> None:
    """``Transformer.logits`` sends a member's ``[T, h]`` rows (a tree's, a stream's) to its batcher as ``[1, T, h]``,
    full head and reduced head alike, and gets back the bits it computes alone: on the member's own thread the head
    met the engine's idle OpenMP team and ran at half speed."""
    from mirrorsd.draft_vocab import head_logits, subset_head
    from mirrorsd.execution import batched_by

    model = mirrorsd.load_model("smollm2-135m", weights="q8", progress=False).model
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    subset = subset_head(model, 4096)
    seen = []

    class Hook:
        def head(self, m, rows, head):
            seen.append((tuple(rows.shape), head))
            with batched_by(None):  # as the engine runs it
                return m.logits(rows, head)

    with torch.inference_mode():
        alone = [model.logits(hidden), head_logits(model, hidden, subset)[0]]
        with batched_by(Hook()):
            hooked = [model.logits(hidden), head_logits(model, hidden, subset)[0]]
    assert seen == [((1, 3, model.config.hidden_size), None), ((1, 3, model.config.hidden_size), subset)]
    assert all(torch.equal(a, b) for a, b in zip(alone, hooked, strict=True))


class RandomBudget:
    """A speculation budget that caps windows at random (0 included) and reports random batch sizes (Mirror-SD's κ
    and stream count follow them): what any controller and any load may do."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.limits: list[int | None] = []
        self.batches: list[int] = []

    def limit(self, state) -> int | None:
        value = self.rng.choice([None, 0, 0, 1, 2, 5])
        self.limits.append(value)
        return value

    def batch(self) -> int:
        self.batches.append(self.rng.choice([1, 8, 12, 16, 32, 64, 200]))
        return self.batches[-1]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_any_speculation_budget_keeps_the_tokens(pair: Pair, method: str, temperature: float) -> None:
    """Capping a window (down to a plain step) is the budget's only power, and it cannot change a token; a capped
    step drafts no more than its cap, and the cap shows in the step log."""
    for seed in range(3):
        r = Req(method, (1, 2, 3, 1, 2, 3, seed), 20, temperature, seed, 0, None, confident=True)
        want = pair.tokens(r)
        budget = RandomBudget(seed)
        with budgeted_by(budget):
            got = pair.tokens(r)
        assert got == want
        log = pair.last.stats.step_log
        assert [step.get("limit") for step in log] == budget.limits  # one cap a step, each in the log
        assert all(step["drafted"] <= step["limit"] for step in log if "limit" in step)
        assert any(step["drafted"] for step in log) or method == REFERENCE  # (something drafted: caps bit)


class NoDrafts:
    """A budget of 0 for every step: the plain batched step."""

    def limit(self, state) -> int | None:
        return 0

    def batch(self) -> int:
        return 16


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ss_under_a_budget_of_zero_runs_ars_plain_step(pair: Pair, temperature: float, monkeypatch) -> None:
    """Skipping speculation costs nothing for ``ss`` too: with no draft rows allowed, its steps are ``ar``'s one-row
    forwards, with no stream rows beside them (a pass's streams only draft the next tree), and its tokens are
    ``ar``'s."""
    r = Req("ss", (1, 2, 3, 1, 2, 3), 20, temperature, 5, 0, None)
    want = pair.tokens(replace(r, method="ar"))
    calls: list[tuple[int, bool]] = []
    run_layers = Transformer.run_layers

    def spy(self, hidden, *args, **kwargs):
        calls.append((hidden.shape[1], kwargs.get("streams") is not None))
        return run_layers(self, hidden, *args, **kwargs)

    monkeypatch.setattr(Transformer, "run_layers", spy)
    with budgeted_by(NoDrafts()):
        got = pair.tokens(r)
    assert got == want
    prefill, decode = calls[:2], calls[2:]  # the prompt's prefill, in two calls: its state at layer N - N_s kept
    assert [rows for rows, _ in prefill] == [len(r.prompt)] * 2
    # the first token the prefill's (as ``ar``'s), then one row a token
    assert len(decode) == len(got) - 1 and all(rows == 1 and not streams for rows, streams in decode)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mirror_scales_kappa_and_draft_streams_with_the_batch(pair: Pair, temperature: float) -> None:
    """App. D.1's schedule: κ 8 → 4 → 2 → 1 and the SS draft's streams down to one as the batch grows, step by step
    as the batch size changes, without changing a token (roots=paper: every candidate is rolled out)."""
    adapters = random_adapters(pair.draft, streams=2, layers=1, std=0.1)
    kwargs = dict(method="mirror", draft=pair.draft, max_new_tokens=30, temperature=temperature, seed=3, gamma=4,
                  kappa=8, roots="paper", draft_streams=adapters, confidence=0.0)
    want = generate(pair.target, [1, 2, 3, 1, 2], **kwargs)
    budget = RandomBudget(7)
    with budgeted_by(budget):
        got = generate(pair.target, [1, 2, 3, 1, 2], **kwargs)
    assert got.token_ids == want.token_ids
    seen = {}
    for batch, step in zip(budget.batches, got.stats.step_log, strict=False):
        if step.get("roots"):
            seen[batch] = step["kappa"]
            assert step["roots"] <= (step["drafted"] + 1) * step["kappa"]
    assert seen and all(kappa == min(8, batch_caps(batch)[0] or 8) for batch, kappa in seen.items())
    assert batch_caps(1) == batch_caps(8) == (None, None) and batch_caps(16) == (4, 1)
    assert batch_caps(32) == (2, 1) and batch_caps(64) == (1, 1)



class _Model:
    """A stand-in for a model the rule prices rows of (what :func:`model_key` keys: a weakly referable object)."""


_TARGET = _Model()  # the model the rule's requests verify on


def _state(stats: GenerationStats) -> SimpleNamespace:
    """What the goodput rule reads of a request in flight: its statistics and its target."""
    return SimpleNamespace(stats=stats, request=SimpleNamespace(target=_TARGET))


def _record(windows: int, prompts: int, rows: int, prefill_rows: int, seconds: float,
            model: object = _TARGET) -> StepRecord:
    """A step of ``model``'s alone: its layers, or its heads when ``rows`` is 0."""
    return StepRecord(0.0, windows, prompts, rows, prefill_rows, seconds,
                      (ModelWork(model_key(model), rows, prefill_rows, seconds),))


def test_goodput_drafts_freely_alone_and_less_as_the_batch_grows() -> None:
    batcher = Batcher()
    rule = Goodput(batcher)
    stats = GenerationStats("sd", accepted=[2, 3, 1, 3] * 4, drafted=[3, 3, 3, 3] * 4)
    state = _state(stats)
    for rows in (1, 2, 4, 8, 16, 32) * 3:  # a CPU-like curve: 40 ms + 5 ms a row
        batcher.steps.append(_record(rows, 0, rows, 0, 0.040 + 0.005 * rows))
    a, b = batcher.cost_curve(8)
    assert a == pytest.approx(0.040) and b == pytest.approx(0.005)
    limits = {}
    for busy in (1, 2, 4, 8, 16):
        batcher._running = busy
        batcher.steps.extend(_record(busy, 0, busy, 0, 0.040 + 0.005 * busy) for _ in range(16))
        limits[busy] = rule.limit(state)
    assert limits[1] is None  # alone: the method's own window
    assert limits[2] >= limits[4] >= limits[8] >= limits[16] == 0
    assert limits[2] > 0
    assert outcomes([2, 3, 0], [3, 3, 0]) == (5, 1) and outcomes([0], [0]) == (0, 0)



def test_goodput_prices_rows_on_the_targets_line_alone() -> None:
    """A draft model's steps (cheaper rows, other sizes) go through the same batcher as its target's verification
    windows; fitted together they bent the line the rule prices a draft row by. The rule reads the target's layer
    forwards only, and decides as it would without the draft's steps."""
    draft = _Model()
    stats = GenerationStats("sd", accepted=[2, 3, 1, 3] * 4, drafted=[3, 3, 3, 3] * 4, draft_forwards=48,
                            draft_s=0.048)
    decisions = {}
    for with_draft in (False, True):
        batcher = Batcher()
        batcher._running = 4
        rule = Goodput(batcher)
        for rows in (4, 8, 16) * 6:  # the target: 40 ms + 5 ms a row
            batcher.steps.append(_record(4, 0, rows, 0, 0.040 + 0.005 * rows))
            if with_draft:  # the draft: 4 rows (one a member) in 10 ms, after 1 to 4 catch-up rows each
                batcher.steps.append(_record(4, 0, 4 + rows // 4, 0, 0.010 + 0.001 * rows, model=draft))
        a, b = batcher.cost_curve(8, model=model_key(_TARGET))
        assert a == pytest.approx(0.040) and b == pytest.approx(0.005)
        decisions[with_draft] = rule.limit(_state(stats))
    assert batcher.cost_curve(8)[1] != pytest.approx(0.005)  # (the whole steps' line is another)
    assert decisions == {False: 3, True: 3}


def test_goodput_keeps_each_targets_last_line_apart() -> None:
    """The line the rule falls back on while a target's recent steps are too few to fit is that target's own: a
    batcher serving two targets must not price one's rows by the other's."""
    other = _Model()
    stats = GenerationStats("sd", accepted=[2, 3, 1, 3] * 4, drafted=[3, 3, 3, 3] * 4, draft_forwards=48,
                            draft_s=0.048)
    batcher = Batcher()
    batcher._running = 4
    rule = Goodput(batcher)
    for rows in (4, 8, 16) * 6:  # _TARGET: 40 ms + 5 ms a row
        batcher.steps.append(_record(4, 0, rows, 0, 0.040 + 0.005 * rows))
    assert rule.limit(_state(stats)) == 3
    other_state = SimpleNamespace(stats=stats, request=SimpleNamespace(target=other))
    assert rule.limit(other_state) is None  # no line of its own yet: its method's window, not _TARGET's price
    batcher.steps.clear()  # too few steps to fit now: each target's last line stands (no line: None), and
    assert rule.limit(_state(stats)) == 1  # _TARGET's prices the batch's 4 members' rows (no recent level: 4)
    assert rule.limit(other_state) is None


def test_a_model_key_is_never_reused_by_another_model() -> None:
    """Step records and the rule's lines outlive a step: a model made after another was collected (an ``id()`` it may
    reuse) must not inherit the old one's records."""
    import gc

    first = _Model()
    key = model_key(first)
    assert model_key(first) == key
    del first
    gc.collect()
    later = [_Model() for _ in range(64)]  # (some may land at the freed address)
    assert key not in {model_key(m) for m in later} and len({model_key(m) for m in later}) == 64


def test_a_step_of_two_models_records_each_models_rows_and_wall(pair: Pair) -> None:
    """A step that carries a draft's rows beside a target's windows records each model's rows and wall apart; a
    model's head step records the model, with no rows."""
    from mirrorsd.batching import _Waiting
    from mirrorsd.execution import LayerCall

    def window(model: Transformer, tokens: int) -> _Waiting:
        ids = torch.arange(tokens).unsqueeze(0) % 64
        call = LayerCall(model.embed(ids), torch.arange(tokens).unsqueeze(0), model.new_cache())
        return _Waiting(model, call, 0, model.config.n_layers)

    batcher = Batcher()
    target_work = [(window(pair.target, 5), 5), (window(pair.target, 1), 1)]
    record = batcher._step([(window(pair.draft, 3), 3), *target_work])
    parts = {m.model: m for m in record.models}
    assert {k: (m.rows, m.prefill_rows) for k, m in parts.items()} == {model_key(pair.target): (6, 0),
                                                                        model_key(pair.draft): (3, 0)}
    assert record.rows == 9 and record.windows == 3
    assert 0 < sum(m.seconds for m in record.models) <= record.seconds
    alone = batcher._step([(window(pair.target, 2), 2)])
    assert alone.models == (ModelWork(model_key(pair.target), 2, 0, alone.seconds),)  # one model: the step's wall
    hidden = target_work[0][0].result
    head = batcher._step([(_Waiting(pair.target, hidden=hidden[:, -1:]), 1)])
    assert [(m.model, m.rows) for m in head.models] == [(model_key(pair.target), 0)] and head.rows == 0


@pytest.mark.parametrize("prefill_rows", [8, None])
def test_a_verification_window_never_waits_behind_another_requests_prompt(pair: Pair, prefill_rows) -> None:
    """A 17-row window (a suffix step's verification) runs whole in the next step, even beside an older long
    prompt that takes the whole prompt budget, whatever ``prefill_rows`` is."""
    from mirrorsd.batching import _Waiting
    from mirrorsd.execution import LayerCall

    def window(tokens: int) -> _Waiting:
        model = pair.target
        ids = torch.arange(tokens).unsqueeze(0) % 64
        call = LayerCall(model.embed(ids), torch.arange(tokens).unsqueeze(0), model.new_cache())
        return _Waiting(model, call, 0, model.config.n_layers)

    batcher = Batcher(prefill_rows)
    prompt, verification, step = window(400), window(17), window(1)
    batcher._waiting.extend([prompt, verification, step])
    work = dict((id(w), rows) for w, rows in batcher._select())
    assert work[id(verification)] == 17 and work[id(step)] == 1
    assert prompt.prompt and 0 < work[id(prompt)] < 400


def test_a_window_at_fault_fails_alone_and_its_forward_mates_get_their_results(pair: Pair) -> None:
    """One member's malformed window (here a mask for the wrong number of keys) must not fail the requests that share
    its forward: they get what they get alone, it gets its error."""
    from mirrorsd.batching import _Waiting
    from mirrorsd.execution import LayerCall

    model = pair.target

    def window(tokens: int, mask: torch.Tensor | None = None) -> _Waiting:
        ids = torch.arange(tokens).unsqueeze(0) % 64
        call = LayerCall(model.embed(ids), torch.arange(tokens).unsqueeze(0), model.new_cache(), mask)
        return _Waiting(model, call, 0, model.config.n_layers)

    good, bad = window(3), window(3, torch.ones(1, 3, 7, dtype=torch.bool))
    with torch.inference_mode():
        Batcher()._step([(good, 3), (bad, 3)])
        alone = window(3)
        Batcher()._step([(alone, 3)])
    assert good.error is None and good.computed and torch.equal(good.result, alone.result)
    assert bad.error is not None and bad.computed


def test_paced_prompt_rows_keep_a_step_within_twice_the_windows_own() -> None:
    assert Batcher(12).prefill_budget(8) == 12  # a fixed number is a fixed number
    batcher = Batcher()
    assert batcher.prefill_budget(8) == PREFILL_START  # no cost line measured yet
    for rows in (8, 16) * 4:  # a CPU-like line: 40 ms + 10 ms a row; two step sizes are enough to draw it
        batcher.steps.append(_record(8, rows > 8, rows, rows - 8, 0.040 + 0.010 * rows))
    # 8 window rows cost 120 ms a step; 12 prompt rows beside them make 240 ms, twice that
    assert batcher.prefill_budget(8) == 12
    batcher.steps.extend(_record(0, 0, 0, 0, 0.030) for _ in range(4))  # the windows' heads: 30 ms a step
    assert batcher.prefill_budget(8) == 15  # their step is 150 ms with its head: 15 rows make it 300 ms
    batcher.steps.extend(_record(1, rows > 1, rows, rows - 1, 0.040 + 0.010 * rows) for rows in (1, 4) * 4)
    assert batcher.prefill_budget(1) == 8  # one stream: (50 + 30) ms a step, so 8 rows


def test_paced_prompt_rows_grow_by_steps_they_have_seen_never_to_a_whole_chunk_at_once() -> None:
    """A flat or noisy line (rows look free) doubles the prompt rows of the recent steps, no more: each larger step
    is measured, within the fitted range, before the next; a jump to a 512-row chunk would stall every stream."""
    batcher = Batcher()
    for rows in (8, 16) * 4:
        batcher.steps.append(_record(8, rows > 8, rows, rows - 8, 0.100))  # 16 rows cost what 8 do
    assert batcher.prefill_budget(8) == 16
    batcher.steps.append(_record(8, 1, 24, 16, 0.100))
    assert batcher.prefill_budget(8) == 32
    batcher.steps.extend(_record(8, 1, 40, 32, 0.100 + 0.010 * 32) for _ in range(8))  # 10 ms a row after all
    assert batcher.prefill_budget(8) < 32


def _rule_at(busy: int) -> Goodput:
    """A goodput rule over a batcher of ``busy`` members whose steps cost 40 ms + 5 ms a row."""
    batcher = Batcher()
    batcher._running = busy
    for rows in (1, 2, 4, 8, 16, 32) * 3:
        batcher.steps.append(_record(rows, 0, rows, 0, 0.040 + 0.005 * rows))
    return Goodput(batcher)


def test_goodput_alone_decodes_plainly_when_not_even_the_first_draft_token_pays() -> None:
    """A method that is not timed (its draft's forwards priced on the line: ``eagle``'s head)."""
    cheap = GenerationStats("eagle", accepted=[1, 2, 0, 1] * 4, drafted=[3] * 16, draft_forwards=48, draft_s=0.048)
    dear = GenerationStats("eagle", accepted=[1, 2, 0, 1] * 4, drafted=[3] * 16, draft_forwards=48, draft_s=48 * 0.035)
    rule = _rule_at(1)
    assert rule.limit(_state(cheap)) is None  # alone, a draft forward of 1 ms pays: its own window
    assert rule.limit(_state(dear)) == 0  # one of 35 ms (α = .5) does not: ar's plain step


def test_goodput_starts_a_new_request_from_its_methods_peers() -> None:
    rule = _rule_at(8)
    fresh = _state(GenerationStats("eagle"))
    assert rule.limit(fresh) is None  # the first request of a method drafts freely until it has a figure
    poor = GenerationStats("eagle", accepted=[0, 1, 0, 0] * 4, drafted=[3] * 16, draft_forwards=48, draft_s=1.0)
    assert rule.limit(_state(poor)) == 0
    assert rule.acceptance(fresh.stats) == pytest.approx((4 + 1) / (4 + 16 + 2))  # the pooled rate (Laplace)
    assert rule.limit(fresh) == 0  # it starts capped, as its peer is: no first window, no draft prefill
    assert rule.limit(_state(GenerationStats("suffix"))) is None  # another method's peers don't count
    prior = rule.acceptance(fresh.stats)
    fresh.stats.accepted.append(3)
    fresh.stats.drafted.append(3)
    assert prior < rule.acceptance(fresh.stats) < 1  # its own windows count, shrunk toward its method's rate


def test_goodput_one_early_rejection_does_not_cap_a_request_for_good() -> None:
    rule = _rule_at(1)
    unlucky = _state(GenerationStats("suffix", accepted=[0], drafted=[4]))
    assert 0 < rule.acceptance(unlucky.stats) < 0.5
    assert rule.limit(unlucky) is None  # alone, free draft rows still pay at that rate: its own window


def _timed_steps(method: str, plain_s: float, drafting_s: float, steps: int = 16) -> GenerationStats:
    """A request's statistics with ``steps`` drafting steps (3 draft tokens, 1 accepted) of ``drafting_s`` each, then
    one plain step (a budget of 0) of ``plain_s``."""
    stats = GenerationStats(method, gamma=3)
    for _ in range(steps):
        stats.record_step(3, 1)
        stats.step_s.append(drafting_s)
    stats.record_step(0, 0, limit=0)
    stats.step_s.append(plain_s)
    return stats


@pytest.mark.parametrize("busy", [1, 4])
def test_goodput_keeps_a_timed_methods_window_only_while_it_pays(busy: int) -> None:
    """A method that drafts inside the target's step (an ss pass: its streams, heads and pruning) keeps its window
    only while its drafting steps, as timed, commit more tokens per second than its plain ones (the row-cost curve
    does not see that work)."""
    decisions = {}
    for case, drafting_s in (("cheap", 0.062), ("dear", 0.120)):  # plain steps 45 ms
        rule = _rule_at(busy)
        stats = _timed_steps("ss", 0.045, drafting_s)
        state = _state(stats)
        for i in range(len(stats.step_s)):  # the rule sees every step as it comes
            rule._walls.setdefault("ss", StepWalls()).observe(
                GenerationStats("ss", drafted=stats.drafted[:i + 1], accepted=stats.accepted[:i + 1],
                                step_log=stats.step_log[:i + 1], step_s=stats.step_s[:i + 1]))
        # 2 tokens a drafting step (1 accepted): it pays while it costs less than 2 plain steps
        assert rule._walls["ss"].measured_pays() == (drafting_s / 0.045 < 2)
        decisions[case] = rule.limit(state)
    assert decisions["cheap"] != 0  # 2 ms of its own: the window (alone: its own, in a batch: the rule's cap)
    assert decisions["dear"] == 0  # 60 ms of its own: ar's plain step



def test_goodput_alone_a_timed_method_with_a_dear_draft_drafts_while_its_steps_pay(pair: Pair) -> None:
    """``sd`` alone: a draft forward's wall (35 ms against a 45 ms step, its prompt's catch-up in it) prices every
    draft token out on the row line, yet its measured drafting steps pay (its suffix lookup drafts without forwards,
    and its windows are long); the measured verdict decides alone, and a measured "no" still keeps it plain. Its real
    steps are timed."""
    decisions = {}
    for case, drafting_s in (("pays", 0.062), ("does not", 0.120)):
        rule = _rule_at(1)
        stats = _timed_steps("sd", 0.045, drafting_s)
        stats.draft_forwards, stats.draft_s = 48, 48 * 0.035
        for i in range(len(stats.step_s)):
            rule._walls.setdefault("sd", StepWalls()).observe(
                GenerationStats("sd", drafted=stats.drafted[:i + 1], accepted=stats.accepted[:i + 1],
                                step_log=stats.step_log[:i + 1], step_s=stats.step_s[:i + 1]))
        decisions[case] = rule.limit(_state(stats))
    assert decisions == {"pays": None, "does not": 0}
    early = GenerationStats("sd", gamma=3, draft_forwards=6, draft_s=6 * 0.035)  # two windows, 1 of 6 accepted
    for accepted in (0, 1):
        early.record_step(3, accepted)
        early.step_s.append(0.060)
    assert _rule_at(1).limit(_state(early)) is None  # not yet timed: it drafts, to time its steps (priced on the line
    # alone, it stayed plain for good)
    got = generate(pair.target, [1, 2, 3], method="sd", draft=pair.draft, max_new_tokens=8)
    assert len(got.stats.step_s) == len(got.stats.drafted) > 0

def test_goodput_times_a_plain_round_every_so_many_rounds_and_counts_a_step_once() -> None:
    """At 4 requests of a timed method, a plain step is timed in a round of the whole batch's plain steps (one beside
    drafting ones would wait for their work), once per :attr:`Goodput.PROBE_EVERY` drafting rounds: counted in
    drafting steps of any member, every 16 / 4 rounds went plain before. A member asked twice about one step counts
    it once."""
    rule = _rule_at(4)
    members = [_state(GenerationStats("ss", gamma=3, accepted=[1] * 16, drafted=[3] * 16))
               for _ in range(4)]
    walls = rule._walls.setdefault("ss", StepWalls())
    plain_rounds = []
    for round_ in range(2 * Goodput.PROBE_EVERY + 7):
        rule.batcher.total_steps = round_  # (every member asks between two batch steps)
        for m in members:
            limit = rule.limit(m)
            rule.limit(m)  # (asked again about the same step)
            if limit == 0:
                plain_rounds.append(round_)
                m.stats.record_step(0, 0, limit=0)
                m.stats.step_s.append(0.045)
            else:
                m.stats.record_step(1, 1)
                m.stats.step_s.append(0.05)
    # 16 drafting rounds timed (the first asks about no step, the second's are fresh starts: not timed), then the
    # whole round plain; again 16 timed rounds later (the round after a plain one is a fresh start too)
    assert plain_rounds == [18] * 4 + [37] * 4
    assert list(walls.plain) == [0.045] * 8 and len(walls.drafting) == 16  # each step counted once


def test_goodput_times_plain_steps_again_after_a_run_of_drafting_ones() -> None:
    rule = _rule_at(1)
    walls = rule._walls.setdefault("ss", StepWalls())
    stats = GenerationStats("ss", gamma=3, accepted=[1] * 16, drafted=[3] * 16)
    state = _state(stats)
    for step in range(Goodput.PROBE_EVERY + 1):  # drafting steps only (the first a fresh start, not timed)
        rule.batcher.total_steps = step
        assert rule.limit(state) is None
        stats.record_step(3, 1)
        stats.step_s.append(0.05)
    rule.batcher.total_steps += 1
    assert rule.limit(state) == 0  # (seeing the 16th drafting step) a plain step, to time one
    assert walls.since_plain == Goodput.PROBE_EVERY
    stats.record_step(0, 0, limit=0)
    stats.step_s.append(0.045)
    rule.batcher.total_steps += 1
    rule.limit(state)
    assert walls.since_plain == 0 and list(walls.plain) == [0.045]


def test_goodput_prices_drafting_with_its_steps_that_had_nothing_to_verify() -> None:
    """A drafting step with no guesses to verify (an ss pass after one whose guesses were all pruned) runs its stream
    rows for one token: it counts as drafting. A fresh start (the first step after a plain one) is the probe's cost
    and is not timed: a round of them after a probe would fill the record at 16 members. The rule decides only after
    :attr:`StepWalls.MIN_DRAFTING` drafting steps."""
    walls = StepWalls()
    stats = GenerationStats("ss", gamma=3)

    def step(drafted: int, accepted: int, seconds: float, **detail) -> None:
        stats.record_step(drafted, accepted, **detail)
        stats.step_s.append(seconds)
        walls.observe(stats)

    step(0, 0, 0.030, limit=0)  # plain: 30 ms a token
    step(0, 0, 0.057)  # a fresh start: not timed
    assert not walls.drafting
    step(0, 0, 0.057)  # its guesses all pruned: streams for one token
    assert list(walls.drafting) == [(0.057, 1)] and walls.measured_pays() is None
    for _ in range(StepWalls.MIN_DRAFTING - 1):
        step(3, 2, 0.060)  # 3 tokens in 60 ms
    assert walls.measured_pays() is True  # mean 2.5 tokens > 2 plain steps' time
    for _ in range(6):
        step(0, 0, 0.057)
        step(3, 1, 0.060)
    assert walls.measured_pays() is False  # every other step had nothing to verify: 1.75 tokens < 2
    for _ in range(Goodput.REPROBE_AFTER):
        step(0, 0, 0.030, limit=0)
    step(0, 0, 0.057, limit=3)  # re-timed: the fresh start is not timed
    assert len(walls.drafting) == 16
    step(3, 2, 0.060, limit=3)  # the re-timed run's first timed step replaces the old record
    assert list(walls.drafting) == [(0.060, 3)] and walls.measured_pays() is None


def test_step_walls_count_a_step_of_statistics_that_reuse_a_collected_ones_id() -> None:
    """A request's statistics are looked at once per step, keyed by their id; a later request's statistics that get
    a collected request's id, at the same step count, are still counted (an id alone would skip their step)."""
    walls = StepWalls()
    old, new = GenerationStats("ss", gamma=3), GenerationStats("ss", gamma=3)
    for stats in (old, new):
        stats.record_step(0, 0)
        stats.record_step(3, 2)
        stats.step_s += [0.057, 0.060]
    walls.observe(old)
    assert list(walls.drafting) == [(0.060, 3)]
    walls.observe(old)  # the same step again: not counted twice
    assert len(walls.drafting) == 1
    walls._seen[id(new)] = walls._seen.pop(id(old))  # as if ``old`` were collected and ``new`` got its id
    walls.observe(new)
    assert len(walls.drafting) == 2


def test_goodput_a_timed_methods_measured_no_holds_where_the_row_line_looks_free() -> None:
    """A timed method whose drafting steps measured as not paying steps plainly even where the batch's row-cost line
    looks flat (a noisy fit at 2 requests: "rows cost nothing", the method's own window), and where its acceptance
    is not known yet; the line still caps a method that measured as paying."""
    batcher = Batcher()
    batcher._running = 2
    for rows in (2, 4, 8) * 3:
        batcher.steps.append(_record(rows, 0, rows, 0, 0.060 - 0.001 * rows))  # a falling line
    rule = Goodput(batcher)
    assert rule.batcher.cost_curve(4.0)[1] == 0.0  # (its slope clamped: rows look free)
    answers = {}
    for method, drafting_s in (("dear", 0.120), ("cheap", 0.060)):  # 2 tokens a step against a 45 ms plain step
        stats = _timed_steps(method, 0.045, drafting_s)
        for i in range(len(stats.step_s)):  # the rule sees every step as it comes
            rule._walls.setdefault(method, StepWalls()).observe(
                GenerationStats(method, drafted=stats.drafted[:i + 1], accepted=stats.accepted[:i + 1],
                                step_log=stats.step_log[:i + 1], step_s=stats.step_s[:i + 1]))
        answers[method] = rule.limit(_state(stats))
    assert answers == {"dear": 0, "cheap": None}  # (it pays: the line's answer, here the method's own window)
    assert rule.limit(_state(GenerationStats("dear"))) == 0  # a new request of it: from its first step


def test_goodput_keeps_a_method_plain_after_a_long_plain_run() -> None:
    """A method that is not timed (``eagle``; ``sd`` was until its steps were timed) which the rule kept plain for
    more than :attr:`Goodput.RECENT` steps keeps its rate (its last steps that drafted), and the batch's last fitted
    row line stands while its steps are all of one size: it stays plain instead of drafting freely again as if it
    were new (at 2 requests `sd` did, a full window every 16 steps)."""
    rule = _rule_at(8)
    poor = GenerationStats("eagle", accepted=[0, 1, 0, 0] * 4, drafted=[3] * 16, draft_forwards=48, draft_s=1.0)
    state = _state(poor)
    assert rule.limit(state) == 0
    for _ in range(3 * Goodput.RECENT):
        poor.record_step(0, 0, limit=0)
    rule.batcher.steps.extend(_record(8, 0, 8, 0, 0.080) for _ in range(256))  # one size: no line to fit
    assert rule.batcher.cost_curve(8) is None
    assert rule.acceptance(poor) is not None and rule.limit(state) == 0


def test_the_goodput_rule_keeps_no_ended_requests_statistics():
    """It kept the whole statistics of up to 128 ended requests (step logs, spans, Mirror-SD's steps) to read 16
    pairs of counts: ~260 MB for Mirror-SD at 2,048 tokens each."""
    import gc
    import weakref

    from mirrorsd.batching import _Drafted

    stats = GenerationStats("sd")
    for accepted in (2, 0, 3):
        stats.record_step(3, accepted)
    stats.draft_s, stats.draft_forwards = 0.5, 9
    tracker = _Drafted(stats)
    seen, drafting = tracker.outcomes(), tracker.drafting()
    gone = weakref.ref(stats)
    del stats
    gc.collect()
    assert gone() is None and tracker.stats is None  # nothing but the request held them
    assert tracker.outcomes() == seen and tracker.drafting() == drafting == (0.5, 9)


@pytest.mark.parametrize("mode", ["alone", "pieces", "batched"])
def test_a_cancelled_members_prompt_stops_at_its_next_chunk(pair: Pair, monkeypatch, mode: str) -> None:
    """A client that leaves during a long prompt frees its place within a chunk (it held it for the whole prefill,
    seconds with nobody to read the answer): its forward raises Cancelled, alone, beside another member, or where
    the model hands its prompt over in pieces (as it does past PREFILL_CHUNK tokens, each piece computed whole), and
    the other member keeps its tokens."""
    import mirrorsd.batching as batching
    import mirrorsd.model
    from mirrorsd.errors import Cancelled

    monkeypatch.setattr(batching, "PREFILL_CHUNK", 4)  # a 60-token prompt: 15 chunks
    if mode == "pieces":
        monkeypatch.setattr(mirrorsd.model, "PREFILL_CHUNK", 8)  # the model's own pieces of 8 rows
    if mode == "batched":
        monkeypatch.setattr(Batcher, "_claim_solo", lambda self, me: False)
    cancelled = threading.Event()
    batcher = Batcher(speculation="fixed", on_step=lambda record: record.rows and cancelled.set())
    long, short = Req("ar", tuple(range(1, 61)), 4, 0.0, 0, 0, None), Req("ar", (7, 8, 9), 30, 0.0, 0, 0, None)
    out: dict[str, object] = {}

    def work(name: str, req: Req, event: threading.Event | None) -> None:
        try:
            with batcher.member(event):
                out[name] = pair.tokens(req)
        except Cancelled as e:
            out[name] = e

    threads = [threading.Thread(target=work, args=("long", long, cancelled))]
    if mode == "batched":
        threads.append(threading.Thread(target=work, args=("short", short, None)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(out["long"], Cancelled)
    # the step that saw the cancel, and at most one in flight
    assert sum(s.prompts for s in batcher.steps) <= 2 if mode == "batched" else batcher.total_steps <= 2
    if mode == "batched":
        assert out["short"] == pair.tokens(short)
    assert batcher.members_running == 0 and not batcher._waiting

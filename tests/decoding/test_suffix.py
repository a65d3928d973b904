"""The suffix index and proposer: longest matches, continuation frequencies, bounded memory, persistence, the
window rule, and the sd hybrid (losslessness of both is in the conformance suite)."""

from __future__ import annotations

import gzip
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mirrorsd import generate
from mirrorsd.decoding import suffix_index
from mirrorsd.decoding.engine import DecodeRequest, GenerationStats, RequestState, Scores
from mirrorsd.decoding.lookup import AcceptanceModel, ModelGate, SuffixProposer, VerifyCost
from mirrorsd.decoding.suffix_index import MAX_MATCH, SuffixIndex
from mirrorsd.sampling import SamplingParams
from mirrorsd.verify import Verdict
from tests.helpers import row_exact, tiny_hf


def test_longest_match_is_measured_past_the_indexed_key():
    index = SuffixIndex(key_len=2)
    doc = index.add([1, 2, 3, 4, 5, 9, 9, 3, 4, 5, 7, 1, 2, 3, 4, 5])
    found = index.occurrences(index.docs[doc])
    # "1 2 3 4 5" ended at 5 (followed by 9); "3 4 5" at 10 (followed by 7); the text itself is skipped
    assert [(length, end) for length, _, end in found] == [(5, 5), (3, 10)]


def test_match_length_is_capped():
    index = SuffixIndex()
    text = [7] * (3 * MAX_MATCH)
    doc = index.add(text)
    assert index.occurrences(index.docs[doc])[0][0] == MAX_MATCH


def test_continuations_count_the_longest_matches_only():
    index = SuffixIndex()
    index.add([5, 6, 1, 2])
    index.add([5, 6, 1, 3])
    index.add([9, 6, 1, 4])  # matches "6 1" only: shorter, left out
    found = index.continuations([0, 5, 6, 1], depth=2)
    assert found.length == 3 and found.occurrences == 2
    assert {t: c.count for t, c in found.root.children.items()} == {2: 1, 3: 1}


def test_eviction_keeps_the_budget_and_forgets_the_oldest():
    index = SuffixIndex(max_tokens=10)
    index.add([1, 2, 3, 4, 5, 6])
    index.add([7, 8, 9, 10, 11, 12])
    assert len(index) == 6 and len(index.docs) == 1
    assert all(0 not in entry for entry in index.table.values())  # no key still points at the evicted doc
    assert (1, 2) not in index.table and (7, 8) in index.table
    assert index.occurrences([0, 1, 2]) == []


def test_shared_index_round_trips_through_a_file(tmp_path):
    index = SuffixIndex()
    index.add([1, 2, 3])
    index.add([4, 5])
    index.save(tmp_path / "s.json")
    again = SuffixIndex()
    again.load(tmp_path / "s.json")
    assert list(again.docs.values()) == [[1, 2, 3], [4, 5]] and again.table == index.table


def test_concurrent_saves_leave_the_newest_whole_copy(tmp_path):
    """Requests finishing together each save the shared index: each write has its own temporary file (one fixed
    name made writers replace or truncate each other's), and the last copy taken is the one left."""
    index, path = SuffixIndex(), tmp_path / "s.json"

    def finish(i: int) -> None:
        with index.lock:
            index.add(list(range(i, i + 2000)))
        index.save(path)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(finish, range(16)))
    again = SuffixIndex()
    again.load(path)
    assert sorted(again.docs.values()) == sorted(index.docs.values()) and len(again.docs) == 16
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]


def _state(tokens: list[int], max_new: int = 32) -> RequestState:
    target = row_exact(tiny_hf(layers=2, seed=1))
    request = DecodeRequest(target, tokens, max_new, SamplingParams(), GenerationStats("suffix"))
    return RequestState(request, list(tokens), target.new_cache(capacity=64))


def test_window_follows_the_evidence():
    text = [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3]
    proposer = SuffixProposer(16, factor=1.0, min_prob=0.1)
    state = _state(text)
    proposer.start(state)
    assert proposer.propose(state).tokens == [4, 5, 6]  # factor 1: as many tokens as matched (3)
    proposer.factor = 4.0
    # a 3-token match: the first token is accepted with p = 0.45 (the prior), each next one x0.8: 0.45, 0.36,
    # 0.29, 0.23, 0.18, 0.15; one more token must beat (b/a)(1 + S)/(1 + (b/a)k) at the prior b/a = 0.1, which
    # the 6th (0.147 < 0.1 x 2.51 / 1.5 = 0.168) does not
    assert proposer.propose(state).tokens == [4, 5, 6, 7, 8]
    proposer.gamma = 2
    assert proposer.propose(state).tokens == [4, 5]
    assert proposer.propose(state, min_match=4).tokens == []


def test_rare_continuations_end_the_window():
    # "1 2" was followed by 3 three times and by 4 once; then 3 by 5, 6, 7: 0.3 (a 2-token match) x 0.75 for
    # the 3, then x 1/3 x 0.8 for any of 5, 6, 7
    text = [1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 3, 7, 1, 2, 4, 0, 1, 2]
    proposer = SuffixProposer(16, factor=8.0, min_prob=0.2)
    state = _state(text)
    proposer.start(state)
    assert proposer.propose(state).tokens == [3]


def test_windows_learn_from_the_verifier():
    acceptance = AcceptanceModel()
    assert acceptance.first_token(3) == AcceptanceModel.FIRST_PRIOR[3]
    for _ in range(16):  # 3-token matches whose first token the target never took
        acceptance.observe(3, drafted=3, accepted=0)
    assert acceptance.first_token(3) < 0.1 and acceptance.first_token(8) == AcceptanceModel.FIRST_PRIOR[8]
    for _ in range(8):  # long matches, fully accepted
        acceptance.observe(12, drafted=5, accepted=5)
    assert acceptance.first_token(12) > 0.85 and acceptance.next_token() > 0.95

    proposer = SuffixProposer(16, min_prob=0.1)
    state = _state([1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3])
    proposer.start(state)
    proposer.acceptance = acceptance
    assert proposer.propose(state).tokens == []  # 3-token matches have not paid in this request


def test_costly_verification_shortens_windows():
    cost = VerifyCost()
    assert cost.ratio == VerifyCost.PRIOR_RATIO
    cost.observe(0, 0.100)
    cost.observe(4, 0.200)
    assert cost.ratio == pytest.approx(0.25)
    proposer = SuffixProposer(16, factor=4.0)
    state = _state([1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3])
    proposer.start(state)
    cheap = proposer.propose(state).tokens
    proposer.cost = cost  # a 4-token window costs twice an empty one: 0.45, 0.36 pass, 0.29 < 0.25 x 1.81 / 1.5
    assert proposer.propose(state).tokens == [4, 5] and len(cheap) == 5


def test_rejection_drafts_are_point_masses():
    proposer = SuffixProposer(4, target_vocab=64, rejection=True, factor=4.0)
    state = _state([1, 2, 3, 1, 2])
    proposer.start(state)
    draft = proposer.propose(state)
    assert draft.tokens == [3, 1, 2]
    assert torch.equal(draft.probs.argmax(-1), torch.tensor(draft.tokens)) and torch.all(draft.probs.sum(-1) == 1)


def test_earlier_outputs_are_looked_up_and_added():
    shared = SuffixIndex()
    shared.add([7, 8, 9, 10, 11])
    proposer = SuffixProposer(16, shared=shared)
    state = _state([1, 7, 8])
    proposer.start(state)
    assert proposer.propose(state).tokens == [9, 10]  # a 2-token match in an earlier output
    window = proposer.last
    state.tokens += [9, 10, 12]
    proposer.feedback(state, Scores(torch.zeros(3, 64), window), Verdict(2, 12))
    proposer.close()
    assert list(shared.docs.values())[-1] == [9, 10, 12]  # the output, without the prompt


def test_suffix_equals_ar_with_and_without_earlier_outputs():
    target = row_exact(tiny_hf(layers=2, seed=1))
    prompt = [3, 1, 4, 1, 5]
    want = generate(target, prompt, method="ar", max_new_tokens=24).token_ids
    drafted = []
    for shared in ("process", "process", "none"):
        got = generate(target, prompt, method="suffix", max_new_tokens=24, shared=shared)
        assert got.token_ids == want
        drafted.append(sum(got.stats.drafted))
    assert drafted[1] > 0  # the second run drafted from the first one's output


def _write_store(path, docs) -> str:
    path.write_bytes(gzip.compress(json.dumps({"docs": docs}).encode()))
    return str(path)


def test_datastore_is_found_by_tokenizer_and_checked(tmp_path):
    assert suffix_index.datastore("none", "vocab151936", 151936) is None
    assert suffix_index.datastore("auto", "vocab512", 512) is None  # nothing shipped for this tokenizer
    shipped = suffix_index.datastore("auto", "vocab151936", 151936)  # the default pair's, in the package
    assert shipped is not None and len(shipped) > 10_000
    assert suffix_index.datastore("auto", "vocab151936", 151936) is shipped  # loaded once per process
    with pytest.raises(FileNotFoundError, match="no such file"):
        suffix_index.datastore(str(tmp_path / "missing.json.gz"), "vocab64", 64)
    with pytest.raises(ValueError, match="another tokenizer"):
        suffix_index.datastore(_write_store(tmp_path / "big.json.gz", [[1, 99]]), "vocab64", 64)


def _with_datastore(tokens: list[int]) -> tuple[SuffixProposer, RequestState]:
    """A proposer over a datastore holding 5..11, started on ``tokens``."""
    fixed = SuffixIndex()
    fixed.add([5, 6, 7, 8, 9, 10, 11])
    proposer, state = SuffixProposer(16, fixed=fixed, factor=4.0), _state(tokens)
    proposer.start(state)
    return proposer, state


def test_datastore_drafts_only_when_it_matches_longer():
    proposer, state = _with_datastore([1, 2, 6, 7, 8])
    assert proposer.propose(state).tokens == [9, 10, 11] and proposer.last_fixed  # a 3-token match there
    # the request's own 3-token match of "6 7 8" ties with the datastore's: the request's continuation wins
    proposer, state = _with_datastore([6, 7, 8, 4, 4, 6, 7, 8])
    assert proposer.propose(state).tokens[0] == 4 and not proposer.last_fixed


def test_datastore_drafts_learn_their_own_acceptance():
    proposer, state = _with_datastore([1, 2, 6, 7, 8])
    window = proposer.propose(state)
    state.tokens += [12]
    proposer.feedback(state, Scores(torch.zeros(4, 64), window), Verdict(0, 12))
    assert proposer.fixed_acceptance.first_token(3) < AcceptanceModel.FIRST_PRIOR[3]
    assert proposer.acceptance.first_token(3) == AcceptanceModel.FIRST_PRIOR[3]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_suffix_with_a_datastore_equals_ar(tmp_path, temperature):
    target = row_exact(tiny_hf(layers=2, seed=1))
    prompt = [3, 1, 4, 1, 5]
    want = generate(target, prompt, method="ar", max_new_tokens=24, temperature=temperature, seed=3).token_ids
    # a datastore holding the answer itself and a wrong continuation of the same prompt
    store = _write_store(tmp_path / "s.json.gz", [prompt + want, prompt + [(t + 1) % 512 for t in want]])
    got = generate(target, prompt, method="suffix", max_new_tokens=24, temperature=temperature, seed=3,
                   datastore=store)
    assert got.token_ids == want and sum(got.stats.accepted) >= 12  # the stored answer was drafted and accepted


def test_persisted_outputs_are_found_by_the_next_process(tmp_path, monkeypatch):
    """shared="persist": a later process starts from the outputs saved under the cache folder, so its first
    request can copy an answer given before the restart, and still returns exactly ar's tokens."""
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path))
    monkeypatch.setattr(suffix_index, "_shared", {})
    target = row_exact(tiny_hf(layers=2, seed=1))
    prompt = [3, 1, 4, 1, 5]
    want = generate(target, prompt, method="ar", max_new_tokens=24).token_ids
    first = generate(target, prompt, method="suffix", max_new_tokens=24, shared="persist")
    monkeypatch.setattr(suffix_index, "_shared", {})  # a new process: nothing in memory, the file on disk
    again = generate(target, prompt, method="suffix", max_new_tokens=24, shared="persist")
    assert first.token_ids == again.token_ids == want
    assert len(suffix_index.shared_index(f"vocab{target.config.vocab_size}").docs) == 2  # loaded, then added
    assert again.stats.target_forwards < first.stats.target_forwards  # it drafted from the saved answer


def test_isolated_requests_neither_read_nor_write_the_persisted_index(tmp_path, monkeypatch):
    """A benchmark answer or a calibration run (isolated_shared_indexes) with shared="persist" must not find the
    saved outputs of earlier runs, nor replace the saved file with its own."""
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path))
    monkeypatch.setattr(suffix_index, "_shared", {})  # this test's own process-wide indexes
    target = row_exact(tiny_hf(layers=2, seed=1))
    prompt = [3, 1, 4, 1, 5]
    generate(target, prompt, method="suffix", max_new_tokens=12, shared="persist")
    saved = tmp_path / "suffix" / f"vocab{target.config.vocab_size}.json"
    before = saved.read_text()
    assert len(json.loads(before)) == 1  # a real request persisted its output
    with suffix_index.isolated_shared_indexes():
        generate(target, [2, 7, 1, 8], method="suffix", max_new_tokens=12, shared="persist")
        isolated = suffix_index.shared_index(f"vocab{target.config.vocab_size}")
        assert len(isolated.docs) == 1  # its own output only: the saved one was not loaded
    assert saved.read_text() == before


def test_isolation_is_the_calling_threads_only(monkeypatch):
    """A first-use plan or a benchmark in one thread isolates its own requests, not a server's in another."""
    import threading

    monkeypatch.setattr(suffix_index, "_shared", {})
    process = suffix_index.shared_index("vocab64")
    process.add([1, 2, 3, 4])
    seen: dict[str, object] = {}
    inside, done = threading.Event(), threading.Event()

    def other_thread() -> None:
        inside.wait()
        seen["index"], seen["persist"] = suffix_index.shared_index("vocab64"), suffix_index.persisting_allowed()
        done.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with suffix_index.isolated_shared_indexes():
        isolated = suffix_index.shared_index("vocab64")
        assert isolated is not process and not isolated.docs and not suffix_index.persisting_allowed()
        inside.set()
        assert done.wait(10)
    worker.join()
    assert seen == {"index": process, "persist": True}
    assert suffix_index.shared_index("vocab64") is process and suffix_index.persisting_allowed()


@pytest.mark.parametrize("suffix_match", [1, 3])
def test_sd_hybrid_logs_which_proposer_drafted(suffix_match):
    target = row_exact(tiny_hf(layers=4, seed=1))
    draft = target.prefix_model(2)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    got = generate(target, prompt, method="sd", draft=draft, max_new_tokens=20, suffix_match=suffix_match,
                   gamma=4, confidence=0.0)
    want = generate(target, prompt, method="ar", max_new_tokens=20)
    assert got.token_ids == want.token_ids
    sources = [s["source"] for s in got.stats.step_log]
    assert sources[0] == "suffix"  # "3 4 1 2" occurred: a 4-token match
    assert set(sources) <= {"suffix", "model"}


def test_model_gate_keeps_the_faster_kind_and_retries_the_other():
    gate = ModelGate(measured=True)
    kinds = []
    for _ in range(30):  # the draft is rarely accepted: model steps commit 1 token in 60 ms, suffix steps in 42
        kinds.append(gate.kind)
        gate.observe(kinds[-1], 1, 0.060 if kinds[-1] == "model" else 0.042)
    assert kinds[:ModelGate.FIRST_BACKOFF] == ["suffix"] * ModelGate.FIRST_BACKOFF  # no draft prefill up front
    assert kinds.count("model") == 2 * ModelGate.PROBE_STEPS  # probed twice, the back-off doubling in between
    assert gate.current == "suffix" and gate.backoff == 4 * ModelGate.FIRST_BACKOFF
    for _ in range(gate.countdown + ModelGate.PROBE_STEPS):  # now it is accepted: 5 tokens in 130 ms
        kind = gate.kind
        gate.observe(kind, 5 if kind == "model" else 1, 0.130 if kind == "model" else 0.042)
    assert gate.current == "model" and gate.switches == 1 and gate.backoff == ModelGate.FIRST_BACKOFF
    always = ModelGate(measured=False)
    always.observe("model", 1, 1.0)
    assert always.kind == "model" and always.rates["model"].steps == 0


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_sd_with_either_model_gate_equals_ar(temperature):
    target = row_exact(tiny_hf(layers=4, seed=2))
    draft = target.prefix_model(2)
    prompt = [7, 1, 8, 2, 8, 1, 8, 2, 8]
    kw = dict(max_new_tokens=40, temperature=temperature, seed=3)
    want = generate(target, prompt, method="ar", **kw).token_ids
    for gate in ("always", "measured"):
        with suffix_index.isolated_shared_indexes():  # (else the measured run copied the answers made before it)
            got = generate(target, prompt, method="sd", draft=draft, gamma=4, model_gate=gate, **kw)
        assert got.token_ids == want and got.stats.draft_forwards > 0
        logged = {s.get("gate") for s in got.stats.step_log}
        assert logged == {None} if gate == "always" else "model" in logged <= {None, "model", "suffix"}


@pytest.mark.parametrize("backend", ["serial", "threads"])
def test_mirror_hybrid_feeds_the_spine_the_draft_cache_lacks(backend):
    target = row_exact(tiny_hf(layers=4, seed=1))
    draft = target.prefix_model(2)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    got = generate(target, prompt, method="mirror", draft=draft, max_new_tokens=24, suffix_match=2, gamma=3,
                   kappa=2, exit_layer=2, backend=backend)
    assert got.token_ids == generate(target, prompt, method="ar", max_new_tokens=24).token_ids
    assert got.stats.extra["mirror"].draft_failed is None  # the rollouts after suffix windows ran
    sources = [s["source"] for s in got.stats.step_log]
    assert sources[0] == "suffix" and set(sources) <= {"suffix", "model", "branch"}


def test_ss_hybrid_drafts_suffix_chains_as_one_branch_trees():
    from tests.helpers import random_adapters

    target = row_exact(tiny_hf(layers=4, seed=1))
    adapters = random_adapters(target, 2, 2, 0, std=0.1)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2]
    got = generate(target, prompt, method="ss", streams=adapters, max_new_tokens=20, suffix_match=2,
                   threshold=0.0)  # random pruning adapters would cut the chain
    assert got.token_ids == generate(target, prompt, method="ar", max_new_tokens=20).token_ids
    first = got.stats.step_log[0]
    assert first["source"] == "suffix" and first["drafted"] > 2  # deeper than the 2 streams could draft


def test_the_step_served_by_the_prefill_teaches_no_cost():
    """``suffix`` prefills the whole prompt, so its first step may run no forward at all: timing it as an empty
    window would make every later window look expensive (the base cost near zero) and stop drafting."""
    proposer = SuffixProposer(16)
    state = _state([1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3])
    proposer.start(state)
    proposer.gamma = 0  # empty windows
    for forwards in (0, 1):  # the step served by the prefill, then a real one
        draft = proposer.propose(state)
        proposer.feedback(state, Scores(torch.zeros(1, 64), draft, forwards=forwards), Verdict(0, 0))
        assert (proposer.cost.base is None) == (forwards == 0)

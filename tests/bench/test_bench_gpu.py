"""`mirrorsd bench gpu` as a CPU dry run (tiny shapes): the command, its report and the oracle draft's schedule.

The GPU figures themselves come from running the command on a CUDA machine (docs/gpu.md); here every step runs
on stand-in shapes so the command cannot rot while no GPU is lent."""

from __future__ import annotations

import json

import pytest
import torch

from mirrorsd import generate
from mirrorsd.bench import gpu
from mirrorsd.cli import main
from tests.helpers import row_exact, tiny_hf


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pair():
    shape = gpu.DRY_SHAPES["qwen2.5-1.5b"]
    target = gpu.random_model(shape, torch.device("cpu"), torch.float32, seed=1)
    draft = gpu.random_model(gpu.DRY_SHAPES[gpu.DRAFT], torch.device("cpu"), torch.float32, seed=0)
    return target, draft


@pytest.mark.parametrize("accept", [1, 3, None])
def test_oracle_draft_forces_its_acceptance_schedule(accept):
    """Every verification accepts exactly `accept` draft tokens (all of them with None), for SD's chain and
    Mirror-SD's rollouts alike, and the answer is still the target's own."""
    target, draft = _pair()
    prompt = list(range(5, 45))
    reference = generate(target, prompt, method="ar", max_new_tokens=24, temperature=0.0).token_ids
    oracle = gpu.OracleDraft.wrap(draft, prompt, reference, accept)
    gamma = 5
    sd = generate(target, prompt, method="sd", draft=oracle, gamma=gamma, confidence=0.0, suffix_match=0,
                  max_new_tokens=24, temperature=0.0)
    assert sd.token_ids == reference
    want = gamma if accept is None else accept
    assert sd.stats.accepted[:-1] == [want] * (len(sd.stats.accepted) - 1)  # the last window may be cut short
    mirror = generate(target, prompt, method="mirror", draft=oracle, gamma=gamma, max_new_tokens=24,
                      temperature=0.0)
    assert mirror.token_ids == reference
    assert mirror.stats.accepted[:-1] == [want] * (len(mirror.stats.accepted) - 1)


@pytest.mark.parametrize("hit", [0.0, 0.5, 1.0])
def test_exit_oracle_holds_the_correction_at_its_rate(hit):
    """Mirror-SD's early exit on random weights never holds the correction; the exit oracle's does at ``hit``: with
    every root rolled out, a rejected window finds its ready branch at that rate, and the answer stays the target's."""
    target, draft = _pair()
    prompt = list(range(5, 45))
    reference = generate(target, prompt, method="ar", max_new_tokens=24, temperature=0.0).token_ids
    mirror = generate(gpu.ExitOracle.wrap(target, prompt, reference, hit, 4), prompt, method="mirror",
                      draft=gpu.OracleDraft.wrap(draft, prompt, reference, 2), gamma=5, kappa=4, roots="paper",
                      confidence=0.0, exit_head="lens", exit_vocab=0, max_new_tokens=24, temperature=0.0)
    assert mirror.token_ids == reference
    fallback = mirror.stats.extra["mirror"].to_dict()["fallback_frequency"]
    assert fallback == 1 - hit if hit in (0.0, 1.0) else 0 < fallback < 1


@pytest.mark.parametrize("hit", [0.0, 0.5, 1.0])
def test_stream_oracle_sets_the_ss_drafts_acceptance(hit):
    """Untrained streams never guess right; the stream oracle's do at ``hit``. SD's SS draft and Mirror-SD's fresh and
    branch rollouts then draft the schedule's tokens (the forced acceptance holds) in fewer forwards: exactly one
    token a forward at 0, a whole stream tree a forward at 1 (γ = 7, 3 streams: 1 + 4 + 2 tokens in 3 passes, less
    where the output's end cuts a window)."""
    target, draft = _pair()
    prompt = list(range(5, 45))
    reference = generate(target, prompt, method="ar", max_new_tokens=24, temperature=0.0).token_ids
    oracle = gpu.OracleDraft.wrap(draft, prompt, reference, 3, hit)
    streams = gpu.oracle_streams(draft)
    sd = generate(target, prompt, method="sd", draft=oracle, gamma=7, confidence=0.0, suffix_match=0,
                  draft_streams=streams, max_new_tokens=24, temperature=0.0)
    assert sd.token_ids == reference
    assert sd.stats.accepted == [3] * 6
    mirror = generate(target, prompt, method="mirror", draft=oracle, gamma=7, kappa=2, roots="paper", confidence=0.0,
                      draft_streams=streams, max_new_tokens=24, temperature=0.0)
    assert mirror.token_ids == reference
    assert mirror.stats.accepted == [3] * 6
    info = mirror.stats.extra["mirror"].to_dict()
    etas = [gpu.draft_eta(sd), info["fresh_tokens_per_draft_forward"], info["rollout_tokens_per_draft_forward"]]
    if hit == 0.0:
        assert etas == [1.0, 1.0, 1.0]
    elif hit == 1.0:
        assert all(2 < eta <= 7 / 3 + 1e-4 for eta in etas[:2]) and etas[2] > 2  # (the output's end cuts windows)
    else:
        assert all(1.1 < eta < 2 for eta in etas)


def test_the_stream_oracle_needs_adapters_that_count_their_streams():
    """Plain adapters do not say how many streams a pass inserted beside each node: a clear error, not wrong rows."""
    from mirrorsd.decoding.streams.adapters import StreamAdapters, StreamConfig

    target, draft = _pair()
    prompt = list(range(5, 45))
    reference = generate(target, prompt, method="ar", max_new_tokens=8, temperature=0.0).token_ids
    cfg = draft.config
    plain = StreamAdapters(draft, StreamConfig(streams=2, layers=1, hidden_size=cfg.hidden_size,
                                               n_layers=cfg.n_layers, vocab_size=cfg.vocab_size))
    with pytest.raises(TypeError, match="OracleStreams"):
        generate(target, prompt, method="sd", draft=gpu.OracleDraft.wrap(draft, prompt, reference, 3, 0.5),
                 gamma=5, confidence=0.0, suffix_match=0, draft_streams=plain, max_new_tokens=8, temperature=0.0)


def test_real_vocabulary_in_bf16_runs_every_method_and_forces_acceptance(tmp_path, monkeypatch):
    """What the tiny dry-run shapes miss and the first H200 run hit: with Qwen's 151,936-token vocabulary the
    drafts read a shipped reduced-vocabulary head, which must run in a bf16 model's dtype, and the forced runs
    must bypass it (it would read the oracle's states without the oracle's logits). (bfloat16 speculation is refused
    on a CPU, where windows are not row-exact; here on a GPU's dtype plumbing, with random weights whose tokens are
    far from ties, and the tokens are still checked against ar.)"""
    import mirrorsd.api

    monkeypatch.setattr(mirrorsd.api, "exact_windows", lambda model, method: None)
    shape = gpu.Shape(64, 128, 2, 4, 2, 151936, True)
    target = gpu.random_model(shape, torch.device("cpu"), torch.bfloat16, seed=1)
    draft = gpu.random_model(gpu.Shape(64, 128, 1, 4, 2, 151936, True), torch.device("cpu"), torch.bfloat16, seed=0)
    prompt = list(range(5, 45))
    reference = generate(target, prompt, method="ar", max_new_tokens=12, temperature=0.0).token_ids
    for method in ("sd", "mirror"):
        got = generate(target, prompt, method=method, draft=draft, max_new_tokens=12, temperature=0.0)
        assert got.token_ids == reference
    rows = gpu._forced("qwen2.5-1.5b", target, draft, prompt, reference, (2,), 5, torch.device("cpu"), 12,
                       tmp_path, lambda *a, **k: None)
    assert [row["accept"] for row in rows] == ["2", "all"]  # (the checks below ran)
    for row in rows:
        want = 3.0 if row["accept"] == "2" else 6.0  # 12 tokens: 4 windows of 2 + 1, or 2 of all 5 + 1
        assert row["sd"]["equal_to_ar"] and row["mirror"]["equal_to_ar"]
        assert row["sd"]["mean_accepted"] == row["mirror"]["mean_accepted"] == want


def test_dry_run_report(tmp_path):
    """The whole command on tiny shapes: every method equal to ar, Eq. 10 terms and traces written, and at A = 3 the
    paper's Fig. 4 cells: SD and Mirror-SD with a plain and with an SS draft."""
    assert main(["bench", "gpu", "--out", str(tmp_path), "--targets", "qwen2.5-1.5b", "--accept", "3",
                 "--max-new-tokens", "12", "--ks", "1,2", "--no-tests"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["dry_run"] and report["device"] == "cpu"
    assert set(report["forward_ms"]["qwen2.5-1.5b"]) == {"1", "2"}
    labels = {m["label"] for m in report["methods"]}
    assert {"ar", "sd", "suffix", "mirror serial", "ss (untrained streams)"} <= labels
    assert all(m["equal_to_ar"] for m in report["methods"])
    batched = report["batched"]["qwen2.5-1.5b"]  # (a CPU's dense fp32 layers run them alone: the rows' code ran)
    assert [r["requests"] for r in batched] == [1, 2] and all(r["equal_alone"] for r in batched)
    for rule in ("fixed", "goodput"):  # the speculating method under each rule: every answer its alone ar one
        cells = [r[f"{gpu.BATCH_SPECULATION}_{rule}"] for r in batched]
        assert all(c["equal_alone"] and c["tok_s"] > 0 and c["draft_rows_per_step"] >= 0 for c in cells)
    assert "goodput (draft rows a step)" in (tmp_path / "report.md").read_text()
    hit = gpu.EXIT_HIT
    assert [(r["accept"], r["draft"], r["exit_hit_rate"]) for r in report["forced"]] == [
        ("3", "plain", hit), *(("3", "plain", h) for h in gpu.EXIT_HITS_AT_3), ("3", "ss", hit), ("all", "plain", hit)]
    for row in report["forced"]:
        assert row["sd"]["equal_to_ar"] and row["mirror"]["equal_to_ar"]
        assert row["mirror"]["eq10_ms"] > 0 and row["mirror"]["step_ms"] > 0
        trace = json.loads((tmp_path / row["mirror"]["trace"]).read_text())
        assert {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"} == {"target", "draft"}
    assert report["forced"][0]["sd"]["mean_accepted"] == pytest.approx(4.0, abs=0.5)  # A accepted + the correction
    alone = report["forced"][0]["mirror"]["alone"]  # Eq. 10's terms each measured alone, and the law from them
    assert alone["backend"] == "serial" and alone["equal_to_ar"] and alone["terms_ms"]["t_draft"] > 0
    assert alone["law_step_ms"] > 0 and alone["law_mirror_over_sd"] > 0
    assert report["forced"][0]["mirror"]["step_over_predicted"] <= report["forced"][0]["mirror"]["step_over_eq10"]
    ss = report["forced"][3]
    assert ss["sd"]["mean_accepted"] == report["forced"][0]["sd"]["mean_accepted"]  # the same tokens, fewer forwards
    assert report["forced"][0]["sd"]["draft_eta"] == pytest.approx(1.0)
    assert ss["sd"]["draft_eta"] > 1.0
    text = (tmp_path / "report.md").read_text()
    assert "DRY RUN" in text and "Fig. 4" in text and "measured alone" in text
    assert len(gpu.fig4_cells(report["forced"])["qwen2.5-1.5b"]) == 4
    # on CUDA each forward's kernels are listed (None on the CPU): the table renders from the report's fields
    from mirrorsd.bench.gpu import markdown

    report["costs"][0]["kernel_times"] = {"wall_ms": 2.8, "kernel_us": 2500.0, "launches": 290.0,
                                          "top": [{"name": "attend", "launches": 28.0, "us": 400.0}]}
    assert "| `attend` | 28 | 400.0 | 16% |" in markdown(report)
    # an SS draft that fails on a GPU is a row of the report and a word in the summary, not the end of the run
    report["forced"][3] = {**{k: ss[k] for k in ("target", "accept", "draft", "exit_hit_rate", "overlap")},
                           "failed": "RuntimeError: boom"}
    assert "failed: RuntimeError: boom" in markdown(report)
    assert "FAILED: forced 3 (ss draft)" in gpu.summary(report)
    assert len(gpu.fig4_cells(report["forced"])["qwen2.5-1.5b"]) == 2
    # so is a method that fails
    report["methods"][2] = {**report["methods"][2], "tok_s": 0.0, "mean_accepted": 0.0, "equal_to_ar": False,
                            "divergence": None, "failed": "RuntimeError: bang"}
    assert "FAILED | RuntimeError: bang |" in markdown(report)
    assert f"{report['methods'][2]['label']} (failed)" in gpu.summary(report)


def test_a_method_that_fails_is_a_row_and_the_run_goes_on(tmp_path, monkeypatch):
    timed = gpu.timed_generate

    def failing(target, prompt, max_new, **kwargs):
        if kwargs.get("method") == "suffix":
            raise RuntimeError("CUDA error: device-side assert triggered")
        return timed(target, prompt, max_new, **kwargs)

    monkeypatch.setattr(gpu, "timed_generate", failing)
    assert main(["bench", "gpu", "--out", str(tmp_path), "--targets", "qwen2.5-1.5b", "--accept", "3",
                 "--max-new-tokens", "8", "--ks", "1", "--no-tests"]) == 1  # (a failed method: exit status 1)
    report = json.loads((tmp_path / "report.json").read_text())
    rows = {m["label"]: m for m in report["methods"]}
    assert "device-side assert" in rows["suffix"]["failed"] and rows["sd"]["equal_to_ar"]
    assert "ss (untrained streams)" in rows and report["forced"]  # what comes after it still ran


def test_the_cuda_tests_say_which_passed(tmp_path):
    """One child run of the CUDA tests tells which passed: the overlap variants are measured only where theirs did."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_cuda.py").write_text(
        "def test_overlap_graphs_ok():\n    pass\n\n\ndef test_issued_inline_broken():\n    assert False\n")
    ran = gpu.run_cuda_tests(tmp_path)
    assert ran["ran"] and ran["returncode"] == 1 and ran["passed"] == ["test_overlap_graphs_ok"]
    assert ran["failed"] == {"test_issued_inline_broken": "assert False"}  # why, for the session reading the report
    assert gpu.run_cuda_tests(tmp_path, "issued_inline")["passed"] == []


def test_cuda_tests_that_hang_are_cut_off_keeping_what_passed(tmp_path):
    """A hung CUDA test must not eat the lease: the child is killed at the timeout, and the tests that passed before
    it still count (the overlap variants whose own test passed are measured)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_cuda.py").write_text(
        "import time\n\n\ndef test_overlap_graphs_ok():\n    pass\n\n\ndef test_hangs():\n    time.sleep(60)\n")
    ran = gpu.run_cuda_tests(tmp_path, timeout=8)
    assert ran["timed_out"] and ran["returncode"] is None and ran["passed"] == ["test_overlap_graphs_ok"]


def test_the_papers_target_sizes_run_on_request(tmp_path):
    """``--targets qwen2.5-32b`` (and 14b): the paper's sizes, outside the default run; their dry stand-ins decode
    every method equal to ar."""
    assert main(["bench", "gpu", "--out", str(tmp_path), "--targets", "qwen2.5-32b", "--accept", "2",
                 "--max-new-tokens", "8", "--ks", "1", "--no-tests"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["forward_ms"]) == {"qwen2.5-32b"} and "peer" not in report["costs"][0]
    assert all(m["equal_to_ar"] for m in report["methods"])


@pytest.mark.parametrize("argv, message", [
    (["--accept", "7"], "below --gamma"),
    (["--accept", "0"], "positive integers"),
    (["--targets", "llama-70b"], "--targets must name"),
    (["--ks", "1,x"], "comma-separated integers"),
])
def test_bad_arguments_are_clear_errors(tmp_path, capsys, argv, message):
    assert main(["bench", "gpu", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_sync_count_that_fails_is_a_note_of_its_row(monkeypatch):
    """Each one-read path (`sd`'s, Mirror-SD's) is counted apart: one that fails on a GPU is reported in its row and
    the report, and the run goes on to measure the rest."""
    target, draft = _pair()

    def counted(model, prompt, tokens=16, warm=False, **options):
        assert tokens == gpu.SYNC_TOKENS and warm  # (several of sd's γ = 20 windows, after a warm request)
        if options.get("method") == "mirror":
            raise RuntimeError("CUDA error: an illegal memory access")
        return 1.0

    monkeypatch.setattr(gpu, "host_syncs_per_step", counted)
    row = gpu.step_costs("t", target, draft, None, list(range(5, 37)), 1e12, 8, lambda *a, **k: None)
    assert row["host_syncs_per_step"] == row["sd_host_syncs_per_step"] == row["sd_confident_host_syncs_per_step"] == 1.0
    assert row["mirror_host_syncs_per_step"] is None
    assert "illegal memory access" in row["failed"]["mirror_host_syncs_per_step"]


def test_the_devices_backend_runs_once_with_a_draft_on_the_host():
    """On a GPU the first target's methods add Mirror-SD's ``devices`` backend with the draft on the host (issue
    62: it keeps working, measured once); without a host draft (the CPU's dry run) there is none."""
    target, draft = _pair()
    labels = [label for _, label, _ in gpu._methods(torch.device("cpu"), draft, None)]
    assert not any("devices" in label for label in labels)
    method, label, options = gpu._methods(torch.device("cuda"), draft, None, host_draft=draft)[-1]
    assert (method, options["backend"], options["draft"]) == ("mirror", "devices", draft)


def test_a_batch_that_hangs_is_cut_off(monkeypatch):
    """A batched run that never finishes raises within its timeout instead of holding the lease."""
    import threading

    release = threading.Event()

    class Hung:  # a request stuck inside its first step: it cannot be stopped, only named
        def deltas(self):
            release.wait(30)
            yield from ()

    monkeypatch.setattr(gpu, "stream", lambda *a, **k: Hung())
    monkeypatch.setattr(gpu, "STOP_WAIT_S", 0.2)
    target, _ = _pair()
    try:
        with pytest.raises(TimeoutError, match="2 of 2 batched requests.*2 did not stop"):
            gpu.run_batched(target, [{"prompt": [1, 2]}, {"prompt": [3, 4]}], 4, timeout_s=0.5)
    finally:
        release.set()


def test_a_timed_out_batch_is_stopped_not_left_running():
    """``run_batched`` on a timeout stops its requests at their next token: the figures after it must not run beside
    them (a GPU lease's bench went on with a hung batch's threads still decoding)."""
    import threading

    target = row_exact(tiny_hf(layers=2, seed=1))
    requests = [{"prompt": list(range(3, 30)), "method": "ar", "temperature": 0.0} for _ in range(3)]
    got, _, _ = gpu.run_batched(target, requests, 8)
    assert got == [generate(target, list(range(3, 30)), method="ar", max_new_tokens=8).token_ids] * 3
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(TimeoutError, match="stopped"):
        gpu.run_batched(target, requests, 400, timeout_s=0.05)
    assert not [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]


@pytest.mark.parametrize("change, rc", [
    ({}, 0),
    ({"methods": [{"label": "sd", "equal_to_ar": False, "divergence": None}]}, 1),
    ({"forced": [{"accept": 3, "draft": "plain", "failed": "RuntimeError: boom"}]}, 1),
    ({"cuda_tests": {"ran": True, "returncode": 1, "passed": [], "failed": {"test_graphs": "AssertionError"}}}, 1),
    ({"cuda_tests": {"ran": True, "returncode": None, "passed": ["a"], "failed": {}, "timed_out": True}}, 1),
])
def test_bench_gpu_exits_1_when_a_check_fails(capsys, monkeypatch, change, rc):
    """`bench gpu` exited 0 with methods not equal to ar or CUDA tests failed (the summary did not even name
    failed CUDA tests): a lease's script reads the exit status, as `mirrorsd bench`'s (1 when not lossless)."""
    report = {"dry_run": True, "device": "cpu", "methods": [{"label": "ar", "equal_to_ar": True, "divergence": None}],
              "forced": [], "cuda_tests": {"ran": True, "returncode": 0, "passed": ["a"], "failed": {}}} | change
    monkeypatch.setattr(gpu, "run", lambda out, **kwargs: report)
    assert main(["bench", "gpu", "--out", "unused", "--no-tests"]) == rc
    out = capsys.readouterr().out
    assert ("FAILED" in out or "NOT equal" in out) == bool(rc)
    if "cuda_tests" in change:
        assert "CUDA test" in out

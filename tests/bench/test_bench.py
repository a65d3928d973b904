"""The benchmark harness: metric code on known inputs, the latency law, method parsing, suites, the report, and
`mirrorsd bench` / `bench sweep` / `plan` / `generate --method auto` end to end on SmolLM2."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mirrorsd
from mirrorsd import plans, zoo
from mirrorsd.api import encode_chat
from mirrorsd.bench import metrics, plan, report
from mirrorsd.bench.metrics import Answer, Turn
from mirrorsd.bench.peers import server_flags
from mirrorsd.bench.probe import Probe
from mirrorsd.bench.report import render, write_report
from mirrorsd.bench.runner import Bench, BenchConfig, MethodSpec, needs_draft, parse_methods
from mirrorsd.cli import main
from mirrorsd.decoding import get_method
from mirrorsd.decoding.suffix_index import isolated_shared_indexes, shared_index
from mirrorsd.exit_heads import ExitTranslators
from mirrorsd.specbench import GROUPS, load_suite
from tests.helpers import requires_smollm2


def answer(method: str, run: int, qid: int, group: str, tokens: int, wall: float, lengths=(), drafted=(),
           counters=None, equal=None) -> Answer:
    turn = Turn(tokens, wall, list(lengths), list(drafted), counters=counters or {})
    return Answer(run, method, qid, group, group, [turn], equal)


# -- metrics ---------------------------------------------------------------------------------------------------


def test_speedup_is_the_ratio_of_mean_per_question_speeds_per_group_and_run():
    rows = []
    for run, slow in ((0, 1.0), (1, 2.0)):  # run 1's machine is twice as slow for both methods alike
        rows += [answer("ar", run, 1, "qa", 10, 1.0 * slow), answer("ar", run, 2, "qa", 30, 1.0 * slow),
                 answer("ar", run, 3, "rag", 10, 1.0 * slow),
                 answer("sd", run, 1, "qa", 10, 0.5 * slow), answer("sd", run, 2, "qa", 30, 0.5 * slow),
                 answer("sd", run, 3, "rag", 10, 2.0 * slow)]
    s = metrics.speedups(rows, "sd", "ar")
    # qa: mean speed 40 vs 20 -> 2.0 in both runs; rag: 5 vs 10 -> 0.5
    assert s["qa"]["median"] == pytest.approx(2.0) and s["qa"]["runs"] == pytest.approx([2.0, 2.0])
    assert s["rag"]["median"] == pytest.approx(0.5)
    # overall: run 0 mean(20, 60, 5) / mean(10, 30, 10) = 85/50 = 1.7 (ratio of means, not mean of ratios)
    assert s["overall"]["median"] == pytest.approx(1.7)
    assert metrics.speedups(rows, "ar", "ar")["overall"]["median"] == 1.0
    tps = metrics.tokens_per_second(rows, "ar")
    assert tps["runs"] == pytest.approx([50 / 3, 25 / 3]) and tps["max"] == pytest.approx(50 / 3)


def test_speed_pools_the_turns_of_a_question():
    a = Answer(0, "ar", 1, "writing", "mt_bench", [Turn(10, 1.0), Turn(30, 3.0)])
    assert a.speed == pytest.approx(10.0) and a.new_tokens == 40


def test_spread_over_runs():
    assert metrics.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [3.0, 1.0, 2.0]}


def test_mean_accepted_tokens_includes_the_bonus_and_pools_steps():
    rows = [answer("sd", 0, 1, "qa", 9, 1.0, lengths=[3, 1, 5], drafted=[4, 4, 4]),
            answer("sd", 0, 2, "rag", 3, 1.0, lengths=[3], drafted=[2]),
            answer("ar", 0, 1, "qa", 4, 1.0, lengths=[1, 1, 1, 1], drafted=[0, 0, 0, 0])]
    assert metrics.mean_accepted_tokens(rows, "sd") == pytest.approx(12 / 4)
    assert metrics.mean_accepted_tokens(rows, "sd", "qa") == pytest.approx(3.0)
    assert metrics.mean_accepted_tokens(rows, "ar") == 1.0
    assert metrics.mean_accepted_tokens(rows, "hf-assisted") is None
    # accepted (2, 0, 4) of 4 drafted, and 2 of 2: positions 1-2 drafted 4 times, accepted 3 times each;
    # positions 3-4 drafted 3 times, accepted once (the share of steps that drafted it, as GenerationStats)
    assert metrics.per_position_acceptance(rows, "sd") == pytest.approx([3 / 4, 3 / 4, 1 / 3, 1 / 3])
    assert metrics.per_position_acceptance(rows, "ar") == []


def test_draft_eta_counts_the_draft_models_windows_only():
    """A suffix lookup's windows cost no draft forward: counted, they gave a one-token-a-forward draft η̄ 1.28."""
    from mirrorsd.api import LoadedModel
    from tests.helpers import row_exact, tiny_hf

    target, draft = LoadedModel(row_exact(tiny_hf(layers=4, seed=1))), LoadedModel(row_exact(tiny_hf(layers=2, seed=2)))
    g = mirrorsd.generate(target, [5, 6, 7, 8, 9] * 6, draft=draft, method="sd", max_new_tokens=64, suffix_match=1)
    log = g.stats.step_log
    assert sum(s["drafted"] for s in log if s.get("source") == "suffix") > 0  # (the lookup drafted some windows)
    counters = metrics.draft_counters(g.stats)
    assert counters["model_drafted"] == sum(s["drafted"] for s in log if s.get("source") == "model") > 0
    sd = [answer("sd", 0, 1, "qa", 1, 1.0, counters=counters)]
    eta = metrics.method_extras(sd, "sd")["draft_tokens_per_forward"]
    assert eta == pytest.approx(counters["model_drafted"] / counters["draft_forwards"])
    assert eta <= 1.0  # an AR draft: a token a forward at most


def test_mirror_and_ss_extras_pool_counters():
    rows = [answer("m", 0, 1, "qa", 1, 1.0, counters={"tree_steps": 4, "misses": 1, "hidden_s": 0.3, "draft_s": 1.0}),
            answer("m", 0, 2, "qa", 1, 1.0, counters={"tree_steps": 6, "misses": 1, "hidden_s": 0.1, "draft_s": 1.0}),
            answer("s", 0, 1, "qa", 1, 1.0, counters={"passes": 4, "committed": 6})]
    assert metrics.method_extras(rows, "m") == pytest.approx({"fallback_frequency": 0.2, "hidden_draft_fraction": 0.2})
    assert metrics.method_extras(rows, "s") == pytest.approx({"call_reduction": 1.5})


def test_acceptance_and_draft_eta_pool_counters():
    """η̄ = draft tokens per draft forward: from every window's drafting, or from Mirror-SD's own rollout counters
    (its windows come from branches, so draft_forwards would count the branch rollouts' forwards against them)."""
    sd = [answer("sd", 0, q, "qa", 1, 1.0, counters={"drafted": 10, "accepted": 6, "draft_forwards": 8})
          for q in (1, 2)]
    assert metrics.method_extras(sd, "sd") == pytest.approx({"acceptance_rate": 0.6, "draft_tokens_per_forward": 1.25})
    mirror = [answer("m", 0, 1, "qa", 1, 1.0, counters={"drafted": 10, "accepted": 5, "draft_forwards": 30,
                                                        "fresh_tokens": 6, "fresh_forwards": 4, "rollout_depth": 14,
                                                        "rollout_forwards": 6})]
    assert metrics.method_extras(mirror, "m")["draft_tokens_per_forward"] == pytest.approx(2.0)


def test_tradeoff_curves_join_runs_by_draft_and_leave_single_points_out(tmp_path):
    runs = []
    for draft, slow in (("d", 1.0), ("self:0.5", 2.0)):
        results = synthetic_results()
        results["config"]["draft"] = draft
        base = results["summary"]["sd"]
        for g in (1, 3):
            results["summary"][f"sd-g{g}"] = {**base, "options": {"gamma": g, "confidence": 0.0},
                                             "tokens_per_s": {"median": 10.0 * g / slow}}
        results["summary"]["lonely"] = {**base, "kind": "mirror", "options": {"gamma": 2}}
        runs.append(results)
    curves = report.tradeoff_curves(runs)
    assert list(curves) == ["sd d", "sd self:0.5"]  # the options every curve shares are left out of the labels
    assert curves["sd self:0.5"][3]["ms_per_token"] == pytest.approx(1e3 / 15)
    assert curves["sd d"][1]["accepted"] == pytest.approx(1.0)  # MAT 2.0, bonus excluded
    table = "\n".join(report.tradeoff_table(runs))
    assert "| sd d | 100.0 ms, 1.00 | 33.3 ms, 1.00 |" in table and "not lossless" not in table
    runs[1]["summary"]["sd-g3"] = {**runs[1]["summary"]["sd-g3"], "lossless": {"checked": 2, "equal": 1}}
    table = "\n".join(report.tradeoff_table(runs))  # (a diverged point was drawn and tabled as any other)
    assert "| sd self:0.5 | 200.0 ms, 1.00 | 66.7 ms, 1.00 ✗ |" in table and "not lossless" in table
    assert report.plot_tradeoff(runs, tmp_path / "t.png") and (tmp_path / "t.png").stat().st_size > 1000
    folders = []
    for i, results in enumerate(runs):
        folders.append(tmp_path / f"run{i}")
        folders[-1].mkdir()
        (folders[-1] / "results.json").write_text(json.dumps(results))
    assert main(["bench", "tradeoff", *map(str, folders), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tradeoff_vs_gamma.png").exists() and "γ=3" in (tmp_path / "out" /
                                                                                "tradeoff.md").read_text()
    assert main(["bench", "tradeoff", str(tmp_path / "nowhere")]) == 2


def test_first_divergence_and_lossless_summary():
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert metrics.first_divergence([1, 2, 3], [1, 2]) == 2
    bad = answer("sd", 1, 7, "qa", 1, 1.0, equal=False)
    bad.divergence = {"position": 3, "logit_gap": 2.5}
    rows = [answer("sd", 0, 7, "qa", 1, 1.0, equal=True), bad, answer("sd", 0, 8, "qa", 1, 1.0, equal=None)]
    s = metrics.lossless_summary(rows, "sd")
    assert s["checked"] == 2 and s["equal"] == 1
    assert s["divergences"] == [{"position": 3, "logit_gap": 2.5, "question_id": 7, "run": 1}]


def test_expected_accepted_from_per_position_acceptance():
    assert metrics.expected_accepted([0.5, 0.5, 1.0], 2) == pytest.approx(0.75)
    assert metrics.expected_accepted([0.5, 0.5, 1.0], 3) == pytest.approx(1.0)
    assert metrics.expected_accepted([1.0] * 4, 7) == 4.0


# -- the latency law -------------------------------------------------------------------------------------------


def costs(draft_ms=2.0) -> plan.Costs:
    target = {1: 10.0, 2: 11.0, 8: 17.0, 16: 25.0}
    return plan.Costs(context=128, threads=2, target_ms=target, prefix_ms={4: {k: v / 2 for k, v in target.items()}},
                      exit_head_ms={1: 0.5, 16: 1.5}, draft_ms={1: draft_ms, 64: 64 * draft_ms / 4})


def test_split_thread_costs_keep_the_reduced_draft_heads():
    """The split tables (threads, processes) were built without the reduced heads' tables: a draft_vocab draft on
    those backends was priced with the full head, serial with its own. They are scaled by the split slowdown."""
    whole = costs()
    whole.default_draft_vocab, whole.draft_vocab_ms = 8192, {8192: {1: 1.0, 64: 16.0}}
    whole.split = {"target_ms": {k: 2 * v for k, v in whole.target_ms.items()}, "prefix_ms": whole.prefix_ms,
                   "draft_ms": {1: 3.0, 64: 48.0}}  # the draft 1.5x slower on its share of the cores
    split = whole.for_backend("threads")
    assert split.draft(1, None) == pytest.approx(1.5) and split.draft(64, None) == pytest.approx(24.0)
    assert split.draft(1, 0) == 3.0 and whole.for_backend("serial") is whole


def test_interpolate_is_piecewise_linear_and_extends_past_the_ends():
    table = {1: 10.0, 2: 11.0, 8: 17.0}
    assert plan.interpolate(table, 2) == 11.0
    assert plan.interpolate(table, 5) == pytest.approx(14.0)
    assert plan.interpolate(table, 10) == pytest.approx(19.0)


def step_ms(kind: str, step: dict, **options) -> float:
    """A registered method's cost model (what the planner asks each method for)."""
    method = get_method(kind)
    return method.step_cost(costs(), step, method.options.parse(options, kind))


def test_latency_law_terms():
    c = costs()
    assert step_ms("ar", {"drafted": 0}) == 10.0
    assert step_ms("sd", {"drafted": 7}) == pytest.approx(7 * 2.0 + 17.0)
    assert step_ms("sd", {"drafted": 0}) == 10.0
    # the draft's first forward read the prompt (64 tokens): D(64) + D(1), not 2·D(1); a suffix window is free
    assert step_ms("sd", {"drafted": 2, "draft_forwards": 2, "fed": 64}) == pytest.approx(32.0 + 2.0 + 12.0)
    assert step_ms("sd", {"drafted": 2, "source": "suffix"}) == pytest.approx(12.0)
    # that first forward reads the last row's logits only: where measured, priced from the reading table (the head
    # on all 64 rows priced SmolLM2's prompt reads 1.5-2x)
    reading = dataclasses.replace(c, draft_read_ms={64: 20.0})
    sd = get_method("sd")
    assert sd.step_cost(reading, {"drafted": 2, "draft_forwards": 2, "fed": 64}, sd.options.parse({}, "sd")) == \
        pytest.approx(20.0 + 2.0 + 12.0)
    assert reading.draft_read(1) == c.draft(1) and plan.Costs.from_dict(json.loads(json.dumps(
        reading.to_dict()))) == reading
    # w = 8: P = 8.5, Δ = 8.5, EE = 0.5 + 1.0 * 7/15, rollout = 7 * D(64) = 7 * 32 = 224
    ee = 0.5 + 7 / 15
    step = {"drafted": 7, "gamma": 7, "roots": 64, "exit_layer": 4, "hit": True}
    assert step_ms("mirror", step, backend="threads") == pytest.approx(8.5 + ee + 224)
    assert step_ms("mirror", step) == pytest.approx(8.5 + ee + 8.5 + 224)  # serial: no overlap
    # a rollout shorter than Δ is hidden; a miss adds the exposed fresh rollout γ·D(1)
    short = {**step, "gamma": 1, "roots": 1}
    assert step_ms("mirror", short, backend="threads") == pytest.approx(8.5 + ee + 8.5)
    assert step_ms("mirror", {**short, "hit": False, "draft_forwards": 1}, backend="threads") == pytest.approx(
        8.5 + ee + 8.5 + 2.0)
    # the first step's fresh rollout also reads the prompt (64 tokens): D(64), as sd's draft does
    first = {**short, "hit": False, "fed": 64, "draft_forwards": 1}
    assert step_ms("mirror", first, backend="threads") == pytest.approx(8.5 + ee + 8.5 + 32.0)
    # a fresh rollout is charged the forwards it ran (a confident window ends early; γ were charged), else one per
    # drafted token (what the planner prices)
    miss = {**step, "hit": False}
    assert step_ms("mirror", {**miss, "draft_forwards": 3}) == pytest.approx(8.5 + ee + 8.5 + 224 + 3 * 2.0)
    assert step_ms("mirror", miss) == pytest.approx(8.5 + ee + 8.5 + 224 + 7 * 2.0)
    # the serial budget rolls out nothing: no exit, a fresh rollout for every window (vanilla SD's step)
    none = {**step, "roots": 0, "hit": None}
    assert step_ms("mirror", none) == pytest.approx(17.0 + 7 * 2.0) == step_ms("sd", {"drafted": 7})
    tree = {"tree": 16, "kept": 2, "streams": 3, "top_fraction": 0.25}
    assert step_ms("ss", tree) == pytest.approx(0.75 * 25.0 + 0.25 * 17.0)
    steps = [{"drafted": 7}, {"drafted": 0}]
    assert plan.turn_time(c, "sd", steps, 0.5, {}) == pytest.approx(0.5 + (31.0 + 10.0) / 1e3)
    assert plan.turn_time(c, "ar", [{"drafted": 0}] * 5, 0.0, {}) == pytest.approx(0.05)
    assert plan.turn_time(c, "hf-ar", [], 0.0, {}) is None


def test_the_law_charges_ar_and_suffix_the_forwards_they_ran():
    """The first step takes its token from the prefill's logits (no forward): it was charged one."""
    from mirrorsd.api import LoadedModel
    from tests.helpers import row_exact, tiny_hf

    target = LoadedModel(row_exact(tiny_hf(layers=4, seed=1)))
    for kind in ("ar", "suffix"):
        g = mirrorsd.generate(target, [5, 6, 7, 8, 9] * 3, method=kind, max_new_tokens=8)
        log, forwards = g.stats.step_log, g.stats.target_forwards - 1  # (the prefill's is timed apart)
        ran = [s for s in log if s.get("target_forwards", 1)]
        assert len(ran) == forwards and (kind != "ar" or len(ran) < len(log)), kind
        assert sum(step_ms(kind, s) for s in log) == pytest.approx(sum(costs().target(s["drafted"] + 1) for s in ran))


def test_planner_ranks_by_predicted_speed():
    perfect, fallback = [1.0] * 8, {g: {4: {1: 0.5, 8: 0.0}} for g in range(1, 9)}
    ranked = sorted(plan.candidates(plan.Measured(costs(draft_ms=0.5), perfect, fallback, backends=("serial",))),
                    key=lambda c: -c.tokens_per_s)
    assert ranked[0].method in ("sd", "mirror") and ranked[0].tokens_per_step == 9.0  # cheap, perfect draft
    useless = sorted(plan.candidates(plan.Measured(costs(draft_ms=50.0), [0.0] * 8, fallback,
                                                  backends=("serial",))),
                     key=lambda c: -c.tokens_per_s)
    assert useless[0].method == "ar"  # a costly draft that is never right loses to ar
    assert plan.Costs.from_dict(json.loads(json.dumps(costs().to_dict()))) == costs()


def test_mirror_is_priced_with_each_windows_own_fallback():
    """Every γ was priced with the γ = 8 window's fallback."""
    mirror = get_method("mirror")
    fallback = {1: {4: {1: 0.0}}, 2: {4: {1: 1.0}}}
    measured = plan.Measured(costs(), [0.5] * 8, fallback, gammas=(1, 2), kappas=(1,), backends=("serial",))
    priced = {p.options["gamma"]: p.step_ms for p in mirror.plan(measured, mirror)}
    for gamma, hit in ((1, True), (2, False)):
        options = {"gamma": gamma, "kappa": 1, "exit_layer": 4, "roots": "paper", "backend": "serial",
                   "confidence": 0.0}
        step = {"drafted": gamma, "gamma": gamma, "roots": gamma + 1, "exit_layer": 4, "hit": hit}
        assert priced[gamma] == pytest.approx(mirror.price(measured.costs, step, **options))


def test_the_threads_backend_splits_the_cores_only_around_the_overlap():
    """The executor splits the threads around the upper layers and the branch rollouts alone: the prefix, the exit
    and a fresh rollout run on every core, and were priced with the split tables (a hit step 304.5 ms for 264.5)."""
    c = dataclasses.replace(costs(), split={"threads": [1, 1], "target_ms": {k: 2 * v for k, v in
                                                                            costs().target_ms.items()},
                                            "prefix_ms": {4: {k: v for k, v in costs().target_ms.items()}},
                                            "draft_ms": {1: 4.0, 64: 128.0}})
    mirror = get_method("mirror")
    opts = mirror.options.parse({"backend": "threads"}, "mirror")
    step = {"drafted": 7, "gamma": 1, "roots": 1, "exit_layer": 4, "hit": False, "draft_forwards": 1}
    pre, split_pre, split_target = 8.5, 17.0, 34.0  # (w = 8: prefix 8.5 on all cores, 17 split; target 34 split)
    ee, rollout = 0.5 + 7 / 15, 4.0  # (one root, one step, the split draft)
    fresh = 2.0  # (a fresh rollout on all cores: D(1))
    assert mirror.step_cost(c, step, opts) == pytest.approx(pre + ee + max(split_target - split_pre, rollout)
                                                            + fresh)
    processes = mirror.options.parse({"backend": "processes"}, "mirror")  # (its fresh rollout: the draft's share)
    assert mirror.step_cost(c, step, processes) == pytest.approx(pre + ee + max(split_target - split_pre, rollout)
                                                                 + 4.0)


def test_a_thread_split_other_than_the_measured_one_is_not_predicted(monkeypatch):
    """A sweep over --thread-splits predicted every split from the one split table measured (331 ms for 1,1, 2,2
    and 3,1 alike)."""
    from mirrorsd.bench import runner
    from mirrorsd.bench.runner import Bench, MethodSpec

    monkeypatch.setattr(runner, "split_threads", lambda: (1, 1))  # (the backend's default split, this machine's)
    c = dataclasses.replace(costs(), split={"threads": [1, 1], "target_ms": {}, "prefix_ms": {}, "draft_ms": {}})
    bench = SimpleNamespace(notes=[], answers=[])
    other = MethodSpec("m31", "mirror", {"backend": "threads", "threads": "3,1"})
    assert Bench._predicted(bench, other, c) is None and Bench._predicted(bench, other, c) is None
    assert bench.notes == ["`m31` is not predicted: its threads 3,1 are not the split the costs were measured at "
                           "(1,1; --threads-split)"]
    Bench._predicted(bench, MethodSpec("m11", "mirror", {"backend": "threads", "threads": "1,1"}), c)
    Bench._predicted(bench, MethodSpec("d", "mirror", {"backend": "threads"}), c)  # (the measured split)
    assert len(bench.notes) == 1
    c = dataclasses.replace(c, split={**c.split, "threads": [3, 1]})  # --threads-split 3,1; a row on the default
    assert Bench._predicted(bench, MethodSpec("d", "mirror", {"backend": "threads"}), c) is None
    assert "`d` is not predicted: its threads 1,1" in bench.notes[-1]


def test_the_sweeps_threads_rows_split_the_cores_as_the_backend_does(monkeypatch):
    """--thread-splits defaulted to 1,1 on any machine: on 16 threads that row ran 1 + 1 beside serial rows on 16,
    and was not predicted."""
    from mirrorsd.cli import bench as cli_bench

    ran = {}
    monkeypatch.setattr(cli_bench, "_run_bench", lambda config, out: ran.setdefault("specs", config.methods) and 0)
    assert main(["bench", "sweep", "--target", "t", "--draft", "d", "--gammas", "2", "--backends", "serial,threads",
                 "--out", "x"]) == 0
    threads = [s for s in ran["specs"] if s.options.get("backend") == "threads"]
    assert threads and all("threads" not in s.options and s.label.endswith("threads") for s in threads)


def test_a_reduced_draft_head_is_priced_with_its_own_table():
    c = dataclasses.replace(costs(), default_draft_vocab=32768, draft_vocab_ms={32768: {1: 1.5, 64: 24.0}})
    sd, mirror = get_method("sd"), get_method("mirror")
    step = {"drafted": 4}
    assert sd.step_cost(c, step, sd.options.parse({}, "sd")) == pytest.approx(4 * 1.5 + 14.0)  # the default head
    full = sd.options.parse({"draft_vocab": 0}, "sd")
    assert sd.step_cost(c, step, full) == pytest.approx(4 * 2.0 + 14.0)
    unmeasured = sd.options.parse({"draft_vocab": 8192}, "sd")  # no table: the full head, an upper bound
    assert sd.step_cost(c, step, unmeasured) == pytest.approx(4 * 2.0 + 14.0)
    miss = {"drafted": 1, "gamma": 1, "roots": 64, "exit_layer": 4, "hit": False}
    serial_exit = 5.5 + 0.5 + 1 / 15 + 5.5  # w = 2: P + EE + Δ, then the rollout and the miss's fresh one
    full = mirror.options.parse({"draft_vocab": 0}, "mirror")
    assert mirror.step_cost(c, miss, full) == pytest.approx(serial_exit + 32 + 2.0)
    reduced = mirror.options.parse({}, "mirror")  # its default, as sd's
    assert mirror.step_cost(c, miss, reduced) == pytest.approx(serial_exit + 24.0 + 1.5)
    assert plan.Costs.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    saved_before = {k: v for k, v in costs().to_dict().items() if k not in ("default_draft_vocab", "draft_vocab_ms")}
    assert plan.Costs.from_dict(json.loads(json.dumps(saved_before))).draft(1, None) == 2.0  # an older plan's file


# -- methods, suites -------------------------------------------------------------------------------------------


def test_llama_ngram_methods_become_one_server_each_with_their_flags(monkeypatch, tmp_path):
    """``llama-server-ngram``: draft-free, its options are llama-server flags (spec-type defaults to ngram-simple),
    one server per labelled configuration plus the draft-less reference; no draft GGUF is needed."""
    specs = parse_methods("llama-server-ngram,mod=llama-server-ngram:spec-type=ngram-mod:spec-draft-n-max=16")
    assert [s.label for s in specs] == ["ar", "llama-server-ar", "llama-server-ngram", "mod"]
    assert all(s.reference == "llama-server-ar" for s in specs[2:]) and not needs_draft("llama-server-ngram")
    assert server_flags(specs[3].options) == ["--spec-type", "ngram-mod", "--spec-draft-n-max", "16"]
    assert server_flags({}) == ["--spec-type", "ngram-simple"]
    assert server_flags({"no_mmap": True, "verbose": False}) == ["--spec-type", "ngram-simple", "--no-mmap"]
    started = {}

    class FakeServer:
        def __init__(self, binary, model, draft, threads, context, extra_args=None, log=None):
            started[len(started)] = (draft, extra_args)

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    monkeypatch.setattr("mirrorsd.bench.runner.LlamaServer", FakeServer)
    monkeypatch.setattr("mirrorsd.bench.runner.find_llama_server", lambda path=None: "/bin/true")
    bench = Bench.__new__(Bench)
    bench.config, bench.notes, bench.servers = BenchConfig("t", None, specs), [], {}
    bench.target = SimpleNamespace(path=tmp_path, config=SimpleNamespace(context_length=4096))
    bench.draft = None  # a draft-free peer needs no draft GGUF
    bench._start_llama([s for s in specs if s.kind != "ar"])
    assert set(bench.servers) == {"llama-server-ar", "llama-server-ngram", "mod"}
    assert list(started.values()) == [(None, None), (None, ["--spec-type", "ngram-simple"]),
                                      (None, ["--spec-type", "ngram-mod", "--spec-draft-n-max", "16"])]

    closed = []

    class FailingServer(FakeServer):
        def __init__(self, *args, **kwargs):
            if len(started) == 4:
                raise RuntimeError("llama-server exited with code 1")
            super().__init__(*args, **kwargs)

        def close(self):
            closed.append(self)

    monkeypatch.setattr("mirrorsd.bench.runner.LlamaServer", FailingServer)
    bench.servers = {}
    with pytest.raises(RuntimeError, match="exited"):  # the first server is stopped, not orphaned
        bench._start_llama([s for s in specs if s.kind != "ar"])
    assert len(closed) == 1


def test_parse_methods_options_labels_and_references():
    specs = parse_methods("sd:gamma=4:confidence=0,fast=mirror:roots=budget:exit-layer=0.25,hf-pld,llama-server")
    by = {s.label: s for s in specs}
    assert specs[0].label == "ar"  # the baseline, added and first
    assert by["sd:gamma=4:confidence=0"].options == {"gamma": 4, "confidence": 0}
    assert by["fast"].kind == "mirror" and by["fast"].options == {"roots": "budget", "exit_layer": 0.25}
    assert by["hf-pld"].reference == "hf-ar" and "hf-ar" in by
    assert by["llama-server"].reference == "llama-server-ar" and "llama-server-ar" in by
    with pytest.raises(ValueError, match="unknown method"):
        parse_methods("ar,medusa")
    with pytest.raises(ValueError, match="key=value"):
        parse_methods("sd:gamma")
    with pytest.raises(ValueError, match="unique"):
        parse_methods("sd,sd")
    assert [s.kind for s in parse_methods("auto")] == ["ar", "auto"]  # resolved when the models are loaded
    for text in ("ar=sd:gamma=4,mirror", "hf-ar=hf-pld,hf-assisted"):  # (a baseline's label on another decoder)
        with pytest.raises(ValueError, match="names a baseline"):
            parse_methods(text)
    with pytest.raises(ValueError, match="no options"):
        parse_methods("auto:gamma=2")


def test_a_method_option_may_hold_a_comma():
    """Mirror-SD's threads are written T,D: the list was split at every comma, so `threads=2,1` never parsed."""
    specs = {s.label: s for s in parse_methods("mirror:backend=threads:threads=2,1,fast=mirror:threads=3,1:backend="
                                               "threads,sd:gamma=3,hf-pld")}
    assert list(specs) == ["ar", "hf-ar", "mirror:backend=threads:threads=2,1", "fast", "sd:gamma=3", "hf-pld"]
    assert specs["mirror:backend=threads:threads=2,1"].options == {"backend": "threads", "threads": (2, 1)}
    assert specs["fast"].options == {"threads": (3, 1), "backend": "threads"}
    with pytest.raises(ValueError, match=r"threads must be TARGET,DRAFT thread counts, got '2,1,1'"):
        parse_methods("mirror:backend=threads:threads=2,1,1")


@pytest.mark.parametrize("split, message", [("x,1", "--threads-split must be comma-separated integers, got 'x,1'"),
                                            ("4", "--threads-split takes two thread counts, TARGET,DRAFT, got '4'"),
                                            ("4,1,1", "--threads-split takes two thread counts"),
                                            ("0,2", "--threads-split must list positive integers")])
def test_a_bad_threads_split_is_refused_naming_the_flag(monkeypatch, capsys, split, message):
    monkeypatch.setattr("mirrorsd.bench.runner.load_model", lambda *args, **kwargs: pytest.fail("loaded a model"))
    assert main(["bench", "--threads-split", split, "--methods", "ar"]) == 2
    assert message in capsys.readouterr().err


def test_bench_auto_with_a_draft_of_another_tokenizer_plans_without_it(tmp_path, monkeypatch, capsys):
    """`mirrorsd bench --target smollm2-135m --methods auto` (with the default Qwen draft) was refused where generate's
    and the API's auto drop such a draft and choose among the methods without one; the probe, which reads the
    draft in the target's token ids, does not run (a method drafting with it still refuses the probe)."""
    from mirrorsd.bench import runner

    class Tokenizer:  # (weakly referenced: shares_tokenizer remembers each pair)
        def __init__(self, words: dict[str, int]) -> None:
            self.get_vocab = lambda: words

    models = {"t": SimpleNamespace(name="t", tokenizer=Tokenizer({"a": 0}), model=SimpleNamespace(device="cpu")),
              "d": SimpleNamespace(name="d", tokenizer=Tokenizer({"b": 0}))}
    monkeypatch.setattr(runner, "load_model", lambda name, **kwargs: models[name])
    planned_with = []
    monkeypatch.setattr(runner, "planned", lambda target, draft, options: planned_with.append(draft) or
                        ("suffix", {"gamma": 8}, None))
    suite = tmp_path / "suite.jsonl"
    suite.write_text('{"question_id": 1, "category": "qa", "turns": ["Name two planets."]}\n')
    config = BenchConfig("t", "d", parse_methods("auto"), suite=str(suite), predict=False)
    bench = Bench(config, progress=False)
    assert planned_with == [None] and bench.draft is None and not config.probe
    assert [(m.label, m.kind, m.options) for m in bench.methods] == [("ar", "ar", {}),
                                                                     ("auto", "suffix", {"gamma": 8})]
    note = ("draft d has a tokenizer of its own: auto chose among the methods without a draft model and the probe "
            "(which reads the draft in the target's token ids) did not run.")
    assert note in bench.notes and note in capsys.readouterr().err
    with pytest.raises(ValueError, match="tokenizer of its own.*not the probe"):
        Bench(BenchConfig("t", "d", parse_methods("auto,sd"), suite=str(suite), predict=False), progress=False)


def test_suites(tmp_path):
    chosen = load_suite("specbench:2")
    assert len(chosen) == 2 * len(GROUPS) and [q.group for q in chosen[::2]] == list(GROUPS)
    assert len(load_suite("specbench")) == 480
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"question_id": 9, "category": "code", "turns": ["a", "b"]}\n')
    mine = load_suite(str(path))
    assert [(q.question_id, q.group, q.turns) for q in mine] == [(1, "custom", ("hi",)), (9, "code", ("a", "b"))]
    path.write_text('{"turns": []}\n')
    with pytest.raises(ValueError, match=":1:"):
        load_suite(str(path))
    path.write_text('{"turns": ["a"], "question_id": "q2"}\n')  # (blamed "turns", which was there)
    with pytest.raises(ValueError, match=':1: "question_id" must be an integer, got "q2"'):
        load_suite(str(path))
    path.write_text('{"turns": ["a"], "question_id": "12"}\n{"turns": ["b"], "question_id": 3.0}\n')
    assert [q.question_id for q in load_suite(str(path))] == [12, 3]
    path.write_text('{"turns": ["a"], "question_id": 2}\n{"turns": ["b"]}\n')  # (line 2 takes id 2: one answer row)
    with pytest.raises(ValueError, match=":2: question_id 2 is taken by line 1"):
        load_suite(str(path))
    with pytest.raises(FileNotFoundError):
        load_suite("nope.jsonl")
    with pytest.raises(ValueError, match="positive"):
        load_suite("specbench:x")


# -- the report ------------------------------------------------------------------------------------------------


def synthetic_results() -> dict:
    rows = [answer("ar", r, q, g, 10, 1.0, [1] * 10, [0] * 10, equal=True) for r in range(2)
            for q, g in ((1, "qa"), (2, "mt_bench"))]
    rows += [answer("sd", r, q, g, 10, 0.5, [2] * 5, [3] * 5, equal=True) for r in range(2)
             for q, g in ((1, "qa"), (2, "mt_bench"))]
    summary = {m: {"kind": m, "options": {}, "reference": "ar", "tokens_per_s": metrics.tokens_per_second(rows, m),
                   "speedup": metrics.speedups(rows, m, "ar"), "mean_accepted_tokens": metrics.mean_accepted_tokens(
                       rows, m), "per_position_acceptance": metrics.per_position_acceptance(rows, m),
                   "lossless": metrics.lossless_summary(rows, m)} for m in ("ar", "sd")}
    return {"config": {"target": "t", "draft": "d", "suite": "specbench:1", "runs": 2, "max_new_tokens": 10,
                       "temperature": 0.0, "warmup": 1},
            "machine": {"cpu": "test cpu", "cores": 2, "torch_threads": 2}, "target_weights": "q4", "questions": 2,
            "notes": ["llama-server skipped: no binary"], "summary": summary, "costs": None, "probe": None,
            "timeline": None, "answers": [{**vars(a), "turns": [t.to_dict() for t in a.turns]} for a in rows]}


def test_report_has_the_table1_layout_machine_and_notes(tmp_path):
    results = synthetic_results()
    text = render(json.loads(json.dumps(results)), [])
    assert "| Task | ar | sd |" in text
    assert "| Question Answering | 1.00x | 2.00x |" in text
    assert "| Multi-turn Conversation | 1.00x | 2.00x |" in text
    assert "| MAT | 1.00 | 2.00 |" in text and "test cpu" in text and "llama-server skipped" in text
    assert "Every checked answer (4) equals its AR reference" in text  # sd's: ar against itself proves nothing
    write_report(results, tmp_path)
    assert (tmp_path / "speedup_by_group.png").stat().st_size > 1000 and (tmp_path / "report.md").exists()


def time_costs_briefly(monkeypatch) -> None:
    """For tests of the wiring, not the timings: the latency law's costs from one timed call per size, and fewer
    sizes, instead of five (they were ~40 s of the end-to-end test on AVX2). These override the sizes a caller
    passes too (``method="auto"``'s quick plan passes its own)."""
    real, brief = plan.measure_costs, dict(rounds=1, target_ks=(1, 4, 16), draft_ks=(1, 4, 16, 64))
    monkeypatch.setattr(plan, "measure_costs", lambda *args, **kwargs: real(*args, **{**kwargs, **brief}))


# -- end to end on real weights --------------------------------------------------------------------------------


@requires_smollm2
def test_hf_assisted_drafts_with_the_self_draft_it_is_given():
    """With ``--draft self:N`` HF's assistant was the target's whole folder (30 layers where ours drafted with 12),
    so the peer's row compared another draft. It is now the first N layers through the final norm and head, as
    ours: the same logits."""
    from mirrorsd.api import self_draft
    from mirrorsd.bench.peers import HFPeers

    target = mirrorsd.load_model("smollm2-135m", weights="fp32", progress=False)
    draft = self_draft(target, "self:12")
    hf = HFPeers(target, draft)
    assert hf.assistant.config.num_hidden_layers == 12 and hf.model.config.num_hidden_layers == 30
    ids = torch.tensor([target.tokenizer.encode("The capital of France is")])
    with torch.inference_mode():
        ours = draft.model(ids)[0].float()
        theirs = hf.assistant(ids).logits[0].float()
    assert torch.allclose(ours[-1], theirs[-1], atol=1e-3, rtol=1e-3)
    assert HFPeers(target, target).assistant.config.num_hidden_layers == 30  # a whole model stays whole


@requires_smollm2
def test_bench_end_to_end_with_peers(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("mirrorsd.bench.runner.find_llama_server", lambda path=None: None)
    time_costs_briefly(monkeypatch)
    suite = tmp_path / "suite.jsonl"
    suite.write_text('{"question_id": 1, "category": "qa", "turns": ["What is the capital of France?"]}\n'
                     '{"question_id": 2, "category": "writing", "turns": ["Name a colour.", "And another one?"]}\n')
    out = tmp_path / "out"
    rc = main(["bench", "--target", "smollm2-135m", "--draft", "smollm2-135m", "--suite", str(suite),
               "--methods", "ar,sd,mirror:backend=threads,ss,suffix,hf-assisted,hf-pld,llama-server",
               "--max-new-tokens", "6", "--runs", "2", "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    summary = results["summary"]
    assert list(summary) == ["ar", "hf-ar", "sd", "mirror:backend=threads", "ss", "suffix", "hf-assisted", "hf-pld"]
    assert any("llama-server skipped" in n for n in results["notes"])
    for label, s in summary.items():
        checked = 0 if label == s["reference"] else 4  # 2 questions x 2 runs; a baseline is not checked against itself
        assert s["lossless"]["checked"] == s["lossless"]["equal"] == checked, label
        assert set(s["speedup"]) == {"qa", "mt_bench", "overall"} and len(s["tokens_per_s"]["runs"]) == 2
    assert summary["ar"]["speedup"]["overall"]["median"] == 1.0
    assert summary["hf-pld"]["speedup_vs_reference"]["overall"]["median"] > 0
    assert summary["sd"]["mean_accepted_tokens"] > 1.0  # the target drafting for itself is always accepted
    assert 0 <= summary["mirror:backend=threads"]["hidden_draft_fraction"] <= 1
    assert summary["ss"]["call_reduction"] >= 1.0 and summary["suffix"]["mean_accepted_tokens"] >= 1.0
    assert summary["sd"]["predicted_tokens_per_s"] > 0
    assert results["probe"]["expected_accepted"]["all"]["1"] == 1.0
    assert results["timeline"]["overlapped"]
    line = json.loads((out / "answers" / "hf-pld.jsonl").read_text().splitlines()[1])
    choice = line["choices"][0]
    assert line["question_id"] == 2 and len(line["choices"]) == 2
    assert len(choice["turns"]) == 2 and len(choice["new_tokens"]) == 2 and len(choice["wall_time"]) == 2
    mirror = json.loads((out / "answers" / "mirror_backend_threads.jsonl").read_text().splitlines()[0])
    assert sum(mirror["choices"][0]["accept_lengths"]) >= mirror["choices"][0]["new_tokens"][0]
    report = (out / "report.md").read_text()
    assert "Multi-turn Conversation" in report and "Question Answering" in report
    for png in ("speedup_by_group.png", "acceptance_vs_gamma.png", "fallback_kappa_exit.png", "step_timeline.png"):
        assert (out / png).stat().st_size > 1000, png


@requires_smollm2
def test_bench_samples_through_the_filters_it_is_given(tmp_path, monkeypatch, capsys):
    """--top-k reaches our methods and the HF peers: at top-k 1 sampling keeps only the argmax, so every answer,
    sampled at T = 1, is the greedy one; a bad filter value fails before any model loads, naming its flag."""
    monkeypatch.setattr("mirrorsd.bench.runner.find_llama_server", lambda path=None: None)
    suite = tmp_path / "suite.jsonl"
    suite.write_text('{"question_id": 1, "category": "qa", "turns": ["What is the capital of France?"]}\n')
    out = tmp_path / "out"
    args = ["bench", "--target", "smollm2-135m", "--suite", str(suite), "--methods", "ar,ss,hf-pld",
            "--max-new-tokens", "8", "--runs", "1", "--warmup", "0", "--no-probe", "--no-predict", "--out", str(out)]
    assert main([*args, "--top-p", "0"]) == 2 and "--top-p must be in (0, 1]" in capsys.readouterr().err
    assert main([*args, "--temperature", "1", "--top-k", "1"]) == 0
    target = mirrorsd.load_model("smollm2-135m", progress=False)
    greedy = mirrorsd.generate(target, [{"role": "user", "content": "What is the capital of France?"}],
                               max_new_tokens=8).text
    for label in ("ar", "ss", "hf-ar", "hf-pld"):
        line = json.loads((out / "answers" / f"{label}.jsonl").read_text().splitlines()[0])
        assert line["choices"][0]["turns"] == [greedy], label
        assert line["model_id"] == f"smollm2-135m/{label}"  # (named the default draft, never loaded)
    report = (out / "report.md").read_text()
    assert "temperature 1.0, top-k 1," in report and report.startswith("# mirrorsd bench: smollm2-135m\n")


@requires_smollm2
def test_an_interrupted_bench_keeps_the_questions_it_finished(tmp_path, monkeypatch, capsys):
    """Ctrl-C (or a failure) hours into a bench writes what every method finished, not nothing."""
    from mirrorsd.bench.runner import Bench

    suite = tmp_path / "suite.jsonl"
    suite.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"Name a colour ({i})."]})
                             + "\n" for i in range(3)))
    answer, calls = Bench._answer, []

    out = tmp_path / "out"
    seen = []

    def stopped_at_the_fifth(self, *args, **kwargs):  # 2 methods: questions 0 and 1 finish, then Ctrl-C
        calls.append(1)
        if len(calls) == 3:  # on disk as each question ends, in case what stops the run is a SIGKILL
            seen.append(json.loads((out / "results.json").read_text()))
        if len(calls) == 5:
            raise KeyboardInterrupt
        return answer(self, *args, **kwargs)

    monkeypatch.setattr(Bench, "_answer", stopped_at_the_fifth)
    out.mkdir()
    for stale in ("report.md", "step_timeline.png", "answers/hf-ar.jsonl"):  # an earlier run's, in the same folder
        (out / stale).parent.mkdir(exist_ok=True)
        (out / stale).write_text("an earlier run")
    rc = main(["bench", "--target", "smollm2-135m", "--suite", str(suite), "--methods", "ar,suffix",
               "--max-new-tokens", "4", "--runs", "1", "--warmup", "0", "--no-probe", "--no-predict",
               "--out", str(out)])
    assert rc == 130 and "interrupted" in capsys.readouterr().err
    assert len(seen[0]["answers"]) == 2 and any("partial: the 2 answers so far" in n for n in seen[0]["notes"])
    results = json.loads((out / "results.json").read_text())
    assert sorted({a["question_id"] for a in results["answers"]}) == [0, 1] and len(results["answers"]) == 4
    assert any("interrupted (KeyboardInterrupt) after 4 answers" in n for n in results["notes"])
    assert not any(n.startswith("partial: the") for n in results["notes"])
    assert len((out / "answers" / "ar.jsonl").read_text().splitlines()) == 2
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["ar.jsonl", "results.json", "suffix.jsonl"]


@requires_smollm2
def test_a_bench_whose_answers_diverge_says_so_and_fails(tmp_path, monkeypatch, capsys):
    """A divergence must not read as a pass: the headline table marks the method and the command exits 1."""
    from mirrorsd.bench.runner import Bench

    check = Bench._check

    def suffix_diverges(self, spec, answer, reference):
        check(self, spec, answer, reference)
        if spec.label == "suffix":  # as if its second token had differed from ar's
            answer.equal_to_reference = False
            answer.divergence = {"turn": 0, "position": 1, "reference_token": 1, "method_token": 2,
                                 "logit_gap": 3.0, "verdict": "mismatch", "reference": "ar"}

    monkeypatch.setattr(Bench, "_check", suffix_diverges)
    suite = tmp_path / "suite.jsonl"
    suite.write_text('{"question_id": 1, "category": "qa", "turns": ["Name a colour."]}\n')
    out = tmp_path / "out"
    rc = main(["bench", "--target", "smollm2-135m", "--suite", str(suite), "--methods", "ar,suffix",
               "--max-new-tokens", "4", "--runs", "1", "--warmup", "0", "--no-probe", "--no-predict",
               "--out", str(out)])
    assert rc == 1 and "not lossless: suffix" in capsys.readouterr().err
    overall = next(line for line in (out / "report.md").read_text().splitlines() if "**Overall**" in line)
    assert overall.count("✗ not lossless") == 1


@requires_smollm2
def test_lossless_check_reports_the_logit_gap_at_a_divergence(smollm2):
    import mirrorsd
    from mirrorsd.bench.runner import Bench, BenchConfig

    ours, _ = smollm2
    ids = mirrorsd.api.encode_prompt(ours, "Count to five.")
    ref = mirrorsd.generate(ours, ids, max_new_tokens=6).token_ids
    bench = Bench.__new__(Bench)
    bench.config, bench.target, bench.hf = BenchConfig("t", None, []), ours, None
    wrong = list(ref)
    wrong[3] = (ref[3] + 1) % ours.config.vocab_size
    reference = Answer(0, "ar", 1, "qa", "qa", [Turn(6, 1.0, token_ids=ref, prompt_ids=ids)])
    bad = Answer(0, "sd", 1, "qa", "qa", [Turn(6, 1.0, token_ids=wrong, prompt_ids=ids)])
    bench._check(MethodSpec("sd", "sd"), bad, reference)
    d = bad.divergence
    assert bad.equal_to_reference is False and d["position"] == 3 and d["method_token"] == wrong[3]
    assert d["logit_gap"] > 1e-3 and d["verdict"] == "mismatch"  # a real disagreement is flagged, not excused
    good = Answer(0, "sd", 1, "qa", "qa", [Turn(6, 1.0, token_ids=list(ref), prompt_ids=ids)])
    bench._check(MethodSpec("sd", "sd"), good, reference)
    assert good.equal_to_reference is True and good.divergence is None


@requires_smollm2
def test_sweep_plan_and_generate_auto(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    suite = tmp_path / "suite.jsonl"  # short prompts: this checks the wiring (Spec-Bench's long ones cost minutes)
    suite.write_text('{"question_id": 1, "category": "qa", "turns": ["What is the capital of France?"]}\n'
                     '{"question_id": 2, "category": "writing", "turns": ["Name a colour."]}\n')
    rc = main(["bench", "sweep", "--target", "smollm2-135m", "--draft", "smollm2-135m", "--suite", str(suite),
               "--gammas", "2", "--kappas", "1", "--exit-layers", "0.5", "--candidates", "exit,draft",
               "--max-new-tokens", "4", "--runs", "1", "--warmup", "0", "--no-probe", "--no-predict",
               "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert list(summary) == ["ar", "sd γ=2", "mirror γ=2 κ=1 ℓe=0.5 paper exit serial",
                             "mirror γ=2 κ=1 ℓe=0.5 paper draft serial"]
    assert summary["mirror γ=2 κ=1 ℓe=0.5 paper exit serial"]["options"]["kappa"] == 1
    assert summary["sd γ=2"]["options"]["suffix_match"] == 0  # vanilla SD, not the hybrid and its gate
    assert summary["mirror γ=2 κ=1 ℓe=0.5 paper draft serial"]["options"]["candidates"] == "draft"
    capsys.readouterr()

    saved = tmp_path / "plan.json"
    monkeypatch.setattr(plan, "plan_path", lambda target, draft: saved)
    monkeypatch.setattr(plans, "plan_path", lambda target, draft: saved)
    time_costs_briefly(monkeypatch)
    rc = main(["plan", "--target", "smollm2-135m", "--draft", "smollm2-135m", "--suite", str(suite),
               "--max-new-tokens", "8", "--json"])
    assert rc == 0
    stored = json.loads(saved.read_text())
    speeds = [r["predicted_tokens_per_s"] for r in stored["ranked"]]
    assert speeds == sorted(speeds, reverse=True)
    assert {r["method"] for r in stored["ranked"]} >= {"ar", "suffix", "sd", "mirror", "ss"}
    assert any(r["method"] == "sd" and "suffix_match" in r["options"] for r in stored["ranked"])  # the hybrid
    assert any(r["method"] == "sd" and r["options"] == {} for r in stored["ranked"])  # sd as it ships, by a run
    ar = next(r for r in stored["ranked"] if r["method"] == "ar")
    best = stored["ranked"][0]
    margin_faster = best["predicted_tokens_per_s"] >= plan.MARGIN * ar["predicted_tokens_per_s"]
    assert stored["recommended"] == (best if margin_faster else ar)
    capsys.readouterr()

    stored["ranked"].insert(0, {"method": "sd", "options": {"gamma": 3, "confidence": 0.0}, "label": "sd:gamma=3"})
    stored["recommended"] = stored["ranked"][0]
    saved.write_text(json.dumps(stored))
    rc = main(["generate", "--target", "smollm2-135m", "--draft", "smollm2-135m", "--method", "auto",
               "--prompt", "Say hi.", "--max-new-tokens", "8", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert rc == 0 and row["stats"]["method"] == "sd" and row["stats"]["gamma"] <= 3

    rc = main(["bench", "--target", "smollm2-135m", "--draft", "smollm2-135m", "--methods", "ar,auto", "--suite",
               str(suite), "--max-new-tokens", "4", "--runs", "1", "--warmup", "0", "--no-probe", "--no-predict",
               "--out", str(tmp_path / "auto")])
    results = json.loads((tmp_path / "auto" / "results.json").read_text())
    assert rc == 0 and results["summary"]["auto"]["kind"] == "sd"  # the plan's recommendation ran
    assert results["summary"]["auto"]["options"] == {"gamma": 3, "confidence": 0.0}
    assert any("`sd:gamma=3:confidence=0.0`" in note for note in results["notes"])


@requires_smollm2
def test_a_calibration_run_never_copies_an_earlier_one():
    target = mirrorsd.load_model("smollm2-135m")
    ids = [encode_chat(target, [{"role": "user", "content": "Name three colours."}])]
    key = f"vocab{target.config.vocab_size}"
    with isolated_shared_indexes():  # this test's own "process" index, not the test session's
        process = shared_index(key)
        process.add([1, 2, 3, 4])  # what the process's own requests gathered before a first-use plan
        before = dict(process.docs)
        first, again = (plan.calibrated(target, target, ids, 12, costs(), "sd", {}) for _ in range(2))
        assert again.tokens_per_step == first.tokens_per_step  # the second run found no copy of the first's answer
        # ... and the process's index is neither wiped nor filled with calibration answers
        assert shared_index(key) is process and process.docs == before


def test_recommendation_needs_a_margin_over_ar():
    ar = plan.Candidate({}, 1.0, 10.0, method="ar")  # 100 tok/s
    slightly = plan.Candidate({}, 1.05, 10.0, method="suffix")
    clearly = plan.Candidate({"factor": 2.0}, 1.5, 10.0, method="suffix")
    assert plan.recommend([slightly, ar]) is ar
    assert plan.recommend([ar, slightly, clearly]) is clearly


@requires_smollm2
def test_generate_auto_plans_on_first_use(tmp_path, monkeypatch, capsys):
    saved = tmp_path / "plan.json"
    monkeypatch.setattr(plans, "plan_path", lambda target, draft: saved)
    monkeypatch.setattr(plan, "plan_path", lambda target, draft: saved)
    time_costs_briefly(monkeypatch)
    target = mirrorsd.load_model("smollm2-135m")
    g = mirrorsd.generate(target, "Say hi.", draft=target, method="auto", max_new_tokens=6)
    assert "planning briefly" in capsys.readouterr().err and saved.is_file()
    stored = json.loads(saved.read_text())
    assert g.stats.method == stored["recommended"]["method"]
    assert g.token_ids == mirrorsd.generate(target, "Say hi.", max_new_tokens=6).token_ids
    mirrorsd.generate(target, "Say hi.", draft=target, method="auto", max_new_tokens=2)
    assert "planning" not in capsys.readouterr().err  # the saved plan is used from now on


def test_a_plan_made_on_another_machine_is_made_again(tmp_path, monkeypatch, capsys):
    """A plan prices the methods on the machine it measured: one from another CPU or thread count (a copied cache
    folder, a VM moved to another host type) is not this machine's pick, so `auto` plans again and says why."""
    saved = tmp_path / "plan.json"
    monkeypatch.setattr(plans, "plan_path", lambda target, draft: saved)
    made = []
    monkeypatch.setattr(plans, "_planner", lambda target, draft: made.append(target.name) or {"fresh": True})
    pair = SimpleNamespace(name="t"), SimpleNamespace(name="d")
    pick = {"method": "suffix", "options": {}, "label": "suffix"}
    saved.write_text(json.dumps({"machine": plans.machine_label(), "recommended": pick}))
    assert plans.saved_recommendation("t", "d") == pick
    assert plans.plan_for(*pair)["recommended"] == pick and not made
    saved.write_text(json.dumps({"machine": "Another CPU, 64 threads", "recommended": pick}))
    assert plans.saved_recommendation("t", "d") is None  # the CLI then resolves `auto` after loading
    assert plans.plan_for(*pair) == {"fresh": True} and made == ["t"]
    err = capsys.readouterr().err
    assert "made on Another CPU, 64 threads" in err and plans.machine_label() in err


def test_a_plan_auto_cannot_follow_is_made_again(tmp_path, monkeypatch, capsys):
    """A plan cut short, naming a method or option this version lacks, or measured with another format or device
    failed every `auto` run (a JSON error without a path, or 'method must be one of ...' the user never chose), or
    was followed silently; now `auto` plans again and says why."""
    saved = tmp_path / "plan.json"
    monkeypatch.setattr(plans, "plan_path", lambda target, draft: saved)
    made = []
    monkeypatch.setattr(plans, "_planner", lambda target, draft: made.append(target.name) or {"fresh": True})
    target = SimpleNamespace(name="t", format="q4 weights, int8x2 activations", model=SimpleNamespace(device="cpu"))
    pair = target, SimpleNamespace(name="d", format="q4 weights, int8x2 activations")
    here = {"machine": plans.machine_label(), "setup": plans.setup_of(*pair)}
    pick = {"method": "suffix", "options": {"gamma": 4}, "label": "suffix"}
    for broken in ('{"machine": "cut sh', json.dumps(here | {"recommended": {"method": "gone", "options": {}}}),
                   json.dumps(here | {"recommended": {"method": "suffix", "options": {"gone_option": 3}}})):
        saved.write_text(broken)
        assert plans.saved_recommendation("t", "d") is None
        assert plans.plan_for(*pair) == {"fresh": True}
        assert "unreadable, older than this version's plans, or names a method" in capsys.readouterr().err
    fp32 = here | {"setup": plans.setup_of(SimpleNamespace(format="fp32", model=target.model), pair[1])}
    saved.write_text(json.dumps(fp32 | {"recommended": pick}))
    assert plans.plan_for(*pair) == {"fresh": True} and len(made) == 4
    assert "made for target fp32 on cpu" in capsys.readouterr().err
    assert plans.measured_otherwise("t", "d", target).startswith("target fp32 on cpu")
    saved.write_text(json.dumps(here | {"recommended": pick}))
    assert plans.plan_for(*pair)["recommended"] == pick and len(made) == 4
    assert plans.measured_otherwise("t", "d", target) is None
    older = here | {"setup": "target q4 weights, int8x2 activations on cpu, draft q4 weights, int8x2 activations"}
    saved.write_text(json.dumps(older | {"recommended": pick}))  # a plan from before setups were records
    assert plans.saved_recommendation("t", "d") is None and plans.measured_otherwise("t", "d", target) is None
    assert plans.plan_for(*pair) == {"fresh": True} and len(made) == 5
    # a bfloat16 load has its own k-curve: an fp32 plan of the same formats was reused for it
    bf16 = SimpleNamespace(name="t", format=target.format, model=SimpleNamespace(device="cpu", dtype=torch.bfloat16))
    saved.write_text(json.dumps(here | {"recommended": pick}))
    assert plans.plan_for(bf16, pair[1]) == {"fresh": True} and len(made) == 6
    assert "this is target q4 weights, int8x2 activations, bfloat16 on cpu" in capsys.readouterr().err


def test_the_machine_label_names_the_kernel_build(monkeypatch):
    """Two VMs that report the same CPU name may run different kernel builds (AVX-512 or only AVX2), which price
    the methods differently, so a plan made on one is not reused on the other."""
    from mirrorsd import kernels

    here = plans.machine_label()
    assert here.endswith(f", {kernels.isa_label()} kernels")
    monkeypatch.setenv("MIRRORSD_KERNELS", "off")
    off = plans.machine_label()
    assert off.endswith(", off kernels") and (off != here) == (not here.endswith(", off kernels"))


def test_a_plan_refuses_a_draft_of_another_tokenizer_before_measuring(monkeypatch):
    """`mirrorsd plan --target smollm2-135m` (with the default Qwen draft) measured costs, then failed with an
    IndexError inside the acceptance probe: the draft's ids indexed the target's embedding."""
    monkeypatch.setattr(plan, "measure_costs", lambda *a, **k: pytest.fail("measured before the check"))
    class Tokenizer:  # (weakly referenced: shares_tokenizer remembers each pair)
        def __init__(self, words: dict[str, int]) -> None:
            self.get_vocab = lambda: words

    vocab = Tokenizer
    target = SimpleNamespace(name="t", tokenizer=vocab({"a": 0}))
    draft = SimpleNamespace(name="d", tokenizer=vocab({"b": 0}))
    with pytest.raises(ValueError, match="draft d has a tokenizer of its own"):
        plan.make_plan(target, draft, [("g", [1, 2])], progress=False)


def test_the_planner_prices_mirror_with_the_exit_its_options_run(monkeypatch):
    """Mirror-SD's priced options leave exit_head at auto, which runs the shipped tuned exit where it has the layer;
    the planner priced them with the lens's fallback (0.89 against the tuned 0.75 at κ = 8, N/2 on the Qwen pair),
    and a window of 8 with 7's acceptance."""
    rows = {"1/4": {8: 0.95}, "1/2": {8: 0.89}, "1/2 tuned": {8: 0.75}}
    assert plan.exit_fallback(rows, {"1/4": 7, "1/2": 14, "3/4": 21}) == {7: {8: 0.95}, 14: {8: 0.75}}
    asked = {}

    def probe(target, draft, prompts, max_new, **kwargs):
        asked.update(kwargs)
        raise StopIteration  # (what came before the probe is what this test reads)

    monkeypatch.setattr(plan, "measure_costs", lambda *a, **k: None)
    monkeypatch.setattr("mirrorsd.bench.probe.run_probe", probe)
    target = mirrorsd.LoadedModel(SimpleNamespace(config=SimpleNamespace(n_layers=28)), name="qwen2.5-coder-1.5b")
    with pytest.raises(StopIteration):
        plan.make_plan(target, SimpleNamespace(model=None, name="d", tokenizer=None), [("g", [1])], progress=False)
    assert asked["tuned"] is not None and 14 in asked["tuned"].layers  # the shipped exit at N/2
    assert asked["gamma"] == max(plan.Measured.gammas)


def test_generate_auto_without_a_plan_says_what_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plans, "plan_path", lambda target, draft: Path(tmp_path / "none.json"))
    with pytest.raises(FileNotFoundError, match="mirrorsd plan --target t"):
        plans.load_plan("t", "d")


def test_assist_suite_is_shipped():
    questions = load_suite("assist")
    assert len(questions) == 12
    assert {q.group for q in questions} == {"editing", "refactoring", "from_context"}
    assert all(len(q.turns) == 1 and len(q.turns[0]) > 200 for q in questions)  # each carries its context


@requires_smollm2
def test_probe_reads_the_exit_head_it_is_given(tmp_path):
    """`--probe-exit-head FOLDER` compares an exit on the probe's own rollouts: an identity translator at N/2 is the
    plain lens, so its "1/2 tuned" row equals the lens row (the shipped, fitted exit's would not)."""
    config = json.loads((zoo.prepare("smollm2-135m") / "config.json").read_text())
    d, half = config["hidden_size"], round(0.5 * config["num_hidden_layers"])
    ExitTranslators({half: torch.cat([torch.eye(d), torch.zeros(1, d)])}, {}).save(tmp_path / "identity")
    out, suite = tmp_path / "probe", tmp_path / "suite.jsonl"  # short prompts (specbench:1's cost ~20 s more)
    suite.write_text('{"question_id": 1, "category": "qa", "turns": ["What is the capital of France?"]}\n'
                     '{"question_id": 2, "category": "writing", "turns": ["Write a short poem about rain."]}\n')
    rc = main(["bench", "--target", "smollm2-135m", "--draft", "smollm2-135m", "--methods", "ar", "--suite",
               str(suite), "--max-new-tokens", "8", "--runs", "1", "--warmup", "0", "--no-predict",
               "--probe-exit-head", str(tmp_path / "identity"), "--out", str(out)])
    fallback = json.loads((out / "results.json").read_text())["probe"]["fallback"]["all"]
    assert rc == 0 and set(fallback) == {"1/4", "1/2", "3/4", "1/2 tuned"}
    assert fallback["1/2 tuned"] == fallback["1/2"]
    # Eq. 9's overlap mass beside it: a probability, nondecreasing in κ, the same through the identity translator,
    # and in the report with Proposition 1's bound
    omega = json.loads((out / "results.json").read_text())["probe"]["overlap"]["all"]
    assert set(omega) == set(fallback) and omega["1/2 tuned"] == omega["1/2"]
    for row in omega.values():
        masses = [row[str(k)] for k in (1, 2, 4, 8, 16)]
        assert all(0.0 <= m <= 1.0 + 1e-6 for m in masses) and masses == sorted(masses)
    assert "Proposition 1's bound" in (out / "report.md").read_text()


def test_probe_overlap_is_the_mean_mass_per_exit_and_kappa():
    probe = Probe(gamma=3, exit_layers={"1/2": 2}, kappas=(1, 4))
    probe.omegas["qa"]["1/2"] += [[0.2, 0.5], [0.4, 0.9]]
    probe.omegas["rag"]["1/2"] += [[0.6, 1.0]]
    assert probe.overlap("qa") == {"1/2": {1: pytest.approx(0.3), 4: pytest.approx(0.7)}}
    assert probe.overlap() == {"1/2": {1: pytest.approx(0.4), 4: pytest.approx(0.8)}}


@pytest.mark.parametrize("temperature, acceptance", [(0.0, "match"), (1.0, "rejection"), (1.0, "match")])
def test_probe_omega_of_the_drawn_distribution_is_the_fallbacks_expectation(temperature, acceptance):
    """Greedy, the correction's distribution is a point mass: 1 − Ω of it is the measured fallback, step by step.
    Sampled speculatively, the correction comes from the residual after a rejection (q at a bonus slot): the masses
    are distributions' and the fallback matches them on average only. Under sample-and-match that distribution has no
    closed form: no such rows."""
    from mirrorsd.api import LoadedModel
    from mirrorsd.bench.probe import run_probe
    from tests.helpers import row_exact, tiny_hf

    target, draft = LoadedModel(row_exact(tiny_hf(layers=4, seed=1))), LoadedModel(row_exact(tiny_hf(layers=2, seed=2)))
    probe = run_probe(target, draft, [("qa", [5, 9, 2, 7]), ("rag", [3, 1, 4])], 24, gamma=3, kappas=(1, 2, 4),
                      progress=False, temperature=temperature, seed=3, acceptance=acceptance)
    fallback, own, paper = probe.fallback(), probe.overlap(drawn=True), probe.overlap()
    assert (own == {}) == (temperature > 0 and acceptance == "match")
    for name in probe.exit_layers:
        for k in (1, 2, 4):
            assert 0.0 <= paper[name][k] <= 1.0 + 1e-9
            assert not own or 0.0 <= own[name][k] <= 1.0 + 1e-9
            if temperature == 0.0:
                assert fallback[name][k] == pytest.approx(1 - own[name][k])
    assert probe.to_dict()["temperature"] == temperature
    assert probe.to_dict()["acceptance"] == (acceptance if temperature else "greedy")


@pytest.mark.parametrize("acceptance", ["match", "rejection"])
def test_the_probe_verifies_as_sd_does(acceptance):
    """The probe simulated speculative sampling at every temperature while the methods default to sample-and-match:
    at T = 1 its acceptance and fallback described a verifier the benched methods did not run. Now its windows are
    accepted as sd's with the same acceptance, seed and fixed γ."""
    from mirrorsd.api import LoadedModel
    from mirrorsd.bench.probe import run_probe
    from tests.helpers import row_exact, tiny_hf

    target, draft = LoadedModel(row_exact(tiny_hf(layers=4, seed=1))), LoadedModel(row_exact(tiny_hf(layers=2, seed=2)))
    prompt = [5, 9, 2, 7]
    probe = run_probe(target, draft, [("qa", prompt)], 24, gamma=3, kappas=(1, 2), progress=False, temperature=1.0,
                      seed=3, acceptance=acceptance)
    got = mirrorsd.generate(target, prompt, draft=draft, method="sd", gamma=3, confidence=0, suffix_match=0,
                            acceptance=acceptance, temperature=1.0, seed=3, max_new_tokens=24)
    sd = [a for a, d in zip(got.stats.accepted, got.stats.drafted, strict=True) if d == 3]
    n = min(len(sd), len(probe.accepted["qa"])) - 1  # (the last windows differ: sd's are cut to the room left)
    assert n >= 3 and probe.accepted["qa"][:n] == sd[:n]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_probe_reads_a_shorter_windows_fallback_from_the_same_steps(temperature):
    """The planner priced every γ with the probe's γ = 8 fallback, though a shorter window's correction comes at
    an earlier slot, where the exit reads otherwise. A γ-window probe now reads, for each γ' < γ, the slot a
    γ'-window's correction would fill: on the first step (same context) it is what a γ'-window probe records."""
    from mirrorsd.api import LoadedModel
    from mirrorsd.bench.probe import run_probe
    from tests.helpers import row_exact, tiny_hf

    target = LoadedModel(row_exact(tiny_hf(layers=4, seed=1)))
    prompt, kw = [5, 9, 2, 7], dict(kappas=(1, 2, 4), progress=False, temperature=temperature, seed=3)
    long = run_probe(target, target, [("qa", prompt)], 1, gamma=4, **kw)  # (one step: its own draft accepts all)
    assert long.accepted["qa"] == [4]
    for gamma in (1, 2, 3, 4):
        short = run_probe(target, target, [("qa", prompt)], 1, gamma=gamma, **kw)
        for name in long.exit_layers:
            assert long._ranks("qa", name, gamma) == short._ranks("qa", name)
        assert long.fallback(gamma=gamma) == short.fallback()
    assert long.fallback(gamma=4) == long.fallback()
    ranks = [long._ranks("qa", name, g)[0] for name in long.exit_layers for g in (1, 2, 3, 4)]
    assert len(set(ranks)) > 1  # (the slots differ: the test tells a shorter window from the longest)


def test_a_wrong_probe_exit_head_fails_before_any_model_loads(tmp_path):
    with pytest.raises(ValueError, match="holds no tuned exit"):
        Bench(BenchConfig("no-such-model", "no-such-draft", [], probe_exit_head=str(tmp_path)), progress=False)


@pytest.mark.serial  # the other pytest-xdist worker would be the busy job
@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux /proc")
def test_a_busy_machine_is_reported_and_our_own_work_is_not():
    """Timings next to another heavy job mean little (on 2 cores, ~4× slower each): the bench warns."""
    import subprocess
    import sys
    import threading

    from mirrorsd.runtime.load import BUSY_SHARE, busy_warning, others_cpu_share

    assert busy_warning(None) is None and busy_warning(BUSY_SHARE / 2) is None
    assert "40% of the" in busy_warning(0.4)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()  # this process spinning a core is not another job
    try:
        assert others_cpu_share() < BUSY_SHARE
    finally:
        stop.set()
        spinner.join()
    cores = os.cpu_count() or 1
    if cores <= 8:  # another process busy on every core is
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
        try:
            time.sleep(0.3)
            assert others_cpu_share() > BUSY_SHARE
        finally:
            for proc in busy:
                proc.kill()
                proc.wait()


def test_cli_commands_warn_on_a_busy_machine(monkeypatch, capsys):
    from mirrorsd import cli
    from mirrorsd.runtime import load

    monkeypatch.setattr(load, "others_cpu_share", lambda interval=0.5: 0.9)
    cli._warn_if_busy("train-streams")
    assert "90% of the" in capsys.readouterr().err
    monkeypatch.setattr(load, "others_cpu_share", lambda interval=0.5: 0.0)
    cli._warn_if_busy("train-streams")
    assert capsys.readouterr().err == ""


def test_bench_loads_the_activations_asked_for_and_records_both_models_formats(monkeypatch, capsys):
    """`mirrorsd bench` had no --activations (SmolLM2 could be timed at int8x2 only) and its results named the
    target's weights alone."""
    from mirrorsd.bench import runner

    loads: list[dict] = []

    def load(name, **kwargs):
        loads.append(kwargs)
        raise RuntimeError("stop after the load")

    monkeypatch.setattr(runner, "load_model", load)
    with pytest.raises(RuntimeError, match="stop after the load"):
        main(["bench", "--target", "smollm2-135m", "--methods", "ar", "--weights", "q4", "--activations", "int8"])
    assert loads[0]["weights"] == "q4" and loads[0]["activations"] == "int8"
    from mirrorsd.bench.report import _format

    assert _format({"target_format": "q4 weights, int8 activations", "target_weights": "q4"}, "target") == \
        "q4 weights, int8 activations"
    assert _format({"target_weights": "q4"}, "target") == "q4"  # (a results file from before)


@requires_smollm2
def test_a_divergence_at_an_answers_end_is_measured_against_the_end_token_the_model_would_choose(smollm2):
    """SmolLM2 ends on <|im_end|> (2) and, as llama.cpp, <|endoftext|> (0): the divergence check took the smallest
    end id, one the model did not choose (12.7 logits apart at an answer's end), and would call a near-tie a
    mismatch."""
    from mirrorsd.bench.runner import END, Bench, MethodSpec

    ours, _ = smollm2
    bench = object.__new__(Bench)
    bench.target = ours
    from mirrorsd.api import encode_prompt

    prompt = encode_prompt(ours, [{"role": "user", "content": "Say hi."}])
    model = ours.model
    logits = model(torch.tensor([prompt]), cache=model.new_cache(capacity=len(prompt) + 1), last=1)[0, -1]
    end = max(ours.eos_token_ids, key=lambda t: float(logits[t]))
    gap = bench._logit_gap(MethodSpec("sd", "sd", {}), prompt, END, 42)
    assert gap == pytest.approx(float(logits[end] - logits[42]))

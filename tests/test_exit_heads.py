"""The tuned early exit (issue 17): the closed-form fit, its files, and Mirror-SD with it (still lossless)."""

from __future__ import annotations

import pytest
import torch

import mirrorsd
from mirrorsd.decoding.mirror import early_exit
from mirrorsd.exit_heads import ExitTranslators, shipped_exit, tuned_exit, unit_rms
from mirrorsd.sampling import SamplingParams
from mirrorsd.train_exit import KLRefine, _corrections, fit_exit, plot_curve, refine_kl, topk_hinge
from mirrorsd.training import Tokens, corpus_texts
from tests.helpers import requires_smollm2


def test_identity_translator_is_the_logit_lens(tiny_pair):
    """A = [I; 0] reproduces the plain lens: the final RMSNorm ignores the unit-RMS rescaling."""
    target, _ = tiny_pair
    d = target.config.hidden_size
    identity = ExitTranslators({2: torch.cat([torch.eye(d), torch.zeros(1, d)])}, {})
    hidden = torch.randn(1, 5, d) * 7
    lens = target.logits(hidden)
    tuned = target.logits(identity(hidden, 2))
    torch.testing.assert_close(tuned, lens, rtol=1e-4, atol=1e-4)
    assert unit_rms(hidden).pow(2).mean(-1).sub(1).abs().max() < 1e-4


def test_files_round_trip_and_clear_errors(tiny_pair, tmp_path):
    target, _ = tiny_pair
    d = target.config.hidden_size
    a = torch.randn(d + 1, d)
    ExitTranslators({1: a}, {"layers": [1]}).save(tmp_path / "exit")
    loaded = ExitTranslators.load(tmp_path / "exit")
    assert loaded.meta == {"layers": [1]} and torch.allclose(loaded.layers[1], a, rtol=1e-2, atol=1e-2)  # bf16
    with pytest.raises(ValueError, match="layers \\[1\\], not layer 2"):
        tuned_exit(target, str(tmp_path / "exit"), 2)
    with pytest.raises(ValueError, match="no tuned exit"):
        tuned_exit(target, str(tmp_path), 1)
    with pytest.raises(ValueError, match="zoo name"):
        tuned_exit(target, "tuned", 1)
    ExitTranslators({1: torch.randn(d + 2, d + 1)}, {}).save(tmp_path / "other")
    with pytest.raises(ValueError, match="another model"):
        tuned_exit(target, str(tmp_path / "other"), 1)
    deeper = target.config.n_layers + 4  # as wide, deeper (an R1 distill beside a Qwen2.5 of one width)
    ExitTranslators({1: a}, {"layers": [1], "n_layers": deeper}).save(tmp_path / "deeper")
    with pytest.raises(ValueError, match=f"fitted on a {deeper}-layer model, the target has"):
        tuned_exit(target, str(tmp_path / "deeper"), 1)


def rolled_out(got) -> int:
    """Roots Mirror-SD rolled out over a run: 0 means the early exit never ran (the serial backend's fitted budget
    is 0 unless told), and a test of what the exit reads would test nothing."""
    return sum(step.roots for step in got.stats.extra["mirror"].steps)


def test_mirror_with_a_tuned_exit_equals_ar(tiny_pair, tmp_path):
    """Any translator only changes which branches the draft rolls out, never the tokens."""
    target, draft = tiny_pair
    d = target.config.hidden_size
    torch.manual_seed(0)
    ExitTranslators({2: torch.randn(d + 1, d) * 0.3}, {}).save(tmp_path / "exit")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for sampling in ({}, {"temperature": 0.9, "seed": 4}):
        want = mirrorsd.generate(target, prompt, method="ar", max_new_tokens=24, **sampling)
        got = mirrorsd.generate(target, prompt, draft=draft, method="mirror", exit_layer=2, budget=2,
                                exit_head=str(tmp_path / "exit"), max_new_tokens=24, **sampling)
        assert got.token_ids == want.token_ids and rolled_out(got) > 0
    hidden, translate = torch.randn(1, 3, d), tuned_exit(target, str(tmp_path / "exit"), 2)
    message = early_exit(target, hidden, 4, SamplingParams(), translate)
    with torch.no_grad():
        want = target.logits(translate(hidden))[0].topk(4).indices
        lens = target.logits(hidden)[0].topk(4).indices
    assert message.ids == want.tolist() != lens.tolist()  # the translated state's top-4, not the lens's


def test_probe_reads_tuned_exits_next_to_the_lens(tiny_pair):
    """The acceptance probe (Fig. 7's fallback grid) adds a "<depth> tuned" row per translated depth; an identity
    translator is the lens, so its row equals the lens row, and a translator that scrambles the state moves it."""
    from mirrorsd.api import LoadedModel
    from mirrorsd.bench.probe import run_probe

    target, draft = tiny_pair
    d = target.config.hidden_size
    rows = {}
    for name, a in (("identity", torch.cat([torch.eye(d), torch.zeros(1, d)])),
                    ("scrambled", torch.randn(d + 1, d, generator=torch.Generator().manual_seed(5)))):
        probe = run_probe(LoadedModel(target), LoadedModel(draft), [("g", [1, 2, 3, 4])], 12, gamma=3,
                          exits={"1/2": 0.5}, progress=False, tuned=ExitTranslators({2: a}, {}))
        rows[name] = probe.fallback()
        assert set(rows[name]) == {"1/2", "1/2 tuned"}
    assert rows["identity"]["1/2 tuned"] == rows["identity"]["1/2"] == rows["scrambled"]["1/2"]
    assert rows["scrambled"]["1/2 tuned"] != rows["scrambled"]["1/2"]  # the probe read the translator


def test_probe_measures_the_draft_runner_ups(tiny_pair):
    """candidates=draft's fallback: with κ = the vocabulary every correction is a candidate (the draft's other
    tokens at a drafted position, the exit's whole row at the bonus slot), so nothing falls back; with fewer it
    can only fall back more."""
    from mirrorsd.api import LoadedModel
    from mirrorsd.bench.probe import run_probe

    target, draft = tiny_pair
    vocab = target.config.vocab_size
    probe = run_probe(LoadedModel(target), LoadedModel(draft), [("g", [1, 2, 3, 4])], 16, gamma=3,
                      kappas=(1, 2, vocab), exits={"1/2": 0.5}, progress=False)
    steps = len(probe.draft_ranks["g"])
    assert steps == len(probe.ranks["g"]["1/2"]) > 0
    fallback = probe.draft_fallback()
    assert fallback[vocab] == 0.0 and fallback[1] >= fallback[2] >= fallback[vocab]
    assert fallback[1] > 0  # two random models disagree
    assert probe.to_dict()["draft_fallback"]["g"] == fallback


def test_unresolvable_tuned_exit_is_a_clear_error(tiny_pair):
    target, draft = tiny_pair
    with pytest.raises(ValueError, match="no shipped tuned exit"):
        mirrorsd.generate(target, [1, 2, 3], draft=draft, method="mirror", exit_head="tuned", max_new_tokens=4)


@requires_smollm2
def test_mirror_reads_the_shipped_tuned_exit_by_default(monkeypatch):
    """``exit_head="auto"`` (the default) resolves to the zoo target's shipped exit where it has a translator for
    ℓe, and to the lens elsewhere; either way the tokens are ``ar``'s."""
    import mirrorsd.decoding.mirror.method as mirror_module

    loaded = mirrorsd.load_model("smollm2-135m", progress=False)
    read = []

    def recording(target, head, layer, option="exit_head"):
        read.append((head, layer))
        return tuned_exit(target, head, layer, option)

    monkeypatch.setattr(mirror_module, "tuned_exit", recording)
    prompt = "Write a haiku about the sea."
    want = mirrorsd.generate(loaded, prompt, method="ar", max_new_tokens=16)
    draft = loaded.model.prefix_model(10)
    got = mirrorsd.generate(loaded, prompt, draft=draft, method="mirror", budget=2, max_new_tokens=16)
    assert got.token_ids == want.token_ids and rolled_out(got) > 0
    assert read == [(str(shipped_exit("smollm2-135m")), 15)]  # N/2 of 30 layers
    got = mirrorsd.generate(loaded, prompt, draft=draft, method="mirror", exit_layer=16, budget=2, max_new_tokens=16)
    assert got.token_ids == want.token_ids and len(read) == 1  # no translator for layer 16: the lens
    assert rolled_out(got) > 0
    assert shipped_exit("smollm2-135m", 16) is None and shipped_exit("smollm2-135m", 22) is not None


@requires_smollm2
def test_fit_on_smollm2_beats_or_matches_the_lens_and_decodes_losslessly(tmp_path):
    loaded = mirrorsd.load_model("smollm2-135m", progress=False)
    translators = fit_exit(loaded.model, loaded.tokenizer, corpus_texts(["pydoc-topics"]), [15], chunks=8,
                           held_out=2, seq_len=64, progress=False)
    held = translators.meta["held_out"]["15"]
    assert held["tuned"]["top8"] >= held["lens"]["top8"] - 0.02  # λ is chosen on held-out, lens is its limit
    assert [p["train_tokens"] for p in translators.meta["curve"]] == [64, 128, 256, 512]
    translators.save(tmp_path / "exit")
    plot_curve(translators.meta, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 1000
    prompt = "Write a haiku about the sea."
    want = mirrorsd.generate(loaded, prompt, method="ar", max_new_tokens=24)
    got = mirrorsd.generate(loaded, prompt, draft=loaded.model.prefix_model(10), method="mirror", exit_layer=15,
                            exit_head=str(tmp_path / "exit"), budget=2, max_new_tokens=24)
    assert got.token_ids == want.token_ids and rolled_out(got) > 0


def test_kl_refine_lowers_the_kl_and_keeps_the_best_held_out_step(tiny_pair):
    """The fine-tune moves the translator towards the final distribution, and what it returns is never worse on
    held-out rows than where it started (step 0 is a candidate): a refinement that does not help is a no-op."""
    target, _ = tiny_pair
    d = target.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    states = unit_rms(torch.randn(512, d, generator=gen))
    finals = states @ torch.randn(d, d, generator=gen) / d**0.5 + 0.1 * torch.randn(512, d, generator=gen)
    start = torch.cat([torch.eye(d), torch.zeros(1, d)])  # the plain lens
    want = target.logits(finals[None, 448:])[0].argmax(-1)
    opts = KLRefine(steps=60, lr=1e-2, batch=64, vocab=0, checks=3)
    a, hits, record = refine_kl(target, start, states[:448], finals[:448], states[448:], want, opts, progress=False)

    def kl(translator):
        target_lp = target.logits(finals[None, :448])[0].log_softmax(-1)
        exit_lp = target.logits((torch.cat([states[:448], torch.ones(448, 1)], 1) @ translator)[None])[0]
        return (target_lp.exp() * (target_lp - exit_lp.log_softmax(-1))).sum(-1).mean()

    assert kl(a) < kl(start)
    assert record["vocab"] == target.config.vocab_size and [p["step"] for p in record["curve"]] == [0, 20, 40, 60]
    assert round(hits[8], 4) == max(p["top8"] for p in record["curve"]) >= record["curve"][0]["top8"]


def test_topk_hinge_spends_itself_outside_the_top_kappa():
    """The hinge is softplus(1 + κ-th rival − wanted): its gradient reaches only the wanted id and its κ-th rival, and
    it is near zero once the wanted id clears the rival by more than the margin."""
    lp = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]]).log_softmax(-1).requires_grad_()
    low = topk_hinge(lp, torch.tensor([5]), kappa=2)  # id 5 against the 2nd-likeliest other (id 1)
    low.backward()
    assert low.item() == pytest.approx(torch.nn.functional.softplus(torch.tensor(1.0 + 4.0 - 0.0)).item())
    assert lp.grad[0].nonzero()[:, 0].tolist() == [1, 5] and lp.grad[0, 5] < 0 < lp.grad[0, 1]
    clear = torch.tensor([[20.0, 4.0, 3.0]]).log_softmax(-1)
    assert topk_hinge(clear, torch.tensor([0]), kappa=2).item() < 1e-6


def test_kl_refine_with_the_hinge_raises_the_held_out_top_kappa(tiny_pair):
    """With the hinge the fine-tune records both terms, and the kept step is never worse than where it started."""
    target, _ = tiny_pair
    d = target.config.hidden_size
    gen = torch.Generator().manual_seed(1)
    states = unit_rms(torch.randn(512, d, generator=gen))
    finals = states @ torch.randn(d, d, generator=gen) / d**0.5
    start = torch.cat([torch.eye(d), torch.zeros(1, d)])
    want = target.logits(finals[None, 448:])[0].argmax(-1)
    opts = KLRefine(steps=40, lr=1e-2, batch=64, vocab=0, checks=2, topk_weight=1.0)
    _, hits, record = refine_kl(target, start, states[:448], finals[:448], states[448:], want, opts, progress=False)
    assert all({"kl", "hinge"} <= set(p) for p in record["curve"][1:])
    assert hits[8] >= record["curve"][0]["top8"] and hits[8] > 0


@requires_smollm2
def test_kl_refined_fit_records_both_fits():
    loaded = mirrorsd.load_model("smollm2-135m", progress=False)
    translators = fit_exit(loaded.model, loaded.tokenizer, corpus_texts(["pydoc-topics"]), [15], chunks=4,
                           held_out=2, seq_len=64, progress=False, refine=KLRefine(steps=4, checks=2))
    held = translators.meta["held_out"]["15"]
    assert held["tuned"]["top8"] >= held["ridge_fit"]["top8"]  # the best step, the ridge fit included
    assert held["kl"]["vocab"] == 32768  # the restricted vocabulary the exit reads by default
    assert translators.meta["recipe"]["kl"]["steps"] == 4 and "then KL" in translators.meta["kind"]


@requires_smollm2
def test_self_distilled_transcripts_join_the_fit():
    from mirrorsd.train_exit import distill_prompts, self_distilled

    loaded = mirrorsd.load_model("smollm2-135m", progress=False)
    transcripts = self_distilled(loaded, 2, 12, progress=False)
    assert len(transcripts) == 2
    want = mirrorsd.generate(loaded, distill_prompts(2)[1], method="ar", max_new_tokens=12)
    assert transcripts[1].tolist() == want.prompt_ids + want.token_ids  # template, prompt, the model's own answer
    translators = fit_exit(loaded.model, loaded.tokenizer, corpus_texts(["pydoc-topics"]), [15], chunks=4,
                           held_out=2, seq_len=64, progress=False, transcripts=transcripts)
    recipe = translators.meta["recipe"]
    assert recipe["self_distilled_transcripts"] == 2
    assert recipe["train_tokens"] + recipe["held_out_tokens"] == 6 * 64 + sum(len(t) for t in transcripts)
    with pytest.raises(ValueError, match="at most 84"):
        distill_prompts(85)


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_zoo_models_ship_tuned_exits_at_quarter_half_three_quarters(name):
    folder = shipped_exit(name)
    assert folder is not None, f"no tuned exit shipped for {name}"
    translators = ExitTranslators.load(folder)
    n = translators.meta["n_layers"]
    assert sorted(translators.layers) == sorted({round(f * n) for f in (0.25, 0.5, 0.75)})
    for layer, row in translators.meta["held_out"].items():
        assert row["tuned"]["top8"] >= row["lens"]["top8"], (name, layer)


def _documents(vocab: int, count: int = 10, length: int = 64, seed: int = 0) -> list[Tokens]:
    """Token-id documents whose second half the model "wrote" (as distilled records mark their answers)."""
    gen = torch.Generator().manual_seed(seed)
    written = [i >= length // 2 for i in range(length)]
    return [Tokens(torch.randint(0, vocab, (length,), generator=gen).tolist(), written) for _ in range(count)]


def test_corrections_are_the_rows_where_the_draft_and_the_model_disagree_on_written_text(tiny_pair):
    target, draft = tiny_pair
    doc = _documents(target.config.vocab_size, 1)[0]
    ids, answer = torch.tensor(doc), torch.tensor(doc.answer)
    with torch.inference_mode():
        want = target(ids[None])[0].argmax(-1)
        guess = draft(ids[None])[0].argmax(-1)
        hard = _corrections(draft, ids, want, answer)
        unmarked = _corrections(draft, ids, want, None)
    assert torch.equal(unmarked, guess != want) and unmarked.any()
    written_next = torch.tensor([bool(a) for a in doc.answer[1:]] + [False])
    assert torch.equal(hard, (guess != want) & written_next)  # row t predicts token t + 1, which must be written


def test_a_fit_weighted_toward_corrections_reports_them_and_weighs_them(tiny_pair):
    target, draft = tiny_pair
    docs = _documents(target.config.vocab_size)
    common = dict(chunks=6, held_out=4, seq_len=64, ridges=(10.0,), progress=False)
    plain = fit_exit(target, None, docs, [2], **common)
    same = fit_exit(target, None, docs, [2], corrections=draft, correction_weight=1.0, **common)
    heavy = fit_exit(target, None, docs, [2], corrections=draft, correction_weight=8.0, **common,
                     refine=KLRefine(steps=4, batch=16, vocab=0, checks=2))
    assert torch.equal(same.layers[2], plain.layers[2])  # weight 1: the plain ridge fit
    assert not torch.allclose(heavy.layers[2], plain.layers[2])
    held = heavy.meta["held_out"]["2"]
    assert 0 < held["corrections"]["rows"] <= 2 * 64 // 2  # written rows of the two test windows at most
    assert set(held["corrections"]) == {"rows", "lens", "tuned", "ridge_fit"}
    assert "corrections" not in plain.meta["held_out"]["2"]
    assert heavy.meta["recipe"]["corrections"]["weight"] == 8.0 and heavy.meta["recipe"]["corrections"]["train_rows"]
    assert all("corrections" in point["2"] for point in heavy.meta["curve"])
    with pytest.raises(ValueError, match="no row where the draft and the model disagree"):
        unmarked = [Tokens(list(d), [False] * len(d)) for d in docs]
        fit_exit(target, None, unmarked, [2], corrections=draft, **common)


def test_a_refit_of_some_layers_joins_an_exit_and_keeps_its_other_layers(tiny_pair, tmp_path):
    target, draft = tiny_pair
    d = target.config.hidden_size
    held = {"1": {"tuned": {"top8": 0.5}}, "2": {"tuned": {"top8": 0.4}}}
    base = ExitTranslators({1: torch.randn(d + 1, d), 2: torch.randn(d + 1, d)},
                           {"layers": [1, 2], "held_out": held, "recipe": {"data": ["stdlib"]}})
    refit = fit_exit(target, None, _documents(target.config.vocab_size), [2], chunks=6, held_out=4, seq_len=64,
                     progress=False, corrections=draft)
    merged = refit.merged_into(base)
    assert torch.equal(merged.layers[1], base.layers[1]) and torch.equal(merged.layers[2], refit.layers[2])
    assert merged.meta["held_out"]["1"] == base.meta["held_out"]["1"]
    assert merged.meta["held_out"]["2"] == refit.meta["held_out"]["2"] and merged.meta["layers"] == [1, 2]
    assert merged.meta["recipe"] == base.meta["recipe"]  # the kept layers' recipe; the refit's is under refits
    assert merged.meta["refits"]["2"]["recipe"]["corrections"]["weight"] == 4.0
    merged.save(tmp_path / "exit")
    assert ExitTranslators.load(tmp_path / "exit").meta["refits"]["2"]["recipe"] == refit.meta["recipe"]
    with pytest.raises(ValueError, match="different models"):
        ExitTranslators({2: torch.zeros(d + 2, d + 1)}, {}).merged_into(base)


def test_fit_reports_hit_rates_on_windows_it_did_not_choose_on(tiny_pair):
    """λ (and the KL step) are picked on the first half of the held-out windows; the rates in ``meta`` are those of
    the second half, so a reported rate is never the best of the candidates measured on the same rows."""
    import random

    from mirrorsd.train_exit import _hits, _states, _with_bias
    from mirrorsd.training import make_chunks

    target, _ = tiny_pair
    gen = torch.Generator().manual_seed(3)
    texts = [torch.randint(0, 64, (160,), generator=gen).tolist() for _ in range(4)]
    translators = fit_exit(target, None, texts, [2], chunks=32, held_out=6, seq_len=16, progress=False)
    windows = [c.ids for c in make_chunks(None, texts, 16, 38, 0)]
    random.Random(0).shuffle(windows)

    def rates(part, translator):
        hidden = torch.cat([_states(target, ids, [2])[0][2] for ids in part])
        want = torch.cat([target.logits(_states(target, ids, [])[1][None])[0].argmax(-1) for ids in part])
        x = hidden.float() if translator is None else _with_bias(hidden).float() @ translator
        return {f"top{k}": round(v, 4) for k, v in _hits(target, x, want, (1, 4, 8, 16)).items()}

    held = translators.meta["held_out"]["2"]
    assert translators.meta["recipe"]["validation_tokens"] == 3 * 16
    assert held["tuned"] == rates(windows[3:6], translators.layers[2])
    assert held["lens"] == rates(windows[3:6], None)
    assert held["tuned"] != rates(windows[:6], translators.layers[2])  # not the old all-windows rates
    with pytest.raises(ValueError, match="held_out must be at least 2"):
        fit_exit(target, None, texts, [2], chunks=8, held_out=1, seq_len=16, progress=False)

"""The Python API around the methods: stopping, streaming, validation."""

from __future__ import annotations

import pytest
import torch

import mirrorsd
from mirrorsd import LoadedModel, Transformer, generate, stream
from mirrorsd.server.app import usage
from tests.helpers import requires_smollm2, row_exact, tiny_hf


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return Transformer.from_hf(tiny_hf(layers=2, seed=7))


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_eos_stops_and_is_not_output(tiny, method):
    reference = generate(tiny, [1, 2, 3], max_new_tokens=20).token_ids
    first = next(i for i in range(3, 20) if reference[i] not in reference[:i])  # a token new at i >= 3
    model = LoadedModel(tiny, eos_token_ids=frozenset({reference[first]}))
    # The identity draft with 8-token windows puts the EOS in the middle of an accepted window.
    # (The model always: the measured gate began with suffix-only steps, which found nothing, so sd ran as ar.)
    kw = {"draft": tiny, "gamma": 8, "confidence": 0, "model_gate": "always", "suffix_match": 0} \
        if method == "sd" else {}
    g = generate(model, [1, 2, 3], method=method, max_new_tokens=20, **kw)
    assert g.finish_reason == "eos"
    assert g.token_ids == reference[:first]
    assert g.stats.new_tokens == first
    assert (g.stats.draft_forwards > 0) == (method == "sd")


def test_a_stop_string_over_more_tokens_than_characters_is_found(tiny):
    """Only the last few tokens were decoded to look for a stop string, as many as it has characters plus 8; but a
    token may decode to nothing (a special token) or to a third of a character (byte-level BPE and CJK or emoji),
    and the stop string went unseen."""
    reference = generate(tiny, [1, 2, 3], max_new_tokens=64).token_ids
    mark = max(set(reference), key=reference.count)
    at = [i for i, t in enumerate(reference) if t == mark]
    assert len(at) >= 3 and at[2] - at[0] > len("xxx") + 8  # (the test's premise: the marks lie far apart)

    class Marks:  # every token decodes to nothing but ``mark``, to "x"
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join("x" for t in ids if t == mark)

    g = generate(LoadedModel(tiny, tokenizer=Marks()), [1, 2, 3], max_new_tokens=64, stop="xxx")
    assert g.finish_reason == "stop" and g.token_ids == reference[:at[2] + 1] and g.text == ""


def test_empty_stop_strings_are_ignored(tiny):
    for stop in ("", [""], ()):
        g = generate(tiny, [1, 2, 3], max_new_tokens=6, stop=stop)
        assert len(g.token_ids) == 6 and g.finish_reason == "length"


def test_max_new_tokens_and_length_reason(tiny):
    g = generate(tiny, [1, 2, 3], method="sd", draft=tiny, gamma=8, confidence=0, max_new_tokens=5)
    assert len(g.token_ids) == 5 and g.finish_reason == "length"


def test_prompt_over_context_is_a_clear_error(tiny):
    context = tiny.config.context_length
    with pytest.raises(ValueError, match="context"):
        generate(tiny, [1] * context, max_new_tokens=4)
    g = generate(tiny, [1] * (context - 3), max_new_tokens=50)
    assert len(g.token_ids) == 3 and g.finish_reason == "length"


def test_a_draft_with_a_shorter_context_is_a_clear_error_not_a_shorter_answer():
    """A draft of 256 tokens' context beside a 1024-token target cut sd's and mirror's answers at 256 tokens in all,
    where `ar` wrote them whole, and blamed "the model's context"."""
    target = Transformer.from_hf(tiny_hf(layers=4, seed=1))
    short = Transformer.from_hf(tiny_hf("mistral", layers=2, seed=2, sliding_window=256))
    prompt = ([1, 2, 3, 4, 5, 6, 7, 8] * 40)[:200]
    for method, options in (("sd", {"draft_context": 0}), ("mirror", {})):
        with pytest.raises(ValueError, match="the draft's context is 256 tokens .the target's 1024.: give "
                                             "max_new_tokens <= 56"):
            generate(target, prompt, method=method, draft=short, max_new_tokens=100, **options)
        got = generate(target, prompt, method=method, draft=short, max_new_tokens=56, **options)
        assert got.token_ids == generate(target, prompt, method="ar", max_new_tokens=56).token_ids
    ar = generate(target, prompt, method="ar", max_new_tokens=100).token_ids
    assert len(ar) == 100
    # sd's default draft reads the prompt's first 4 and last 128 tokens: 232 positions in all, within its 256 (it was
    # refused, where its draft never reads the long prompt)
    assert generate(target, prompt, method="sd", draft=short, max_new_tokens=100).token_ids == ar
    with pytest.raises(ValueError, match="the draft's context is 256 tokens .the target's 1024.: give a draft"):
        generate(target, [1] * 300, method="mirror", draft=short, max_new_tokens=100)  # (no max_new_tokens <= -44)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "beam"}, "method must be one of ar, suffix, sd, mirror, ss"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),  # (a TypeError at the first token)
        ({"temperature": 0.5, "top_k": 2.5}, "top_k must be an integer"),  # (a TypeError inside torch.topk)
        ({"temperature": -0.5}, "temperature"),
        ({"method": "ar", "draft": "x"}, "does not use a draft"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer >= 1, got True"),  # (taken as 1)
        ({"temperature": "0.5"}, "temperature must be a number, got '0.5'"),
        ({"method": "ss", "tree_k": 65}, "tree_k must be in 1..64 .the vocabulary."),
        ({"method": "mirror", "exit_layer": 0.99}, "0.99 of 2 layers is layer 2"),
        ({"temperature": 0.5, "seed": 1.7}, "seed must be an integer"),  # (taken as 1)
        ({"temperature": 0.5, "seed": True}, "seed must be an integer"),
        ({"temperature": 0.5, "seed": "12"}, "seed must be an integer"),
        ({"temperature": 0.5, "seed": 2**64 + 1}, r"seed must be an integer in \[-2\*\*63"),  # (seed 1's tokens)
        ({"stop": 5}, "stop must be a string or a list of strings, got 5"),  # ('int' object is not iterable)
        ({"stop": ["a", None]}, "stop must be a string or a list of strings"),
    ],
)
def test_bad_arguments(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny, [1, 2], **({"draft": tiny} if kwargs.get("method") == "mirror" else {}), **kwargs)


def test_a_self_draft_is_taken_by_name_as_the_cli_takes_it(tiny):
    """``draft="self:1"`` raised a TypeError whose hint, ``mirrorsd.load_model('self:1')``, failed too."""
    got = generate(tiny, [1, 2, 3], draft="self:1", method="sd", max_new_tokens=8)
    assert got.token_ids == generate(tiny, [1, 2, 3], max_new_tokens=8).token_ids
    with pytest.raises(ValueError, match="needs 1..1 of the target's layers"):
        generate(tiny, [1, 2, 3], draft="self:2", method="sd")


def test_a_self_draft_named_again_is_the_same_draft_model():
    """Each ``draft="self:N"`` built a new prefix model, so what is kept per draft model (its process for Mirror-SD's
    processes backend, its subset heads) was built again for every request: ~9 s a request on SmolLM2."""
    import gc
    import weakref

    from mirrorsd.api import self_draft

    target = LoadedModel(row_exact(tiny_hf(layers=4, seed=1)))
    first = self_draft(target, "self:2").model
    assert self_draft(target, "self:2").model is first and self_draft(target, "self:0.5").model is first
    assert self_draft(target, "self:1").model is not first and first.config.n_layers == 2
    self_draft(target, "self:3")  # (a sweep over depths keeps the two most recent: each may hold a draft process)
    assert self_draft(target, "self:2").model is not first
    gone = weakref.ref(target.model)
    del target
    gc.collect()
    assert gone() is None  # (the kept prefix does not keep its target alive)


class _Vocab:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_auto_with_a_draft_of_another_tokenizer_plans_without_it(tiny, tmp_path, monkeypatch, capsys):
    """The plan probes the draft's acceptance in the target's ids: with SmolLM2 as the target and the CLI's default
    Qwen draft, ``generate --target smollm2-135m`` (auto) failed with an IndexError inside the probe."""
    from mirrorsd import plans

    asked = []
    monkeypatch.setattr(plans, "plan_path", lambda target, draft: tmp_path / f"{target}-{draft}.json")
    monkeypatch.setattr(plans, "_planner", lambda target, draft: asked.append(draft) or
                        {"recommended": {"method": "ar", "options": {}}})
    target = LoadedModel(tiny, tokenizer=_Vocab({"a": 0}), name="t")
    draft = LoadedModel(tiny, tokenizer=_Vocab({"b": 0}), name="d")
    got = generate(target, [1, 2, 3], draft=draft, method="auto", max_new_tokens=4)
    assert asked == [None] and got.stats.method == "ar"
    assert "draft d has a tokenizer of its own" in capsys.readouterr().err


def test_an_option_the_method_auto_chose_does_not_take_says_auto_chose_it(tiny, tmp_path, monkeypatch):
    from mirrorsd import plans

    monkeypatch.setattr(plans, "plan_path", lambda target, draft: tmp_path / f"{target}-{draft}.json")
    monkeypatch.setattr(plans, "_planner", lambda target, draft: {"recommended": {"method": "ar", "options": {}}})
    target = LoadedModel(tiny, tokenizer=_Vocab({"a": 0}), name="t")
    with pytest.raises(ValueError, match="gamma is not an option of method 'ar', which method='auto' chose"):
        generate(target, [1, 2, 3], draft=LoadedModel(tiny, tokenizer=target.tokenizer, name="d"), method="auto",
                 gamma=4)


@requires_smollm2
def test_chat_messages_without_a_role_or_content_are_refused_clearly():
    target = mirrorsd.load_model("smollm2-135m")
    for messages in ([{"content": "hi"}], [{"role": "user"}], [{"role": "user", "content": 3}]):
        with pytest.raises(ValueError, match="chat message 0 needs a text 'role' and 'content'"):
            generate(target, messages)  # (jinja2's UndefinedError, or a TypeError inside the template)


def test_what_users_of_hf_and_openai_pass_is_taken_or_refused_clearly(tiny):
    """None for the sampling arguments and stop (OpenAI's clients send it: a TypeError), numpy integers (refused as
    "must be an integer ..., got 3"), HF's [1, T] input_ids (refused) and text or floats as ids (taken as ids)."""
    import numpy as np

    want = generate(tiny, [1, 2, 3], max_new_tokens=6)
    nulls = {"temperature": None, "top_k": None, "top_p": None, "stop": None}
    assert generate(tiny, [1, 2, 3], max_new_tokens=np.int64(6), **nulls).token_ids == want.token_ids
    assert generate(tiny, torch.tensor([[1, 2, 3]]), max_new_tokens=6).token_ids == want.token_ids
    assert generate(tiny, np.array([1, 2, 3]), max_new_tokens=6).token_ids == want.token_ids
    sampled = generate(tiny, [1, 2, 3], max_new_tokens=6, temperature=np.float32(0.8), top_k=np.int64(5), seed=1)
    assert sampled.token_ids == generate(tiny, [1, 2, 3], max_new_tokens=6, temperature=0.8, top_k=5, seed=1).token_ids
    for prompt in (["1", "2"], [1.9, 2.2], [True, False]):
        with pytest.raises(ValueError, match="got a sequence holding"):
            generate(tiny, prompt)
    for prompt in (torch.tensor([[1, 2], [3, 4]]), torch.tensor([1.0, 2.0])):
        with pytest.raises(ValueError, match="a tensor prompt is one sequence of token ids"):
            generate(tiny, prompt)
    with pytest.raises(TypeError, match=r"load it first, target=mirrorsd.load_model\('smollm2-135m'\)"):
        generate("smollm2-135m", "Hi")
    with pytest.raises(TypeError, match=r"draft must be a model .* load it first, draft=mirrorsd.load_model"):
        generate(tiny, [1, 2], draft="qwen2.5-coder-0.5b")
    for kwargs in ({}, {"draft": tiny}):  # a bare model has no name to key a plan by, nor a tokenizer
        with pytest.raises(ValueError, match="method='auto' follows the plan saved for a named target and draft"):
            generate(tiny, [1, 2], method="auto", **kwargs)
    with pytest.raises(ValueError, match="this draft has no name"):
        generate(LoadedModel(tiny, tokenizer=object(), name="t"), [1, 2], method="auto", draft=tiny)


def test_tokens_accepted_past_an_eos_or_stop_cut_are_not_counted(tiny):
    """A window accepted whole past the EOS that ends the answer counted its tokens as accepted: the server's
    accepted_prediction_tokens exceeded its completion_tokens. The verifier's own counts stay (acceptance statistics
    read them); the step log says how much of the step reached the output."""
    plain = generate(tiny, [1, 2, 3], max_new_tokens=12).token_ids
    ends = LoadedModel(tiny, eos_token_ids=frozenset({plain[5]}))
    got = generate(ends, [1, 2, 3], method="sd", draft=tiny, gamma=8, confidence=0, max_new_tokens=12,
                   model_gate="always", suffix_match=0)  # one window of 8, all accepted, cut by the EOS
    assert got.finish_reason == "eos" and got.token_ids == plain[:plain.index(plain[5])]
    assert got.stats.accepted_output <= len(got.token_ids) < sum(got.stats.accepted)  # the verifier's count stays
    assert got.stats.step_log[-1]["output"] == len(got.token_ids) - sum(a + 1 for a in got.stats.accepted[:-1])
    # OpenAI's prediction fields split the drafted tokens by whether they reached the completion (they summed to
    # less than drafted_tokens: rejected was the verifier's)
    details = usage(got)["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] == got.stats.accepted_output
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == sum(got.stats.drafted)


def test_a_vanishing_temperature_is_greedy(tiny):
    """Logits divided by 1e-45 overflow to inf and softmax gives NaN: the draws were noise, not the argmax that a
    vanishing temperature tends to (vLLM treats temperatures below 1e-5 as greedy; so do we)."""
    greedy = generate(tiny, [1, 2, 3], max_new_tokens=16).token_ids
    for tiny_t in (1e-45, 1e-7):
        assert generate(tiny, [1, 2, 3], max_new_tokens=16, temperature=tiny_t, seed=3).token_ids == greedy


def test_bad_prompts(tiny):
    with pytest.raises(ValueError, match="empty"):
        generate(tiny, [])
    with pytest.raises(ValueError, match="out of range"):
        generate(tiny, [1, 10_000])
    with pytest.raises(ValueError, match="no tokenizer"):
        generate(tiny, "text needs a tokenizer")
    with pytest.raises(ValueError, match="no tokenizer"):
        generate(tiny, [{"role": "user", "content": "chat needs one too"}])
    with pytest.raises(ValueError, match="text, token ids or chat messages"):
        generate(tiny, ["not", "ids"])


@requires_smollm2
def test_chat_messages_go_through_the_template_like_text():
    model = mirrorsd.load_model("smollm2-135m", progress=False)
    messages = [{"role": "user", "content": "List three colours."}]
    got = generate(model, messages, max_new_tokens=8)
    assert got.token_ids == generate(model, "List three colours.", max_new_tokens=8).token_ids


class _Vocab:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab
        self.reads = 0

    def get_vocab(self) -> dict[str, int]:
        self.reads += 1
        return self.vocab

    def decode(self, ids: list[int], **_) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_tokenizer_mismatch_is_refused(tiny):
    target = LoadedModel(tiny, tokenizer=_Vocab({"a": 0, "b": 1}), name="t")
    draft = LoadedModel(tiny, tokenizer=_Vocab({"a": 1, "b": 0}), name="d")
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        generate(target, [1, 2], method="sd", draft=draft)
    with pytest.raises(ValueError, match="tokenizer mismatch"):  # a mismatch is never remembered as a match
        generate(target, [1, 2], method="sd", draft=draft)


def test_matching_vocabularies_are_compared_once_per_pair(tiny):
    """Comparing two 152k-entry vocabularies took ~0.2 s of every request."""
    target = LoadedModel(tiny, tokenizer=_Vocab({"a": 0, "b": 1}))
    draft = LoadedModel(tiny, tokenizer=_Vocab({"a": 0, "b": 1}))
    for _ in range(3):
        generate(target, [1, 2], method="sd", draft=draft, max_new_tokens=2)
    assert target.tokenizer.reads == draft.tokenizer.reads == 1


@requires_smollm2
def test_stop_strings_streaming_and_chat_template(smollm2):
    ours, _ = smollm2
    prompt = "Count from one to ten in words, separated by commas."
    full = generate(ours, prompt, max_new_tokens=40)
    assert full.prompt_ids[:1] == ours.tokenizer("<|im_start|>")["input_ids"]  # chat template applied
    assert len(full.text) > 10
    middle = len(full.text) // 2
    stop = full.text[middle:middle + 3]
    for method, kw in [("ar", {}), ("sd", {"draft": ours.model.prefix_model(6), "gamma": 5})]:
        s = stream(ours, prompt, method=method, stop=stop, max_new_tokens=40, **kw)  # a str is one stop string
        pieces = list(s)
        g = s.result
        assert g.finish_reason == "stop"
        assert g.text == full.text[: full.text.index(stop)]
        assert "".join(pieces) == g.text
        assert g.token_ids == full.token_ids[: len(g.token_ids)]


@requires_smollm2
@pytest.mark.parametrize("method", ["ar", "sd", "suffix"])
def test_deltas_split_the_text_by_token_source(smollm2, method):
    """Per-step deltas (what the server's chat page colours): segments cover each delta's text exactly, every
    step ends with the target's own token, and only accepted draft tokens are marked "draft"."""
    ours, _ = smollm2
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps"
    kw = {"draft": ours.model.prefix_model(15), "gamma": 4} if method == "sd" else {}
    s = stream(ours, prompt, method=method, max_new_tokens=40, stop=["lazy cat"], **kw)
    deltas = list(s.deltas())
    g = s.result
    assert "".join(d.text for d in deltas) == g.text
    assert all("".join(t for t, _ in d.segments) == d.text for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == g.token_ids
    steps = deltas[: g.stats.steps]  # one delta per decoding step, then possibly held-back text
    for i, (d, accepted) in enumerate(zip(steps, g.stats.accepted, strict=True)):
        full = ["draft"] * accepted + ["target"]
        assert d.sources == full if i < len(steps) - 1 else d.sources == full[: len(d.sources)]
    drafted = sum(src == "draft" for d in steps for src in d.sources)
    assert drafted == 0 if method == "ar" else drafted > 0


@requires_smollm2
def test_raw_skips_the_chat_template(smollm2):
    ours, _ = smollm2
    g = generate(ours, "Hello", raw=True, max_new_tokens=2)
    assert g.prompt_ids == ours.tokenizer("Hello")["input_ids"]


def test_stats_dict_is_json_ready(tiny):
    import json

    g = generate(tiny, [1, 2, 3], method="sd", draft=tiny.prefix_model(1), max_new_tokens=12)
    d = json.loads(json.dumps(g.to_dict()))
    assert d["stats"]["new_tokens"] == 12
    for key in ("target_forwards", "mean_accepted_length", "per_position_acceptance", "tokens_per_s", "draft_s",
                "target_s", "wall_s"):
        assert key in d["stats"]
    assert d["token_ids"] == g.token_ids and isinstance(d["stats"]["seed"], int)


def test_seed_none_is_random_and_reported(tiny):
    a = generate(tiny, [1, 2, 3], temperature=1.0, max_new_tokens=16)
    b = generate(tiny, [1, 2, 3], temperature=1.0, max_new_tokens=16)
    assert a.stats.seed != b.stats.seed
    again = generate(tiny, [1, 2, 3], temperature=1.0, max_new_tokens=16, seed=a.stats.seed)
    assert again.token_ids == a.token_ids


def test_options_are_checked_before_iterating_and_streams_run_once(tiny):
    with pytest.raises(ValueError, match="gamma"):
        stream(tiny, [1, 2], method="sd", draft=tiny, gamma=0)
    s = stream(tiny, [1, 2], max_new_tokens=3)
    list(s)
    with pytest.raises(RuntimeError, match="once"):
        list(s)


def test_closing_a_stream_mid_iteration_ends_its_steps_at_once(tiny):
    """What the server does when a client leaves: the engine's steps (and the KV cache they hold) end at close(),
    not whenever the half-read iterator is collected."""
    s = stream(tiny, [1, 2], max_new_tokens=50, ignore_eos=True)
    it = s.deltas()
    next(it)
    s.close()
    assert s.request.stats.new_tokens >= 1  # the steps' finally ran: what was made is accounted for
    assert s.result is None
    with pytest.raises(StopIteration):
        next(it)


def test_stats_gamma_is_the_configured_window_and_max_drafted_the_largest_drafted(tiny):
    draft = tiny.prefix_model(1)
    g = generate(tiny, [1, 2, 3], method="sd", draft=draft, gamma=10000, confidence=0.0, max_new_tokens=5,
                 model_gate="always", suffix_match=0)  # (run alone, the measured gate started suffix-only: no window)
    assert g.stats.gamma == 10000
    assert 1 <= g.stats.max_drafted <= 4  # the windows stay inside max_new_tokens
    assert g.stats.to_dict()["gamma"] == 10000 and g.stats.to_dict()["max_drafted"] == g.stats.max_drafted
    assert generate(tiny, [1, 2, 3], method="ar", max_new_tokens=3).stats.gamma == 0


def test_default_method_is_sd_with_a_draft_else_ar(tiny):
    assert generate(tiny, [1, 2], max_new_tokens=3).stats.method == "ar"
    assert generate(tiny, [1, 2], draft=tiny.prefix_model(1), max_new_tokens=3).stats.method == "sd"


@requires_smollm2
def test_loading_pauses_the_collector_and_restores_it(monkeypatch):
    """Loading builds hundreds of thousands of long-lived objects with the cyclic collector paused (full passes
    would walk them all for nothing), and leaves the collector as the caller had it, also after a failure."""
    import gc

    from mirrorsd.collector import paused_collector

    seen = []
    monkeypatch.setattr(Transformer, "from_pretrained", lambda *a, **k: seen.append(gc.isenabled()) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        mirrorsd.load_model("smollm2-135m", progress=False)
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        with paused_collector():
            pass
        assert not gc.isenabled()  # the caller's own choice stays
    finally:
        gc.enable()


@pytest.mark.parametrize("method", ["ar", "suffix", "sd"])
def test_warm_up_runs_the_method_and_leaves_no_trace(tiny, monkeypatch, method):
    """``api.warm_up`` (what `mirrorsd serve` runs before it listens) decodes with the method and its options,
    greedy, and keeps its answer out of the shared suffix index that real requests read."""
    from mirrorsd.decoding import suffix_index

    key = "warm-up test"
    calls = []
    real = mirrorsd.api.generate

    def recording(target, prompt, **kwargs):
        calls.append(kwargs)
        out = real(target, prompt, **kwargs)
        suffix_index.shared_index(key).add(out.token_ids)  # what a request's answer would do
        return out

    options = {"gamma": 3} if method in ("suffix", "sd") else {}
    monkeypatch.setattr(mirrorsd.api, "generate", recording)
    seconds = mirrorsd.api.warm_up(tiny, method=method, draft=tiny, **options)
    monkeypatch.undo()
    assert seconds > 0 and len(calls) == 1
    assert calls[0]["method"] == method and calls[0]["temperature"] == 0 and calls[0]["ignore_eos"]
    assert all(calls[0][k] == v for k, v in options.items())
    assert (calls[0]["draft"] is tiny) == (method == "sd")  # a draft only where the method takes one
    assert len(suffix_index.shared_index(key)) == 0  # the warm-up's index was its own


def test_a_stream_closed_from_another_thread_stops_after_the_step_in_flight(tiny):
    """A UI's stop button or a watchdog closes the stream another thread iterates: close() raised "generator
    already executing" on nearly every try, and the stream ran to its end."""
    import threading

    s = stream(tiny, [1, 2, 3], max_new_tokens=1000, ignore_eos=True)
    seen, errors = threading.Semaphore(0), []

    def consume() -> None:
        try:
            for _ in s.deltas():
                seen.release()
        except Exception as error:  # noqa: BLE001 (closing from here raced the reader's next read)
            errors.append(repr(error))

    reader = threading.Thread(target=consume)
    reader.start()
    for _ in range(3):
        assert seen.acquire(timeout=60)
    s.close()  # (while the reader is in a step, or between two: both must stop it)
    reader.join(60)
    assert not reader.is_alive() and s.result is None and 3 <= len(s.token_ids) < 1000 and not errors


@pytest.mark.parametrize("kwargs, match", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0, "temperature": 1}, "top_p"),
    ({"prompt": [10**9]}, "out of range"),
    ({"prompt": list(range(1, 60)) * 20}, "context"),
])
def test_auto_checks_the_request_before_it_plans(tiny, monkeypatch, kwargs, match):
    """``method="auto"`` planned first (1-2 minutes on a machine without a plan), then refused the bad argument."""
    monkeypatch.setattr("mirrorsd.api.planned", lambda *a, **k: pytest.fail("planned before checking"))
    prompt = kwargs.pop("prompt", [1, 2, 3])
    with pytest.raises(ValueError, match=match):
        generate(tiny, prompt, method="auto", **kwargs)


@pytest.mark.parametrize("spec", ["self:inf", "self:1e400", "self:nan", "self:1.5", "self:-0.5"])
def test_a_self_draft_fraction_outside_0_1_is_refused_before_loading(spec):
    """``self:inf`` passed the check before loading and failed after it as an OverflowError traceback."""
    from mirrorsd.api import self_draft_depth

    with pytest.raises(ValueError, match="a fraction of them between 0 and 1"):
        self_draft_depth(spec)


def test_a_folder_with_a_gguf_beside_changed_safetensors_is_warned_about(tmp_path):
    """A fine-tune saved into a copy of a zoo folder loaded the old GGUF's q4 codes by default, silently (its logits
    45 away from the fine-tune's)."""
    import warnings

    from mirrorsd.api import default_format

    folder = tmp_path / "my-finetune"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(b"")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert default_format(str(folder), folder, "cpu", torch.float32) == ("q4", "int8x2")  # (a GGUF alone)
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.warns(UserWarning, match="model.gguf beside its safetensors.*weights='fp32'"):
        assert default_format(str(folder), folder, "cpu", torch.float32) == ("q4", "int8x2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (weights asked for: the advice was taken, nothing to warn about)
        default_format(str(folder), folder, "cpu", torch.float32, asked="fp32")


@requires_smollm2
def test_generation_ends_where_hf_and_llama_cpp_end_it(tmp_path):
    """Without a generation_config.json HF ends on the model config's eos ids (a Llama-3-style list), and a zoo model
    converted from a GGUF also ends on the special tokens llama.cpp ends on by their text (Qwen's GGUF names one EOS,
    so its converted config lost ``<|endoftext|>``: a raw or fill-in-the-middle completion ran on past it)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from mirrorsd import zoo
    from mirrorsd.api import end_ids

    source = zoo.resolve("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    assert end_ids(source, tokenizer) == {2}  # <|im_end|>, as its generation config says
    assert end_ids(source, tokenizer, converted=True) == {0, 2}  # and <|endoftext|>, as llama.cpp ends on it
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 7]}))
    assert end_ids(tmp_path, tokenizer) == {2, 7}
    shutil.copy(source / "generation_config.json", tmp_path)
    assert end_ids(tmp_path, tokenizer) == {2}  # a generation config, where there is one, is HF's word


@requires_smollm2
def test_a_stop_string_behind_a_run_of_special_tokens_is_found():
    """Special tokens decode to nothing, so a stop string may begin many tokens back; a long last token made the
    tail look long enough, and ``Hello`` + 20 ``<|im_start|>`` + ``====...`` ran past ``stop=["Hello="]``."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from mirrorsd import zoo
    from mirrorsd.api import GenerationStream
    from mirrorsd.decoding import GenerationStats

    tokenizer = AutoTokenizer.from_pretrained(zoo.resolve("smollm2-135m"), local_files_only=True)
    target = LoadedModel(model=None, tokenizer=tokenizer, name="smollm2-135m", eos_token_ids=frozenset({2}))
    ids = [*tokenizer("Hello", add_special_tokens=False)["input_ids"], *[1] * 20,
           *tokenizer("=" * 32, add_special_tokens=False)["input_ids"]]
    request = SimpleNamespace(max_new_tokens=100, stats=GenerationStats("ar"))
    s = GenerationStream(target, [1], ([t] for t in ids), request, ["Hello="], False)
    assert "".join(d.text for d in s.deltas()) == ""
    assert s.result.finish_reason == "stop" and s.result.text == ""


def test_speculation_is_refused_where_a_windows_rows_are_not_exact():
    """bfloat16 and float16 on a CPU go through PyTorch's GEMM, where a window's logits differ from one token's (0.38
    measured on SmolLM2 in bfloat16): sd and suffix changed greedy tokens. Refused, naming the way out; ar runs."""
    hf = tiny_hf("qwen2", layers=2, seed=1).to(torch.bfloat16)
    target = Transformer.from_hf(hf)
    for method, extra in (("sd", {"draft": target}), ("suffix", {})):
        with pytest.raises(ValueError, match=f"method '{method}' cannot be exact with bfloat16 weights on a CPU"):
            generate(target, [1, 2, 3], method=method, max_new_tokens=4, **extra)
    assert len(generate(target, [1, 2, 3], method="ar", max_new_tokens=4).token_ids) == 4


@requires_smollm2
def test_a_dtype_that_is_not_a_float_type_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of .*got torch.int8"):
        mirrorsd.load_model("smollm2-135m", dtype=torch.int8)


@requires_smollm2
def test_auto_in_bfloat16_on_a_cpu_runs_ar_without_planning(monkeypatch, capsys):
    """Only ar is exact there: auto planned, calibrated suffix and failed with a refusal of a method the user never
    named (and a saved plan's pick failed the same way)."""
    import mirrorsd.plans

    monkeypatch.setattr(mirrorsd.plans, "plan_for", lambda *args: pytest.fail("planned"))
    target = mirrorsd.load_model("smollm2-135m", dtype="bfloat16")
    got = generate(target, "Hi", method="auto", max_new_tokens=3)
    assert got.stats.method == "ar" and len(got.token_ids) == 3
    assert "bfloat16 on a CPU runs only ar exactly" in capsys.readouterr().err

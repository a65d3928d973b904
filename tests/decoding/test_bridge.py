"""A draft with a tokenizer of its own (``sd`` drafting through text): the byte views of the tokenizers, the
proposer's re-tokenization and cache, losslessness against ``ar``, and the errors around it."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from tokenizers import ByteLevelBPETokenizer, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import mirrorsd
from mirrorsd import Transformer
from mirrorsd.api import LoadedModel
from mirrorsd.decoding import bridge
from mirrorsd.decoding.bridge import ByteTokenizer, TokenBridge, complete_utf8
from mirrorsd.errors import OptionError
from tests.helpers import assert_same_or_near_tie, exact_pair_distribution, tiny_hf

TEXT = ("The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n"
        "Grüße aus Köln! 你好，世界。 Emoji: 🙂🚀 <|im_start|>user\nhello<|im_end|>\n")


@pytest.fixture(scope="module")
def toy_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE of its own (ids unrelated to SmolLM2's), with the ChatML specials."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT * 20, "hello world, the answer is " * 50], vocab_size=400, min_frequency=2,
                            special_tokens=["<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def toy_draft(toy_tokenizer) -> LoadedModel:
    """A random 2-layer draft on the toy tokenizer: it shares nothing with the target but the text."""
    model = Transformer.from_hf(tiny_hf(vocab=len(toy_tokenizer), layers=2, hidden=64, seed=3))
    return LoadedModel(model, toy_tokenizer, "toy", eos_token_ids=frozenset([toy_tokenizer.eos_token_id]))


@pytest.mark.parametrize(("data", "whole"), [
    (b"abc", 3), (b"", 0), ("é".encode(), 2), ("é".encode()[:1], 0), (b"a" + "你".encode()[:2], 1),
    ("🙂".encode()[:3], 0), ("🙂".encode(), 4), (b"x\x80", 2),  # a stray continuation byte stays (decoding replaces it)
])
def test_complete_utf8_stops_before_a_cut_character(data, whole):
    assert complete_utf8(data) == whole


def test_byte_tokenizer_gives_each_tokens_exact_bytes(toy_tokenizer):
    tok = ByteTokenizer(toy_tokenizer)
    ids = toy_tokenizer.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT.encode()
    assert tok.encode(TEXT.encode()) == ids
    assert tok.encode("ab🙂".encode()[:-1]) == tok.encode(b"ab")  # a cut character waits for its last bytes
    assert tok.encode(b"<|im_end|>") == [toy_tokenizer.eos_token_id]  # a special token written out is the token


def test_a_tokenizer_that_is_not_byte_level_is_refused():
    word = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ValueError, match="byte-level"):
        ByteTokenizer(PreTrainedTokenizerFast(tokenizer_object=word))


@pytest.fixture(scope="module")
def smol(smollm2) -> LoadedModel:
    return smollm2[0]


def test_text_round_trips_between_two_vocabularies(smol, toy_tokenizer):
    b = TokenBridge(smol.tokenizer, toy_tokenizer)
    ids = smol.tokenizer.encode(TEXT, add_special_tokens=False)
    assert b.draft.decode(b.draft.encode(b.target.decode(ids))) == TEXT.encode()
    assert b.target.encode(b.target.decode(ids)) == ids


CHAT = [{"role": "user", "content": "List the first five prime numbers and explain why 9 is not prime."}]


@pytest.mark.parametrize("kwargs", [
    {},
    {"temperature": 0.8, "seed": 3},
    {"suffix_match": 0, "confidence": 0.0, "gamma": 3, "draft_context": 8},
], ids=["greedy", "seeded", "no-suffix-short-context"])
def test_a_draft_with_another_tokenizer_gives_ar_tokens(smol, toy_draft, kwargs):
    sampling = {k: v for k, v in kwargs.items() if k in ("temperature", "top_p", "seed")}
    want = mirrorsd.generate(smol, CHAT, method="ar", max_new_tokens=40, **sampling)
    got = mirrorsd.generate(smol, CHAT, method="sd", draft=toy_draft, max_new_tokens=40, **kwargs)
    assert got.stats.draft_forwards > 0  # the toy draft really drafted
    if "temperature" in kwargs:
        assert got.token_ids == want.token_ids
    else:
        assert_same_or_near_tie(smol.model, want.prompt_ids, got.token_ids, want.token_ids)


def test_the_target_as_its_own_bridged_draft_is_accepted_throughout(smol, monkeypatch):
    """With the same model and tokenizer on both sides the bridge is an identity, so every drafted token should be
    the target's: a cache fed the wrong tokens or positions would show as rejections."""
    monkeypatch.setattr(mirrorsd.api, "shares_tokenizer", lambda target, draft: False)
    want = mirrorsd.generate(smol, CHAT, method="ar", max_new_tokens=48)
    got = mirrorsd.generate(smol, CHAT, method="sd", draft=smol, max_new_tokens=48, suffix_match=0, gamma=4,
                            confidence=0.0, draft_context=0)
    assert_same_or_near_tie(smol.model, want.prompt_ids, got.token_ids, want.token_ids)
    assert got.stats.mean_accepted_length > 4.0, got.stats.step_log
    # after its prompt the draft is fed only what it lacks: the bonus token and the re-tokenized tail
    fed_later = [step["fed"] for step in got.stats.step_log[1:] if "fed" in step]
    assert fed_later and max(fed_later) <= bridge.RETOKENIZE + 1, got.stats.step_log


def test_a_bridged_draft_with_a_reduced_vocabulary_stays_lossless(smol, monkeypatch):
    """``draft_vocab`` restricts a bridged draft's head to its own tokenizer's most frequent ids (SmolLM2's table
    ships): it proposes only those ids' text, and the target still decides every token."""
    from mirrorsd.draft_vocab import load_table

    monkeypatch.setattr(mirrorsd.api, "shares_tokenizer", lambda target, draft: False)
    allowed = set(load_table(smol.model.config.vocab_size)[:8192].tolist())
    drafted: list[int] = []
    propose = bridge.BridgedProposer.propose

    def spy(self, state):
        result = propose(self, state)
        if result.forwards > 1:  # the draft was fed every token it drafted but the last
            drafted.extend(self.cached[1 - result.forwards:])
        return result

    monkeypatch.setattr(bridge.BridgedProposer, "propose", spy)
    want = mirrorsd.generate(smol, CHAT, method="ar", max_new_tokens=32)
    got = mirrorsd.generate(smol, CHAT, method="sd", draft=smol, max_new_tokens=32, suffix_match=0, gamma=4,
                            confidence=0.0, draft_context=0, draft_vocab=8192)
    assert_same_or_near_tie(smol.model, want.prompt_ids, got.token_ids, want.token_ids)
    assert got.stats.mean_accepted_length > 1.5, got.stats.step_log
    assert drafted and set(drafted) <= allowed


def test_only_methods_that_draft_through_text_take_another_tokenizer(smol, toy_draft):
    with pytest.raises(ValueError, match="tokenizer mismatch.*use sd"):
        mirrorsd.generate(smol, "hi", method="mirror", draft=toy_draft, max_new_tokens=4)
    with pytest.raises(OptionError, match="schedule"):
        mirrorsd.generate(smol, "hi", method="sd", draft=toy_draft, max_new_tokens=4, schedule="heuristic")


def _permuted(tokenizer: PreTrainedTokenizerFast, hf_model, seed: int) -> LoadedModel:
    """The same tokenizer and model with every token id moved (a permutation): the text segmentation and the
    distributions are the target's, the ids are not, so only the bridge can use it as a draft."""
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    n = len(tokenizer)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    data["model"]["vocab"] = {token: int(perm[i]) for token, i in data["model"]["vocab"].items()}
    for added in data["added_tokens"]:
        added["id"] = int(perm[added["id"]])
    moved = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)),
                                    eos_token=tokenizer.eos_token)
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for matrix in (model.model.embed_tokens.weight, model.lm_head.weight):
            matrix[perm] = matrix.clone()
    return LoadedModel(Transformer.from_hf(model), moved, "permuted", eos_token_ids=frozenset([moved.eos_token_id]))


def test_rejection_sampling_through_the_bridge_keeps_the_target_distribution(toy_tokenizer):
    """Joint law of the first two tokens under ``acceptance="rejection"`` at temperature 1 with windows of up to 3,
    against P(x1, x2 | prompt) enumerated from the target. The draft is the target with its ids permuted, so its
    greedy guesses are the target's likeliest tokens and both the acceptance and the residual branch are taken."""
    hf = tiny_hf(vocab=len(toy_tokenizer), layers=2, hidden=64, seed=5, std=0.5)
    target = LoadedModel(Transformer.from_hf(hf), toy_tokenizer, "toy",
                         eos_token_ids=frozenset([toy_tokenizer.eos_token_id]))
    draft = _permuted(toy_tokenizer, hf, seed=6)
    prompt, n = toy_tokenizer.encode("hello world", add_special_tokens=False), 1500
    exact = exact_pair_distribution(target.model, prompt, 1.0).flatten()
    vocab = len(toy_tokenizer)
    counts = torch.zeros(vocab * vocab)
    accepted = Counter()
    for seed in range(n):
        g = mirrorsd.generate(target, prompt, method="sd", draft=draft, temperature=1.0, seed=seed, max_new_tokens=4,
                              acceptance="rejection", gamma=3, suffix_match=0, confidence=0.0)
        ids = (g.token_ids + [toy_tokenizer.eos_token_id] * 2)[:2]  # (an EOS first ends the answer)
        counts[ids[0] * vocab + ids[1]] += 1
        accepted[g.stats.accepted[0]] += 1
    assert accepted[0] and sum(accepted.values()) > accepted[0], accepted  # both branches were taken
    keep = exact * n >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([exact[keep] * n, (exact[~keep] * n).sum()[None]])
    assert keep.sum() >= 5 and chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3


def test_the_drafts_text_stays_the_committed_text_through_split_characters(smol, toy_tokenizer):
    """SmolLM2 writes a CJK character or an emoji as several byte tokens; re-tokenizing the tail from the end of one
    of them started inside a character, which decoded to U+FFFD and drifted the offsets (the draft read
    '你��，����' and dropped later English letters). Fed one target token at a time, the draft's tokens now always
    spell the committed text up to its last whole character; and the target stopped inside a character drafts
    nothing (its tokens would begin that character again, none acceptable)."""
    from types import SimpleNamespace

    b = TokenBridge(toy_tokenizer, smol.tokenizer)
    proposer = bridge.BridgedProposer(smol.model, b, len(toy_tokenizer), 4)
    ids = toy_tokenizer.encode("你好，世界。今天天气很好，我们去公园散步吧。Then 🦜 flies.", add_special_tokens=False)
    cache = smol.model.new_cache()
    for n in range(1, len(ids) + 1):
        state = SimpleNamespace(tokens=ids[:n], draft_cache=cache, room=8)
        proposer._sync(state)
        text = b.target.decode(ids[:n])
        assert b.draft.decode(proposer.ids) == text[:complete_utf8(text)], n
    proposer = bridge.BridgedProposer(smol.model, b, len(toy_tokenizer), 4)
    cut = next(n for n in range(1, len(ids)) if complete_utf8(b.target.decode(ids[:n])) < len(b.target.decode(ids[:n])))
    assert not proposer.propose(SimpleNamespace(tokens=ids[:cut], draft_cache=smol.model.new_cache(), room=8)).tokens


def test_a_prompt_ending_inside_a_character_waits_for_its_last_bytes(smol, toy_draft):
    """A prompt of one byte of a 3-byte character has no text the draft could read yet: the first step drafts
    nothing, and decoding goes on as ``ar``."""
    lead = ByteTokenizer(smol.tokenizer).bytes.index("你".encode()[:1])
    want = mirrorsd.generate(smol, [lead], method="ar", max_new_tokens=6)
    got = mirrorsd.generate(smol, [lead], method="sd", draft=toy_draft, max_new_tokens=6, suffix_match=0)
    assert got.stats.drafted[0] == 0
    assert_same_or_near_tie(smol.model, want.prompt_ids, got.token_ids, want.token_ids)


def test_a_server_with_a_draft_of_another_tokenizer(smol, toy_draft):
    """`mirrorsd serve --draft` with such a draft answers ``sd`` requests as ``generate`` does, and refuses the
    methods that need the target's token ids with a 400, not a failed stream."""
    import openai

    from mirrorsd.server import ServerConfig, create_app
    from tests.helpers import LiveServer

    server = LiveServer(create_app(smol, toy_draft, ServerConfig("smollm2-135m", method="sd")))
    try:
        messages = [{"role": "user", "content": "Name two planets."}]
        want = mirrorsd.generate(smol, messages, method="sd", draft=toy_draft, max_new_tokens=16)
        got = server.client().chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=16,
                                                      temperature=0)
        assert got.choices[0].message.content == want.text
        assert got.usage.model_extra["drafted_tokens"] > 0
        with pytest.raises(openai.BadRequestError, match="tokenizer mismatch.*use sd"):
            server.client().chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=4,
                                                    extra_body={"mirrorsd": {"method": "mirror"}})
    finally:
        server.stop()


def test_the_bench_runs_sd_through_text_and_refuses_what_cannot(smol, toy_draft, monkeypatch, tmp_path):
    """`mirrorsd bench --draft` with such a draft times ``sd`` (lossless against ``ar``) and refuses, before any
    question runs, the methods and the probe that read the target's token ids from the draft; ``auto`` plans
    without it, as ``generate``'s does."""
    from mirrorsd.bench import runner
    from mirrorsd.bench.runner import Bench, BenchConfig, parse_methods

    models = {"target": smol, "toy": toy_draft}
    monkeypatch.setattr(runner, "load_model", lambda name, **kwargs: models[name])
    suite = tmp_path / "suite.jsonl"
    suite.write_text('{"question_id": 1, "category": "qa", "turns": ["Name two planets."]}\n')
    for methods, probe, refused in (("ar,mirror", False, "mirror"), ("ar,sd", True, "the probe")):
        with pytest.raises(ValueError, match=f"tokenizer of its own.*not {refused}"):
            Bench(BenchConfig("target", "toy", parse_methods(methods), suite=str(suite), probe=probe), progress=False)
    plans: list[object] = []
    monkeypatch.setattr(runner, "planned", lambda target, draft, options: plans.append(draft) or ("ar", {}, None))
    auto = Bench(BenchConfig("target", "toy", parse_methods("ar,auto"), suite=str(suite)), progress=False)
    assert plans == [None] and auto.draft is None and not auto.config.probe
    assert any("tokenizer of its own" in note for note in auto.notes)
    monkeypatch.undo()
    monkeypatch.setattr(runner, "load_model", lambda name, **kwargs: models[name])
    bench = Bench(BenchConfig("target", "toy", parse_methods("ar,sd"), suite=str(suite), max_new_tokens=12, runs=1,
                              warmup=0, probe=False, predict=False), progress=False)
    summary = bench.run()["summary"]
    assert summary["sd"]["lossless"]["checked"] == summary["sd"]["lossless"]["equal"] == 1

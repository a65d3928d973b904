"""``mirrorsd train-draft`` and tuned drafts: the deltas merged at load are the trained adapter's, labels are the
target's own tokens, the cache resumes, and a tuned draft keeps every method lossless."""

from __future__ import annotations

import itertools

import pytest
import torch

import mirrorsd
from mirrorsd import Transformer, generate, train_draft
from mirrorsd import tuned_drafts as td
from mirrorsd.loading import _is_projection
from mirrorsd.quant import quantize_groups, quantize_q8
from mirrorsd.runtime.tensor_parallel import run_tracks
from mirrorsd.train_draft import DraftCache, DraftLoRA, cached_labels, soft_loss, target_labels, train
from mirrorsd.train_streams import cache_states
from mirrorsd.training import HELD_OUT, Chunk, shard_paths
from tests.helpers import requires_smollm2, tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")


def _folder(hf, path) -> str:
    hf.save_pretrained(path)
    return str(path)


def _random_lora(model: Transformer, layers: int, rank: int = 4, seed: int = 0) -> DraftLoRA:
    lora = DraftLoRA(model, layers, rank, 2 * rank)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.trainable():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return lora


def _tuned(tmp_path, hf, layers: int = 2) -> tuple[str, DraftLoRA, Transformer]:
    """A tuned-draft folder over ``hf`` saved as an HF folder, with random deltas, and the adapted dense model."""
    base = _folder(hf, tmp_path / "base")
    dense = Transformer.from_pretrained(base, weights="fp32", linear="dense")
    lora = _random_lora(dense, layers)
    cfg = dense.config
    td.TuneConfig(base=base, target="a target", layers=layers, rank=4, alpha=8, hidden_size=cfg.hidden_size,
                  n_layers=cfg.n_layers, vocab_size=cfg.vocab_size).save(tmp_path / "tuned", lora.state())
    return str(tmp_path / "tuned"), lora, dense


def _load(tuned: str, weights: str) -> Transformer:
    """A tuned tiny draft as load_model builds it (the tiny folders have no tokenizer for load_model itself)."""
    config = td.load_config(td.resolve(tuned))
    return Transformer.from_pretrained(config.base, weights=weights, deltas=td.deltas(tuned))


def test_merged_deltas_give_the_trained_adapters_logits(tmp_path):
    tuned, lora, dense = _tuned(tmp_path, tiny_hf(layers=3, seed=3))
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = dense(ids)
        merged = _load(tuned, "fp32")
        assert torch.allclose(merged(ids), want, atol=2e-3, rtol=1e-3)  # fp16 file, fp32 merge
    assert merged.config.n_layers == 3
    # Quantized weights: merged before quantization, exactly as quantizing the merged fp32 weights.
    deltas = td.deltas(tuned)
    assert sorted(deltas) == sorted(td.load_config(td.resolve(tuned)).weight_names())
    hf = tiny_hf(layers=3, seed=3)
    state = {k.removeprefix("model."): v.detach() for k, v in hf.state_dict().items()}
    state = {k: quantize_q8(v + deltas.get(k, 0)) if _is_projection(k) else v for k, v in state.items()}
    with torch.no_grad():
        assert torch.equal(_load(tuned, "q8")(ids),
                           Transformer.from_state(hf.config, state)(ids))


def test_merge_requantizes_codes_at_their_own_width_and_refuses_other_shapes():
    weight = torch.randn(8, 64)
    delta = torch.randn(8, 64) * 0.01
    q8 = quantize_q8(weight)
    merged = td.merge(q8, delta)
    assert (merged.bits, merged.group) == (8, 32)
    assert torch.equal(merged.codes, quantize_groups(q8.dequantize() + delta, 8).codes)
    q4 = quantize_groups(weight, 4, 16)
    merged = td.merge(q4, delta)
    assert (merged.bits, merged.group, int(merged.codes.max()) < 16) == (4, 16, True)
    assert (merged.dequantize() - (q4.dequantize() + delta)).abs().max() <= merged.scales.max() / 2 + 1e-6
    assert torch.equal(td.merge(weight, delta), weight + delta)
    for other in (weight, q8):
        with pytest.raises(ValueError, match="shape"):
            td.merge(other, torch.zeros(4, 64))


def test_resolve_names_only_tuned_folders(tmp_path):
    tuned, _, _ = _tuned(tmp_path, tiny_hf(layers=3, seed=3))
    assert td.resolve(tuned) == tmp_path / "tuned"
    assert td.resolve(tmp_path / "base") is None and td.resolve("smollm2-135m") is None


@pytest.mark.parametrize("method", ["sd", "mirror"])
def test_a_tuned_draft_keeps_speculation_equal_to_ar(tmp_path, method):
    target = Transformer.from_hf(tiny_hf(layers=4, seed=1))
    tuned, _, _ = _tuned(tmp_path, tiny_hf(layers=2, seed=2), layers=1)
    draft = _load(tuned, "fp32")
    prompt = [1, 5, 9, 12]
    want = generate(target, prompt, max_new_tokens=24, method="ar").token_ids
    got = generate(target, prompt, max_new_tokens=24, method=method, draft=draft).token_ids
    assert got == want


def _tokenizer(text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
    return {"input_ids": [ord(c) % 64 for c in text]}


def test_labels_are_the_targets_tokens_from_it_or_its_state_cache(tmp_path):
    target = Transformer.from_hf(tiny_hf(layers=4, seed=1))
    gen = torch.Generator().manual_seed(1)
    chunks = [Chunk(torch.randint(0, 64, (12,), generator=gen), 1) for _ in range(3)]
    computed = target_labels(target, top_k=5)(tmp_path / HELD_OUT, chunks)
    with torch.no_grad():
        logits = target(chunks[1].ids[None])[0]
    assert computed[1]["labels"].tolist() == logits.argmax(-1).tolist()
    logp, ids = torch.log_softmax(logits, -1).topk(5, -1)
    assert torch.equal(computed[1]["top_ids"], ids.int())
    assert torch.allclose(computed[1]["top_logp"].float(), logp, atol=1e-2)  # stored in fp16
    cache_states(target, 2, [], chunks, tmp_path, progress=False)  # the target's train-streams cache
    read = cached_labels(tmp_path)(tmp_path / HELD_OUT, chunks)
    assert all(torch.equal(a["labels"], b["labels"]) and a.keys() == {"labels"}
               for a, b in zip(read, computed, strict=True))
    # The top-k from a streams cache: the target's layers above the cached ones, over the cached (bf16) states.
    with pytest.raises(ValueError, match="no top-5"):
        cached_labels(tmp_path, None, 5)(tmp_path / HELD_OUT, chunks)
    topped = cached_labels(tmp_path, target, 5)(tmp_path / HELD_OUT, chunks)
    for a, b in zip(topped, computed, strict=True):
        assert torch.equal(a["labels"], b["labels"])
        assert (a["top_ids"] == b["top_ids"]).float().mean() > 0.9
        assert torch.allclose(a["top_logp"].float(), b["top_logp"].float(), atol=0.1)
    other = [Chunk(c.ids.flip(0), 1) for c in chunks]
    with pytest.raises(ValueError, match="other windows"):
        cached_labels(tmp_path)(tmp_path / HELD_OUT, other)
    with pytest.raises(FileNotFoundError, match="no shard-00000"):
        cached_labels(tmp_path)(tmp_path / "shard-00000.safetensors", chunks)


def test_the_soft_loss_is_least_at_the_targets_bucketed_distribution():
    """The top-k buckets and the rest partition the vocabulary: at the target's own logits the gradient vanishes,
    anywhere else the loss is higher, and a top token outside the training vocabulary counts in the rest."""
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(6, 20, generator=gen) * 3
    logp, top = torch.log_softmax(teacher, -1).topk(4, -1)
    keep = torch.tensor([True, True, False, True, True, True])
    at = teacher.clone().requires_grad_()
    least = soft_loss(at, top, logp, keep)
    least.backward()
    assert at.grad.abs().max() < 1e-5
    for seed in range(3):
        other = teacher + torch.randn(6, 20, generator=torch.Generator().manual_seed(seed + 1))
        assert soft_loss(other, top, logp, keep) > least
    # Its value is the bucketed cross-entropy, written out.
    p = logp.exp()
    rest = 1 - p.sum(1)
    q = torch.softmax(teacher, -1)
    want = -(p * q.gather(1, top).log()).sum(1) - rest * (1 - q.gather(1, top).sum(1)).log()
    assert torch.allclose(least, want[keep].mean(), atol=1e-5)
    # Token outside the vocabulary subset (index < 0): its probability joins the rest bucket.
    outside = top.clone()
    outside[:, 1] = -100
    p2 = torch.where(outside >= 0, p, 0.0)
    inside = outside.clamp(min=0)
    q_in = torch.where(outside >= 0, q.gather(1, inside), 0.0)
    want = -(p2 * q_in.clamp(min=1e-30).log()).sum(1) - (1 - p2.sum(1)) * (1 - q_in.sum(1)).log()
    assert torch.allclose(soft_loss(teacher, outside, logp, keep), want[keep].mean(), atol=1e-5)


def test_training_raises_agreement_with_the_target_and_resumes(tmp_path):
    target = Transformer.from_hf(tiny_hf(layers=4, seed=1))
    draft_hf = tiny_hf(layers=3, seed=2)
    text = tmp_path / "corpus.txt"
    text.write_text("".join(chr(65 + (i * 7) % 29) for i in range(2400)))
    common = dict(model_name="draft", target_name="target", decode_format="fp32", cache=tmp_path / "cache",
                  layers=2, rank=8, chunks=24, seq_len=32, lr=1e-2, held_out=2, vocab=0, eval_every=60,
                  progress=False)
    draft = Transformer.from_hf(draft_hf)

    def tower() -> Transformer:
        return Transformer.from_hf(draft_hf, linear="dense")

    with pytest.raises(ValueError, match="dense"):
        DraftLoRA(Transformer.from_hf(draft_hf), 1, 4, 8)
    summary = train(tower(), draft, target, _tokenizer, [str(text)], tmp_path / "out",
                    steps=60, **common)
    before, after = summary["held_out_agreement_before"], summary["held_out_agreement_after"]
    assert after > before + 0.1, (before, after)
    shards = shard_paths(tmp_path / "cache", 24, 32)
    assert all(p.exists() for p in shards) and len(DraftCache(shards, "cpu")) == 24
    tuned = td.resolve(tmp_path / "out")
    assert td.load_config(tuned).recipe["held_out_agreement_after"] == after
    # The checkpoint resumes: asking for more steps continues from step 60, not from scratch.
    again = train(tower(), draft, target, _tokenizer, [str(text)], tmp_path / "out",
                  steps=70, **common)
    assert [p["step"] for p in again["curve"]] == [0, 60, 70]
    with pytest.raises(ValueError, match="other settings"):
        train(tower(), draft, target, _tokenizer, [str(text)], tmp_path / "out2",
              steps=10, **(common | {"seq_len": 16}))


def test_chat_answers_are_the_targets_own(tmp_path, monkeypatch):
    """``--data chat-answers`` gave the draft its own answers to learn (and a target cache built on the target's
    answers was refused as other windows)."""
    from mirrorsd import training

    asked = []

    def answers(model: str, tokenizer) -> list[str]:
        asked.append(model)
        return ["".join(chr(65 + (i * 7) % 29) for i in range(1200))]

    monkeypatch.setattr(training, "chat_answer_texts", answers)
    draft_hf = tiny_hf(layers=3, seed=2)
    train(Transformer.from_hf(draft_hf, linear="dense"), Transformer.from_hf(draft_hf),
          Transformer.from_hf(tiny_hf(layers=4, seed=1)), _tokenizer, ["chat-answers"], tmp_path / "out",
          model_name="the-draft", target_name="the-target", decode_format="fp32", layers=2, rank=4, chunks=8,
          seq_len=32, held_out=2, steps=1, vocab=0, eval_every=1, progress=False)
    assert asked == ["the-target"]


def test_training_on_the_targets_top_k_caches_it_and_raises_agreement(tmp_path):
    """--soft-top: the cache keeps the target's top-k, the loss is the bucketed distribution's, and the curve says
    how sure the draft is and how often it is right when sure."""
    target = Transformer.from_hf(tiny_hf(layers=4, seed=1))
    draft_hf = tiny_hf(layers=3, seed=2)
    text = tmp_path / "corpus.txt"
    text.write_text("".join(chr(65 + (i * 7) % 29) for i in range(2400)))
    summary = train(Transformer.from_hf(draft_hf, linear="dense"), Transformer.from_hf(draft_hf), target, _tokenizer,
                    [str(text)], tmp_path / "out", model_name="draft", target_name="target", decode_format="fp32",
                    layers=2, rank=8, chunks=24, seq_len=32, lr=1e-2, held_out=2, vocab=0, eval_every=60,
                    steps=60, soft_top=4, progress=False)
    assert summary["held_out_agreement_after"] > summary["held_out_agreement_before"] + 0.1
    assert "top 4 tokens" in summary["labels"]
    assert all(0 <= point["sure"] <= 1 and 0 <= point["sure_agreement"] <= 1 for point in summary["curve"])
    item = DraftCache(shard_paths(tmp_path / "out" / "cache", 24, 32), "cpu")[0]
    assert item.top_ids.shape == (32, 4) and item.top_logp.shape == (32, 4)
    assert torch.equal(item.top_ids[:, 0], item.labels)  # the likeliest is the argmax label


def test_the_soft_target_trains_positions_whose_argmax_lies_outside_the_vocabulary_subset(tmp_path, monkeypatch):
    """With --vocab, argmax labels outside the subset are skipped; the soft target trains them through its rest
    bucket, so every written position counts whatever the subset."""
    target = Transformer.from_hf(tiny_hf(layers=4, seed=1))
    draft_hf = tiny_hf(layers=3, seed=2)
    text = tmp_path / "corpus.txt"
    text.write_text("".join(chr(65 + (i * 7) % 29) for i in range(1200)))
    monkeypatch.setattr(train_draft, "load_table", torch.arange)  # the subset: the first ids

    def tokens(vocab: int, soft_top: int) -> int:
        return train(Transformer.from_hf(draft_hf, linear="dense"), Transformer.from_hf(draft_hf), target,
                     _tokenizer, [str(text)], tmp_path / f"out-{vocab}-{soft_top}", model_name="draft",
                     target_name="target", decode_format="fp32", layers=2, rank=8, chunks=8, seq_len=32, lr=1e-2,
                     held_out=2, vocab=vocab, eval_every=4, steps=4, soft_top=soft_top, progress=False)["train_tokens"]

    assert 0 < tokens(32, 0) < tokens(0, 0) == tokens(32, 4) == tokens(0, 4)


def test_training_in_the_spd_form_caches_trains_and_saves_that_form(tmp_path):
    """--spd-tracks 2: the cache holds the lower segment's output as the two tracks compute it, the top segment
    learns in that form, and the folder says which form it was trained for."""
    target = Transformer.from_hf(tiny_hf(layers=4, seed=1))
    draft_hf = tiny_hf(layers=4, seed=2)
    text = tmp_path / "corpus.txt"
    text.write_text("".join(chr(65 + (i * 7) % 29) for i in range(2400)))
    common = dict(model_name="draft", target_name="target", decode_format="fp32", cache=tmp_path / "cache",
                  rank=8, chunks=24, seq_len=32, lr=1e-2, held_out=2, vocab=0, eval_every=60, spd_tracks=2,
                  progress=False)
    draft = Transformer.from_hf(draft_hf)

    def tower() -> Transformer:
        return Transformer.from_hf(draft_hf, linear="dense")

    with pytest.raises(ValueError, match=r"re-align only at layers \[0, 2, 4\]"):
        train(tower(), draft, target, _tokenizer, [str(text)], tmp_path / "bad", layers=1, steps=1, **common)
    summary = train(tower(), draft, target, _tokenizer, [str(text)], tmp_path / "out", layers=2, steps=60,
                    **common)
    assert summary["held_out_agreement_after"] > summary["held_out_agreement_before"] + 0.1, summary
    assert td.load_config(td.resolve(tmp_path / "out")).spd_tracks == 2
    dense = tower()
    item = DraftCache([tmp_path / "cache" / HELD_OUT], "cpu")[0]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "cache" / HELD_OUT), framework="pt") as f:
        held_ids = f.get_tensor("ids")[0].long()
    positions = torch.arange(held_ids.shape[0])[None]
    with torch.no_grad():
        spd = run_tracks(dense, dense.embed(held_ids[None]), positions, 0, 2, 2)[0].to(torch.bfloat16)
        whole = dense.run_layers(dense.embed(held_ids[None]), positions, None, None, 0, 2)[0].to(torch.bfloat16)
    assert torch.equal(item.hidden, spd) and not torch.equal(item.hidden, whole)
    # Another form over the same windows reads the labels from this cache: no target needed.
    common |= {"cache": tmp_path / "cache4", "target_cache": tmp_path / "cache"}
    with pytest.raises(ValueError, match="holds target's tokens, not bigger's"):  # (silently distilled toward it)
        train(tower(), draft, None, _tokenizer, [str(text)], tmp_path / "all", layers=4, steps=1,
              **common | {"target_name": "bigger"})
    train(tower(), draft, None, _tokenizer, [str(text)], tmp_path / "all", layers=4, steps=1, **common)
    assert torch.equal(DraftCache([tmp_path / "cache4" / HELD_OUT], "cpu")[0].labels, item.labels)


def test_a_draft_run_in_another_form_than_it_was_trained_in_is_warned_about(tmp_path):
    from argparse import Namespace

    from rich.console import Console

    from mirrorsd.cli.generate import _warn_draft_form

    hf = tiny_hf(layers=4, seed=3)
    dense = Transformer.from_hf(hf, linear="dense")
    cfg = dense.config
    td.TuneConfig(base=_folder(hf, tmp_path / "base"), target="t", layers=2, rank=4, alpha=8,
                  hidden_size=cfg.hidden_size, n_layers=cfg.n_layers, vocab_size=cfg.vocab_size,
                  spd_tracks=2).save(tmp_path / "tuned", _random_lora(dense, 2).state())
    said = []
    for draft_tp, syncs in ((1, "spd"), (2, "layer"), (2, "spd")):
        console = Console(record=True, width=300)
        _warn_draft_form(Namespace(draft=str(tmp_path / "tuned"), draft_syncs=syncs), draft_tp, console)
        said.append(console.export_text())
    assert "trained in the spd form over 2 tracks and runs whole" in said[0]
    assert "runs whole" in said[1] and said[2] == ""
    _warn_draft_form(Namespace(draft="qwen2.5-coder-0.5b", draft_syncs="spd"), 1, Console(record=True))  # no folder


@requires_smollm2
def test_a_tuned_smollm2_draft_keeps_sd_equal_to_ar_on_real_weights(smollm2, tmp_path):
    """SmolLM2 drafting for itself with random deltas on its top layers (any draft weights are legal): the output is
    still the target's, token for token, as ar and HF transformers give it."""
    ours, hf = smollm2
    dense = mirrorsd.load_model("smollm2-135m", weights="fp32", linear="dense", progress=False).model
    cfg = dense.config
    lora = _random_lora(dense, 2)
    td.TuneConfig(base="smollm2-135m", target="smollm2-135m", layers=2, rank=4, alpha=8, hidden_size=cfg.hidden_size,
                  n_layers=cfg.n_layers, vocab_size=cfg.vocab_size).save(tmp_path, lora.state())
    draft = mirrorsd.load_model(tmp_path, progress=False)
    assert draft.weights == "q4"
    prompt = ours.tokenizer("def fibonacci(n):", add_special_tokens=False)["input_ids"]
    want = generate(ours.model, prompt, max_new_tokens=24, method="ar").token_ids
    got = generate(ours.model, prompt, max_new_tokens=24, method="sd", draft=draft.model).token_ids
    assert got == want
    with torch.no_grad():
        hf_ids = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    assert got == hf_ids


def test_distilled_documents_mark_the_answers_and_the_loss_covers_only_them():
    from mirrorsd.distill.engine import records
    from mirrorsd.train_draft import DraftItem, loss_labels
    from mirrorsd.training import DISTILL_RECORDS, distill_documents, make_chunks
    from tests.helpers import REPO

    folder = REPO / "data" / "distill" / "qwen2.5-coder-1.5b"
    first = distill_documents(folder)[0]
    rows, marks, ids_seen = list(itertools.islice(records(folder), 2 * DISTILL_RECORDS)), [], []
    kept = 0
    for k, (ids, answer_from, _) in enumerate(rows):
        if k + 1 < len(rows) and len(rows[k + 1][0]) > len(ids) and rows[k + 1][0][:len(ids)].tolist() == ids.tolist():
            continue  # the next turn's record holds this one whole (its marks below cover it)
        earlier = [r for r in rows[:k] if len(r[0]) < len(ids) and ids[:len(r[0])].tolist() == r[0].tolist()]
        mark = [False] * answer_from + [True] * (len(ids) - answer_from)
        for e_ids, e_from, _ in earlier:  # the earlier turns' answers stay the model's
            mark[e_from:len(e_ids)] = [True] * (len(e_ids) - e_from)
        marks += mark
        ids_seen += ids.tolist()
        kept += 1
        if kept == DISTILL_RECORDS:
            break
    assert first == ids_seen and first.answer == marks and 0 < sum(marks) < len(marks)
    chunk = make_chunks(None, [first], 64, 1, seed=0)[0]
    start = next(i for i in range(0, len(first) - 63, 64) if first[i:i + 64] == chunk.ids.tolist())
    assert chunk.answer.tolist() == marks[start:start + 64]
    # Position t is trained on when token t + 1 was written by the target.
    answer = torch.tensor([False, False, True, True, False, True])
    item = DraftItem(torch.zeros(6, 4), torch.arange(10, 16), 1, answer)
    assert loss_labels(item, True).tolist() == [-100, 11, 12, -100, 14, 15]
    assert loss_labels(item, False).tolist() == [10, 11, 12, 13, 14, 15]


def test_a_cache_labelled_by_a_zoo_name_serves_the_same_model_named_by_its_folder(tmp_path, monkeypatch):
    """`--target qwen2.5-coder-1.5b` and `--target ~/.cache/mirrorsd/qwen2.5-coder-1.5b` are one model: a cache built
    under either name serves the other; a different folder is still refused."""
    import json

    from mirrorsd import zoo

    folder = tmp_path / "models" / "qwen2.5-coder-1.5b"
    folder.mkdir(parents=True)
    (tmp_path / "other").mkdir()
    monkeypatch.setattr(zoo, "cache_dir", lambda: tmp_path / "models")
    cache = tmp_path / "cache"
    cache.mkdir()
    for labeller, asked in (("qwen2.5-coder-1.5b", str(folder)), (str(folder), "qwen2.5-coder-1.5b")):
        (cache / train_draft.CACHE_META).write_text(json.dumps({"target": labeller}))
        train_draft.check_labeller(cache, asked)
    with pytest.raises(ValueError, match="not .*other's tokens|tokens, not"):
        train_draft.check_labeller(cache, str(tmp_path / "other"))

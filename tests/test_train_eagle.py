"""``mirrorsd train-eagle``: the training-time-test unroll computes what drafting step by step computes, and
training raises held-out chain acceptance and resumes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mirrorsd import Transformer, generate
from mirrorsd.decoding.eagle.head import EagleHead, feature_layers, rotary
from mirrorsd.train_eagle import FeatureCache, target_features, train, unroll
from mirrorsd.training import HELD_OUT, Chunk
from tests.helpers import tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")


def _tokenizer(text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
    return {"input_ids": [ord(c) % 64 for c in text]}


def _drafted(head: EagleHead, target: Transformer, features: torch.Tensor, ids: torch.Tensor, start: int,
             depth: int) -> list[torch.Tensor]:
    """Drafting after position ``start``, one row at a time with a growing key list: rows 0..start from the
    target's features, then the head's own states fed back."""
    keys, values = [], []

    def row(token: int, feature: torch.Tensor, position: int) -> torch.Tensor:
        x = head.join(target.embed(torch.tensor([token])), feature[None])
        cos, sin = (c[None] for c in target.rope(torch.tensor([position])))
        q, k, v = head.qkv(x, cos, sin)
        keys.append(k)
        values.append(v)
        attended = F.scaled_dot_product_attention(q, torch.cat(keys, 1), torch.cat(values, 1), enable_gqa=True)
        return head.finish(x, attended)[0]

    fused = head.fc3(features.to(head.fc3.weight.dtype))
    for t in range(start):
        row(int(ids[t + 1]), fused[t], t)
    states, feature = [], fused[start]
    for j in range(depth):
        feature = row(int(ids[start + 1 + j]), feature, start + j)
        states.append(feature)
    return states


def test_the_unroll_is_what_drafting_computes():
    target = Transformer.from_hf(tiny_hf("qwen2", layers=8, seed=1, attention_bias=True))
    assert feature_layers(8) == (2, 4, 5)
    ids = torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(0))
    item = target_features(target, Chunk(ids, 1))
    assert item["features"].shape == (24, 3 * 64) and item["labels"].shape == (24,)
    torch.manual_seed(0)
    head = EagleHead(target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # off the identity-like start, so every path matters
        # In float64: the two orders of the same sums then agree to ~1e-14, where float32's reorderings reached 2e-4
        # on an AVX-512 host (the batched and the one-row attention accumulate differently).
        head.double()
        states = unroll(head, target, item["features"], ids, 3)
        for start in (0, 5, 19):
            for j, want in enumerate(_drafted(head, target, item["features"], ids, start, 3)):
                assert states[j].dtype == want.dtype == torch.float64
                torch.testing.assert_close(states[j][start], want, rtol=0, atol=1e-9)


def test_rope_rotates_pairs_of_halves():
    x = torch.randn(2, 3, 8)
    angle = torch.rand(3, 4)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    got = rotary(x, cos, sin)
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # HF's, the target's convention

    want, _ = apply_rotary_pos_emb(x[:, None], x[:, None], cos[None], sin[None])  # (heads at dim 1)
    torch.testing.assert_close(got, want[:, 0])  # direction and pairing too, not only the lengths
    assert not torch.allclose(got, x)


def _own_texts(target: Transformer, folder, count: int = 40, distinct: int = 4, length: int = 32) -> str:
    """``count`` texts of one chunk each, ``distinct`` of them different: two random tokens and the target's greedy
    continuation (what the held-out chains measure on), written so that :func:`_tokenizer` reads the tokens back.
    (A random target's next-but-one token is no function a head learns from a few hundred tokens: repeats make the
    held-out windows ones it has seen.)"""
    folder.mkdir()
    torch.manual_seed(0)
    prompts = [torch.randint(0, 64, (2,)).tolist() for _ in range(distinct)]
    texts = [p + generate(target, p, method="ar", max_new_tokens=length - 2).token_ids for p in prompts]
    for i in range(count):
        (folder / f"{i}.txt").write_text("".join(chr(64 + t) for t in texts[i % distinct]))
    return str(folder)


def test_training_raises_chain_acceptance_and_resumes(tmp_path):
    target = Transformer.from_hf(tiny_hf(layers=8, seed=1))
    text = _own_texts(target, tmp_path / "corpus")
    common = dict(model_name="target", decode_format="fp32", cache=tmp_path / "cache", chunks=24, seq_len=32,
                  lr=1e-2, held_out=2, vocab=0, depth=3, eval_every=120, dtype=torch.float32, progress=False)
    summary = train(target, _tokenizer, [text], tmp_path / "out", steps=120, **common)
    before, after = summary["tokens_per_pass_before"], summary["tokens_per_pass_after"]
    assert after > before + 0.1, (before, after)
    assert len(summary["accept_after"]) == 3 and summary["accept_after"] == sorted(summary["accept_after"])[::-1]
    assert len(FeatureCache([tmp_path / "cache" / HELD_OUT], "cpu")) == 2
    assert (tmp_path / "out" / "eagle_head.safetensors").exists()
    again = train(target, _tokenizer, [text], tmp_path / "out", steps=130, **common)
    assert [p["step"] for p in again["curve"]] == [0, 120, 130]


def test_a_target_with_qk_norms_is_refused_before_any_work(tmp_path):
    """A head trained on a Qwen3 target could not decode (its block is run as the target's, which reads q/k norms
    the head lacks: a bare KeyError); training is refused before the feature cache, and so is a head to load."""
    target = Transformer.from_hf(tiny_hf("qwen3", layers=4, seed=1))
    with pytest.raises(ValueError, match="no q/k norms"):
        train(target, _tokenizer, ["unused"], tmp_path / "out", model_name="t", decode_format="fp32", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="no q/k norms"):
        EagleHead(target, init_from_target=False)  # (what loading a head builds)


def test_held_out_chains_start_only_where_the_tokens_read_are_the_targets():
    """Drafting reads the target's own tokens; text it would not have written (a sampled answer, a corpus) was
    teacher-forced into the held-out chains all the same, which then measured no chain."""
    from mirrorsd.train_eagle import FeatureItem, chain, step_labels

    labels = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17])
    ids = torch.tensor([0, 10, 11, 99, 13, 14, 15, 16])  # position 3 read 99, not the target's 12
    item = FeatureItem(torch.zeros(8, 3), labels, ids, 0, torch.ones(8, dtype=torch.bool))
    steps = step_labels(item, 2, answers_only=True)
    assert steps[0].tolist() == [11, 12, -100, 14, 15, 16, 17]  # step 0 at t reads ids[t + 1]
    assert steps[1].tolist() == [12, -100, 14, 15, 16, 17]
    hits = [torch.ones(7, dtype=torch.bool), torch.ones(6, dtype=torch.bool)]
    assert chain(hits, steps) == ([4, 4], 4)  # starts 1 and 2 read position 3
    assert step_labels(item, 2, answers_only=False)[0].tolist() == labels[1:].tolist()  # training keeps all

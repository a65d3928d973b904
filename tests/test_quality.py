"""Quantized weights must answer chat prompts as fp32 does (issue: SmolLM2's default q4 answered "L'Étoile, ..."
to "What is the capital of France?"), and the quality gate that picks each zoo model's default format."""

from __future__ import annotations

import json

import pytest
import torch

import mirrorsd
from mirrorsd import quality
from mirrorsd.api import default_format, encode_prompt
from mirrorsd.cli import main
from mirrorsd.specbench import Question
from mirrorsd.zoo import ZOO
from tests.helpers import requires_smollm2

pytestmark = requires_smollm2

CHAT_PROMPTS = ["What is the capital of France?", "Count to five."]


@pytest.fixture(scope="module")
def fp32():
    return mirrorsd.load_model("smollm2-135m", weights="fp32", progress=False)


@pytest.fixture(scope="module")
def default():
    return mirrorsd.load_model("smollm2-135m", progress=False)


def test_zoo_defaults_come_from_the_gate(default, tmp_path):
    entry = ZOO["smollm2-135m"]
    assert (default.weights, default.activations) == (entry.default_weights, entry.default_activations)
    assert default.format == f"{entry.default_weights} weights, {entry.default_activations} activations"
    assert default_format("smollm2-135m", default.path, "cpu", torch.bfloat16) == ("fp32", "int8")
    assert default_format(str(tmp_path), tmp_path, "cpu", torch.float32) == ("fp32", "int8")
    (tmp_path / "model.gguf").touch()
    assert default_format(str(tmp_path), tmp_path, "cpu", torch.float32) == ("q4", "int8x2")


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_default_format_answers_chat_prompts_like_fp32(fp32, default, prompt):
    want = mirrorsd.generate(fp32, prompt, max_new_tokens=24)
    got = mirrorsd.generate(default, prompt, max_new_tokens=24)
    assert got.token_ids == want.token_ids, (got.text, want.text)
    if "France" in prompt:
        assert "Paris" in got.text


def test_int8_activations_flip_the_near_tie_that_int8x2_keeps(fp32):
    """The root cause, pinned: fp32's first answer token wins by a logit gap of ~0.08; int8 activation noise
    (the sink token's massive activations leave the rest of their groups at a few levels) flips it, the second
    int8 plane does not. Also the power check for the test above: the old default fails it."""
    ids = torch.tensor([encode_prompt(fp32, CHAT_PROMPTS[0])])
    with torch.inference_mode():
        ref = fp32.model(ids)[0, -1]
        top2 = ref.topk(2)
        assert float(top2.values[0] - top2.values[1]) < 0.5  # a near-tie in fp32 itself
        q4 = mirrorsd.load_model("smollm2-135m", weights="q4", activations="int8", progress=False)
        assert int(q4.model(ids)[0, -1].argmax()) != int(top2.indices[0])
        q4.model.use_activations("int8x2")
        assert int(q4.model(ids)[0, -1].argmax()) == int(top2.indices[0])
    assert mirrorsd.generate(q4, CHAT_PROMPTS[0], max_new_tokens=8).token_ids == \
        mirrorsd.generate(fp32, CHAT_PROMPTS[0], max_new_tokens=8).token_ids


def test_gate_scores(fp32):
    questions = [Question(1, "writing", (p,)) for p in CHAT_PROMPTS]
    convs = quality.chat_conversations(fp32, questions, answer_tokens=12, progress=False)
    assert all(c.answer_len > 0 and c.ids[: c.answer_start] == encode_prompt(fp32, q.turns[0])
               for c, q in zip(convs, questions, strict=True))
    refs = quality.reference_scores(fp32.model, convs, progress=False)
    assert all(torch.equal(r.argmax, torch.tensor(c.ids[c.answer_start :])) for r, c in zip(refs, convs, strict=True))
    same = quality.score_format(fp32.model, convs, refs, name="smollm2", fmt="q4/int8x2", progress=False)
    assert same.agreement == 1.0 and same.identical_answers == 2 and abs(same.ppl_increase) < 1e-6
    q4 = mirrorsd.load_model("smollm2-135m", weights="q4", activations="int8", progress=False)
    worse = quality.score_format(q4.model, convs, refs, name="smollm2", fmt="q4/int8", progress=False)
    assert worse.first_divergence[0] == 0 and worse.agreement < 1.0 and not worse.passed
    assert quality.pick_default([worse, same]) == "q4/int8x2"
    assert quality.pick_default([worse]) == "fp32"


def test_parse_formats_rejects_bad_names():
    assert quality.parse_formats("q4/int8, q8/int8x2") == ["q4/int8", "q8/int8x2"]
    for bad in ("q4", "fp32/int8", "q3/int8", "q4/int4", ""):
        with pytest.raises(ValueError):
            quality.parse_formats(bad)


def test_bench_quality_cli_writes_the_table_and_resumes(tmp_path, capsys):
    suite = tmp_path / "suite.jsonl"
    suite.write_text("\n".join(json.dumps({"prompt": p}) for p in CHAT_PROMPTS) + "\n")
    args = ["bench", "quality", "--models", "smollm2-135m", "--formats", "q4/int8,q4/int8x2", "--suite", str(suite),
            "--answer-tokens", "8", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    report = json.loads((tmp_path / "out" / "quality.json").read_text())
    scores = report["models"]["smollm2-135m"]["scores"]
    assert set(scores) == {"q4/int8", "q4/int8x2"}
    assert scores["q4/int8x2"]["agreement"] == 1.0 and not scores["q4/int8"]["passed"]
    assert report["models"]["smollm2-135m"]["default"] == "q4/int8x2"
    table = (tmp_path / "out" / "quality.md").read_text()
    assert "| smollm2-135m | q4/int8x2 |" in table and "**yes**" in table
    capsys.readouterr()
    assert main(args + ["--formats", "q4/int8,q4/int8x2,q8/int8x2"]) == 0  # adds one format, keeps the others
    again = json.loads((tmp_path / "out" / "quality.json").read_text())["models"]["smollm2-135m"]["scores"]
    assert again["q4/int8"] == scores["q4/int8"] and "q8/int8x2" in again
    assert main(["bench", "quality", "--formats", "q4", "--out", str(tmp_path)]) == 2
    assert "WEIGHTS/ACTIVATIONS" in capsys.readouterr().err

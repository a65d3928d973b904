"""``mirrorsd bench serve``: its server grammar, its prompts, reading aiperf's JSON, the report; and (slow) the whole
sweep with the real aiperf against real servers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mirrorsd.bench import serve
from mirrorsd.cli import main

DATA = Path(__file__).parent / "data"


def test_servers_parse_with_labels_kinds_and_flags():
    specs = serve.parse_servers(serve.DEFAULT_SERVERS)
    assert [(s.label, s.kind) for s in specs] == [("ar", "mirrorsd"), ("suffix", "mirrorsd"),
                                                   ("llama.cpp", "llama-server")]
    assert specs[0].flags == {"method": "ar"}
    one = serve.parse_servers("serial=mirrorsd:method=ar:max-num-seqs=1,llama-server")
    assert one[0].flags == {"method": "ar", "max-num-seqs": "1"}
    assert (one[1].label, one[1].kind, one[1].flags) == ("llama-server", "llama-server", {})
    capped = serve.parse_servers("ar1=mirrorsd:method=ar:max-num-seqs=1:max-concurrency=16")[0]
    assert capped.flags == {"method": "ar", "max-num-seqs": "1"}  # (the sweep's own flag is not the server's)
    assert capped.max_concurrency == 16 and capped.runs_at(16) and not capped.runs_at(32)
    assert one[0].max_concurrency is None and one[0].runs_at(10**6)


def test_a_servers_keys_take_method_options_by_name_and_values_with_commas():
    """`mirrorsd bench --methods` takes ss:depth=2 and `mirrorsd methods` lists --tree-depth: both reach `mirrorsd
    serve` as its flag. Mirror-SD's threads=T,D was split into another server at its comma."""
    by_name, by_flag, threads, ar = serve.parse_servers(
        "a=mirrorsd:method=ss:depth=2:threshold=0.1,b=mirrorsd:method=ss:tree-depth=2:prune-threshold=0.1,"
        "c=mirrorsd:method=mirror:backend=threads:threads=2,1:exit_layer=0.25,d=mirrorsd:method=ar")
    assert by_name.flags == by_flag.flags == {"method": "ss", "tree-depth": "2", "prune-threshold": "0.1"}
    assert threads.flags == {"method": "mirror", "backend": "threads", "threads": "2,1", "exit-layer": "0.25"}
    assert (ar.label, ar.flags) == ("d", {"method": "ar"})
    llama = serve.parse_servers("l=llama-server:tensor-split=3,1:depth=2")[0]  # (its own flags, as given)
    assert llama.flags == {"tensor-split": "3,1", "depth": "2"}


def test_the_servers_take_turns_going_first():
    """The sweep ran its servers in one fixed order every round: whatever running first costs (or saves) fell on
    the same server each time."""
    specs = serve.parse_servers("a=mirrorsd,b=mirrorsd,c=mirrorsd:max-concurrency=1")
    firsts = {serve.run_order(specs, 1, shift)[0].label for shift in range(3)}
    assert firsts == {"a", "b", "c"}
    assert [s.label for s in serve.run_order(specs, 4, 1)] == ["b", "a"]  # (c does not run at 4)


@pytest.mark.parametrize("text, message", [("vllm", "unknown server kind"), ("a=mirrorsd:method", "flag=value"),
                                           ("a=mirrorsd,a=llama-server", "uniquely"), ("", "uniquely"),
                                           ("a=mirrorsd:max-concurrency=0", "positive integer"),
                                           ("a=mirrorsd:max-concurrency=x", "positive integer")])
def test_bad_servers_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        serve.parse_servers(text)


def test_every_level_and_round_gets_its_own_prompts():
    slices = serve.prompt_slices([1, 2, 4], rounds=2, per_client=2)
    assert {k: len(v) for k, v in slices.items()} == {(c, r): 2 * c for c in (1, 2, 4) for r in (0, 1)}
    every = [t for v in slices.values() for t in v]
    assert len(set(every)) == len(every) == 28  # no prompt twice: suffix could copy an earlier answer
    assert slices == serve.prompt_slices([1, 2, 4], rounds=2, per_client=2)  # the same for every server


def test_two_turn_conversations_come_from_mt_bench_and_never_repeat():
    """Spec-Bench has 80 two-turn questions: a sweep that needs more marks each further pass's first turns, so no
    conversation repeats one a server has cached."""
    slices = serve.prompt_slices([16, 32], rounds=2, per_client=1, turns=2)
    chats = [c for v in slices.values() for c in v]
    assert len(chats) == 96 and all(len(c) == 2 for c in chats) and len(set(chats)) == 96
    assert sum(c[0].startswith("[pass 2] ") for c in chats) == 16
    mt_bench = {q.turns for q in serve.load_suite("specbench") if len(q.turns) == 2}
    assert len(mt_bench) == 80 and all(c in mt_bench for c in chats[:80])
    lines = [json.loads(line) for line in serve.input_lines(chats[:2], 16).splitlines()]
    assert lines[0] == {"session_id": "chat-0", "turns": [{"text": chats[0][0], "output_length": 16},
                                                          {"text": chats[0][1], "output_length": 16}]}
    single = serve.input_lines([("Name a colour.",)], 8)
    assert json.loads(single) == {"text": "Name a colour.", "output_length": 8}  # aiperf's single_turn line
    command = serve.aiperf_command("aiperf", "http://h:1", "model", Path("."), 2, 8, Path("in"), Path("out"), turns=2)
    assert command[command.index("--custom-dataset-type") + 1] == "multi_turn"
    assert command[command.index("--request-count") + 1] == "8"


def test_prefix_cache_counts_read_a_live_metrics_page():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    page = ('# TYPE mirrorsd:prefix_cache_queries_total counter\n'
            'mirrorsd:prefix_cache_queries_total{model_name="model"} 120.0\n'
            'mirrorsd:prefix_cache_hits_total{model_name="model"} 90.0\n')

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = (page if self.path == "/metrics" else "").encode()
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert serve.prefix_cache_counts(f"http://127.0.0.1:{server.server_port}") == (120.0, 90.0)
        page = "# llama-server exports other names\nllamacpp:prompt_tokens_total 5\n"
        assert serve.prefix_cache_counts(f"http://127.0.0.1:{server.server_port}") is None
    finally:
        server.shutdown()
    assert serve.prefix_cache_counts("http://127.0.0.1:9") is None  # nothing listening


def test_a_real_aiperf_export_reads_into_our_figures(tmp_path):
    run = tmp_path / "c2-r0" / "nested"
    run.mkdir(parents=True)
    shutil.copy(DATA / "aiperf_profile_export.json", run / "profile_export_aiperf.json")
    figures = serve.read_run(tmp_path / "c2-r0")
    raw = json.loads((DATA / "aiperf_profile_export.json").read_text())
    assert figures["tok_s"] == raw["output_token_throughput"]["avg"]
    assert figures["tpot_p99_ms"] == raw["inter_token_latency"]["p99"]
    assert figures["completed"] == 4
    with pytest.raises(RuntimeError, match="no profile_export_aiperf.json"):
        serve.read_run(tmp_path / "empty")


def test_median_report_and_plot(tmp_path):
    runs = [{"tok_s": 10.0, "tpot_p50_ms": 50.0}, {"tok_s": 30.0, "tpot_p50_ms": 40.0}, {"tok_s": 20.0}]
    assert serve.median_of(runs) == {"tok_s": 20.0, "tpot_p50_ms": 45.0}
    results = {"machine": {"cpu": "test cpu", "cores": 2}, "target": "t", "levels": [1, 2], "rounds": 3,
               "max_tokens": 16, "per_client": 2,
               "servers": {"ar": {"command": ["serve"]}, "ar1": {"command": ["serve", "one"]}},
               "median": {"ar": {"1": {"tok_s": 12.5, "ttft_p50_ms": 100.0, "ttft_p99_ms": 200.0},
                                 "2": {"tok_s": 20.0, "tpot_p50_ms": 30.0}},
                          "ar1": {"1": {"tok_s": 11.0}}}}  # (ar1 skipped level 2: max-concurrency=1)
    text = serve.markdown(results)
    assert "| 1 | 12.50 | 11.00 |" in text and "| 2 | 20.00 | – |" in text
    assert "| 1 | 100 / 200 | – |" in text and "| 2 | – | – |" in text
    assert "prefix cache" not in text and "2 requests per client" in text
    results["turns"], results["median"]["ar"]["2"]["cached_prompt_share"] = 2, 0.625
    text = serve.markdown(results)
    assert "2 conversations per client per level (2 turns each)" in text
    assert "## Prompt tokens the prefix cache restored" in text and "| 2 | 62% |" in text and "| 1 | – |" in text
    serve.plot(results, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
    # a request that failed shows at its level: aiperf's figures cover the ones that succeeded only
    results["runs"] = {"ar": {"1": [{"tok_s": 12.5}], "2": [{"tok_s": 20.0, "failed": 3.0}]}, "ar1": {"1": []}}
    assert "| 2 | 20.00 ⚠ 3 failed | – |" in serve.markdown(results)
    assert serve.failures(results, "ar") == 3 and serve.failures(results, "ar1") == 0


def test_aiperf_runs_without_the_offline_switch(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "HF_HUB_OFFLINE" not in serve.aiperf_env()
    command = serve.aiperf_command("aiperf", "http://h:1", "model", tmp_path, 4, 8, tmp_path / "in.jsonl",
                                   tmp_path / "out")
    assert command[command.index("--concurrency") + 1] == "4"
    assert command[command.index("--tokenizer") + 1] == str(tmp_path.resolve())
    assert "ignore_eos:true" in command
    assert command[command.index("--request-rate") + 1] == "50"  # (not a busy-polling timing manager)


def test_cli_without_llama_server_leaves_it_out(monkeypatch, capsys):
    monkeypatch.delenv("MIRRORSD_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["bench", "serve", "--servers", "llama.cpp=llama-server"]) == 2
    err = capsys.readouterr()
    assert "llama.cpp is left out" in err.out and "nothing left to run" in err.err


@pytest.mark.slow
def test_the_sweep_runs_aiperf_against_real_servers(tmp_path):
    """The real thing on SmolLM2: our server in its own process, aiperf from its own environment (installed on
    first use), two levels; every request completes with its fixed-length answer."""
    out = tmp_path / "sweep"
    assert main(["bench", "serve", "--target", "smollm2-135m", "--servers",
                 "ar=mirrorsd:method=ar,ar1=mirrorsd:method=ar:max-num-seqs=1:max-concurrency=1",
                 "--concurrency", "1,2", "--rounds", "1", "--max-tokens", "8", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    for level in (1, 2):
        (run,) = results["runs"]["ar"][str(level)]
        assert run["completed"] == 2 * level and run["tok_s"] > 0
    assert list(results["runs"]["ar1"]) == ["1"] and results["runs"]["ar1"]["1"][0]["completed"] == 2
    assert (out / "throughput_latency.png").is_file() and "Aggregate output tok/s" in (out / "report.md").read_text()


@pytest.mark.slow
def test_a_two_turn_sweep_sends_conversations_and_reads_the_prefix_cache(tmp_path):
    """aiperf's multi-turn sessions against our server on SmolLM2: every turn completes, and the second turns'
    prompts (the first turn and its answer) are mostly restored by the prefix cache."""
    out = tmp_path / "sweep"
    assert main(["bench", "serve", "--target", "smollm2-135m", "--servers", "ar=mirrorsd:method=ar",
                 "--concurrency", "2", "--rounds", "1", "--max-tokens", "8", "--turns", "2",
                 "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    (run,) = results["runs"]["ar"]["2"]
    assert run["completed"] == 2 * 2 * 2 and 0.3 < run["cached_prompt_share"] < 1
    assert "## Prompt tokens the prefix cache restored" in (out / "report.md").read_text()

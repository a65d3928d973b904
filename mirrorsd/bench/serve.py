"""``mirrorsd bench serve``: a load sweep against live servers (ours, and llama.cpp's ``llama-server`` beside
them), driven by NVIDIA's ``aiperf``.

The load generator is aiperf, not ours: it keeps C requests in flight, streams them, and reports throughput, time
to first token and inter-token latency with percentiles. It runs as a subprocess from its own virtual environment
(its dependencies are not ours), pointed at the target's local tokenizer folder. With ``HF_HUB_OFFLINE`` set,
aiperf 0.13 refuses a local folder, so that variable is dropped from its environment: an absolute path loads with
no network call.

Every server is started once and stays up; the sweep then runs in interleaved rounds (each round: every
concurrency level, every server in turn, the order rotating), so a noisy host spreads over all servers alike, and
each figure is the median over rounds. Each (level, round) sends its own slice of shuffled Spec-Bench first turns,
the same slice to every server, so no request repeats a prompt an earlier one answered (``suffix`` would otherwise
copy it).
Answers are ``max_tokens`` long (``ignore_eos``), greedy.

With ``turns`` 2 each request is a conversation instead: Spec-Bench's two-turn questions as aiperf multi-turn
sessions, whose second turn carries the first turn and the server's own answer to it, as a chat client sends it.
That is the load a prefix cache serves, and the share of prompt tokens our server restored instead of prefilling is
read from its ``/metrics`` around each run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cache import cache_dir
from ..decoding.registry import option_flag, split_specs
from ..runtime.processes import free_port
from ..specbench import load_suite
from .peers import LlamaServer, find_llama_server

AIPERF_VERSION = "0.13.0"
AIPERF_ENV = "MIRRORSD_AIPERF"
KINDS = ("mirrorsd", "llama-server")
DEFAULT_SERVERS = "ar=mirrorsd:method=ar,suffix=mirrorsd:method=suffix,llama.cpp=llama-server"
# With --concurrency alone aiperf 0.13's timing manager polls for a free slot without sleeping and burns a whole core
# (measured: 85-100% CPU for the run), half of a 2-core server. A request rate that never binds (50 requests/s,
# evenly spaced) makes it sleep between tries; the concurrency still sets the load.
PACING = ("--request-rate", "50", "--arrival-pattern", "constant")
# The figures kept from aiperf's per-run JSON: (its metric, its statistic, our key).
METRICS = (("output_token_throughput", "avg", "tok_s"), ("time_to_first_token", "p50", "ttft_p50_ms"),
           ("time_to_first_token", "p99", "ttft_p99_ms"), ("inter_token_latency", "p50", "tpot_p50_ms"),
           ("inter_token_latency", "p99", "tpot_p99_ms"), ("request_latency", "p50", "latency_p50_ms"),
           ("request_latency", "p99", "latency_p99_ms"), ("completed_request_count", "avg", "completed"),
           ("input_sequence_length", "avg", "prompt_tokens"), ("output_sequence_length", "avg", "answer_tokens"),
           ("error_request_count", "avg", "errors"))


@dataclass(frozen=True)
class ServerSpec:
    """``LABEL=KIND:flag=value:...``: a server to start, its flags those of ``mirrorsd serve`` or ``llama-server``
    (``ar=mirrorsd:method=ar:max-num-seqs=1`` is the one-at-a-time server). The one flag of the sweep's own,
    ``max-concurrency=N``, skips this server's levels above N: a one-at-a-time server's throughput stays flat past
    1 while its run time grows with the level, so measuring it at 32 costs the sweep most of a round."""

    label: str
    kind: str
    flags: dict[str, str] = field(default_factory=dict)
    max_concurrency: int | None = None

    def runs_at(self, level: int) -> bool:
        return self.max_concurrency is None or level <= self.max_concurrency


def parse_servers(text: str) -> list[ServerSpec]:
    """A mirrorsd server's keys are ``mirrorsd serve``'s flags, a method option's also by its name (``depth`` for
    ``--tree-depth``), as ``mirrorsd bench --methods`` takes them; a value may hold a comma (``threads=2,1``)."""
    specs: list[ServerSpec] = []
    for item in split_specs(text):
        label, _, body = item.partition("=") if "=" in item.split(":")[0] else (item, "", item)
        kind, *pairs = body.split(":")
        if kind not in KINDS:
            raise ValueError(f"unknown server kind {kind!r} in {item!r}; available: {', '.join(KINDS)}")
        flags = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise ValueError(f"server flag {pair!r} in {item!r} must be flag=value")
            flag = option_flag(key) if kind == "mirrorsd" else None
            flags[flag.lstrip("-") if flag else key] = value
        cap = flags.pop("max-concurrency", None)
        if cap is not None and not (cap.isdigit() and int(cap) > 0):
            raise ValueError(f"max-concurrency={cap} in {item!r} must be a positive integer")
        specs.append(ServerSpec(label, kind, flags, int(cap) if cap is not None else None))
    labels = [s.label for s in specs]
    if not specs or len(set(labels)) != len(labels):
        raise ValueError(f"--servers needs one or more uniquely labelled servers, got {text!r}")
    return specs


def find_aiperf(path: str | None = None, install: bool = True) -> str:
    """``path``, ``$MIRRORSD_AIPERF``, ``aiperf`` on PATH, or the one in the cache's own virtual environment,
    which is made (pinned version, from the package index) when ``install`` is set and nothing else is found."""
    venv = cache_dir() / "aiperf-venv"
    for candidate in (path, os.environ.get(AIPERF_ENV), shutil.which("aiperf"), str(venv / "bin" / "aiperf")):
        if candidate and Path(candidate).is_file():
            return candidate
    if path:
        raise FileNotFoundError(f"--aiperf {path}: no such file")
    if not install:
        raise FileNotFoundError(f"aiperf not found: set ${AIPERF_ENV}, put it on PATH, or let `mirrorsd bench "
                                f"serve` install it into {venv}")
    print(f"installing aiperf {AIPERF_VERSION} into its own environment {venv} (once)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"aiperf=={AIPERF_VERSION}"], check=True)
    return str(venv / "bin" / "aiperf")


def run_order(servers: list[ServerSpec], level: int, shift: int) -> list[ServerSpec]:
    """The servers that run at ``level``, rotated by ``shift`` (round + level index): who runs first, after an
    idle or a busy neighbour, changes from round to round, as the Spec-Bench runner rotates its methods."""
    running = [s for s in servers if s.runs_at(level)]
    shift = shift % len(running) if running else 0
    return running[shift:] + running[:shift]


def prompt_slices(levels: list[int], rounds: int, per_client: int, seed: int = 0,
                  turns: int = 1) -> dict[tuple[int, int], list[tuple[str, ...]]]:
    """(level, round) -> its own ``per_client × level`` conversations: Spec-Bench's questions with at least ``turns``
    turns (all 480 for one, the 80 MT-bench ones for two), their first ``turns`` turns, shuffled once. Where the
    sweep needs more conversations than there are, the suite wraps around with each pass's first turns marked
    (``[pass 2]``), so no request repeats an earlier prompt, which ``suffix`` or a prefix cache would replay."""
    chats = [q.turns[:turns] for q in load_suite("specbench") if len(q.turns) >= turns]
    random.Random(seed).shuffle(chats)
    slices, at = {}, 0
    for r in range(rounds):
        for level in levels:
            picked = []
            for i in range(at, at + per_client * level):
                chat, again = chats[i % len(chats)], i // len(chats)
                picked.append((f"[pass {again + 1}] {chat[0]}", *chat[1:]) if again else tuple(chat))
            slices[level, r] = picked
            at += per_client * level
    return slices


def input_lines(conversations: list[tuple[str, ...]], max_tokens: int) -> str:
    """aiperf's custom dataset: ``single_turn`` lines for one-turn conversations, ``multi_turn`` sessions else."""
    lines = []
    for i, chat in enumerate(conversations):
        turns = [{"text": text, "output_length": max_tokens} for text in chat]
        lines.append(turns[0] if len(chat) == 1 else {"session_id": f"chat-{i}", "turns": turns})
    return "".join(json.dumps(line) + "\n" for line in lines)


def prefix_cache_counts(url: str) -> tuple[float, float] | None:
    """(prompt tokens queried, of them restored) so far, from a ``mirrorsd serve``'s ``/metrics`` (a server with the
    cache off counts no hits); None where the server exports no such counters or does not answer."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    totals = {"queries": 0.0, "hits": 0.0}
    seen = False
    for line in text.splitlines():
        for key in totals:
            if line.startswith(f"mirrorsd:prefix_cache_{key}"):
                totals[key] += float(line.rsplit(" ", 1)[1])
                seen = True
    return (totals["queries"], totals["hits"]) if seen else None


class OurServer:
    """``mirrorsd serve`` in its own process on loopback."""

    def __init__(self, target: str, flags: dict[str, str], max_num_seqs: int, log: Path) -> None:
        self.port = free_port()
        args = {"target": target, "max-num-seqs": str(max_num_seqs), **flags}
        self.command = [sys.executable, "-m", "mirrorsd.cli", "serve", "--port", str(self.port),
                        "--served-model-name", "model", *(x for k, v in args.items() for x in (f"--{k}", v))]
        self._log = open(log, "w")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        _wait_healthy(self.process, self.url, self.command, timeout=600)

    def close(self) -> None:
        _stop(self.process)
        self._log.close()


def _wait_healthy(process: subprocess.Popen, url: str, command: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode}: {' '.join(command)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    _stop(process)
    raise RuntimeError(f"server not ready in {timeout:.0f} s: {' '.join(command)}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def warm(url: str, model: str) -> None:
    """One short chat request, so the first timed level pays no lazy setup."""
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "temperature": 0}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        r.read()


def aiperf_command(aiperf: str, url: str, model: str, tokenizer: Path, level: int, requests: int, inputs: Path,
                   out: Path, turns: int = 1) -> list[str]:
    """One aiperf run: ``requests`` requests (every turn of every conversation), ``level`` in flight."""
    return [aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--concurrency", str(level), "--request-count", str(requests), *PACING, "--input-file", str(inputs),
            "--custom-dataset-type", "single_turn" if turns == 1 else "multi_turn",
            "--dataset-sampling-strategy", "sequential",
            "--tokenizer", str(tokenizer.resolve()), "--output-artifact-dir", str(out), "--ui", "none",
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0", "--use-server-token-count",
            "--workers-max", "1", "--random-seed", "0"]


def aiperf_env() -> dict[str, str]:
    """aiperf's environment: without the offline switches that make 0.13 refuse a local tokenizer folder."""
    return {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}


def read_run(folder: Path) -> dict[str, float]:
    """Our figures from one aiperf run's ``profile_export_aiperf.json``."""
    files = sorted(folder.rglob("profile_export_aiperf.json"))
    if not files:
        raise RuntimeError(f"aiperf wrote no profile_export_aiperf.json under {folder} (see its logs there)")
    data = json.loads(files[0].read_text())
    figures = {}
    for metric, stat, key in METRICS:
        value = (data.get(metric) or {}).get(stat)
        if value is not None:
            figures[key] = float(value)
    return figures


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in runs for k in r}
    return {k: statistics.median(r[k] for r in runs if k in r) for k in sorted(keys)}


@dataclass
class ServeConfig:
    target: str
    servers: list[ServerSpec]
    levels: list[int]
    rounds: int
    max_tokens: int
    per_client: int
    aiperf: str | None
    llama_server: str | None
    slot_context: int
    out: Path
    notes: list[str] = field(default_factory=list)
    turns: int = 1


def _start(spec: ServerSpec, cfg: ServeConfig, tokenizer: Path, threads: int) -> tuple[Any, str]:
    log = cfg.out / f"server-{spec.label}.log"
    top = max(cfg.levels)
    if spec.kind == "mirrorsd":
        return OurServer(cfg.target, {"max-tokens": str(cfg.max_tokens), **spec.flags}, top, log), "model"
    binary = find_llama_server(cfg.llama_server)
    if binary is None:
        raise FileNotFoundError("llama-server not found: pass --llama-server PATH or set $MIRRORSD_LLAMA_SERVER "
                                "(or leave llama-server out of --servers)")
    gguf = tokenizer / "model.gguf"
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf}: llama-server needs the target's GGUF file (a zoo model has one)")
    flags = [x for k, v in spec.flags.items() for x in (f"--{k}", *([v] if v else []))]
    server = LlamaServer(binary, gguf, None, threads, cfg.slot_context * top, flags, log, parallel=top)
    return server, "model"


def run(cfg: ServeConfig) -> dict[str, Any]:
    """Start every server, run the interleaved sweep, stop them; the results (also written as results.json)."""
    import torch

    from ..zoo import resolve
    from .runner import machine

    cfg.out.mkdir(parents=True, exist_ok=True)
    aiperf = find_aiperf(cfg.aiperf)
    tokenizer = resolve(cfg.target)
    slices = prompt_slices(cfg.levels, cfg.rounds, cfg.per_client, turns=cfg.turns)
    inputs = cfg.out / "inputs"
    inputs.mkdir(exist_ok=True)
    for (level, r), conversations in slices.items():
        (inputs / f"c{level}-r{r}.jsonl").write_text(input_lines(conversations, cfg.max_tokens))
    servers: dict[str, Any] = {}
    results: dict[str, Any] = {"machine": machine(), "target": cfg.target, "levels": cfg.levels,
                               "rounds": cfg.rounds, "notes": cfg.notes, "max_tokens": cfg.max_tokens,
                               "per_client": cfg.per_client, "turns": cfg.turns,
                               "servers": {s.label: {"kind": s.kind, "flags": s.flags,
                                                     "max_concurrency": s.max_concurrency} for s in cfg.servers},
                               "runs": {s.label: {str(c): [] for c in cfg.levels if s.runs_at(c)}
                                        for s in cfg.servers}}
    try:
        for spec in cfg.servers:
            print(f"starting {spec.label} ({spec.kind})", file=sys.stderr, flush=True)
            servers[spec.label] = _start(spec, cfg, tokenizer, torch.get_num_threads())
            results["servers"][spec.label]["command"] = servers[spec.label][0].command
            warm(servers[spec.label][0].url, servers[spec.label][1])
        total, done = cfg.rounds * sum(s.runs_at(c) for c in cfg.levels for s in cfg.servers), 0
        for r in range(cfg.rounds):
            for li, level in enumerate(cfg.levels):
                for spec in run_order(cfg.servers, level, r + li):
                    server, model = servers[spec.label]
                    folder = cfg.out / "aiperf" / spec.label / f"c{level}-r{r}"
                    shutil.rmtree(folder, ignore_errors=True)
                    command = aiperf_command(aiperf, server.url, model, tokenizer, level,
                                             cfg.per_client * level * cfg.turns, inputs / f"c{level}-r{r}.jsonl",
                                             folder, cfg.turns)
                    done += 1
                    print(f"[{done}/{total}] round {r + 1}, concurrency {level}, {spec.label}", file=sys.stderr,
                          flush=True)
                    folder.mkdir(parents=True)
                    before = prefix_cache_counts(server.url) if spec.kind == "mirrorsd" else None
                    with open(folder / "aiperf.out", "w") as log:
                        subprocess.run(command, env=aiperf_env(), stdout=log, stderr=subprocess.STDOUT, check=True)
                    figures = read_run(folder)
                    # aiperf's percentiles are over the requests that succeeded: a failed one must show, not vanish
                    asked = cfg.per_client * level * cfg.turns
                    if failed := max(asked - figures.get("completed", 0), figures.get("errors", 0)):
                        figures["failed"] = failed
                        print(f"warning: {spec.label} at concurrency {level}: {failed:.0f} of {asked} requests "
                              f"failed (aiperf's log: {folder / 'aiperf.out'})", file=sys.stderr, flush=True)
                    after = prefix_cache_counts(server.url) if before is not None else None
                    if before is not None and after is not None and after[0] > before[0]:
                        figures["cached_prompt_share"] = (after[1] - before[1]) / (after[0] - before[0])
                    results["runs"][spec.label][str(level)].append(figures)
                    (cfg.out / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        for server, _ in servers.values():
            server.close()
    results["median"] = {label: {c: median_of(runs) for c, runs in levels.items() if runs}
                         for label, levels in results["runs"].items()}
    (cfg.out / "results.json").write_text(json.dumps(results, indent=1))
    return results


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    labels = list(results["median"])
    chats = "conversations" if results.get("turns", 1) > 1 else "requests"
    lines = [f"# Load sweep: {results['target']}, {results['max_tokens']}-token answers (greedy, ignore_eos), "
             f"{results['per_client']} {chats} per client per level"
             + (f" ({results['turns']} turns each)" if results.get("turns", 1) > 1 else ""),
             "",
             f"Machine: {m.get('cpu')}, {m.get('cores')} cores, torch {m.get('torch')}, {m.get('date')}. "
             f"Load generator: aiperf {AIPERF_VERSION}. Median of {results['rounds']} interleaved rounds.",
             *(f"Note: {n}" for n in results.get("notes", [])), "", "Servers:", ""]
    lines += [f"- **{label}**: `{' '.join(results['servers'][label].get('command', []))}`" for label in labels]
    lines += ["", "Mean prompt / answer tokens per request as each server counted them (the same prompts through each "
              "server's own chat template): " + "; ".join(
                  f"{lb} {_mean(results, lb, 'prompt_tokens'):.0f} / {_mean(results, lb, 'answer_tokens'):.0f}"
                  for lb in labels) + "."]
    lines += ["", "## Aggregate output tok/s", "", "| concurrency | " + " | ".join(labels) + " |",
              "|---|" + "---|" * len(labels)]
    for c in results["levels"]:
        row = [_cell(results["median"][lb].get(str(c)), lambda f: f"{f['tok_s']:.2f}")
               + (f" ⚠ {n:.0f} failed" if (n := failures(results, lb, c)) else "") for lb in labels]
        lines.append(f"| {c} | " + " | ".join(row) + " |")
    for key, title in (("ttft", "Time to first token, ms (p50 / p99)"),
                       ("tpot", "Time per output token, ms (p50 / p99)")):
        lines += ["", f"## {title}", "", "| concurrency | " + " | ".join(labels) + " |",
                  "|---|" + "---|" * len(labels)]
        for c in results["levels"]:
            cells = [_cell(results["median"][lb].get(str(c)),
                           lambda f, k=key: f"{f[k + '_p50_ms']:.0f} / {f[k + '_p99_ms']:.0f}") for lb in labels]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    cached = [lb for lb in labels if any("cached_prompt_share" in f for f in results["median"][lb].values())]
    if cached:
        lines += ["", "## Prompt tokens the prefix cache restored (share of all prompt tokens)", "",
                  "| concurrency | " + " | ".join(cached) + " |", "|---|" + "---|" * len(cached)]
        for c in results["levels"]:
            row = [_cell(results["median"][lb].get(str(c)), lambda f: f"{f['cached_prompt_share']:.0%}")
                   for lb in cached]
            lines.append(f"| {c} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def failures(results: dict[str, Any], label: str, level: int | None = None) -> float:
    """Requests that failed in a server's runs (at one concurrency level, or at all): its figures at that level
    come from the ones that succeeded alone."""
    levels = results.get("runs", {}).get(label, {})
    return sum(run.get("failed", 0) for c, runs in levels.items() if level is None or c == str(level) for run in runs)


def _cell(figures: dict[str, float] | None, text) -> str:
    """A level a server skipped (``max-concurrency``) or a figure aiperf did not report reads "–"."""
    try:
        return text(figures) if figures else "–"
    except KeyError:
        return "–"


def _mean(results: dict[str, Any], label: str, key: str) -> float:
    values = [f[key] for f in results["median"][label].values() if key in f]
    return statistics.fmean(values) if values else float("nan")


def plot(results: dict[str, Any], path: Path) -> None:
    """Throughput against time per output token, one line per server, each point labelled by its concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for label, levels in results["median"].items():
        points = [(c, levels[str(c)]) for c in results["levels"] if str(c) in levels]
        xs = [f.get("tpot_p50_ms", float("nan")) for _, f in points]
        ys = [f.get("tok_s", float("nan")) for _, f in points]
        ax.plot(xs, ys, marker="o", label=label)
        for (c, _), x, y in zip(points, xs, ys, strict=True):
            ax.annotate(str(c), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set_xlabel("time per output token, p50 (ms)")
    ax.set_ylabel("aggregate output tok/s")
    ax.set_title(f"{results['target']}: throughput vs latency (labels: concurrency)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""Whole-model forward costs: what one k-token forward costs next to a one-token forward, and AR tok/s.

Speculative decoding pays only when verifying k tokens costs about one decode step, so the figure that
matters is ``forward_ms[k] / forward_ms[1]`` measured on the real model at a realistic context length. All
sizes are timed interleaved (round-robin) so drifting clocks or a busy neighbour hit them alike, and the
median over rounds is reported. ``llama_bench`` optionally times llama.cpp on the same GGUF file in the same
run, for a side-by-side AR figure: its runs alternate with ours round by round (on a shared VM the speed of
either drifts by tens of percent within minutes), and the median of the per-round ratios is reported.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import kernels
from ..model import Transformer
from ..plans import cpu_name
from ..runtime import synchronize

DEFAULT_KS = (1, 2, 4, 8, 16)


@dataclass
class ForwardReport:
    model: str
    weights: str
    activations: str
    linear: str
    context: int
    rounds: int
    forward_ms: dict[str, float]
    relative: dict[str, float]
    ar_tok_s: float
    ar_tokens: int
    prompt_tokens: int  # 0: not measured
    prompt_tok_s: float | None
    fast_kernels: str  # the kernels' instruction set (kernels.isa()), or "off" on the PyTorch fallbacks
    threads: int
    machine: str
    llama_cpp: dict | None = field(default=None)

    def to_dict(self) -> dict:
        return asdict(self)



#: Untimed rounds of each window before timing: a CUDA graph is captured on a shape's third sight (with three
#: timed rounds and one warm-up, the median was an uncaptured forward).
WARMUP = 3


@torch.inference_mode()
def forward_costs(model: Transformer, ks: tuple[int, ...] = DEFAULT_KS, context: int = 128,
                  rounds: int = 5) -> dict[int, float]:
    """Median milliseconds of a k-token forward (with LM head on every row, as verification needs) after
    ``context`` cached tokens."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=generator).to(model.device)  # a CPU generator
    cache = model.new_cache(capacity=context + max(ks) + 1)
    model(prompt, cache=cache, last=1)
    windows = {k: torch.randint(0, vocab, (1, k), generator=generator).to(model.device) for k in ks}
    times: dict[int, list[float]] = {k: [] for k in ks}
    for round_ in range(rounds + WARMUP):
        for k in ks:
            synchronize(model.device)
            start = time.perf_counter()
            model(windows[k], cache=cache)
            synchronize(model.device)  # CUDA runs asynchronously: time the work, not its launch
            elapsed = time.perf_counter() - start
            cache.truncate(context)
            if round_ >= WARMUP:
                times[k].append(elapsed * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


@torch.inference_mode()
def ar_tokens_per_second(model: Transformer, tokens: int = 32, context: int = 128, rounds: int = 3) -> float:
    """Greedy one-token decoding speed after a ``context``-token prompt (median over rounds)."""
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=generator).to(model.device)
    rates = []
    for _ in range(rounds):
        cache = model.new_cache(capacity=context + tokens + 1)
        token = model(prompt, cache=cache, last=1)[0, -1].argmax().view(1, 1)
        synchronize(model.device)
        start = time.perf_counter()
        for _ in range(tokens):
            token = model(token, cache=cache)[0, -1].argmax().view(1, 1)
        synchronize(model.device)
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


@torch.inference_mode()
def prompt_tokens_per_second(model: Transformer, tokens: int = 512, rounds: int = 3) -> float:
    """Prompt processing speed: one ``tokens``-token forward into an empty cache with the LM head on its last row only
    (as prefill runs it, and as llama-bench's pp test does), median over rounds."""
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, model.config.vocab_size, (1, tokens), generator=generator).to(model.device)
    rates = []
    for _ in range(rounds):
        cache = model.new_cache(capacity=tokens + 1)
        synchronize(model.device)
        start = time.perf_counter()
        model(prompt, cache=cache, last=1)
        synchronize(model.device)
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def llama_bench(binary: str | Path, gguf: str | Path, ks: tuple[int, ...], tokens: int, threads: int,
                repetitions: int = 3) -> dict:
    """llama.cpp's own numbers on the same file: tg tok/s and ms per k-token prompt batch."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", str(repetitions), "-o", "json",
           "-p", ",".join(str(k) for k in ks), "-n", str(tokens), "-b", "2048", "-ub", "512"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:  # a crash is the binary's, not ours: say which and what it printed, no traceback
        how = (f"was killed by {signal.Signals(-result.returncode).name}" if result.returncode < 0
               else f"exited with code {result.returncode}")
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        hint = (" (SIGILL: built for instructions this CPU lacks, or its AMX path built by GCC 12, whose "
                "_tile_loadconfig lets the compiler drop the tile shapes: patch that call as docs/benchmarks.md "
                "shows, or rebuild with -mno-amx-tile -mno-amx-int8)" if result.returncode == -signal.SIGILL else "")
        raise ValueError(f"llama-bench {how}{hint}: {' '.join(cmd)}\n{tail}")
    rows = json.loads(result.stdout)
    out: dict = {"command": " ".join(cmd), "forward_ms": {}}
    for row in rows:
        if row.get("n_gen", 0) > 0:
            out["ar_tok_s"] = row["avg_ts"]
        elif row.get("n_prompt", 0) > 0:
            out["forward_ms"][str(row["n_prompt"])] = 1e3 * row["n_prompt"] / row["avg_ts"]
        out.setdefault("build", row.get("build_commit"))
    return out


def run(name: str, weights: str = "q4", ks: tuple[int, ...] = DEFAULT_KS, context: int = 128, rounds: int = 5,
        ar_tokens: int = 32, llama_bench_path: str | None = None, linear: str = "auto",
        activations: str = "int8", prompt_tokens: int = 512) -> ForwardReport:
    """Load a zoo model (or local folder) and measure it; see the module docstring. ``prompt_tokens``: also time a
    prompt of that many tokens (0: not), alternating with llama.cpp's pp test of the same size where it runs."""
    from ..zoo import resolve

    path = resolve(name)
    model = Transformer.from_pretrained(path, weights=weights, linear=linear, activations=activations)
    costs = forward_costs(model, ks, context, rounds)
    threads = torch.get_num_threads()
    ours: list[float] = []
    prompts: list[float] = []
    theirs: list[dict] = []
    if prompt_tokens:
        prompt_tokens_per_second(model, prompt_tokens, rounds=1)  # warm-up: the larger activation buffers
    their_sizes = tuple(sorted({*ks, prompt_tokens} - {0}))
    for _ in range(rounds if llama_bench_path else 1):
        ours.append(ar_tokens_per_second(model, ar_tokens, context, rounds=1 if llama_bench_path else 3))
        if prompt_tokens:
            prompts.append(prompt_tokens_per_second(model, prompt_tokens, rounds=1 if llama_bench_path else 3))
        if llama_bench_path:
            theirs.append(llama_bench(llama_bench_path, Path(path) / "model.gguf", their_sizes, ar_tokens, threads, 1))
    report = ForwardReport(
        model=name, weights=weights, activations=activations, linear=linear, context=context, rounds=rounds,
        forward_ms={str(k): round(v, 3) for k, v in costs.items()},
        relative={str(k): round(v / costs[min(ks)], 3) for k, v in costs.items()},
        ar_tok_s=round(statistics.median(ours), 3), ar_tokens=ar_tokens, prompt_tokens=prompt_tokens,
        prompt_tok_s=round(statistics.median(prompts), 2) if prompts else None,
        fast_kernels=kernels.isa() if kernels.available() else "off", threads=threads, machine=cpu_name(),
    )
    if theirs:
        report.llama_cpp = {
            "command": theirs[0]["command"], "build": theirs[0].get("build"),
            "forward_ms": {k: round(statistics.median(t["forward_ms"][k] for t in theirs), 3)
                           for k in theirs[0]["forward_ms"]},
            "ar_tok_s": round(statistics.median(t["ar_tok_s"] for t in theirs), 3),
            "ar_tok_s_rounds": [round(t["ar_tok_s"], 2) for t in theirs],
            "ours_ar_tok_s_rounds": [round(x, 2) for x in ours],
            "ar_ratio_median": round(statistics.median(o / t["ar_tok_s"]
                                                       for o, t in zip(ours, theirs, strict=True)), 3),
        }
        if prompts:
            their_prompt = [prompt_tokens * 1e3 / t["forward_ms"][str(prompt_tokens)] for t in theirs]
            report.llama_cpp |= {
                "prompt_tok_s": round(statistics.median(their_prompt), 2),
                "prompt_ratio_median": round(statistics.median(o / t for o, t in zip(prompts, their_prompt,
                                                                                     strict=True)), 3)}
    return report

"""Where AMX tiles start to pay: k-token forwards of a real model through the AMX path and through the VNNI path of
the same (AMX) build, interleaved round by round, median per k. The crossover is the smallest k whose AMX forward is
faster; linear_into's default (``amx_min_rows`` in cpu_linear.cpp) should sit there.

    python benchmarks/amx_crossover.py --model qwen2.5-coder-1.5b --ks 1,2,3,4,8,16,32,64 --rounds 7

Needs a CPU with AMX-INT8 (``grep amx_int8 /proc/cpuinfo``). Both paths give the same bits (the cross-build test), so
only time differs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mirrorsd import kernels
from mirrorsd.model import Transformer
from mirrorsd.plans import cpu_name
from mirrorsd.zoo import resolve

PATHS = {"vnni": 1 << 40, "amx": 1}  # amx_min_rows for each path


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--weights", default="q4")
    parser.add_argument("--ks", default="1,2,3,4,8,16,32,64")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompt", type=int, default=512, help="also time a prompt of this many tokens (0: skip)")
    args = parser.parse_args()
    if kernels.isa() != "avx512-amx" or not kernels.available():
        raise SystemExit(f"needs the avx512-amx kernel build; this host runs {kernels.isa_label()!r}")
    ks = [int(k) for k in args.ks.split(",")]
    model = Transformer.from_pretrained(resolve(args.model), weights=args.weights)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    cache = model.new_cache(capacity=args.context + max(ks) + 1)
    model(torch.randint(0, vocab, (1, args.context), generator=generator), cache=cache, last=1)
    windows = {k: torch.randint(0, vocab, (1, k), generator=generator) for k in ks}
    times: dict[str, dict[int, list[float]]] = {path: {k: [] for k in ks} for path in PATHS}
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=generator)
    prompt_s: dict[str, list[float]] = {path: [] for path in PATHS}
    default = kernels.set_amx_min_rows(1)
    try:
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for k in ks:
                for path, rows in PATHS.items():
                    kernels.set_amx_min_rows(rows)
                    start = time.perf_counter()
                    model(windows[k], cache=cache)
                    elapsed = time.perf_counter() - start
                    cache.truncate(args.context)
                    if round_:
                        times[path][k].append(elapsed * 1e3)
            for path, rows in PATHS.items():
                if not args.prompt:
                    break
                kernels.set_amx_min_rows(rows)
                start = time.perf_counter()
                model(prompt, cache=model.new_cache(capacity=args.prompt + 1), last=1)
                if round_:
                    prompt_s[path].append(time.perf_counter() - start)
    finally:
        kernels.set_amx_min_rows(default)
    ms = {path: {k: statistics.median(v) for k, v in per.items()} for path, per in times.items()}
    report = {"model": args.model, "weights": args.weights, "context": args.context, "rounds": args.rounds,
              "machine": f"{cpu_name()}, {torch.get_num_threads()} threads", "default_amx_min_rows": default,
              "forward_ms": {path: {str(k): round(v, 2) for k, v in per.items()} for path, per in ms.items()},
              "amx_over_vnni": {str(k): round(ms["amx"][k] / ms["vnni"][k], 3) for k in ks},
              "crossover": next((k for k in ks if ms["amx"][k] < ms["vnni"][k]), None)}
    if args.prompt:
        report["prompt_tok_s"] = {path: round(args.prompt / statistics.median(v), 1) for path, v in prompt_s.items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

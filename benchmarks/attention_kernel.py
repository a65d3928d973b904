"""The CPU attention kernel alone (``mirrorsd/kernels/cpu_attention.cpp``) on Qwen2.5-1.5B's shapes: 12 query heads,
2 kv heads, head_dim 128, causal over a cache whose last T keys are the queries' own. T = 1 is a decoding step,
T = 8 a verification window, T = S a prompt. Prints the median time of one call, what the model's 28 layers would
spend, and the arithmetic rate (two products of 2·dim flops per query and key seen).

    python benchmarks/attention_kernel.py [--shapes 1x1024,8x1024,512x512,1024x1024,1536x1536] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mirrorsd import kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1x1024,8x1024,512x512,1024x1024,1536x1536",
                        help="comma-separated TxS pairs: queries x keys")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit("the C++ kernels are unavailable on this machine (see the warning above)")
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        t, s = (int(x) for x in shape.split("x"))
        q = torch.randn(1, args.heads, t, args.dim, generator=g)
        k, v = (torch.randn(1, args.kv_heads, s, args.dim, generator=g) for _ in range(2))
        kernels.attend(q, k, v, None)
        calls = max(3, 2_000_000 // (t * s))
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(calls):
                kernels.attend(q, k, v, None)
            times.append((time.perf_counter() - start) / calls)
        ms = statistics.median(times) * 1e3
        seen = sum(s - t + i + 1 for i in range(t))
        rate = args.heads * seen * 4 * args.dim / (ms / 1e3) / 1e9
        print(f"T={t:5d} S={s:5d}: {ms:8.3f} ms per call, {ms * args.layers:8.1f} ms per {args.layers} layers, "
              f"{rate:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()

"""Where a k-token forward's linear time goes, per kind of layer, and how close k = 1 gets to the memory bandwidth.

For each kind of quantized linear in the model (q/k/v/o, gate/up/down, the LM head; a kind whose layers come in two
formats, as Q4_K_M's down and v projections do, is split by format) it calls all layers of that kind back to back (so
their weights come from DRAM, as in a forward) with each row count, alternating with a 2-thread ``torch.sum`` over
512 MB for the machine's read bandwidth in the same minutes; medians over the rounds. The first row count is the
reference the others are compared to. ``--hot`` calls each kind's first layer as many times instead, so its weights
stay in cache and the figures show the kernel's arithmetic alone, with less of a shared host's memory noise.

    python benchmarks/linear_kinds.py [--model qwen2.5-coder-1.5b] [--rounds 6] [--rows 1,8,64] [--hot]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mirrorsd.linear import QuantLinear
from mirrorsd.model import Transformer
from mirrorsd.zoo import resolve

FIELDS = ("codes", "planes", "scales", "offsets", "super_scales", "super_offsets")


def weight_bytes(module: QuantLinear) -> int:
    return sum(getattr(module, f).numel() * getattr(module, f).element_size() for f in FIELDS
               if getattr(module, f) is not None)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds; the first warms up")
    parser.add_argument("--rows", default="1,8", help="comma-separated activation row counts (the first is the base)")
    parser.add_argument("--hot", action="store_true", help="repeat each kind's first layer (weights in cache)")
    args = parser.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    model = Transformer.from_pretrained(str(resolve(args.model)), weights="q4")
    kinds: dict[str, list[QuantLinear]] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            kinds.setdefault(f"{name.split('.')[-1]}/q{module.bits}", []).append(module)
    big = torch.ones(128 * 1024 * 1024)
    bandwidth: list[float] = []
    times: dict[str, dict[int, list[float]]] = {kind: {rows: [] for rows in row_counts} for kind in kinds}
    for round_ in range(args.rounds):
        start = time.perf_counter()
        big.sum()
        if round_:
            bandwidth.append(big.numel() * 4 / (time.perf_counter() - start) / 1e9)
        for kind, modules in kinds.items():
            for rows in row_counts:
                x = torch.randn(rows, modules[0].in_features)
                start = time.perf_counter()
                for module in [modules[0]] * len(modules) if args.hot else modules:
                    module(x)
                if round_:
                    times[kind][rows].append(time.perf_counter() - start)
    print(f"torch.sum read bandwidth: {statistics.median(bandwidth):.1f} GB/s")
    base = row_counts[0]
    totals = dict.fromkeys(row_counts, 0.0)
    for kind, modules in kinds.items():
        size = sum(weight_bytes(m) for m in modules)
        medians = {rows: statistics.median(times[kind][rows]) for rows in row_counts}
        for rows, value in medians.items():
            totals[rows] += value
        others = "  ".join(f"k={rows} {value * 1e3:6.2f} ms ({value / medians[base]:.2f}x)"
                           for rows, value in medians.items() if rows != base)
        print(f"{kind:13s} x{len(modules):2d} {size / 1e6:7.1f} MB  g{modules[0].group}  "
              f"k={base} {medians[base] * 1e3:6.2f} ms ({size / medians[base] / 1e9:4.1f} GB/s)  {others}")
    print("all linears: " + ", ".join(f"k={rows} {value * 1e3:.1f} ms ({value / totals[base]:.2f}x)"
                                      for rows, value in totals.items()))


if __name__ == "__main__":
    main()

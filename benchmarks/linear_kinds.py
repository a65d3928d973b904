"""Where a k-token forward's linear time goes, per kind of layer, and how close k = 1 gets to the memory bandwidth.

For each kind of quantized linear in the model (q/k/v/o, gate/up/down, the LM head) it calls all layers of that kind
back to back (so their weights come from DRAM, as in a forward) with 1 and 8 activation rows, alternating with a
2-thread ``torch.sum`` over 512 MB for the machine's read bandwidth in the same minutes; medians over the rounds.

    python benchmarks/linear_kinds.py [--model qwen2.5-coder-1.5b] [--rounds 6]
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
    args = parser.parse_args()
    model = Transformer.from_pretrained(str(resolve(args.model)), weights="q4")
    kinds: dict[str, list[QuantLinear]] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            kinds.setdefault(name.split(".")[-1], []).append(module)
    big = torch.ones(128 * 1024 * 1024)
    bandwidth: list[float] = []
    times: dict[str, dict[int, list[float]]] = {kind: {1: [], 8: []} for kind in kinds}
    for round_ in range(args.rounds):
        start = time.perf_counter()
        big.sum()
        if round_:
            bandwidth.append(big.numel() * 4 / (time.perf_counter() - start) / 1e9)
        for kind, modules in kinds.items():
            for rows in (1, 8):
                x = torch.randn(rows, modules[0].in_features)
                start = time.perf_counter()
                for module in modules:
                    module(x)
                if round_:
                    times[kind][rows].append(time.perf_counter() - start)
    print(f"torch.sum read bandwidth: {statistics.median(bandwidth):.1f} GB/s")
    totals = {1: 0.0, 8: 0.0}
    for kind, modules in kinds.items():
        size = sum(weight_bytes(m) for m in modules)
        one, eight = (statistics.median(times[kind][rows]) for rows in (1, 8))
        totals[1] += one
        totals[8] += eight
        print(f"{kind:10s} x{len(modules):2d} {size / 1e6:7.1f} MB  q{modules[0].bits}/g{modules[0].group}  "
              f"k=1 {one * 1e3:6.2f} ms ({size / one / 1e9:4.1f} GB/s)  k=8 {eight * 1e3:6.2f} ms ({eight / one:.2f}x)")
    print(f"all linears: k=1 {totals[1] * 1e3:.1f} ms, k=8 {totals[8] * 1e3:.1f} ms ({totals[8] / totals[1]:.2f}x)")


if __name__ == "__main__":
    main()

"""The small-M linear options on Qwen2.5-Coder-1.5B's layer shapes: which one the seam should pick.

For M = 1, 2, 4, 8, 16 rows and each distinct (out, in) shape of the model, times (median of interleaved
rounds, weights cycled through several copies so they come from DRAM as in a real forward):

* ``stock``: ``F.linear`` (MKL sgemm);
* ``onednn``: oneDNN-prepacked weights (``torch.utils.mkldnn.to_mkldnn``, what inductor's freezing picks);
* ``compile``: ``torch.compile(mode="max-autotune")`` with inductor freezing (optional: ``--compile``);
* ``ours-f32`` / ``ours-q8`` / ``ours-q4``: our packed kernels (fp32; int8 / 4-bit codes, int8 activations).

    python benchmarks/bench_linear.py --out bench_out/linear.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch._inductor.config
import torch.nn.functional as F
import torch.utils.mkldnn

from mirrorsd import kernels
from mirrorsd.linear import PackedLinear, QuantLinear
from mirrorsd.plans import cpu_name
from mirrorsd.quant import GroupQuant, quantize_q8

SHAPES = {"q/o_proj": (1536, 1536), "k/v_proj": (256, 1536), "gate/up_proj": (8960, 1536), "down_proj": (1536, 8960)}


def machine() -> str:
    return (f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"python {platform.python_version()}")


def q4_of(w: torch.Tensor) -> GroupQuant:
    """Asymmetric 4-bit per 32 (Q4_1-like) — only the layout and bytes matter for timing."""
    n, k = w.shape
    g = w.view(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    return GroupQuant(codes, scale, lo, 32, 4)


def timed(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if r:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--copies", type=int, default=4, help="weight copies cycled per call (defeats the L3 cache)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(max-autotune) (slow)")
    ap.add_argument("--out", default="bench_out/linear.md")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("our kernels are unavailable here; nothing to compare")
    rows = [int(r) for r in args.rows.split(",")]
    lines = ["# Small-M linear options — Qwen2.5-Coder-1.5B shapes", "", f"Machine: {machine()}. Milliseconds per "
             f"call, median of {args.rounds} interleaved rounds, {args.copies} weight copies cycled.", ""]
    for label, (n, k) in SHAPES.items():
        copies = [torch.randn(n, k) * 0.02 for _ in range(args.copies)]
        layers: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
            "stock": [lambda x, w=w: F.linear(x, w) for w in copies],
            "onednn": [torch.utils.mkldnn.to_mkldnn(torch.nn.Linear(k, n, bias=False).requires_grad_(False))
                       for _ in copies],
            "ours-f32": [PackedLinear(w) for w in copies],
            "ours-q8": [QuantLinear(quantize_q8(w)) for w in copies],
            "ours-q4": [QuantLinear(q4_of(w)) for w in copies],
        }
        if args.compile:
            torch._inductor.config.freezing = True  # constant weights: lets inductor prepack them
            compiled = []
            for w in copies:
                lin = torch.nn.Linear(k, n, bias=False).requires_grad_(False)
                lin.weight.copy_(w)
                compiled.append(torch.compile(lin.eval(), mode="max-autotune"))
            layers["compile"] = compiled
        lines += [f"## {label} ({n}×{k})", "", "| M | " + " | ".join(layers) + " |",
                  "|---|" + "---|" * len(layers)]
        for m in rows:
            x = torch.randn(m, k)
            state = {name: 0 for name in layers}

            def call(name: str, x: torch.Tensor = x, state: dict = state, layers: dict = layers) -> None:
                i = state[name] = (state[name] + 1) % args.copies
                layers[name][i](x)

            for name in layers:  # warm-up (and compilation) per M
                for _ in range(args.copies):
                    call(name)
            med = timed({name: (lambda name=name: call(name)) for name in layers}, args.rounds)
            lines.append(f"| {m} | " + " | ".join(f"{med[name]:.3f}" for name in layers) + " |")
            print(label, m, {name: round(v, 3) for name, v in med.items()}, flush=True)
        lines.append("")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

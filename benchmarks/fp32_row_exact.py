"""What the row-exact path costs an fp32 model (``Transformer.make_row_exact``, which ``mirrorsd serve`` uses to batch
fp32 requests): a 256-token prompt and 48 greedy ``ar`` tokens, PyTorch's GEMM against the C++ fp32 blocks,
interleaved. Usage: ``python benchmarks/fp32_row_exact.py MODEL [--rounds N]``."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mirrorsd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", help="zoo model name or local HF folder")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    prompt = list(range(100, 356))
    for _ in range(args.rounds):
        for mode in ("torch-gemm", "row-exact"):
            loaded = mirrorsd.load_model(args.model, weights="fp32", progress=False)
            if mode == "row-exact" and not loaded.model.make_row_exact():
                raise SystemExit("the C++ kernels do not apply to this model here")
            seconds = []
            for _ in range(3):
                cache = loaded.model.new_cache(capacity=len(prompt) + 8)
                began = time.perf_counter()
                with torch.inference_mode():
                    loaded.model.prefill(torch.tensor([prompt]), cache)
                seconds.append(time.perf_counter() - began)
            decoded = mirrorsd.generate(loaded, prompt[:16], max_new_tokens=48, method="ar", temperature=0.0, raw=True)
            print(f"{args.model} {mode}: prompt {statistics.median(seconds):.3f} s, "
                  f"decode {decoded.stats.tokens_per_s:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()

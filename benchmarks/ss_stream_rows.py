"""``ss`` with its stream layers in the C++ blocks (``stream_blocks_forward``) against the Python blocks, the path
before it, in one process: Spec-Bench first turns, greedy, methods interleaved in a rotating order per question.
Prints tok/s, the mean per-question ratio to ``ar``, and whether every answer equals ``ar``'s.

    python benchmarks/ss_stream_rows.py [--suite specbench:2] [--tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mirrorsd
from mirrorsd.decoding.streams.adapters import load_adapters
from mirrorsd.specbench import load_suite

METHODS = ("ar", "ss-cpp", "ss-python")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--suite", default="specbench:2")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    loaded = mirrorsd.load_model(args.model, progress=False)
    top = list(loaded.model.layers)[load_adapters(loaded.model, args.model).first_layer:]
    rates: dict[str, list[float]] = {name: [] for name in METHODS}
    same = True
    for round_ in range(args.rounds):
        for i, question in enumerate(load_suite(args.suite)):
            shift = (i + round_) % len(METHODS)
            answers = set()
            for name in METHODS[shift:] + METHODS[:shift]:
                for block in top:  # the Python blocks: what ran stream rows before stream_blocks_forward
                    block.use_kernel = name != "ss-python"
                start = time.perf_counter()
                out = mirrorsd.generate(loaded, [{"role": "user", "content": question.turns[0]}],
                                        method="ar" if name == "ar" else "ss", max_new_tokens=args.tokens,
                                        temperature=0)
                rates[name].append(len(out.token_ids) / (time.perf_counter() - start))
                answers.add(tuple(out.token_ids))
            same = same and len(answers) == 1
    for block in top:
        block.use_kernel = True
    print(f"every answer equals ar's: {same}; ar {statistics.mean(rates['ar']):.2f} tok/s")
    for name in METHODS[1:]:
        ratio = statistics.mean(a / b for a, b in zip(rates[name], rates["ar"], strict=True))
        print(f"{name}: {statistics.mean(rates[name]):.2f} tok/s, {ratio:.3f}x ar")
    gain = statistics.median(a / b for a, b in zip(rates["ss-cpp"], rates["ss-python"], strict=True))
    print(f"ss-cpp / ss-python, median per question: {gain:.3f}")


if __name__ == "__main__":
    main()

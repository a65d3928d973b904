"""Issue 18 item 4: what the heads that are only partly read cost, full vocabulary against a restricted one, in one
process with the two alternating round by round (on a noisy VM the only fair comparison).

Times, on the loaded zoo model (default weights), the early exit of Mirror-SD (norm + head + top-κ on ``k`` window
rows) and Speculative Streaming's stream-candidate read (norm + head + top-k on γ = 3 stream rows), each with the
full head and with the ``--vocab`` most frequent ids (:func:`mirrorsd.draft_vocab.subset_head`), next to one
1-token forward of the whole model for scale. Prints JSON: medians over the rounds in ms.

    python benchmarks/restricted_heads.py [--model qwen2.5-coder-1.5b] [--vocab 32768] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

import mirrorsd
from mirrorsd.decoding.mirror import DEFAULT_KAPPA, early_exit
from mirrorsd.draft_vocab import head_logits, subset_head, top_tokens
from mirrorsd.sampling import SamplingParams


def ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    loaded = mirrorsd.load_model(args.model, progress=False)
    model = loaded.model
    head = subset_head(model, args.vocab)
    d = model.config.hidden_size
    cache = model.new_cache(capacity=300)
    model.prefill(torch.randint(0, model.config.vocab_size, (1, 256)), cache)
    token = torch.tensor([[42]])

    def forward() -> None:
        model(token, cache=cache)
        cache.truncate(256)

    cases: dict[str, Callable[[], object]] = {"forward k=1": forward}
    for k in (1, 4, 8):
        hidden = torch.randn(1, k, d)
        for name, which in (("full", None), ("restricted", head)):
            cases[f"exit k={k} {name}"] = (
                lambda hidden=hidden, which=which: early_exit(model, hidden, DEFAULT_KAPPA, SamplingParams(),
                                                              head=which))
    streams = torch.randn(3, d)
    for name, which in (("full", None), ("restricted", head)):
        cases[f"stream top-3 {name}"] = (
            lambda which=which: top_tokens(*head_logits(model, streams, which), 3)[1].tolist())
    times: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for fn in cases.values():  # warm-up
            fn()
        for _ in range(args.rounds):
            for name, fn in cases.items():
                times[name].append(ms(fn))
    print(json.dumps({"model": args.model, "vocab": model.config.vocab_size, "restricted_to": args.vocab,
                      "threads": torch.get_num_threads(), "rounds": args.rounds,
                      "median_ms": {name: round(statistics.median(t), 3) for name, t in times.items()}}, indent=1))


if __name__ == "__main__":
    main()

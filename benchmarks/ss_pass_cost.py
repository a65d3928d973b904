"""What one Speculative Streaming pass costs against a one-token ``ar`` forward, by tree shape, with the streams in
the pass (``defer="never"``, the paper's) or after verification (``"always"``), in one process, shapes interleaved
round by round (a shared host drifts between runs). Random prompt of 150 tokens; the model's shipped adapter.
``--draft-vocab N``: the pass's main rows and the ``ar`` forward both read the N-id reduced head a draft reads
(``draft_vocab``; only a draft's main rows may: a target's verify with the full vocabulary).

    python benchmarks/ss_pass_cost.py [--model qwen2.5-coder-1.5b] [--rounds 10] [--draft-vocab 32768]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mirrorsd
from mirrorsd.decoding.streams.adapters import load_adapters
from mirrorsd.decoding.streams.passes import StreamGuesses, ss_pass
from mirrorsd.draft_vocab import draft_table_kind, subset_head
from mirrorsd.sampling import SamplingParams

SHAPES = ((1, 1), (1, 3), (2, 2), (2, 3), (3, 3), (6, 3))  # (tree budget: nodes below the root, streams)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--draft-vocab", type=int, default=0, help="the main rows' reduced vocabulary (0: the full one)")
    args = p.parse_args()
    model = mirrorsd.load_model(args.model, progress=False).model
    adapters = load_adapters(model, args.model)
    head = adapters.head(model)
    # a greedy AR draft reads the subset's columns; a pass's main rows the full row they fill (its tree compares ids)
    subset = subset_head(model, args.draft_vocab, draft_table_kind(model.config.vocab_size)) if args.draft_vocab \
        else None
    main = subset.full if subset is not None else None
    guesses = StreamGuesses([[11, 12, 13]] * 3, [[-0.1, -2.0, -3.0]] * 3)
    times: dict[object, list[float]] = {}
    with torch.inference_mode():
        cache = model.new_cache(capacity=512)
        model.prefill(torch.randint(100, 20000, (1, 150), generator=torch.Generator().manual_seed(0)), cache)
        past = len(cache)

        def timed(key: object, start: float) -> None:
            times.setdefault(key, []).append(time.perf_counter() - start)
            cache.truncate(past)

        for _ in range(args.rounds + 1):  # the first round warms up
            start = time.perf_counter()
            model(torch.tensor([[5]]), cache=cache, head=subset)
            timed("ar", start)
            for budget, streams in SHAPES:
                for defer in ("never", "always"):
                    start = time.perf_counter()
                    ss_pass(model, adapters, cache, [5], guesses.tree(streams, budget), SamplingParams(), head=head,
                            streams=streams, defer=defer, main_head=main)
                    timed((budget, streams, defer), start)
    ar = statistics.median(times.pop("ar")[1:])
    vocab = f", main rows and ar over {args.draft_vocab} ids" if args.draft_vocab else ""
    print(f"{args.model}: one-token ar forward {ar * 1e3:.1f} ms{vocab}; a pass in ar forwards (median of "
          f"{args.rounds})")
    print("| nodes below the root | streams | one pass | streams after verification |\n|---|---|---|---|")
    for budget, streams in SHAPES:
        one, deferred = (statistics.median(times[(budget, streams, d)][1:]) / ar for d in ("never", "always"))
        print(f"| {budget} | {streams} | {one:.2f} | {deferred:.2f} |")


if __name__ == "__main__":
    main()

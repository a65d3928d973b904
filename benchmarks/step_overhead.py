"""Per-step time outside the model forwards, for ``ar``, ``sd`` and ``suffix`` (issue 18, item 5): the loop, proposers,
verification, cache bookkeeping, detokenizing and stop checks: everything a step does besides its forwards.

Each method generates the same greedy answer twice, ``--short`` and ``--long`` new tokens; the differences in wall
time, forward time and steps cancel the prompt's prefill, so ``(Δwall - Δforwards) / Δsteps`` is the overhead of
one decoding step. Medians over ``--runs``. Prints JSON.

    python benchmarks/step_overhead.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b] [--runs 5]
        [--methods ar,sd,suffix]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mirrorsd import api
from mirrorsd.decoding.suffix_index import isolated_shared_indexes

PROMPT = "Write a Python function that checks whether a string is a palindrome, with a docstring and tests."


def timed_forwards(model: torch.nn.Module) -> list[float]:
    """Wrap ``model.forward`` so its wall time adds up in the returned one-element list."""
    spent = [0.0]
    inner = model.forward

    def forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    model.forward = forward
    return spent


def one(target, draft, method: str, tokens: int, spent: list[list[float]], options: dict) -> tuple[float, float, int]:
    """(wall s, forward s, steps) of one generation."""
    before = sum(s[0] for s in spent)
    with isolated_shared_indexes():  # no run may copy an earlier run's answer
        start = time.perf_counter()
        result = api.generate(target, PROMPT, draft=draft, method=method, max_new_tokens=tokens, **options)
        wall = time.perf_counter() - start
    if len(result.token_ids) != tokens:
        raise SystemExit(f"{method} stopped after {len(result.token_ids)} tokens; use a prompt that runs longer")
    return wall, sum(s[0] for s in spent) - before, result.stats.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=80)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--methods", default="ar,sd,suffix", help="comma-separated, from ar, sd and suffix")
    args = parser.parse_args()
    target, draft = api.load_model(args.target), api.load_model(args.draft)
    spent = [timed_forwards(target.model), timed_forwards(draft.model)]
    known = {"ar": (None, {}), "sd": (draft, {"model_gate": "always"}), "suffix": (None, {})}  # sd drafts every step
    unknown = set(args.methods.split(",")) - set(known)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; pick from {sorted(known)}")
    methods = {m: known[m] for m in args.methods.split(",")}
    samples: dict[str, list[tuple[float, float, float]]] = {m: [] for m in methods}
    for run in range(args.runs + 1):  # run 0 warms up
        for method, (draft_model, options) in methods.items():
            short = one(target, draft_model, method, args.short, spent, options)
            long = one(target, draft_model, method, args.long, spent, options)
            steps = long[2] - short[2]
            if run and steps > 0:
                wall, forwards = long[0] - short[0], long[1] - short[1]
                samples[method].append((wall / steps, forwards / steps, (wall - forwards) / steps))
    report = {}
    for method, rows in samples.items():
        step, forward, overhead = (statistics.median(col) * 1e3 for col in zip(*rows, strict=True))
        report[method] = {"step_ms": round(step, 2), "forward_ms_per_step": round(forward, 2),
                          "overhead_ms_per_step": round(overhead, 2), "overhead_share": round(overhead / step, 3)}
    print(json.dumps({"target": args.target, "draft": args.draft, "tokens": [args.short, args.long],
                      "runs": args.runs, "threads": torch.get_num_threads(), **report}, indent=1))


if __name__ == "__main__":
    main()

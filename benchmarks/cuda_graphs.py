"""``ar``, ``sd`` and ``suffix`` on a GPU with and without CUDA graphs, at a length where captures amortize.

``mirrorsd bench gpu`` generates 24-48 tokens per answer, so each window shape's capture (one eager forward and a
recording, ~50 ms) weighs on its tok/s; this times 128-token answers, twice each (median), on random weights of
the Qwen2.5-1.5B and 7B shapes with a 0.5B-shaped draft, and checks every answer against eager ``ar``. Prints one
JSON line per run. Needs CUDA.

    python benchmarks/cuda_graphs.py [--tokens 128] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

import torch

from mirrorsd.bench import gpu
from mirrorsd.cuda_graphs import cuda_graphs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cuda")
    for i, name in enumerate(gpu.TARGETS):
        shape = gpu.REAL_SHAPES[name]
        target = gpu.random_model(shape, device, torch.bfloat16, seed=1 + i)
        draft = gpu.random_model(replace(gpu.REAL_SHAPES[gpu.DRAFT], vocab=shape.vocab), device, torch.bfloat16,
                                 seed=0)
        prompt = torch.randint(0, shape.vocab, (128,), generator=torch.Generator().manual_seed(i)).tolist()
        reference = None
        for graphs in (False, True):
            for method, options in (("ar", {}), ("sd", {"draft": draft}), ("suffix", {})):
                torch.cuda.reset_peak_memory_stats(device)
                rates, answers = [], []
                with cuda_graphs(graphs):
                    for _ in range(args.runs):
                        out, seconds = gpu.timed_generate(target, prompt, args.tokens, method=method, **options)
                        rates.append(len(out.token_ids) / seconds)
                        answers.append(out.token_ids)
                reference = reference or answers[0]
                print(json.dumps({"target": name, "method": method, "cuda_graphs": graphs,
                                  "tok_s": round(statistics.median(rates), 1), "runs": [round(r, 1) for r in rates],
                                  "tokens_per_step": round(out.stats.mean_accepted_length, 2),
                                  "equal_to_eager_ar": all(a == reference for a in answers),
                                  "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)}),
                      flush=True)
        del target, draft


if __name__ == "__main__":
    main()

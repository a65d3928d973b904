"""Issue 18's kernel changes A/B in one process: the old paths against the new, interleaved round by round.

The old paths are still in the code (row-by-row SDPA attention, PyTorch RMSNorm and rotary ops, stored offsets of
symmetric formats), so one loaded model can switch between them; on a noisy machine that is the only fair
comparison. Prints JSON: k-token forward costs after ``--context`` cached tokens, AR tok/s, a 1,024-token prefill,
and with ``--profile`` the split of a forward into quantized linears and everything else.

    python benchmarks/kernels_round_two.py [--model qwen2.5-coder-1.5b] [--rounds 7] [--profile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mirrorsd.linear import QuantLinear
from mirrorsd.model import Attention, RMSNorm, Transformer
from mirrorsd.zoo import resolve

KS = (1, 2, 4, 8, 16)


class Switch:
    """Flips a loaded model between the old and the new paths."""

    def __init__(self, model: Transformer) -> None:
        self.fusable = [x for x in model.modules() if isinstance(x, Attention | RMSNorm)]
        if not all(x.fused for x in self.fusable):
            raise SystemExit("the new paths are off here (no fast kernels, or not a quantized model)")
        self.symmetric = [x for x in model.modules()  # one-level scales: fp16 offsets can stand in
                          if isinstance(x, QuantLinear) and x.zero and x.super_scales is None]
        self.zeros = {x: x.zero for x in self.symmetric}
        self.offsets = {x: (x.scales.float() * -x.zero).half() for x in self.symmetric}

    def use(self, new: bool) -> None:
        for x in self.fusable:
            x.fused = new
        for x in self.symmetric:
            x.offsets, x.zero = (None, self.zeros[x]) if new else (self.offsets[x], 0)


def timed_linears(model: Transformer) -> dict[str, float]:
    """Wrap every quantized linear so its wall time adds up in the returned dict."""
    spent = {"linear": 0.0}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            inner = module.forward

            def forward(x: torch.Tensor, inner=inner) -> torch.Tensor:
                start = time.perf_counter()
                out = inner(x)
                spent["linear"] += time.perf_counter() - start
                return out

            module.forward = forward
    return spent


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--weights", default="q4")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds; the first warms up")
    parser.add_argument("--profile", action="store_true", help="also split k=1 and k=8 forwards into linears/other")
    args = parser.parse_args()
    model = Transformer.from_pretrained(resolve(args.model), weights=args.weights)
    for block in model.layers:  # round two's paths: per-op Python blocks, not round three's block kernel
        block.use_kernel = False
    switch = Switch(model)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.context), generator=g)
    windows = {k: torch.randint(0, vocab, (1, k), generator=g) for k in KS}
    long_prompt = torch.randint(0, vocab, (1, 1024), generator=g)
    caches = {}
    for new in (False, True):
        switch.use(new)
        caches[new] = model.new_cache(capacity=args.context + 40)
        model(prompt, cache=caches[new], last=1)
    spent = timed_linears(model) if args.profile else None
    runs = {new: {"forward": {k: [] for k in KS}, "ar": [], "prefill": [], "split": {1: [], 8: []}}
            for new in (False, True)}
    for round_ in range(args.rounds):
        for new in (False, True) if round_ % 2 == 0 else (True, False):
            switch.use(new)
            cache, record = caches[new], runs[new]
            for k in KS:
                if spent is not None:
                    spent["linear"] = 0.0
                start = time.perf_counter()
                model(windows[k], cache=cache)
                elapsed = time.perf_counter() - start
                cache.truncate(args.context)
                if round_:
                    record["forward"][k].append(elapsed * 1e3)
                    if spent is not None and k in record["split"]:
                        record["split"][k].append((elapsed * 1e3, spent["linear"] * 1e3))
            token, start = windows[1], time.perf_counter()
            for _ in range(16):
                token = model(token, cache=cache)[0, -1].argmax().view(1, 1)
            rate = 16 / (time.perf_counter() - start)
            cache.truncate(args.context)
            if round_:
                record["ar"].append(rate)
            if round_ % 2 == 1:
                fresh = model.new_cache(capacity=long_prompt.shape[1] + 4)
                start = time.perf_counter()
                model(long_prompt, cache=fresh, last=1)
                record["prefill"].append(time.perf_counter() - start)
    report = {}
    for new, record in runs.items():
        forward = {k: statistics.median(v) for k, v in record["forward"].items()}
        entry = {"forward_ms": {k: round(v, 1) for k, v in forward.items()},
                 "relative": {k: round(v / forward[1], 2) for k, v in forward.items()},
                 "ar_tok_s": round(statistics.median(record["ar"]), 2),
                 "ar_range": [round(min(record["ar"]), 2), round(max(record["ar"]), 2)],
                 "prefill_1024_s": round(statistics.median(record["prefill"]), 2)}
        if spent is not None:
            for k, pairs in record["split"].items():
                total, linear = (statistics.median(x) for x in zip(*pairs, strict=True))
                entry[f"k{k}_total_linear_other_ms"] = [round(total, 1), round(linear, 1), round(total - linear, 1)]
        report["new" if new else "old"] = entry
    print(json.dumps({"model": args.model, "weights": args.weights, "context": args.context,
                      "rounds": args.rounds - 1, "threads": torch.get_num_threads(), **report}, indent=1))


if __name__ == "__main__":
    main()

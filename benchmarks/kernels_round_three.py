"""Issue 18's third round A/B in one process: each change switched on and off round by round on one loaded model
(on a noisy VM the only fair comparison).

``--change two_level``: K-quant scales as GGUF stores them (int8 per group × fp16 per 256) against fp16 per group.
``--change block``: a whole decoder block in one C++ op (``cpu_block.cpp``) against the per-op Python path.

Prints JSON: weight bytes per token, k-token forward costs after ``--context`` cached tokens and AR tok/s (medians
over the rounds), and the median of the per-round AR ratios.

    python benchmarks/kernels_round_three.py --change two_level|block [--model qwen2.5-coder-1.5b] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from mirrorsd import kernels
from mirrorsd.linear import QuantLinear
from mirrorsd.model import Transformer
from mirrorsd.zoo import resolve

KS = (1, 2, 4, 8, 16)
FIELDS = ("codes", "planes", "scales", "offsets", "super_scales", "super_offsets")


def packings(model: Transformer, path: str) -> dict[bool, dict[QuantLinear, kernels.PackedQuant]]:
    """Both packings of every K-quant layer (the GGUF is decoded again: the model keeps only packed weights)."""
    from transformers import AutoConfig

    from mirrorsd.gguf_weights import load_gguf_weights

    weights = load_gguf_weights(f"{path}/model.gguf", AutoConfig.from_pretrained(path, local_files_only=True))
    named = {f"{name}.weight": module for name, module in model.named_modules() if isinstance(module, QuantLinear)}
    named.setdefault("embed_tokens.weight", model.lm_head)  # a tied head is the quantized embedding
    out: dict[bool, dict[QuantLinear, kernels.PackedQuant]] = {True: {}, False: {}}
    for name, module in named.items():
        q = weights.get(name) or weights.get(f"model.{name}")
        if q is not None and kernels.uses_two_level(q, module.bits):
            for on in (True, False):
                out[on][module] = kernels.pack_quant(q, module.bits, two_level=on)
    return out


def use(model: Transformer, packs: dict[QuantLinear, kernels.PackedQuant]) -> None:
    for module, packed in packs.items():
        for field in FIELDS:
            setattr(module, field, getattr(packed, field))
    for block in model.layers:  # the block kernels hold the weights they were bound to
        block.bind_kernel()


def switch(model: Transformer, change: str, path: str) -> Callable[[bool], None]:
    """A function turning ``change`` on (True) or off."""
    if change == "two_level":
        packs = packings(model, path)
        return lambda on: use(model, packs[on])
    if not all(block.use_kernel for block in model.layers):
        raise SystemExit("no block kernels here (no fast kernels, or not a quantized model)")

    def toggle(on: bool) -> None:
        for block in model.layers:
            block.use_kernel = on

    return toggle


def bytes_per_token(model: Transformer) -> int:
    return sum(getattr(m, f).numel() * getattr(m, f).element_size() for m in model.modules()
               if isinstance(m, QuantLinear) for f in FIELDS if getattr(m, f) is not None)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--change", choices=("two_level", "block"), required=True)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds; the first warms up")
    args = parser.parse_args()
    path = str(resolve(args.model))
    model = Transformer.from_pretrained(path, weights="q4")
    turn = switch(model, args.change, path)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.context), generator=g)
    windows = {k: torch.randint(0, vocab, (1, k), generator=g) for k in KS}
    caches, runs, sizes = {}, {}, {}
    for on in (True, False):
        turn(on)
        sizes[on] = bytes_per_token(model)
        caches[on] = model.new_cache(capacity=args.context + 40)
        model(prompt, cache=caches[on], last=1)
        runs[on] = {"forward": {k: [] for k in KS}, "ar": []}
    for round_ in range(args.rounds):
        for on in (True, False) if round_ % 2 == 0 else (False, True):
            turn(on)
            cache, record = caches[on], runs[on]
            for k in KS:
                start = time.perf_counter()
                model(windows[k], cache=cache)
                elapsed = time.perf_counter() - start
                cache.truncate(args.context)
                if round_:
                    record["forward"][k].append(elapsed * 1e3)
            token, start = windows[1], time.perf_counter()
            for _ in range(16):
                token = model(token, cache=cache)[0, -1].argmax().view(1, 1)
            if round_:
                record["ar"].append(16 / (time.perf_counter() - start))
            cache.truncate(args.context)
    report = {}
    for on, record in runs.items():
        forward = {k: statistics.median(v) for k, v in record["forward"].items()}
        report["on" if on else "off"] = {
            "weight_mb": round(sizes[on] / 1e6, 1),
            "forward_ms": {k: round(v, 1) for k, v in forward.items()},
            "relative": {k: round(v / forward[1], 2) for k, v in forward.items()},
            "ar_tok_s": round(statistics.median(record["ar"]), 2),
            "ar_range": [round(min(record["ar"]), 2), round(max(record["ar"]), 2)]}
    pairs = [a / b for a, b in zip(runs[True]["ar"], runs[False]["ar"], strict=True)]
    report["ar_ratio_median"] = round(statistics.median(pairs), 3)
    print(json.dumps({"change": args.change, "model": args.model, "context": args.context,
                      "rounds": args.rounds - 1, **report}, indent=1))


if __name__ == "__main__":
    main()

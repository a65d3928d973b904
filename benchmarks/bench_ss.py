"""Speculative Streaming measurements on the Qwen2.5-Coder pair (q4 on CPU) with the shipped adapters.

Same prompts and protocol as ``bench_mirror.py`` (Spec-Bench first turns, ``--per-group`` per task group, plus
the code prompts; methods interleaved per prompt with a rotating order; every output checked against ar):

* target (1.5B): ar, vanilla SD (γ=7 textbook, and our CPU default), ``ss`` with trees k = 1..3 and with
  pruning, Mirror-SD (serial, budget roots) with the AR draft and with the SS draft;
* draft alone (0.5B): ar vs ``ss`` -- the draft-only speedup and tokens per draft forward η̄ (SS Fig. 6b).

    python benchmarks/bench_ss.py --out docs/ss_results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from bench_mirror import prompts, speed

import mirrorsd

TARGET_CONFIGS = {
    "ar": ("ar", {}),
    "sd-g7": ("sd", {"gamma": 7, "confidence": 0.0}),
    "sd": ("sd", {}),
    "ss-k1": ("ss", {"tree_k": 1}),
    "ss-k2": ("ss", {"tree_k": 2}),
    "ss-k3": ("ss", {"tree_k": 3}),
    "ss-k3-prune": ("ss", {"tree_k": 3, "threshold": 0.05}),
    "mirror-budget": ("mirror", {"backend": "serial", "roots": "budget"}),
    "mirror-budget-ssdraft": ("mirror", {"backend": "serial", "roots": "budget", "draft_streams": True}),
}
DRAFT_CONFIGS = {"ar": ("ar", {}), "ss-k1": ("ss", {"tree_k": 1}), "ss-k2": ("ss", {"tree_k": 2})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--per-group", type=int, default=1, help="Spec-Bench questions per task group")
    p.add_argument("--groups", default="mt_bench,translation,math_reasoning,code",
                   help="task groups ('code' is the code prompts)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--configs", default=",".join(TARGET_CONFIGS))
    p.add_argument("--out", type=Path, required=True, help="JSON results file")
    args = p.parse_args()
    target, draft = mirrorsd.load_model(args.target), mirrorsd.load_model(args.draft)
    items = [(g, t) for g, t in prompts(args.per_group) if g in args.groups.split(",")]
    report = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                         f"torch {torch.__version__}", "target": args.target, "draft": args.draft,
              "weights": target.weights, "max_new_tokens": args.max_new_tokens, "prompts": len(items),
              "runs": args.runs, "date": time.strftime("%Y-%m-%d")}
    report["draft_only"] = speed(draft, None, items, DRAFT_CONFIGS, args.max_new_tokens, args.runs)
    args.out.write_text(json.dumps(report, indent=1))
    configs = {name: TARGET_CONFIGS[name] for name in args.configs.split(",")}
    report["target"] = speed(target, draft, items, {"ar": TARGET_CONFIGS["ar"], **configs}, args.max_new_tokens,
                             args.runs)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

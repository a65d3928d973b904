"""Our ``ar`` / ``sd`` against HF transformers' ``generate`` / assisted generation, same weights, same prompts.

Interleaved: every run visits every prompt, and on each prompt every method runs back to back (the order
rotates between runs), so machine drift hits all methods alike. Figures are medians over runs. Greedy
decoding; each method's tokens are checked against our ``ar`` (lossless) on every run.

    python benchmarks/bench_hf.py --runs 3 --max-new-tokens 64 --out bench_out/hf
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import mirrorsd
from mirrorsd.api import encode_prompt

PROMPTS = {
    "code-1": ("code", "Write a Python function `is_palindrome(s: str) -> bool` that ignores case and "
                       "punctuation, with a docstring and three doctest examples."),
    "code-2": ("code", "Implement binary search over a sorted Python list. Return the index or -1, and "
                       "explain the loop invariant in a comment."),
    "prose-1": ("prose", "Write a short paragraph about the history of the printing press in Europe."),
    "prose-2": ("prose", "Explain to a child why the sky is blue, in four or five sentences."),
}


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"python {platform.python_version()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--gamma", type=int, default=None, help="our sd window (default: the API default)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", default=",".join(PROMPTS), help="comma-separated subset of " + ",".join(PROMPTS))
    ap.add_argument("--out", default="bench_out/hf")
    ap.add_argument("--backend", default="auto", choices=["auto", "dense"],
                    help="our linear layers: auto = packed small-M kernels, dense = PyTorch's GEMM (as HF)")
    args = ap.parse_args()

    # fp32 weights on both sides, so HF's tokens are comparable with ours.
    target = mirrorsd.load_model(args.target, weights="fp32", backend=args.backend)
    draft = mirrorsd.load_model(args.draft, weights="fp32", backend=args.backend)
    hf_target = AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(draft.path, dtype=torch.float32).eval()
    n = args.max_new_tokens
    sd_opts = {} if args.gamma is None else {"gamma": args.gamma}

    def ours(method: str, ids: list[int]) -> tuple[list[int], float, dict]:
        kw = {"draft": draft, **sd_opts} if method == "sd" else {}
        g = mirrorsd.generate(target, ids, method=method, max_new_tokens=n, **kw)
        return g.token_ids, g.stats.wall_s, g.stats.to_dict()

    def hf(assisted: bool, ids: list[int]) -> tuple[list[int], float, dict]:
        x = torch.tensor([ids])
        kw = {"assistant_model": hf_draft} if assisted else {}
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf_target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                     eos_token_id=sorted(target.eos_token_ids), pad_token_id=x[0, 0].item(), **kw)
        wall = time.perf_counter() - start
        new = [t for t in out[0, len(ids):].tolist() if t not in target.eos_token_ids]
        return new, wall, {}

    methods = {
        "ours-ar": lambda ids: ours("ar", ids),
        "hf-ar": lambda ids: hf(False, ids),
        "ours-sd": lambda ids: ours("sd", ids),
        "hf-assisted": lambda ids: hf(True, ids),
    }
    names = [p.strip() for p in args.prompts.split(",") if p.strip()]
    encoded = {p: encode_prompt(target, PROMPTS[p][1]) for p in names}

    # Warm-up: one short call of each method (allocator, thread pools, lazy init).
    for fn in methods.values():
        n_saved, n = n, 4
        fn(encoded[names[0]])
        n = n_saved

    rows: dict[tuple[str, str], list[dict]] = {}
    order = list(methods)
    for run in range(args.runs):
        for p in names:
            reference = None
            for m in order[run % len(order):] + order[:run % len(order)]:
                tokens, wall, stats = methods[m](encoded[p])
                if m == "ours-ar":
                    reference = tokens
                rows.setdefault((p, m), []).append(
                    {"tokens": tokens, "wall_s": wall, "tok_s": len(tokens) / wall, "stats": stats})
                print(f"run {run + 1}/{args.runs} {p:8s} {m:12s} {len(tokens):3d} tok {wall:6.2f} s "
                      f"{len(tokens) / wall:5.2f} tok/s", flush=True)
            for m in order:
                rows[(p, m)][-1]["same_as_ours_ar"] = rows[(p, m)][-1]["tokens"] == reference

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    med = {k: statistics.median(r["tok_s"] for r in v) for k, v in rows.items()}
    lines = [
        f"# ours vs HF transformers — {args.target} + draft {args.draft}",
        "",
        f"Machine: {machine()}. Greedy, {n} new tokens max, chat template, median of {args.runs} interleaved "
        f"runs; our sd γ = {sd_opts.get('gamma', 'default')}, HF assisted with its defaults.",
        "",
        "| prompt | kind | ours ar tok/s | HF ar tok/s | ours/HF (ar) | ours sd tok/s | HF assisted tok/s "
        "| ours/HF (sd) | ours sd MAL | all outputs = ours ar |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in names:
        mal = statistics.median(r["stats"]["mean_accepted_length"] for r in rows[(p, "ours-sd")])
        same = all(r["same_as_ours_ar"] for m in order for r in rows[(p, m)])
        a, h, s, ha = (med[(p, m)] for m in ("ours-ar", "hf-ar", "ours-sd", "hf-assisted"))
        lines.append(f"| {p} | {PROMPTS[p][0]} | {a:.2f} | {h:.2f} | {a / h:.2f}× | {s:.2f} | {ha:.2f} | "
                     f"{s / ha:.2f}× | {mal:.2f} | {'yes' if same else 'NO'} |")
    gm = {m: statistics.geometric_mean([med[(p, m)] for p in names]) for m in order}
    lines += ["", f"Geometric mean over prompts: ours ar {gm['ours-ar']:.2f} vs HF ar {gm['hf-ar']:.2f} tok/s "
              f"({gm['ours-ar'] / gm['hf-ar']:.2f}×); ours sd {gm['ours-sd']:.2f} vs HF assisted "
              f"{gm['hf-assisted']:.2f} tok/s ({gm['ours-sd'] / gm['hf-assisted']:.2f}×); ours sd vs ours ar "
              f"{gm['ours-sd'] / gm['ours-ar']:.2f}×."]
    report = "\n".join(lines) + "\n"
    (out / "report.md").write_text(report)
    (out / "results.json").write_text(json.dumps(
        {"machine": machine(), "args": vars(args),
         "runs": {f"{p}/{m}": v for (p, m), v in rows.items()}}, indent=1))
    print("\n" + report)


if __name__ == "__main__":
    main()

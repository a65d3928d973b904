"""Speculative speedups re-measured on the fast CPU path: ``ar`` and ``sd`` per weight configuration.

Configurations (comma-separated ``--configs``): ``fp32-dense`` (PyTorch's stock GEMMs: the path before the
kernels), ``fp32`` (packed small-M fp32 kernel), ``q8`` and ``q4`` (VNNI kernels; q4 = the zoo GGUF's codes).
Target and draft use the same configuration. Interleaved: every run visits every prompt and, on each prompt,
every (configuration, method) back to back in a rotating order; figures are medians over runs. Greedy; each
``sd`` output is checked against the ``ar`` output of the same configuration (a quantized model is its own
target).

    python benchmarks/bench_fastpath.py --runs 3 --max-new-tokens 64 --out bench_out/fastpath
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench_hf import PROMPTS, machine

import mirrorsd
from mirrorsd.api import encode_prompt

CONFIGS = {"fp32-dense": ("fp32", "dense"), "fp32": ("fp32", "auto"), "q8": ("q8", "auto"), "q4": ("q4", "auto")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--configs", default="fp32-dense,fp32,q4", help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", default=",".join(PROMPTS), help="comma-separated subset of " + ",".join(PROMPTS))
    ap.add_argument("--out", default="bench_out/fastpath")
    args = ap.parse_args()

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    models = {}
    for c in configs:
        weights, backend = CONFIGS[c]
        models[c] = (mirrorsd.load_model(args.target, weights=weights, backend=backend),
                     mirrorsd.load_model(args.draft, weights=weights, backend=backend))
    names = [p.strip() for p in args.prompts.split(",") if p.strip()]
    first_target = models[configs[0]][0]
    encoded = {p: encode_prompt(first_target, PROMPTS[p][1]) for p in names}

    def run_one(config: str, method: str, ids: list[int], n: int):
        target, draft = models[config]
        kw = {"draft": draft} if method == "sd" else {}
        return mirrorsd.generate(target, ids, method=method, max_new_tokens=n, **kw)

    jobs = [(c, m) for c in configs for m in ("ar", "sd")]
    for c, m in jobs:  # warm-up
        run_one(c, m, encoded[names[0]], 4)

    rows: dict[tuple[str, str, str], list[dict]] = {}
    for run in range(args.runs):
        for p in names:
            shift = run % len(jobs)
            for c, m in jobs[shift:] + jobs[:shift]:
                g = run_one(c, m, encoded[p], args.max_new_tokens)
                st = g.stats
                rows.setdefault((p, c, m), []).append({"tokens": g.token_ids, "tok_s": st.tokens_per_s,
                                                       "stats": st.to_dict()})
                print(f"run {run + 1}/{args.runs} {p:8s} {c:10s} {m:3s} {st.new_tokens:3d} tok "
                      f"{st.tokens_per_s:6.2f} tok/s", flush=True)
            for c in configs:
                rows[(p, c, "sd")][-1]["same_as_ar"] = rows[(p, c, "sd")][-1]["tokens"] == rows[(p, c, "ar")][-1][
                    "tokens"]

    med = {k: statistics.median(r["tok_s"] for r in v) for k, v in rows.items()}
    base = configs[0]
    lines = [f"# Speculative speedups on the fast path — {args.target} + draft {args.draft}", "",
             f"Machine: {machine()}. Greedy, {args.max_new_tokens} new tokens max, chat template, median of "
             f"{args.runs} interleaved runs, sd with its defaults.", "",
             "| prompt | config | ar tok/s | sd tok/s | sd/ar | MAL | ar vs " + base + " ar | sd = ar |",
             "|---|---|---|---|---|---|---|---|"]
    for p in names:
        for c in configs:
            a, s = med[(p, c, "ar")], med[(p, c, "sd")]
            mal = statistics.median(r["stats"]["mean_accepted_length"] for r in rows[(p, c, "sd")])
            same = all(r["same_as_ar"] for r in rows[(p, c, "sd")])
            lines.append(f"| {p} | {c} | {a:.2f} | {s:.2f} | {s / a:.2f}× | {mal:.2f} | "
                         f"{a / med[(p, base, 'ar')]:.2f}× | {'yes' if same else 'NO'} |")
    lines.append("")
    for c in configs:
        ga = statistics.geometric_mean([med[(p, c, "ar")] for p in names])
        gs = statistics.geometric_mean([med[(p, c, "sd")] for p in names])
        gb = statistics.geometric_mean([med[(p, base, "ar")] for p in names])
        lines.append(f"- {c}: geomean ar {ga:.2f} tok/s, sd {gs:.2f} tok/s, sd/ar {gs / ga:.2f}×, "
                     f"sd vs {base} ar {gs / gb:.2f}×")
    report = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(report)
    (out / "results.json").write_text(json.dumps(
        {"machine": machine(), "args": vars(args), "runs": {"/".join(k): v for k, v in rows.items()}}, indent=1))
    print("\n" + report)


if __name__ == "__main__":
    main()

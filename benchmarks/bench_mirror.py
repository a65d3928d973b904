"""Mirror-SD measurements on a target/draft pair (default: the Qwen2.5-Coder 1.5B/0.5B pair, q4 on CPU).

Three parts, each on the same prompts (Spec-Bench questions, ``--per-group`` per task group, first turns, chat
template; plus code prompts):

* ``speed``: ar, vanilla SD (γ=7 textbook, and our CPU default) and Mirror-SD (serial/threads × paper/budget
  roots), interleaved per prompt with a rotating order; tok/s, speedup over ar, mean accepted length, fallback
  frequency, hidden-draft fraction, and the measured step time next to the paper's Eq. 10. Every output is
  checked against ar.
* ``fallback``: fallback frequency of the ``paper`` reuse rule for κ ∈ {1, 2, 4, 8, 16} × ℓe ∈ {N/4, N/2, 3N/4}
  (the paper's Fig. 7). Whether the correction is among position A's top-κ exit candidates depends only on the
  target and on the verified windows, which Mirror-SD shares with vanilla SD (parity), so one vanilla-SD pass
  with early exits read at all three depths gives the whole grid without rolling anything out.
* ``gamma``: E[A_t] (accepted draft tokens per step, the paper's convention) for γ = 1..7 per task group
  (Fig. 3b), from vanilla SD runs with textbook fixed windows.

    python benchmarks/bench_mirror.py --out docs/mirror_results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

import mirrorsd
from mirrorsd import specbench
from mirrorsd.bench.probe import run_probe
from mirrorsd.decoding import SPECULATIVE

CODE_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, with a docstring and tests.",
    "Implement binary search over a sorted list in Python and explain its complexity.",
    "Write a Python class for a least-recently-used cache with get and put methods.",
]

CONFIGS = {
    "ar": ("ar", {}),
    "sd-g7": ("sd", {"gamma": 7, "confidence": 0.0}),
    "sd": ("sd", {}),
    "mirror-serial-paper": ("mirror", {"backend": "serial", "roots": "paper"}),
    "mirror-serial-budget": ("mirror", {"backend": "serial", "roots": "budget"}),
    "mirror-threads-paper": ("mirror", {"backend": "threads", "roots": "paper"}),
    "mirror-threads-budget": ("mirror", {"backend": "threads", "roots": "budget"}),
}


def prompts(per_group: int) -> list[tuple[str, str]]:
    """(group, text) pairs: Spec-Bench first turns, then the code prompts as group ``code``."""
    return [(q.group, q.turns[0]) for q in specbench.subset(per_group)] + [("code", p) for p in CODE_PROMPTS]


def speed(target, draft, items, configs, max_new, runs) -> dict:
    results: dict[str, list[dict]] = defaultdict(list)
    names = list(configs)
    total = runs * len(items) * len(names)
    done = 0
    for run in range(runs):
        for i, (group, text) in enumerate(items):
            rotation = (run * len(items) + i) % len(names)
            reference = None
            for name in names[rotation:] + names[:rotation]:
                method, options = configs[name]
                g = mirrorsd.generate(target, text, method=method, draft=draft if method in SPECULATIVE else None,
                                      max_new_tokens=max_new, **options)
                row = {"run": run, "prompt": i, "group": group, "tokens": g.stats.new_tokens, "wall_s": g.stats.wall_s,
                       "tok_s": g.stats.tokens_per_s, "mal": g.stats.mean_accepted_length, "ids": g.token_ids}
                if "ss" in g.stats.extra:
                    row["call_reduction"] = g.stats.extra["ss"].call_reduction
                    row["tree_after_pruning"] = statistics.mean(g.stats.extra["ss"].tree_after)
                if "mirror" in g.stats.extra:
                    row["eta"] = g.stats.to_dict()["mirror"]["fresh_tokens_per_draft_forward"]
                    row["steps"] = [vars(s) | {"eq10_s": s.eq10_s} for s in g.stats.extra["mirror"].steps]
                results[name].append(row)
                done += 1
                print(f"[{done}/{total}] {name:22s} {group:15s} {row['tok_s']:6.2f} tok/s  MAL {row['mal']:.2f}",
                      flush=True)
            reference = next(r["ids"] for r in results["ar"] if r["run"] == run and r["prompt"] == i)
            for name in names:
                row = next(r for r in results[name] if r["run"] == run and r["prompt"] == i)
                row["equal_to_ar"] = row["ids"] == reference
    return summarize_speed(results)


def summarize_speed(results: dict[str, list[dict]]) -> dict:
    ar_rate = {(r["run"], r["prompt"]): r["tok_s"] for r in results["ar"]}
    out = {}
    for name, rows in results.items():
        per_run = defaultdict(lambda: [0, 0.0])
        for r in rows:
            per_run[r["run"]][0] += r["tokens"]
            per_run[r["run"]][1] += r["wall_s"]
        ratios = [r["tok_s"] / ar_rate[(r["run"], r["prompt"])] for r in rows]
        summary = {
            "tok_s": statistics.median(t / s for t, s in per_run.values()),
            "speedup_geomean": statistics.geometric_mean(ratios),
            "speedup_min": min(ratios), "speedup_max": max(ratios),
            "mal": statistics.mean(r["mal"] for r in rows),
            "all_equal_to_ar": all(r["equal_to_ar"] for r in rows),
            "by_group": {g: statistics.geometric_mean([x for r, x in zip(rows, ratios, strict=True) if r["group"] == g])
                         for g in dict.fromkeys(r["group"] for r in rows)},
        }
        for key in ("call_reduction", "tree_after_pruning", "eta"):
            values = [r[key] for r in rows if r.get(key) is not None]
            if values:
                summary[key] = statistics.mean(values)
        steps = [s for r in rows for s in r.get("steps", [])]
        if steps:
            tree = [s for s in steps if s["hit"] is not None]
            draft_total = sum(s["t_draft"] + s["t_fallback"] for s in steps)
            summary |= {
                "fallback_frequency": sum(not s["hit"] for s in tree) / len(tree) if tree else None,
                "mean_roots": statistics.mean(s["roots"] for s in tree) if tree else 0,
                "hidden_draft_fraction": sum(s["hidden"] for s in steps) / draft_total if draft_total else None,
                "mean_ms": {k: 1e3 * statistics.mean(s[k] for s in steps) for k in (
                    "t_pre", "t_ee", "t_channel", "delta", "t_draft", "t_fv", "t_fallback", "step_s", "eq10_s")},
            }
        out[name] = summary
    return out


def fallback_grid(target, draft, items, max_new, gamma=7, kappas=(1, 2, 4, 8, 16)) -> dict:
    """Vanilla SD (γ fixed, greedy) with the early exit read at N/4, N/2 and 3N/4 (mirrorsd.bench.probe)."""
    prompts = [(group, mirrorsd.api.encode_prompt(target, text)) for group, text in items]
    probe = run_probe(target, draft, prompts, max_new, gamma, kappas)
    grid = {g: {**{name: {str(k): f for k, f in row.items()} for name, row in probe.fallback(g).items()},
                "steps": len(probe.ranks[g][next(iter(probe.exit_layers))]) if g != "all" else
                sum(len(by_exit[next(iter(probe.exit_layers))]) for by_exit in probe.ranks.values())}
            for g in probe.groups()}
    return {"exit_layers": probe.exit_layers, "gamma": gamma, "fallback": grid,
            "mean_accepted": {g: statistics.mean(a) for g, a in probe.accepted.items() if a}}


def gamma_sweep(target, draft, items, max_new, gammas=range(1, 8)) -> dict:
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for gamma in gammas:
        per_group: dict[str, list[int]] = defaultdict(list)
        for group, text in items:
            g = mirrorsd.generate(target, text, method="sd", draft=draft, gamma=gamma, confidence=0.0,
                                  max_new_tokens=max_new)
            per_group[group].extend(g.stats.accepted)
            per_group["all"].extend(g.stats.accepted)
        for group, acc in per_group.items():
            out[group][gamma] = statistics.mean(acc)
        print(f"gamma {gamma}: E[A] overall {out['all'][gamma]:.2f}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--per-group", type=int, default=2, help="Spec-Bench questions per task group")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"speed configurations: {', '.join(CONFIGS)}")
    p.add_argument("--parts", default="speed,fallback,gamma")
    p.add_argument("--groups", help="only these task groups (comma-separated; 'code' is the code prompts)")
    p.add_argument("--out", type=Path, required=True, help="JSON results file")
    args = p.parse_args()
    target, draft = mirrorsd.load_model(args.target), mirrorsd.load_model(args.draft)
    items = prompts(args.per_group)
    if args.groups:
        items = [(group, text) for group, text in items if group in args.groups.split(",")]
    parts = set(args.parts.split(","))
    report = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                         f"torch {torch.__version__}", "target": args.target, "draft": args.draft,
              "weights": target.weights, "max_new_tokens": args.max_new_tokens, "prompts": len(items),
              "runs": args.runs, "date": time.strftime("%Y-%m-%d")}
    if "fallback" in parts:
        report["fallback_grid"] = fallback_grid(target, draft, items, args.max_new_tokens)
        args.out.write_text(json.dumps(report, indent=1))
    if "gamma" in parts:
        report["gamma_sweep"] = gamma_sweep(target, draft, items, args.max_new_tokens)
        args.out.write_text(json.dumps(report, indent=1))
    if "speed" in parts:
        configs = {name: CONFIGS[name] for name in args.configs.split(",")}
        if "ar" not in configs:
            configs = {"ar": CONFIGS["ar"], **configs}
        report["speed"] = speed(target, draft, items, configs, args.max_new_tokens, args.runs)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "speed"}, indent=1))
    print(json.dumps(report.get("speed"), indent=1))


if __name__ == "__main__":
    main()

"""A distilled draft against the stock one, in one run: ``ar`` and ``sd`` with each draft, interleaved per question,
every answer checked equal to ``ar``'s. Reports per draft the tokens per target step (MAT), the draft tokens accepted
per drafted one, tok/s and the median speed-up over ``ar`` per run.

Usage: ``python benchmarks/tuned_draft.py --drafts qwen2.5-coder-0.5b qwen2.5-coder-0.5b-distilled,confidence=0.8
[--suite specbench:2] [--runs 2] [--max-new-tokens 64] [--sd-options suffix_match=0]``: a draft is a name, then
``,key=value`` options of method sd for it alone."""

from __future__ import annotations

import argparse
import json
import statistics

import mirrorsd
from mirrorsd.specbench import load_suite


def _options(pairs: list[str]) -> dict:
    return {k: json.loads(v) if v[:1].isdigit() else v for k, v in (o.split("=", 1) for o in pairs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--drafts", nargs="+", required=True,
                        help="zoo names or tuned-draft names/folders, each with ,key=value sd options of its own")
    parser.add_argument("--suite", default="specbench:2")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sd-options", nargs="*", default=[], metavar="KEY=VALUE",
                        help="options of method sd for every draft (e.g. suffix_match=0: the model drafts alone)")
    parser.add_argument("--out", help="write the per-question rows here as JSON")
    args = parser.parse_args()
    options = _options(args.sd_options)
    target = mirrorsd.load_model(args.target, progress=False)
    models = {spec.split(",")[0]: None for spec in args.drafts}
    models = {name: mirrorsd.load_model(name, progress=False) for name in models}
    drafts = {spec: (models[spec.split(",")[0]], options | _options(spec.split(",")[1:])) for spec in args.drafts}
    questions = load_suite(args.suite)
    warm = [{"role": "user", "content": questions[0].turns[0]}]
    mirrorsd.generate(target, warm, max_new_tokens=8, method="ar")  # untimed: first-use costs fall on no one
    for model, kwargs in drafts.values():
        mirrorsd.generate(target, warm, max_new_tokens=8, method="sd", draft=model, **kwargs)
    rows = []
    for run in range(args.runs):
        for qi, q in enumerate(questions):
            messages = [{"role": "user", "content": q.turns[0]}]
            turns = [None, *drafts]  # None: ar; the order rotates per question and run, so no one always goes first
            shift = (run + qi) % len(turns)
            results = {}
            for name in turns[shift:] + turns[:shift]:
                model, kwargs = drafts[name] if name else (None, {})
                results[name] = mirrorsd.generate(target, messages, max_new_tokens=args.max_new_tokens,
                                                  method="sd" if name else "ar", draft=model, **kwargs)
            ar = results[None]
            for name in drafts:
                g = results[name]
                if g.token_ids != ar.token_ids:
                    raise SystemExit(f"draft {name}, question {q.question_id}: sd differs from ar")
                rows.append({"run": run, "question": q.question_id, "group": q.group, "draft": name,
                             "ar_s": ar.stats.wall_s, "sd_s": g.stats.wall_s, "tokens": g.stats.new_tokens,
                             "steps": g.stats.steps, "accepted": sum(g.stats.accepted),
                             "drafted": sum(g.stats.drafted), "mat": g.stats.mean_accepted_length})
            print(f"run {run} q{q.question_id} {q.group}: " + ", ".join(
                f"{r['draft']} MAT {r['mat']:.2f} {r['ar_s'] / r['sd_s']:.2f}x" for r in rows[-len(drafts):]),
                flush=True)
    print(f"\n{args.target}, suite {args.suite}, {args.max_new_tokens} tokens, {args.runs} runs, sd options {options}; "
          "every answer = ar")
    for name in drafts:
        mine = [r for r in rows if r["draft"] == name]
        per_run = [sum(r["ar_s"] for r in mine if r["run"] == k) / sum(r["sd_s"] for r in mine if r["run"] == k)
                   for k in range(args.runs)]
        steps = sum(r["steps"] for r in mine)
        accepted = sum(r["accepted"] for r in mine)
        print(f"  {name}: MAT {(accepted + steps) / max(1, steps):.2f} tokens/step, accepted/drafted "
              f"{accepted / max(1, sum(r['drafted'] for r in mine)):.3f}, speed vs ar "
              f"{statistics.median(per_run):.2f}x (runs: {', '.join(f'{x:.2f}' for x in per_run)})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

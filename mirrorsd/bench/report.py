"""``report.md`` and PNG plots from a bench's ``results.json`` (also usable on a saved file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..decoding import REFERENCE
from ..sampling import SAMPLING_EPS
from ..specbench import GROUPS
from .metrics import OVERALL

GROUP_TITLES = {"translation": "Translation", "summarization": "Summarization", "qa": "Question Answering",
                "math_reasoning": "Mathematical Reasoning", "rag": "Retrieval Aug. Generation",
                "mt_bench": "Multi-turn Conversation"}
TABLE_ORDER = ("translation", "summarization", "qa", "math_reasoning", "rag", "mt_bench")  # the paper's Table 1
WIDE_LIMIT = 9  # more methods than this: one row per method instead of one column


def _x(s: dict[str, float] | None, spread: bool = False) -> str:
    if not s:
        return "–"
    text = f"{s['median']:.2f}x"
    if spread and len(s["runs"]) > 1:
        text += f" ({s['min']:.2f}–{s['max']:.2f})"
    return text


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def _filters(cfg: dict[str, Any]) -> str:
    """The sampling filters a run used, when any (results of runs before they existed have neither key)."""
    parts = [f"top-k {cfg['top_k']}" if cfg.get("top_k") else "", f"top-p {cfg['top_p']}" if cfg.get("top_p", 1) < 1
             else ""]
    return "".join(f", {p}" for p in parts if p)


def _format(results: dict[str, Any], role: str) -> str:
    """A model's loaded format (an older results file has the target's weights only)."""
    return results.get(f"{role}_format") or results.get(f"{role}_weights") or "?"


def _machine(m: dict[str, Any]) -> str:
    parts = [m.get("cpu", "?"), f"{m.get('cores')} cores", f"{m.get('torch_threads')} torch threads"]
    if m.get("memory_gib"):
        parts.append(f"{m['memory_gib']} GiB RAM")
    if m.get("gpu"):
        parts.append(f"GPU {m['gpu']}")
    parts += [f"torch {m.get('torch')}", f"transformers {m.get('transformers')}", f"python {m.get('python')}"]
    return ", ".join(parts)


def _groups(results: dict[str, Any]) -> list[str]:
    present = {a["group"] for a in results["answers"]}
    return [g for g in TABLE_ORDER if g in present] + sorted(present - set(GROUPS))


def render(results: dict[str, Any], plots: list[str]) -> str:
    cfg, summary = results["config"], results["summary"]
    labels = list(summary)
    groups = _groups(results)
    runs = cfg["runs"]
    lines = [
        f"# mirrorsd bench: {cfg['target']}" + (f" + draft {d}" if (d := results.get("draft", cfg["draft"])) else ""),
        "",
        f"Machine: {_machine(results['machine'])}.",
        f"Suite `{cfg['suite']}` ({results['questions']} questions), max {cfg['max_new_tokens']} new tokens, "
        f"temperature {cfg['temperature']}{_filters(cfg)}, {runs} run(s) (median; range in brackets), "
        f"warm-up {cfg['warmup']}, "
        f"methods interleaved per question with a rotating order; our target `{_format(results, 'target')}`"
        + (f", our draft `{_format(results, 'draft')}`." if results.get("draft") else "."),
        "",
        "Speedup = mean per-question tok/s of the method ÷ that of `ar` in the same run (Spec-Bench's definition); "
        "MAT = mean tokens committed per target step, bonus included; acceptance = accepted ÷ drafted tokens; "
        "draft η̄ = draft tokens per draft forward (1 for an AR draft, more for one drafting with SS streams).",
        "",
    ]
    for note in results.get("notes", []):
        lines.append(f"> {note}")
    if results.get("notes"):
        lines.append("")
    if len(labels) <= WIDE_LIMIT:
        lines += ["## Speedup per task group (layout of the Mirror-SD paper's Table 1)", "",
                  "| Task | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
        for g in groups:
            lines.append(f"| {GROUP_TITLES.get(g, g)} | " + " | ".join(
                _x(summary[m]["speedup"].get(g)) for m in labels) + " |")
        lines.append("| **Overall** | " + " | ".join(_x(summary[m]["speedup"].get(OVERALL), True)
                                                  + (" ✗ not lossless" if diverged(summary[m]) else "")
                                                  for m in labels) + " |")
        lines.append("| MAT | " + " | ".join(_f(summary[m]["mean_accepted_tokens"]) for m in labels) + " |")
        lines.append("")
    lines += ["## Per method", "",
              "| method | tok/s | speedup vs ar | vs own AR | MAT | acceptance | draft η̄ | lossless vs reference "
              "| fallback | hidden draft | call reduction | predicted tok/s (law) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in labels:
        s = summary[m]
        tps = s["tokens_per_s"]
        loss = s["lossless"]
        lossless = ("reference" if m == s["reference"] else f"{loss['equal']}/{loss['checked']} = {s['reference']}"
                    if loss["checked"] else "n/a (sampling)")
        own = _x(s["speedup_vs_reference"].get(OVERALL)) if "speedup_vs_reference" in s else "–"
        lines.append(
            f"| `{m}` | {tps['median']:.2f} ({tps['min']:.2f}–{tps['max']:.2f}) | {_x(s['speedup'].get(OVERALL))} "
            f"| {own} | {_f(s['mean_accepted_tokens'])} | {_f(s.get('acceptance_rate'))} "
            f"| {_f(s.get('draft_tokens_per_forward'))} | {lossless} | {_f(s.get('fallback_frequency'))} "
            f"| {_f(s.get('hidden_draft_fraction'))} | {_f(s.get('call_reduction'))} "
            f"| {_f(s.get('predicted_tokens_per_s'))} |")
    lines.append("")
    lines += _per_position(summary) + _divergences(summary) + _probe(results) + _costs(results)
    table = tradeoff_table([results])
    if table:
        lines += ["## Latency and acceptance vs γ (the Mirror-SD paper's Fig. 3a)", "", *table]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    opts = [f"- `{m}`: {summary[m]['kind']} {summary[m]['options'] or ''}".rstrip() for m in labels]
    lines += ["## Configurations", "", *opts, "",
              "Raw data: `results.json`; Spec-Bench answer files: `answers/<method>.jsonl`.", ""]
    return "\n".join(lines)


def diverged(method: dict[str, Any]) -> bool:
    """Whether any of a method's checked answers differs from its reference's."""
    return method["lossless"]["equal"] < method["lossless"]["checked"]


def _per_position(summary: dict[str, Any]) -> list[str]:
    rows = {m: s["per_position_acceptance"] for m, s in summary.items() if s["per_position_acceptance"]}
    if not rows:
        return []
    depth = min(max(len(v) for v in rows.values()), 12)
    out = ["## Per-position acceptance (share of steps drafting position i that accepted it)", "",
           "| method | " + " | ".join(str(i + 1) for i in range(depth)) + " |", "|---|" + "---|" * depth]
    for m, v in rows.items():
        out.append(f"| `{m}` | " + " | ".join(f"{x:.2f}" if i < len(v) else "" for i, x in
                                                enumerate(v[:depth] + [0.0] * (depth - len(v[:depth])))) + " |")
    return [*out, ""]


def _divergences(summary: dict[str, Any]) -> list[str]:
    rows = [(m, d) for m, s in summary.items() for d in s["lossless"]["divergences"]]
    out = ["## Lossless check", ""]
    if not rows:  # (a reference checked against itself proves nothing: not counted)
        checked = sum(s["lossless"]["checked"] for m, s in summary.items() if m != s["reference"])
        if not checked:
            return [*out, "No answer could be checked token for token (sampling without a shared noise key, or "
                          "no method beside its reference).", ""]
        return [*out, f"Every checked answer ({checked}) equals its AR reference token for token.", ""]
    out += ["| method | question | run | turn | position | reference token | method token | logit gap | verdict |",
            "|---|---|---|---|---|---|---|---|---|"]
    for m, d in rows:
        out.append(f"| `{m}` | {d['question_id']} | {d['run']} | {d['turn']} | {d['position']} | "
                   f"{d['reference_token']} | {d['method_token']} | {_f(d['logit_gap'], '{:.2e}')} | "
                   f"{d['verdict'] or 'n/a'} |")
    return [*out, ""]


def _probe(results: dict[str, Any]) -> list[str]:
    p = results.get("probe")
    if not p:
        return []
    ea = p["expected_accepted"]["all"]
    fb = p["fallback"]["all"]
    kappas = sorted({int(k) for row in fb.values() for k in row})
    decoding = "greedy"
    if (p.get("temperature") or 0) >= SAMPLING_EPS:  # (a probe from before "acceptance" sampled speculatively)
        verified = {"match": "sample-and-match"}.get(p.get("acceptance", "rejection"), "speculative sampling")
        decoding = f"temperature {p['temperature']}, {verified}"
    out = [f"## Acceptance probe (one untimed vanilla-SD pass, γ = {p['gamma']}, {decoding}, {p['steps']} full "
           "windows)",
           "", "E[A_t] vs γ: " + ", ".join(f"γ={g}: {v:.2f}" for g, v in ea.items()), "",
           "Fallback frequency of the `paper` reuse rule (correction not among the exit's top-κ, read through the "
           "exit head decoding reads by default) per κ × ℓe:", "",
           "| ℓe | " + " | ".join(f"κ={k}" for k in kappas) + " |", "|---|" + "---|" * len(kappas)]
    for name, row in fb.items():
        layer = p["exit_layers"][name]
        out.append(f"| {name} (layer {layer}) | " + " | ".join(f"{row[str(k)]:.2f}"
                                                             for k in kappas) + " |")
    draft = p.get("draft_fallback", {}).get("all")
    if draft:  # mirror's candidates=draft
        label = "draft's runner-ups, full vocabulary, N/2 exit at the bonus slot (`candidates=draft:draft_vocab=0`)"
        out.append(f"| {label} | " + " | ".join(f"{draft[str(k)]:.2f}" for k in kappas) + " |")
    omega = p.get("overlap", {}).get("all")
    drawn = p.get("overlap_drawn", {}).get("all") or {}
    if omega:
        out += ["", "Top-κ overlap mass Ω_κ(ℓe) (Eq. 9: the target's probability on the exit's top-κ at the "
                "correction's slot) and Proposition 1's bound on the fallback of a correction drawn from the "
                "target, each cell measured fallback / bound 1 − Ω_κ" + (" / 1 − Ω_κ under the distribution the "
                "correction was drawn from (the residual after a rejection, the argmax's point mass when greedy: "
                "the fallback's own expectation)" if drawn else "") + ":", "",
                "| ℓe | " + " | ".join(f"κ={k}" for k in kappas) + " |", "|---|" + "---|" * len(kappas)]
        for name, row in omega.items():
            own = drawn.get(name, {})
            out.append(f"| {name} | " + " | ".join(
                f"{fb[name][str(k)]:.2f} / {1 - row[str(k)]:.2f}"
                + (f" / {1 - own[str(k)]:.2f}" if str(k) in own else "") for k in kappas) + " |")
    return [*out, ""]


def _costs(results: dict[str, Any]) -> list[str]:
    c = results.get("costs")
    if not c:
        return []
    t = c["target_ms"]
    d = c["draft_ms"]
    line = ", ".join(f"T({n}) {t[str(n)]:.1f}" for n in (1, 2, 4, 8, 16) if str(n) in t)
    if d:
        line += "; draft " + ", ".join(f"D({n}) {d[str(n)]:.1f}" for n in (1, 8, 32, 64) if str(n) in d)
    for vocab, table in c.get("draft_vocab_ms", {}).items():
        line += f"; draft with a {vocab}-id head D(1) {table['1']:.1f}" if "1" in table else ""
    return ["## Measured forward costs (ms, after " + f"{c['context']} cached tokens) for the latency law", "",
            line + ".", "Predicted tok/s applies the law (mirrorsd/bench/plan.py) to each method's own recorded "
            "steps (windows, roots, hits, tree sizes) and measured prefill, run 1.", ""]


# -- plots ---------------------------------------------------------------------------------------------------


PLOTS = ("speedup_by_group.png", "acceptance_vs_gamma.png", "fallback_kappa_exit.png", "step_timeline.png")


def plot_all(results: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    made = []
    for name, fn in zip(PLOTS, (_plot_speedup, _plot_gamma, _plot_fallback, _plot_timeline), strict=True):
        if fn(results, out / name):
            made.append(name)
    if plot_tradeoff([results], out / TRADEOFF_PLOT):
        made.append(TRADEOFF_PLOT)
    return made


TRADEOFF_PLOT = "tradeoff_vs_gamma.png"


def tradeoff_curves(runs: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, float]]]:
    """Methods that differ only in ``gamma``, across one or more runs (each with its own draft), as curves: label
    (kind, draft, the options that tell curves apart) -> γ -> ms per token (median run), accepted draft tokens per
    step (MAT − 1, the paper's E[A_t]), tok/s and whether every answer equalled its reference's. Curves with a
    single γ are left out."""
    points: dict[tuple[str, str, tuple], dict[int, dict[str, float]]] = {}
    for results in runs:
        draft = results["config"].get("draft") or ""
        for s in results["summary"].values():
            gamma = (s.get("options") or {}).get("gamma")
            if gamma is None or s.get("mean_accepted_tokens") is None:
                continue
            rest = tuple(sorted((k, str(v)) for k, v in s["options"].items() if k != "gamma"))
            tps = s["tokens_per_s"]["median"]
            points.setdefault((s["kind"], draft, rest), {})[int(gamma)] = {
                "ms_per_token": 1e3 / tps if tps else float("nan"), "tokens_per_s": tps,
                "accepted": s["mean_accepted_tokens"] - 1, "lossless": not diverged(s)}
    points = {key: c for key, c in points.items() if len(c) > 1}
    shared = set.intersection(*(set(rest) for _, _, rest in points)) if points else set()
    return {" ".join(x for x in (kind, draft, ":".join(f"{k}={v}" for k, v in rest if (k, v) not in shared)) if x):
            dict(sorted(c.items())) for (kind, draft, rest), c in points.items()}


def tradeoff_table(runs: list[dict[str, Any]]) -> list[str]:
    """Markdown: per curve and γ, ms per token and accepted draft tokens per step, beside ``ar`` of each run."""
    curves = tradeoff_curves(runs)
    if not curves:
        return []
    gammas = sorted({g for c in curves.values() for g in c})
    out = ["| curve | " + " | ".join(f"γ={g}" for g in gammas) + " |", "|---|" + "---|" * len(gammas)]
    for label, c in curves.items():
        out.append(f"| {label} | " + " | ".join(
            f"{c[g]['ms_per_token']:.1f} ms, {c[g]['accepted']:.2f}{'' if c[g]['lossless'] else ' ✗'}" if g in c
            else "" for g in gammas) + " |")
    refs = [f"{r['config'].get('draft')}: `ar` {r['summary'][REFERENCE]['tokens_per_s']['median']:.2f} tok/s "
            f"({1e3 / r['summary'][REFERENCE]['tokens_per_s']['median']:.1f} ms per token)"
            for r in runs if REFERENCE in r["summary"]]
    lossy = any(not p["lossless"] for c in curves.values() for p in c.values())
    return [*out, "", "Each cell: latency per token (median run), accepted draft tokens per step (E[A_t])"
            + ("; ✗: **not lossless**, an answer differed from its reference's (the run's report lists where)"
               if lossy else "") + ". " + "; ".join(refs) + ".", ""]


def plot_tradeoff(runs: list[dict[str, Any]], path: Path) -> bool:
    """The Mirror-SD paper's Fig. 3a on our models: latency per token and acceptance against γ, one curve per
    draft and method (two panels where the paper draws one 3-D surface)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = tradeoff_curves(runs)
    if not curves:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    marked = False
    for label, c in curves.items():
        gammas = list(c)
        left.plot(gammas, [c[g]["ms_per_token"] for g in gammas], marker="o", label=label)
        right.plot(gammas, [c[g]["accepted"] for g in gammas], marker="o", label=label)
        lossy = [g for g in gammas if not c[g]["lossless"]]
        for axis, key in ((left, "ms_per_token"), (right, "accepted")):  # a point that is not lossless: a red x
            axis.plot(lossy, [c[g][key] for g in lossy], "x", color="red", ms=10, mew=2,
                      label="not lossless" if lossy and axis is right and not marked else None)
        marked = marked or bool(lossy)
    for r in runs:
        if REFERENCE in r["summary"]:
            left.axhline(1e3 / r["summary"][REFERENCE]["tokens_per_s"]["median"], color="black", lw=0.8, ls=":")
    left.set_xlabel("γ (draft window)")
    left.set_ylabel("latency per token, ms (dotted: ar)")
    right.set_xlabel("γ (draft window)")
    right.set_ylabel("E[A_t], accepted draft tokens per step")
    left.set_title("Latency vs γ (cf. Mirror-SD Fig. 3a)")
    right.set_title("Acceptance vs γ")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plot_speedup(results: dict[str, Any], path: Path) -> bool:
    import matplotlib.pyplot as plt

    summary = results["summary"]
    labels = [m for m in summary if m != REFERENCE]
    groups = [*_groups(results), OVERALL]
    if not labels:
        return False
    fig, ax = plt.subplots(figsize=(min(14, max(7, 0.35 * len(groups) * len(labels))), 4.5))
    width = 0.8 / len(labels)
    for i, m in enumerate(labels):
        values = [summary[m]["speedup"].get(g, {}).get("median", 0) for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=m)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))],
                  [GROUP_TITLES.get(g, g).replace(" ", "\n", 1) for g in groups], fontsize=8)
    ax.set_ylabel("speedup over ar (tok/s ratio)")
    ax.set_title(f"{results['config']['target']}: speedup per task group")
    ax.legend(fontsize=7, ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _line_plot(path: Path, curves: dict[str, dict[str, float]], xlabel: str, ylabel: str, title: str,
               log2: bool = False, bold: str | None = None, dashed: dict[str, dict[str, float]] | None = None) -> bool:
    """One line per label over integer x values (JSON's string keys); ``dashed``: more curves, each in the colour of
    the solid one at the same place (a bound beside what it bounds)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs: list[int] = []
    colours = []
    for label, curve in curves.items():
        xs = sorted(int(x) for x in curve)
        line, = ax.plot(xs, [curve[str(x)] for x in xs], marker="o", lw=2.5 if label == bold else 1, label=label)
        colours.append(line.get_color())
    for (label, curve), colour in zip((dashed or {}).items(), colours, strict=False):
        xs = sorted(int(x) for x in curve)
        ax.plot(xs, [curve[str(x)] for x in xs], ls="--", color=colour, lw=1, label=label)
    if log2:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plot_gamma(results: dict[str, Any], path: Path) -> bool:
    p = results.get("probe")
    if not p:
        return False
    curves = {GROUP_TITLES.get(g, g): c for g, c in p["expected_accepted"].items() if c}
    return _line_plot(path, curves, "γ (draft window)", "E[A_t] (accepted draft tokens per step)",
                      "Acceptance vs γ (cf. Mirror-SD Fig. 3b)", bold="all")


def _plot_fallback(results: dict[str, Any], path: Path) -> bool:
    p = results.get("probe")
    if not p or not p["fallback"]["all"]:
        return False
    curves = {f"ℓe = {name} (layer {p['exit_layers'][name]})": row for name, row in p["fallback"]["all"].items()}
    bounds = {f"1 − Ω_κ, ℓe = {name}": {k: 1 - v for k, v in row.items()}
              for name, row in p.get("overlap", {}).get("all", {}).items()}
    return _line_plot(path, curves, "κ (early-exit candidates per position)", "fallback frequency",
                      "Fallback vs κ × ℓe, dashed: Prop. 1's bound (cf. Mirror-SD Fig. 7)", log2=True, dashed=bounds)


def _plot_timeline(results: dict[str, Any], path: Path) -> bool:
    """One Mirror-SD step from the middle of the first traced generation: target and draft lanes."""
    import matplotlib.pyplot as plt

    tl = results.get("timeline")
    if not tl:
        return False
    spans = tl["spans"]
    starts = [s for s in spans if s["lane"] == "target" and s["name"] == "layers < ℓe"]
    if not starts:
        return False
    mid = len(starts) // 2
    t0 = starts[mid]["start"]
    t1 = starts[mid + 1]["start"] if mid + 1 < len(starts) else max(s["end"] for s in spans)
    chosen = [s for s in spans if s["end"] > t0 and s["start"] < t1]
    lanes = ["target", "draft"]
    fig, ax = plt.subplots(figsize=(9, 2.6))
    colors = plt.get_cmap("tab10")
    names = list(dict.fromkeys(s["name"] for s in chosen))
    for s in chosen:
        y = lanes.index(s["lane"]) if s["lane"] in lanes else 2
        ax.barh(y, 1e3 * (s["end"] - s["start"]), left=1e3 * (s["start"] - t0), height=0.6,
                color=colors(names.index(s["name"]) % 10), label=s["name"])
    handles, texts = ax.get_legend_handles_labels()
    unique = dict(zip(texts, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.45),
              ncols=4)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("ms from the step's start")
    ax.set_title(f"One Mirror-SD step ({tl['method']}): the draft's rollout overlaps the target's upper layers")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def clear_report(out: Path) -> None:
    """Remove what :func:`write_report` made of an earlier run in ``out``: a plot this run does not draw (or a report
    it does not reach, when stopped) would sit beside its results as if it were theirs."""
    for name in ("report.md", *PLOTS, TRADEOFF_PLOT):
        (out / name).unlink(missing_ok=True)


def write_report(results: dict[str, Any], out: Path) -> Path:
    """Plots and ``report.md`` in ``out``; ``results`` as written to (or read from) ``results.json``."""
    results = json.loads(json.dumps(results))  # JSON's string keys throughout, saved or fresh
    plots = plot_all(results, out)
    path = out / "report.md"
    path.write_text(render(results, plots), encoding="utf-8")
    return path

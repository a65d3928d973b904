"""``mirrorsd train-exit``: fit the tuned early exit (:mod:`mirrorsd.exit_heads`) of a model in closed form.

The frozen model runs once over offline text. For every chosen layer ℓ the fit needs only two running sums,
``XᵀX`` and ``XᵀY`` (X: unit-RMS layer-ℓ states with a bias column, Y: unit-RMS final states), so the
states are never stored and the ridge solution ``A = (XᵀX + λI)⁻¹ (XᵀY + λA₀)`` is exact for any amount of
data. The ridge pulls towards ``A₀ = [I; 0]``, the plain logit lens, so a strong λ falls back to the paper's
exit rather than to nothing; λ is chosen on held-out windows.
Held-out chunks measure what Mirror-SD needs: how often the target's own next token (the final layer's
argmax) is among the exit's top-κ, for the plain logit lens and the tuned exit. They are split in two: the
first half (validation) picks λ and the KL step, the second (test) is what gets reported, so a reported hit rate
is never the maximum over the candidates it chose between. The sums are additive, so the learning curve
(held-out hit rate against training tokens) costs a solve per point, not a retraining.

Optionally (:class:`KLRefine`) the ridge fit is then fine-tuned by gradient descent on KL(final ‖ exit), the
tuned lens's own objective (Belrose et al. 2023), over the restricted vocabulary the exit reads by default. The
states are kept for that (bf16, ~6 KB per token and layer on a 1.5B), and validation checks keep the best step,
so a refinement that does not help leaves the ridge fit in place.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .draft_vocab import default_size, head_weight, load_table
from .exit_heads import ExitTranslators, unit_rms
from .model import Transformer
from .training import make_chunks

KAPPAS = (1, 4, 8, 16)
RIDGES = (1.0, 10.0, 100.0, 1000.0, 10000.0)
# Chat prompts for self-distillation: about stdlib modules, so no benchmark question is among them.
TOPICS = ("itertools", "functools", "collections", "pathlib", "json", "re", "datetime", "asyncio", "subprocess",
          "argparse", "logging", "dataclasses", "typing", "unittest", "sqlite3", "csv", "random", "statistics",
          "heapq", "bisect", "contextlib", "threading", "socket", "hashlib", "shutil", "tempfile", "textwrap", "enum")
TEMPLATES = ("Explain what Python's `{}` module is for, with a short example.",
             "Write a small Python program that uses the `{}` module, and explain how it works.",
             "What are common mistakes people make with Python's `{}` module, and how do you avoid them?")


def distill_prompts(count: int) -> list[str]:
    prompts = [t.format(m) for t in TEMPLATES for m in TOPICS]
    if count > len(prompts):
        raise ValueError(f"at most {len(prompts)} self-distillation prompts, got {count}")
    return prompts[:count]


def self_distilled(loaded: Any, count: int, max_new_tokens: int, progress: bool = True) -> list[torch.Tensor]:
    """Chat transcripts (template, prompt and the model's own greedy answer) for ``count`` prompts: the text
    Mirror-SD's exit reads when it decodes chat, which stdlib source and reference prose are not."""
    from .api import generate
    from .decoding import REFERENCE

    out = []
    for prompt in tqdm(distill_prompts(count), desc="self-distilling", disable=not progress):
        g = generate(loaded, prompt, method=REFERENCE, max_new_tokens=max_new_tokens)
        out.append(torch.tensor(g.prompt_ids + g.token_ids))
    return out


def _states(model: Transformer, ids: torch.Tensor, layers: list[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Unit-RMS states ``[T, d]`` after each of ``layers`` and the final layer's raw state."""
    positions = torch.arange(ids.shape[0], device=model.device)[None]
    hidden, start, out = model.embed(ids[None].to(model.device)), 0, {}
    for layer in [*layers, model.config.n_layers]:
        hidden = model.run_layers(hidden, positions, None, None, start=start, end=layer)
        start = layer
        if layer < model.config.n_layers:
            out[layer] = unit_rms(hidden[0]).double()
    return out, hidden[0]


def _with_bias(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], dim=1)


def _greedy(model: Transformer, final: torch.Tensor) -> torch.Tensor:
    """The model's greedy next token at every row of its raw final states (in batches: a 152k head is large)."""
    return torch.cat([model.logits(final[None, i:i + 1024])[0].argmax(-1) for i in range(0, len(final), 1024)])


def _corrections(draft: Transformer, ids: torch.Tensor, want: torch.Tensor,
                 answer: torch.Tensor | None) -> torch.Tensor:
    """Rows where ``draft``'s greedy next token differs from the target's (``want``): where Mirror-SD's early exit
    has to hold the correction. With answer marks, only rows whose next token the model wrote (a window Mirror-SD
    verifies is always the model's own text)."""
    hard = _greedy(draft, _states(draft, ids, [])[1]) != want
    if answer is not None:
        hard &= torch.cat([answer[1:].bool(), torch.zeros(1, dtype=torch.bool)])
    return hard


def _selecting_kappa(kappas: tuple[int, ...]) -> int:
    """The κ whose held-out hit rate picks the ridge λ and the best KL step: Mirror-SD's κ = 8 when measured."""
    return 8 if 8 in kappas else max(kappas)


def _rates(hits: dict[int, float]) -> dict[str, float]:
    return {f"top{k}": round(v, 4) for k, v in hits.items()}


def _hits(model: Transformer, hidden: torch.Tensor, want: torch.Tensor, kappas: tuple[int, ...]) -> dict[int, float]:
    """Share of rows whose ``want`` token is among the top-κ of the head on ``hidden`` (rows in batches: the
    logits of a 152k vocabulary are large)."""
    hit = {k: 0 for k in kappas}
    for i in range(0, hidden.shape[0], 256):
        top = model.logits(hidden[None, i:i + 256].float())[0].topk(max(kappas), dim=-1).indices
        for k in kappas:
            hit[k] += int((top[:, :k] == want[i:i + 256, None]).any(-1).sum())
    return {k: hit[k] / hidden.shape[0] for k in kappas}


@dataclass(frozen=True)
class KLRefine:
    """Gradient steps on KL(final ‖ exit) after the ridge fit. 300 steps of 256 tokens at 1e-4 (Adam) measured
    best on the 1.5B's N/2 exit (3e-4 overfits the 32k training tokens sooner)."""

    steps: int = 300
    lr: float = 1e-4
    batch: int = 256
    vocab: int | None = None  # ids the KL runs over: None = the exit's default restricted vocabulary, 0 = all
    checks: int = 6  # held-out evaluations (the best one is kept)
    # Weight of a top-κ hinge added to the KL (0: KL alone). Mirror-SD needs the final token inside the exit's
    # top-κ, not the whole distribution right: the hinge pushes that token above the κ-th likeliest other one.
    topk_weight: float = 0.0
    topk_kappa: int = 8


def topk_hinge(log_probs: torch.Tensor, want: torch.Tensor, kappa: int, margin: float = 1.0) -> torch.Tensor:
    """Mean softplus(margin + z_κ − z_want), z_κ the κ-th largest log-probability among the other ids: zero
    gradient once ``want`` is clear of the κ-th rival, so the loss spends itself on rows outside the top-κ."""
    mine = log_probs.gather(-1, want[:, None])[:, 0]
    rivals = log_probs.scatter(-1, want[:, None], float("-inf"))
    kth = rivals.topk(kappa, dim=-1).values[:, -1]
    return torch.nn.functional.softplus(margin + kth - mine).mean()


class _RestrictedHead:
    """The model's final norm + LM head as differentiable dense math on a subset of ids (the kernels' quantized
    head has no backward), for the KL's both sides."""

    def __init__(self, model: Transformer, vocab: int | None) -> None:
        size = model.config.vocab_size
        if vocab is None:
            vocab = default_size(size)
        weight = head_weight(model.lm_head, model.embed_tokens.weight, model.config.tie_word_embeddings)
        if 0 < vocab < size:
            weight = weight[load_table(size)[:vocab].to(weight.device)]
        self.weight = weight.float().contiguous()
        self.norm = model.norm.weight.float()
        self.vocab = self.weight.shape[0]

    def log_probs(self, state: torch.Tensor) -> torch.Tensor:
        return ((unit_rms(state) * self.norm) @ self.weight.T).log_softmax(-1)


def refine_kl(model: Transformer, start: torch.Tensor, states: torch.Tensor, finals: torch.Tensor,
              held: torch.Tensor, want: torch.Tensor, opts: KLRefine, kappas: tuple[int, ...] = KAPPAS,
              seed: int = 0, progress: bool = True, desc: str = "KL", weights: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[int, float], dict[str, Any]]:
    """Fine-tune translator ``start`` on unit-RMS ``states`` → final ``finals`` (rows matched) by KL to the
    final distribution (plus :func:`topk_hinge` on its argmax when ``opts.topk_weight``), drawing rows in
    proportion to ``weights`` (None: uniformly). Returns the best translator by top-8 on the ``held`` rows (``start``
    itself when no step beats it), its hit rates there, and a record (vocabulary, best step, the ``held`` rows' curve
    over steps). The rows are chosen on, so :func:`fit_exit` passes validation rows and reports on others."""
    head = _RestrictedHead(model, opts.vocab)
    gen = torch.Generator().manual_seed(seed)
    a = start.clone().requires_grad_()
    optimiser = torch.optim.Adam([a], lr=opts.lr)
    kappa = _selecting_kappa(kappas)
    best = (_hits(model, _with_bias(held) @ start, want, kappas), 0, start)
    curve = [{"step": 0, **_rates(best[0])}]
    every = max(1, opts.steps // opts.checks)
    bar = tqdm(range(1, opts.steps + 1), desc=desc, disable=not progress)
    for step in bar:
        if weights is None:
            rows = torch.randint(0, states.shape[0], (opts.batch,), generator=gen)
        else:
            rows = torch.multinomial(weights, opts.batch, replacement=True, generator=gen)
        rows = rows.to(states.device)
        with torch.no_grad():
            target = head.log_probs(finals[rows].float())
        exit_lp = head.log_probs(_with_bias(states[rows].float()) @ a)
        kl = (target.exp() * (target - exit_lp)).sum(-1).mean()
        hinge = topk_hinge(exit_lp, target.argmax(-1), opts.topk_kappa) if opts.topk_weight else None
        loss = kl if hinge is None else kl + opts.topk_weight * hinge
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if step % every == 0 or step == opts.steps:
            with torch.no_grad():
                hits = _hits(model, _with_bias(held) @ a, want, kappas)
            terms = {"kl": round(kl.item(), 4)} | ({} if hinge is None else {"hinge": round(hinge.item(), 4)})
            curve.append({"step": step, **terms, **_rates(hits)})
            if hits[kappa] > best[0][kappa]:
                best = (hits, step, a.detach().clone())
            bar.set_postfix_str(f"KL {kl.item():.3f}, top{kappa} {hits[kappa]:.3f} (best {best[0][kappa]:.3f})")
    return best[2], best[0], {"vocab": head.vocab, "best_step": best[1], "curve": curve}


class _HeldRows:
    """Held-out windows' layer states, the model's greedy next tokens on them, and (with a corrections draft) the
    rows where that draft disagrees: the rows Mirror-SD's exit must get right."""

    def __init__(self, model: Transformer, windows: list, layers: list[int], corrections: Transformer | None,
                 progress: bool, desc: str) -> None:
        xs: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
        wants, hard = [], []
        for ids, answer in tqdm(windows, desc=desc, disable=not progress):
            states, final = _states(model, ids, layers)
            for layer in layers:
                xs[layer].append(states[layer])
            wants.append(_greedy(model, final))
            if corrections is not None:
                hard.append(_corrections(corrections, ids, wants[-1], answer))
        self.want = torch.cat(wants)
        self.states = {layer: torch.cat(x) for layer, x in xs.items()}
        self.hard = torch.cat(hard).nonzero()[:, 0] if corrections is not None else None
        if self.hard is not None and not len(self.hard):
            raise ValueError(f"the {len(windows)} held-out {desc.split()[0]} window(s) hold no row where the draft "
                             "and the model disagree on text the model wrote (half of --held-out choose λ and the KL "
                             "step, half are reported, and each half needs such rows): give more held-out windows, "
                             "or data with the model's own answers")


def fit_exit(model: Transformer, tokenizer, texts: list[str | list[int]], layers: list[int], *, chunks: int = 64,
             held_out: int = 8, seq_len: int = 256, ridges: tuple[float, ...] = RIDGES,
             kappas: tuple[int, ...] = KAPPAS, seed: int = 0, progress: bool = True,
             transcripts: list[torch.Tensor] = (), refine: KLRefine | None = None,
             corrections: Transformer | None = None, correction_weight: float = 4.0) -> ExitTranslators:
    """Fit translators for ``layers`` on ``chunks`` windows of ``seq_len`` tokens of ``texts`` plus whole
    ``transcripts`` (:func:`self_distilled`), ``held_out`` of the shuffled windows kept out (half to choose λ and the
    KL step, half to report), then (``refine``) fine-tune each by KL; ``meta`` holds the recipe, the test windows'
    top-κ hit rates (lens, ridge, tuned) and the learning curves.

    ``corrections``: a draft model whose disagreements with the target mark the rows Mirror-SD's exit must get
    right (the correction after a rejected draft token; issue 17 measured these as the hard tokens). Those rows
    count ``correction_weight`` times in the ridge sums and the KL's row draws, the test hit rates are also
    reported on them, and λ and the KL step are chosen by the validation windows' ones."""
    n_layers = model.config.n_layers
    bad = [layer for layer in layers if not 0 < layer < n_layers]
    if bad:
        raise ValueError(f"exit layers must be in 1..{n_layers - 1}, got {bad}")
    if corrections is not None and corrections.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"the corrections' draft has a vocabulary of {corrections.config.vocab_size} tokens, the "
                         f"model {model.config.vocab_size}: it must share the model's tokenizer")
    if correction_weight < 1:
        raise ValueError(f"correction_weight must be at least 1, got {correction_weight}")
    if held_out < 2:
        raise ValueError(f"held_out must be at least 2 windows (half pick λ and the KL step, half are reported), "
                         f"got {held_out}")
    windows = [(c.ids, c.answer) for c in make_chunks(tokenizer, texts, seq_len, chunks + held_out, seed)]
    windows += [(t, None) for t in transcripts]
    random.Random(seed).shuffle(windows)
    test, train = windows[:held_out], windows[held_out:]
    d = model.config.hidden_size
    start = time.perf_counter()
    with torch.inference_mode():
        # Validation picks λ and the KL step; the test rows, never chosen on, are what ``meta`` reports.
        val = _HeldRows(model, test[:held_out // 2], layers, corrections, progress, "validation states")
        tst = _HeldRows(model, test[held_out // 2:], layers, corrections, progress, "test states")

        def scores(layer: int, a: torch.Tensor | None, rows: _HeldRows = tst) -> dict[str, dict[int, float]]:
            """Hit rates on all ``rows`` and on their corrections (``a`` None: the lens itself, since the final
            RMSNorm ignores the unit-RMS scale)."""
            x = rows.states[layer].float() if a is None else _with_bias(rows.states[layer]).float() @ a
            out = {"all": _hits(model, x, rows.want, kappas)}
            if rows.hard is not None:
                out["corrections"] = _hits(model, x[rows.hard], rows.want[rows.hard], kappas)
            return out

        chosen = "all" if corrections is None else "corrections"  # what picks λ and the KL step
        lens = {layer: scores(layer, None) for layer in layers}

        gram = {layer: torch.zeros(d + 1, d + 1, dtype=torch.float64) for layer in layers}
        cross = {layer: torch.zeros(d + 1, d, dtype=torch.float64) for layer in layers}
        checkpoints = sorted({max(1, len(train) * f // 8) for f in (1, 2, 4, 8)})
        seen = marked = 0
        curve: list[dict[str, Any]] = []
        best: dict[int, tuple[float, float, torch.Tensor, dict[str, dict[int, float]]]] = {}
        kept: dict[int | str, list[torch.Tensor]] = {key: [] for key in [*layers, "final", "w"]} if refine else {}
        bar = tqdm(train, desc="fitting exits", disable=not progress)
        for n, (ids, answer) in enumerate(bar, 1):
            states, final = _states(model, ids, layers)
            seen += len(ids)
            w = torch.ones(len(ids), dtype=torch.float64)
            if corrections is not None:
                rows = _corrections(corrections, ids, _greedy(model, final), answer)
                marked += int(rows.sum())
                w[rows] = correction_weight
            root = w.sqrt()[:, None]
            y = unit_rms(final).double()
            if refine:
                kept["final"].append(y.to(torch.bfloat16))
                kept["w"].append(w)
            for layer in layers:
                if refine:
                    kept[layer].append(states[layer].to(torch.bfloat16))
                x = _with_bias(states[layer]) * root
                gram[layer] += x.T @ x
                cross[layer] += x.T @ (y * root)
            if n not in checkpoints:
                continue
            point: dict[str, Any] = {"train_tokens": seen}
            eye = torch.eye(d + 1, dtype=torch.float64)
            identity = eye[:, :d]  # [I; 0]: the logit lens itself, which the ridge pulls towards
            for layer in layers:
                scored = []
                for ridge in ridges:
                    a = torch.linalg.solve(gram[layer] + ridge * eye, cross[layer] + ridge * identity).float()
                    picked = scores(layer, a, val)[chosen][_selecting_kappa(kappas)]
                    scored.append((picked, ridge, a))
                top = max(scored, key=lambda s: s[0])
                best[layer] = (*top, scores(layer, top[2]))
                point[str(layer)] = {"ridge": top[1], **_rates(best[layer][3]["all"])}
                if corrections is not None:
                    point[str(layer)]["corrections"] = _rates(best[layer][3]["corrections"])
            curve.append(point)
            bar.set_postfix_str(", ".join(f"ℓ{layer} top8 {best[layer][3][chosen].get(8, 0):.2f}" for layer in layers))
    ridge_hits = {layer: best[layer][3] for layer in layers}
    refined: dict[int, dict[str, Any]] = {}
    if refine:
        finals, weights = torch.cat(kept.pop("final")), torch.cat(kept.pop("w"))
        select = slice(None) if val.hard is None else val.hard
        for layer in layers:
            a, _, refined[layer] = refine_kl(model, best[layer][2], torch.cat(kept.pop(layer)), finals,
                                             val.states[layer][select].float(), val.want[select], refine, kappas,
                                             seed, progress, desc=f"KL, layer {layer}",
                                             weights=None if corrections is None else weights)
            best[layer] = (best[layer][0], best[layer][1], a, scores(layer, a))

    rates = {}
    for layer in layers:
        row = {"lens": _rates(lens[layer]["all"]), "tuned": _rates(best[layer][3]["all"]), "ridge": best[layer][1]}
        if refine:
            row |= {"ridge_fit": _rates(ridge_hits[layer]["all"]), "kl": refined[layer]}
        if corrections is not None:
            row["corrections"] = {"rows": len(tst.hard), "lens": _rates(lens[layer]["corrections"]),
                                  "tuned": _rates(best[layer][3]["corrections"]),
                                  **({"ridge_fit": _rates(ridge_hits[layer]["corrections"])} if refine else {})}
        rates[str(layer)] = row
    meta = {
        "kind": "tuned-lens (affine, closed-form ridge on unit-RMS states"
                + (", then KL to the final distribution)" if refine else ")"),
        "hidden_size": d, "n_layers": n_layers, "layers": layers,
        "recipe": {"chunks": chunks, "held_out": held_out, "seq_len": seq_len, "train_tokens": seen,
                   "held_out_tokens": len(val.want) + len(tst.want),
                   "validation_tokens": len(val.want), "reported_on": "test (held-out, not used to choose)",
                   "self_distilled_transcripts": len(transcripts),
                   "ridges_tried": list(ridges), "seed": seed, "labels": "the model's own greedy next token",
                   **({"kl": asdict(refine)} if refine else {}),
                   **({"corrections": {"weight": correction_weight, "train_rows": marked,
                                       "selected_by": "validation top-8 on the corrections"}}
                      if corrections is not None else {})},
        "held_out": rates,
        "curve": curve,
        "fit_s": round(time.perf_counter() - start, 1),
    }
    return ExitTranslators({layer: best[layer][2] for layer in layers}, meta)


def plot_curve(meta: dict[str, Any], path: Path) -> None:
    """Held-out top-8 hit rate against training tokens per layer (ridge fits; dotted: on the draft's corrections
    when the fit marked them), the KL-refined exit as a star at the full data, the lens as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for i, layer in enumerate(meta["layers"]):
        colour = f"C{i}"
        xs = [p["train_tokens"] for p in meta["curve"]]
        ax.plot(xs, [p[str(layer)]["top8"] for p in meta["curve"]], "o-", color=colour,
                label=f"tuned, layer {layer}/{meta['n_layers']}")
        held = meta["held_out"][str(layer)]
        if "kl" in held:
            ax.plot([xs[-1]], [held["tuned"]["top8"]], "*", ms=12, color=colour, label=f"+ KL, layer {layer}")
        ax.axhline(meta["held_out"][str(layer)]["lens"]["top8"], color=colour, ls="--", lw=1,
                   label=f"logit lens, layer {layer}")
        if "corrections" in held:  # the rows a draft gets wrong, which the exit must hold for Mirror-SD
            ax.plot(xs, [p[str(layer)]["corrections"]["top8"] for p in meta["curve"]], "s:", color=colour,
                    label=f"tuned, layer {layer}, on the draft's corrections")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out: next token in the exit's top-8")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

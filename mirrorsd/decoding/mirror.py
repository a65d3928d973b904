"""``mirror``: Mirror Speculative Decoding (Bhendawade et al. 2025, arXiv 2510.13161), per-position reading.

One step, with committed text ending in ``a`` (the target cache holds everything before it) and the current
draft window ``d_1..d_w``:

1. The target runs layers ``[0, ℓe)`` on ``[a, d_1..d_w]``.
2. **Early exit**: the target's own final norm + LM head on those hidden states; the top-κ ids and log-probs
   at each of the ``w+1`` positions form the token-channel message. Only ids and log-probs cross, never
   logits.
3. **In parallel** (an :mod:`~mirrorsd.runtime` executor): the target runs ``[ℓe, N)`` and verifies, while
   the draft rolls out, for every root ``(j, v)``, a γ-token continuation of ``(committed, a, d_1..d_j, v)``.
   All roots go through the draft together, one tree-masked forward per draft step over the shared prefix
   cache (branch tokens are appended after the spine; masks say who sees whom).
4. **Verification** is vanilla SD's (:mod:`mirrorsd.verify`): ``A`` tokens accepted, the target's own
   token ``c`` at slot ``A+1`` (correction, or bonus after full acceptance).
5. **Reuse**: hit iff the root ``(A, c)`` was rolled out -- in ``paper`` mode, iff ``c`` is among the top-κ
   early-exit candidates of position ``A``, the position that predicts slot ``A+1``. Its rollout is the next
   window at once and the draft cache is compacted to that branch. Miss (fallback): a fresh rollout from
   ``(committed, c)``, whose time is exposed.
6. ``A + 1`` tokens are committed and the target cache is truncated to them.

The first window after prefill comes from an ordinary rollout. Every committed token is the target's own,
so the output equals ``ar``; the branch rolled out for ``(A, c)`` is exactly the window vanilla SD's draft
would propose after that step (same context, same position-keyed noise), so the accepted lengths equal
``sd``'s with the same draft and ``confidence`` (the paper's parity claim, App. B).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from ..kv_cache import KVCache
from ..model import Transformer
from ..runtime import Executor, Span, Tracer, make_executor
from ..runtime.trace import overlap
from ..sampling import DRAFT_STREAM, TARGET_STREAM, SamplingParams, probabilities, sample
from ..streams import StreamAdapters, load_adapters
from ..verify import ACCEPTANCE_RULES, Verdict, verify_match, verify_rejection
from . import ss
from .base import DecodeRequest
from .sd import check_draft, draft_tokens, propose, window_end

DEFAULT_GAMMA = 7  # the paper's window
DEFAULT_KAPPA = 8  # the paper's top-κ at batch size 1
DEFAULT_EXIT = 0.5  # ℓe = N/2
ROOT_MODES = ("paper", "budget")


@dataclass(frozen=True)
class MirrorOptions:
    gamma: int = DEFAULT_GAMMA
    kappa: int = DEFAULT_KAPPA
    exit_layer: int | float = DEFAULT_EXIT
    roots: str = "paper"
    budget: int | None = None  # roots="budget": fixed number of roots; None = fit the rollouts into Δ
    backend: str = "serial"
    threads: tuple[int, int] | None = None  # (target, draft) intra-op threads while they overlap
    acceptance: str = "match"
    confidence: float = 0.0
    draft_streams: Any = None  # Speculative Streaming adapter of the draft: fresh rollouts then take SS passes

    @classmethod
    def parse(cls, options: dict[str, Any], n_layers: int, vocab: int) -> tuple[MirrorOptions, int]:
        """Validated options and the resolved exit layer index ℓe (layers ``[0, ℓe)`` run before the exit)."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown options for method 'mirror': {unknown}")
        threads = options.get("threads")
        if isinstance(threads, str):
            try:
                threads = tuple(int(x) for x in threads.split(","))
            except ValueError:
                raise ValueError(f"threads must be 'TARGET,DRAFT' thread counts, got {threads!r}") from None
        opts = cls(**{**options, "threads": threads})
        if opts.gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {opts.gamma}")
        if not 1 <= opts.kappa <= vocab:
            raise ValueError(f"kappa must be in 1..{vocab} (the vocabulary), got {opts.kappa}")
        if opts.roots not in ROOT_MODES:
            raise ValueError(f"roots must be one of {ROOT_MODES}, got {opts.roots!r}")
        if opts.budget is not None and (opts.roots != "budget" or opts.budget < 1):
            raise ValueError("budget takes a positive number of roots, with roots='budget'")
        if opts.threads is not None and (len(opts.threads) != 2 or min(opts.threads) < 1):
            raise ValueError(f"threads must be two positive counts (target, draft), got {opts.threads}")
        if opts.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {opts.acceptance!r}")
        if not 0.0 <= opts.confidence < 1.0:
            raise ValueError(f"confidence must be in [0, 1), got {opts.confidence}")
        return opts, resolve_exit_layer(opts.exit_layer, n_layers)


def resolve_exit_layer(exit_layer: int | float, n_layers: int) -> int:
    """An index in ``1..N-1``, or a fraction of the depth in (0, 1) (``0.5`` is the paper's N/2)."""
    if isinstance(exit_layer, float) and not exit_layer.is_integer():
        if not 0 < exit_layer < 1:
            raise ValueError(f"a fractional exit layer must be in (0, 1), got {exit_layer}")
        index = round(exit_layer * n_layers)
    else:
        index = int(exit_layer)
    if not 1 <= index <= n_layers - 1:
        raise ValueError(f"the exit layer must be in 1..{n_layers - 1} for a {n_layers}-layer target "
                         f"(or a fraction in (0, 1)), got {exit_layer}")
    return index


# -- token channel and root selection ------------------------------------------------------------------


@dataclass(frozen=True)
class ChannelMessage:
    """What crosses the token channel at the early exit: ids and bf16 log-probs, nothing else."""

    ids: list[list[int]]  # [w+1][κ]: row j holds the candidates for slot j+1 (after a, d_1..d_j), best first
    logprobs: list[list[float]]  # [w+1][κ]

    def candidates(self, window: list[int], j: int) -> list[int]:
        """Position j's candidates that can be a correction: a correction never equals the draft token it
        replaces (at j = w, the bonus slot, all of them can)."""
        return [v for v in self.ids[j] if j >= len(window) or v != window[j]]


def early_exit(target: Transformer, hidden: torch.Tensor, kappa: int, params: SamplingParams) -> ChannelMessage:
    """Top-κ of the target's own head on layer-ℓe hidden states (at the sampling temperature, raw if greedy)."""
    logits = target.logits(hidden)[0]
    if not params.greedy:
        logits = logits / params.temperature
    top = logits.log_softmax(-1).topk(kappa, dim=-1)
    return ChannelMessage(top.indices.tolist(), top.values.to(torch.bfloat16).float().tolist())  # the paper's bf16


def select_roots(msg: ChannelMessage, window: list[int], mode: str, scorer: RootScorer | None = None,
                 budget: int = 0) -> list[tuple[int, int]]:
    """Roots ``(position j, candidate v)`` to roll out: ``paper``, all ``(w+1)·κ`` top-κ candidates;
    ``budget``, the ``budget`` roots the scorer rates most likely to be this step's correction."""
    if mode == "paper":
        return [(j, v) for j, ids in enumerate(msg.ids) for v in ids]
    assert scorer is not None
    return scorer.select(msg, window, budget)


class RootScorer:
    """The ``budget`` estimator: P(root (j, v) is the correction) = P(A = j) · P(c = v | A = j), both read off
    the early-exit candidates and calibrated on the generation's own past steps.

    * P(A = j) = Π_{i<j} a(d_{i+1}) · (1 − a(d_{j+1})), without the last factor at j = w (the bonus slot); a(d)
      is the observed acceptance rate of draft tokens that are (or are not) the early exit's top candidate at
      their position.
    * P(c = v | A = j) is the observed frequency of corrections at v's early-exit rank among the candidates
      that can be corrections (:meth:`ChannelMessage.candidates`); the last bin counts "none of them".

    Mid-layer probabilities are not taken at face value: the logit lens at N/2 is badly calibrated. Multiplying
    them along the window put the chance of reaching the bonus slot far below what the Qwen pair showed (its
    code windows were mostly accepted whole), so every root went to the first positions and none hit.
    """

    def __init__(self, kappa: int) -> None:
        self.accepts = {True: [3.0, 1.0], False: [1.0, 3.0]}  # agrees with the exit's top-1 -> [accepted, rejected]
        self.ranks = [0.5**r for r in range(kappa)] + [0.5**kappa]  # pseudo-counts per rank, last = not a candidate

    def acceptance(self, msg: ChannelMessage, window: list[int], j: int) -> float:
        accepted, rejected = self.accepts[window[j] == msg.ids[j][0]]
        return accepted / (accepted + rejected)

    def select(self, msg: ChannelMessage, window: list[int], budget: int) -> list[tuple[int, int]]:
        total = sum(self.ranks)
        scored: list[tuple[float, int, int, int]] = []
        reach = 1.0
        for j in range(len(msg.ids)):
            stop = 1.0 - self.acceptance(msg, window, j) if j < len(window) else 1.0
            for rank, v in enumerate(msg.candidates(window, j)):
                scored.append((-reach * stop * self.ranks[rank] / total, j, rank, v))
            if j < len(window):
                reach *= self.acceptance(msg, window, j)
        scored.sort()
        return [(j, v) for _, j, _, v in scored[:budget]]

    def observe(self, msg: ChannelMessage, window: list[int], accepted: int, correction: int) -> None:
        for j in range(min(accepted + 1, len(window))):
            self.accepts[window[j] == msg.ids[j][0]][0 if j < accepted else 1] += 1
        candidates = msg.candidates(window, accepted)
        rank = candidates.index(correction) if correction in candidates else len(self.ranks) - 1
        self.ranks[rank] += 1


class RootBudget:
    """Picks how many roots fit in the overlap budget Δ: fits draft-step time ≈ α + β·R by least squares
    over recent rollouts (proportional to R until two widths were seen) and takes the largest R whose γ
    steps stay within the recent median Δ."""

    def __init__(self, start: int, most: int, window: int = 32) -> None:
        self.current, self.most, self.window = start, most, window
        self.samples: list[tuple[int, float]] = []  # (roots, seconds per draft step)
        self.deltas: list[float] = []

    def observe(self, roots: int, steps: int, draft_s: float, delta_s: float) -> None:
        self.samples = [*self.samples, (roots, draft_s / max(steps, 1))][-self.window:]
        self.deltas = [*self.deltas, delta_s][-self.window:]
        widths = [r for r, _ in self.samples]
        per_step = [t for _, t in self.samples]
        if len(set(widths)) >= 2:
            beta, alpha = _line_fit(widths, per_step)
            beta = max(beta, 1e-9)
        else:
            alpha, beta = 0.0, sum(per_step) / sum(widths)
        delta = sorted(self.deltas)[len(self.deltas) // 2]
        fit = int((delta / max(steps, 1) - alpha) / beta)
        self.current = max(1, min(self.most, fit))


def _line_fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return slope, my - slope * mx


# -- the draft side --------------------------------------------------------------------------------------


@dataclass
class Tree:
    """Branch-complete rollouts: branch r continues root ``roots[r]`` with ``tokens[r]`` (γ tokens)."""

    roots: list[tuple[int, int]]
    tokens: list[list[int]]
    top_probs: list[list[float]] | None  # confidence rule
    q: torch.Tensor | None  # [R, γ, vocab] draft distributions (rejection sampling)
    base: int  # cache index of the first branch entry; branch r's step-s input sits at base + s·R + r
    forwards: int
    span: Span | None = None

    def branch(self, accepted: int, correction: int) -> int | None:
        for r, root in enumerate(self.roots):
            if root == (accepted, correction):
                return r
        return None


@dataclass
class Window:
    tokens: list[int]
    q_rows: list[torch.Tensor]


class DraftSide:
    """The draft model, its one-row cache and the three things it does: fresh rollouts, tree rollouts over the
    shared prefix, and keeping a selected branch."""

    def __init__(self, draft: Transformer, target_vocab: int, capacity: int, params: SamplingParams,
                 rejection: bool, confidence: float, streams: StreamAdapters | None = None) -> None:
        self.model, self.params, self.confidence, self.streams = draft, params, confidence, streams
        self.cache: KVCache = draft.new_cache(capacity=capacity)
        self.rejection = rejection
        self.stream = DRAFT_STREAM if rejection else TARGET_STREAM  # coupled noise for sample-and-match
        self.need_probs = rejection or confidence > 0
        self.pad = target_vocab - draft.config.vocab_size
        self.fresh_tokens = self.fresh_forwards = 0  # η̄ = tokens per draft forward in fresh rollouts

    def fresh(self, seq: list[int], window: int) -> tuple[Window, int]:
        """Vanilla SD's rollout after the committed ``seq``: feeds what the cache lacks, drafts ``window``."""
        keep = min(len(self.cache), len(seq) - 1)  # past that, the cache holds rejected spine or branch tokens
        self.cache.truncate(keep)
        if self.streams is not None:  # the same tokens, several per draft forward
            drafted = ss.rollout(self.model, self.streams, self.cache, seq[keep:], len(seq), window, self.params,
                                 self.stream, self.need_probs, self.confidence, self.pad)
        else:
            drafted = propose(self.model, self.cache, seq[keep:], len(seq), window, self.params, self.stream,
                              self.need_probs, self.confidence, self.pad)
        self.fresh_tokens += len(drafted.tokens)
        self.fresh_forwards += drafted.forwards
        return Window(drafted.tokens, drafted.q_rows), drafted.forwards

    def rollout(self, committed: int, window: list[int], roots: list[tuple[int, int]], steps: int,
                tracer: Tracer) -> Tree:
        """γ tokens after every root, one batched tree-masked forward per step over the shared cache.

        ``committed`` is the length of the committed text (through ``a``); the cache holds it plus
        ``window[:-1]``. Root ``(j, v)`` sits at position ``committed + j`` and sees the spine up to ``d_j``.
        """
        with tracer.span("draft", "rollout", roots=len(roots), steps=steps) as span:
            tree = self._rollout(committed, window, roots, steps)
        tree.span = span
        return tree

    def _rollout(self, committed: int, window: list[int], roots: list[tuple[int, int]], steps: int) -> Tree:
        model, cache, params = self.model, self.cache, self.params
        device = model.device
        spine_feed = window[-1:]
        if len(cache) != committed + max(len(window) - 1, 0):
            raise RuntimeError(f"draft cache holds {len(cache)} positions, expected "
                               f"{committed + max(len(window) - 1, 0)}")
        n_roots, past = len(roots), len(cache)
        base = past + len(spine_feed)  # == committed + len(window)
        sees_spine = torch.tensor([committed + j for j, _ in roots], device=device)  # root (j, v) sees [0, L+j)
        branch_rows = torch.arange(n_roots, device=device)
        root_pos = torch.tensor([committed + j for j, _ in roots], device=device)
        feed = spine_feed + [v for _, v in roots]
        tokens: list[list[int]] = [[] for _ in roots]
        top_probs: list[list[float]] | None = [[] for _ in roots] if self.confidence > 0 else None
        q_steps: list[torch.Tensor] = []
        for step in range(steps):
            lead = len(spine_feed) if step == 0 else 0
            total = base + (step + 1) * n_roots
            cols = torch.arange(total, device=device)
            mask = torch.zeros(1, lead + n_roots, total, dtype=torch.bool, device=device)
            if lead:
                mask[0, 0, : past + 1] = True  # d_w extends the spine causally
            rows = mask[0, lead:]
            rows |= cols.unsqueeze(0) < sees_spine.unsqueeze(1)
            for s in range(step + 1):  # the branch's own earlier inputs and itself
                rows[branch_rows, base + s * n_roots + branch_rows] = True
            positions = torch.cat([torch.arange(past, past + lead, device=device), root_pos + step]).unsqueeze(0)
            hidden = model.run_layers(model.embed(draft_tokens(model, feed)), positions, cache, mask)
            logits = model.logits(hidden[0, lead:])
            if self.need_probs:
                q = probabilities(logits, params) if not params.greedy else logits.double().softmax(-1)
                if top_probs is not None:
                    for r, p in enumerate(q.max(-1).values.tolist()):
                        top_probs[r].append(p)
                if self.rejection:
                    q_steps.append(torch.nn.functional.pad(q, (0, self.pad)) if self.pad else q)
            drawn = sample(logits, (root_pos + step + 1).tolist(), params, self.stream)
            for r, token in enumerate(drawn):
                tokens[r].append(token)
            feed = drawn
        q = torch.stack(q_steps, 1) if q_steps else None
        return Tree(roots, tokens, top_probs, q, base, steps)

    def keep_branch(self, tree: Tree, branch: int, committed_before: int, window: int) -> Window:
        """Compact the cache to the spine through ``d_A`` plus the branch's inputs ``c, t_1..t_{w-1}``."""
        n = len(tree.roots)
        kept = list(range(committed_before)) + [tree.base + s * n + branch for s in range(max(window, 1))]
        self.cache.keep(kept)
        q_rows = list(tree.q[branch, :window]) if tree.q is not None else []
        return Window(tree.tokens[branch][:window], q_rows)

    def window_length(self, tree: Tree, branch: int, limit: int) -> int:
        if tree.top_probs is None:
            return min(limit, len(tree.tokens[branch]))
        return min(limit, window_end(tree.top_probs[branch], self.confidence))


# -- statistics --------------------------------------------------------------------------------------------


@dataclass
class MirrorStep:
    """One step's timings in seconds (the paper's Eq. 10 terms) and outcome."""

    accepted: int
    drafted: int
    roots: int
    hit: bool | None  # None: no rollouts this step (none needed, or the draft is gone)
    t_pre: float  # target layers [0, ℓe)
    t_ee: float  # early-exit head + top-κ (rendezvous sampling)
    t_channel: float  # message hand-off until the draft starts
    delta: float  # target layers [ℓe, N) + head + verification: the overlap budget Δ
    t_draft: float  # the tree rollout
    t_fv: float  # final rendezvous: waiting for the draft after the target, plus branch selection
    t_fallback: float  # fresh rollout after a miss (exposed)
    hidden: float  # rollout time overlapped by the suffix
    step_s: float  # measured: step start to the next window ready

    @property
    def eq10_s(self) -> float:
        """T_pre + T_rv^ee + max(Δ, T_draft) + T_rv^fv (the paper's Eq. 10, which leaves fallbacks out)."""
        return self.t_pre + self.t_ee + self.t_channel + max(self.delta, self.t_draft) + self.t_fv

    @property
    def exposed(self) -> float:
        return self.t_draft - self.hidden + self.t_fallback


@dataclass
class MirrorStats:
    backend: str
    exit_layer: int
    kappa: int
    roots_mode: str
    steps: list[MirrorStep] = field(default_factory=list)
    draft_failed: str | None = None
    draft_streams: bool = False
    fresh_tokens: int = 0
    fresh_forwards: int = 0

    def to_dict(self) -> dict[str, Any]:
        steps = self.steps
        with_tree = [s for s in steps if s.hit is not None]
        misses = sum(1 for s in with_tree if not s.hit)
        draft_total = sum(s.t_draft + s.t_fallback for s in steps)
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return {
            "backend": self.backend, "exit_layer": self.exit_layer, "kappa": self.kappa, "roots": self.roots_mode,
            "steps": len(steps),
            "fallback_frequency": round(misses / len(with_tree), 4) if with_tree else None,
            "mean_roots": round(mean([s.roots for s in with_tree]), 2),
            "hidden_draft_fraction": round(sum(s.hidden for s in steps) / draft_total, 4) if draft_total else None,
            "exposed_draft_s": round(sum(s.exposed for s in steps), 4),
            "mean_ms": {name: round(1e3 * mean([getattr(s, name) for s in steps]), 3) for name in (
                "t_pre", "t_ee", "t_channel", "delta", "t_draft", "t_fv", "t_fallback", "step_s", "eq10_s")},
            "draft_failed": self.draft_failed,
            "draft_streams": self.draft_streams,
            # η̄: draft tokens per draft forward in fresh rollouts (1 for an AR draft, more with SS streams)
            "fresh_tokens_per_draft_forward": round(self.fresh_tokens / self.fresh_forwards, 4)
            if self.fresh_forwards else None,
        }


# -- the method ----------------------------------------------------------------------------------------------


def decode(req: DecodeRequest) -> Iterator[list[int]]:
    check_draft(req.target, req.draft)
    opts, exit_layer = MirrorOptions.parse(req.options, req.target.config.n_layers, req.target.config.vocab_size)
    executor = make_executor(opts.backend, req.target.device, req.draft.device, opts.threads)
    return _run(req, opts, exit_layer, executor)


@torch.inference_mode()
def _run(req: DecodeRequest, opts: MirrorOptions, exit_layer: int, executor: Executor) -> Iterator[list[int]]:
    target, params, stats = req.target, req.sampling, req.stats
    rejection = opts.acceptance == "rejection" and not params.greedy
    tracer = Tracer()
    stats.spans = tracer.spans
    mstats = MirrorStats(executor.name, exit_layer, opts.kappa, opts.roots)
    stats.extra["mirror"] = mstats
    most_roots = (opts.gamma + 1) * opts.kappa
    overlapped = executor.name != "serial"  # serial runs the rollout after the suffix: no channel wait to time
    budget = RootBudget(opts.budget or opts.kappa, most_roots) if opts.roots == "budget" else None
    scorer = RootScorer(opts.kappa) if opts.roots == "budget" else None

    seq = list(req.prompt_ids)
    capacity = len(seq) + req.max_new_tokens + 2
    t_cache = target.new_cache(capacity=capacity)
    streams = None if opts.draft_streams is None else load_adapters(req.draft, opts.draft_streams)
    mstats.draft_streams = streams is not None
    draft: DraftSide | None = DraftSide(req.draft, target.config.vocab_size, capacity, params, rejection,
                                        opts.confidence, streams)

    def draft_failed(error: BaseException) -> None:
        nonlocal draft
        draft = None
        mstats.draft_failed = f"{type(error).__name__}: {error}"
        warnings.warn(f"mirror: the draft failed ({mstats.draft_failed}); continuing with the target alone",
                      RuntimeWarning, stacklevel=3)

    def fresh(window_limit: int) -> tuple[Window, float]:
        start = time.perf_counter()
        if draft is None or window_limit <= 0:
            return Window([], []), 0.0
        try:
            with tracer.span("draft", "fresh rollout"):
                window, forwards = draft.fresh(seq, window_limit)
            stats.draft_forwards += forwards
            mstats.fresh_tokens, mstats.fresh_forwards = draft.fresh_tokens, draft.fresh_forwards
            return window, time.perf_counter() - start
        except Exception as error:  # noqa: BLE001 - any draft failure degrades to target-only decoding
            draft_failed(error)
            return Window([], []), time.perf_counter() - start

    try:
        with tracer.span("target", "prefill") as prefill:
            if len(seq) > 1:
                target.prefill(torch.tensor([seq[:-1]], device=target.device), t_cache)
                stats.target_forwards += 1
        stats.prefill_s += prefill.seconds
        produced = 0
        window, t_fallback = fresh(min(opts.gamma, req.max_new_tokens - 1))
        stats.draft_s += t_fallback
        step_start = time.perf_counter()
        while True:
            committed = len(seq)
            tokens = [seq[-1], *window.tokens]
            ids = torch.tensor([tokens], device=target.device)
            positions = torch.arange(committed - 1, committed + len(window.tokens), device=target.device)[None]
            with tracer.span("target", "layers < ℓe") as pre:
                hidden = target.run_layers(target.embed(ids), positions, t_cache, end=exit_layer)
            # The next window can hold at most this many tokens; rollouts past it would be wasted.
            steps = min(opts.gamma, req.max_new_tokens - produced - 2)
            future, roots, t_ee, submitted = None, [], 0.0, 0.0
            if draft is not None and steps > 0:
                with tracer.span("target", "early exit") as ee:
                    message = early_exit(target, hidden, opts.kappa, params)
                t_ee = ee.seconds
                roots = select_roots(message, window.tokens, opts.roots, scorer, budget.current if budget else 0)
                submitted = time.perf_counter()
                future = executor.submit(partial(draft.rollout, committed, window.tokens, roots, steps, tracer))
            with executor.overlapping(), tracer.span("target", "layers ≥ ℓe + verify") as suffix:
                hidden = target.run_layers(hidden, positions, t_cache, start=exit_layer)
                logits = target.logits(hidden)[0]
                verdict = _verify(window, logits, list(range(committed, committed + len(tokens))), params,
                                  rejection)
            stats.target_forwards += 1
            tree: Tree | None = None
            if future is not None:
                try:
                    tree = future.result()
                    stats.draft_forwards += tree.forwards
                except Exception as error:  # noqa: BLE001 - degrade, never lose the verified tokens
                    draft_failed(error)
            joined = time.perf_counter()
            new = verdict.committed(window.tokens)
            t_cache.truncate(committed + verdict.accepted)
            seq.extend(new)
            produced += len(new)
            stats.record_step(len(window.tokens), verdict.accepted)
            rollout = tree.span if tree is not None else None
            record = MirrorStep(
                accepted=verdict.accepted, drafted=len(tokens) - 1, roots=len(roots), hit=None, t_pre=pre.seconds,
                t_ee=t_ee, t_channel=max(0.0, rollout.start - submitted) if rollout and overlapped else 0.0,
                delta=suffix.seconds, t_draft=rollout.seconds if rollout else 0.0,
                t_fv=max(0.0, joined - max(suffix.end, rollout.end if rollout else suffix.end)), t_fallback=0.0,
                hidden=overlap(rollout, suffix), step_s=time.perf_counter() - step_start)
            mstats.steps.append(record)  # now: the caller may stop after these tokens
            stats.target_s += record.t_pre + record.t_ee + record.delta
            stats.draft_s += record.t_draft
            if budget is not None and tree is not None:
                if opts.budget is None:
                    budget.observe(len(roots), steps, record.t_draft, suffix.seconds)
                scorer.observe(message, window.tokens, verdict.accepted, verdict.next_token)
            yield new
            resumed = time.perf_counter()

            # Final rendezvous: reuse the branch the correction selects, or fall back to a fresh rollout.
            limit = min(opts.gamma, req.max_new_tokens - produced - 1)
            if tree is not None and draft is not None:
                with tracer.span("draft", "select") as select:
                    branch = tree.branch(verdict.accepted, verdict.next_token)
                    if branch is not None:
                        length = draft.window_length(tree, branch, limit)
                        window = draft.keep_branch(tree, branch, committed + verdict.accepted, length)
                record.t_fv += select.seconds
                record.hit = branch is not None
                if not record.hit:
                    window, record.t_fallback = fresh(limit)
            else:
                window, record.t_fallback = fresh(limit)
            stats.draft_s += record.t_fallback
            record.step_s += time.perf_counter() - resumed
            step_start = time.perf_counter()
    finally:
        executor.close()


def _verify(window: Window, logits: torch.Tensor, positions: list[int], params: SamplingParams,
            rejection: bool) -> Verdict:
    if rejection:
        q = torch.stack(window.q_rows) if window.q_rows else None
        return verify_rejection(window.tokens, q, logits, positions, params)
    return verify_match(window.tokens, logits, positions, params)

"""``mirror``: Mirror Speculative Decoding (Bhendawade et al. 2025, arXiv 2510.13161), per-position reading.

One step, with committed text ending in ``a`` (the target cache holds everything before it) and the current
draft window ``d_1..d_w``:

1. **Prefix** -- the target runs layers ``[0, ℓe)`` on ``[a, d_1..d_w]``.
2. **Early exit** -- the target's own final norm + LM head on those hidden states; the top-κ ids and log-probs
   at each of the ``w+1`` positions form the token-channel message. Only ids and log-probs cross, never logits.
3. **Rollouts, in parallel** (an :mod:`~mirrorsd.runtime` executor) -- while the target runs ``[ℓe, N)``, the
   draft rolls out, for every root ``(j, v)``, a γ-token continuation of ``(committed, a, d_1..d_j, v)``. All
   roots go through the draft together, one tree-masked forward per draft step over the shared prefix cache.
4. **Verification** -- the loop's verifier (match or rejection): ``A`` tokens accepted and the target's own
   token ``c`` at slot ``A+1`` (correction, or bonus after full acceptance).
5. **Reuse or fallback** -- hit iff the root ``(A, c)`` was rolled out (in ``paper`` mode, iff ``c`` is among
   the top-κ early-exit candidates of position ``A``): its rollout is the next window at once and the draft
   cache is compacted to that branch. Miss: the next window is a fresh rollout from ``(committed, c)``, whose
   time is exposed.

On the loop, steps 1-3 are :class:`EarlyExitScorer` and step 5 is :class:`BranchProposer`'s feedback. Every
committed token is the target's own, so the output equals ``ar``; the branch rolled out for ``(A, c)`` is exactly
the window vanilla SD's draft would propose after that step (same context, same position-keyed noise), so the
accepted lengths equal ``sd``'s with the same draft and ``confidence`` (the paper's parity claim, App. B).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from ..draft_vocab import SubsetHead, head_logits, optional_head, top_tokens
from ..exit_heads import tuned_exit
from ..model import Transformer
from ..runtime import BACKENDS, Executor, Span, Tracer, make_executor
from ..runtime.trace import overlap
from ..sampling import SamplingParams, probabilities, sample
from ..streams import load_adapters
from ..verify import ACCEPTANCE_RULES, Verdict
from .engine import VERIFIERS, ChainScorer, DecodeRequest, Draft, RequestState, Roles, Scores, draft_tokens
from .proposers import ModelProposer, StreamProposer, check_draft, draft_vocab_option, draft_vocab_size, window_end
from .registry import MethodOptions, ModelShape, OptionError, at_least, option, probability, register
from .suffix import HYBRID_LOOKUP, SuffixProposer, suffix_match_option, suffix_proposer

DEFAULT_GAMMA = 7  # the paper's window
DEFAULT_KAPPA = 8  # the paper's top-κ at batch size 1
DEFAULT_EXIT = 0.5  # ℓe = N/2
ROOT_MODES = ("paper", "budget")
CANDIDATE_SOURCES = ("exit", "draft")


def layer_or_fraction(text: str) -> int | float:
    """An int when it is one (a layer index), else a float (a fraction of the depth)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


layer_or_fraction.kind = "a layer index or a fraction"  # type: ignore[attr-defined]


def thread_split(text: str) -> tuple[int, int]:
    target, draft = (int(x) for x in text.split(","))
    return target, draft


thread_split.kind = "TARGET,DRAFT thread counts"  # type: ignore[attr-defined]


@dataclass(frozen=True)
class MirrorOptions(MethodOptions):
    gamma: int = option(DEFAULT_GAMMA, "most draft tokens per verification window", check=at_least(1))
    kappa: int = option(DEFAULT_KAPPA, "top-κ early-exit candidates per window position", check=at_least(1))
    exit_layer: int | float = option(DEFAULT_EXIT, "early-exit layer ℓe: an index 1..N-1 or a fraction of the "
                                     "target's depth", parse=layer_or_fraction, check=(lambda v: v > 0, "must be > 0"))
    candidates: str = option("exit", "where a window position's κ candidate corrections come from: exit (the "
                             "target's early-exit top-κ, the paper) or draft (the draft's own next κ likeliest tokens "
                             "at the positions it drafted, the exit's at the bonus slot)", choices=CANDIDATE_SOURCES)
    roots: str = option("budget", "budget: roll out only the candidates most likely to be the correction, as many "
                        "as fit in the target's suffix time (none on the serial backend, where nothing overlaps: "
                        "every rollout there is time the step waits for); paper: all (γ+1)·κ of them, as the "
                        "paper does",
                        choices=ROOT_MODES)  # Spec-Bench, serial: 0.87x ar (no roots), 0.66x (one), 0.17x (paper)
    budget: int | None = option(None, "with --roots budget: a fixed number of roots instead of fitting Δ (on the "
                                "serial backend: roll out that many although nothing overlaps)", parse=int,
                                check=at_least(1), default_text="fit Δ")
    backend: str = option("serial", "where the draft runs while the target finishes: serial (no overlap, the "
                          "reference), threads (CPU core split), cuda-streams (one GPU), devices (--draft-device), "
                          "processes (the draft in its own process, a torch.distributed token channel)",
                          choices=BACKENDS)
    channel_timeout: float = option(60.0, "with --backend processes: seconds to wait for the draft process before "
                                    "going on without it", check=(lambda v: v > 0, "must be > 0"))
    threads: tuple[int, int] | None = option(None, "with --backend threads: TARGET,DRAFT intra-op threads while "
                                             "they overlap", default_text="the larger half to the target",
                                             parse=thread_split, check=(lambda v: len(v) == 2 and min(v) >= 1,
                                                                        "must be two positive counts"))
    acceptance: str = option("match", "match: greedy / sample-and-match (the target's own tokens, as ar); "
                             "rejection: speculative sampling (the target's distribution)", choices=ACCEPTANCE_RULES)
    confidence: float = option(0.6, "end a draft window at the first position where the draft's top probability "
                               "is below this; 0 always drafts γ tokens (the paper)",
                               check=probability())  # Spec-Bench, serial: 1.10x ar vs 0.92x at 0 (docs/mirror_sd.md)
    draft_streams: Any = option(None, "draft with Speculative Streaming: fresh rollouts take several tokens per "
                                "draft forward (the same tokens). ADAPTER is a folder; alone, the draft's shipped "
                                "adapter", parse=str, metavar="ADAPTER", const="auto", default_text="an AR draft")
    exit_vocab: int | None = option(None, "score the early exit on the N most frequent token ids only (the "
                                    "correction is rarely outside them, and 32k of 152k ids read a fifth of the "
                                    "head); 0: the full vocabulary, as the paper", parse=int, check=at_least(0),
                                    default_text="32768 where a frequency table ships")
    exit_head: str = option("auto", "early-exit head: lens (the target's final norm + LM head on the layer-ℓe "
                            "state: the paper's choice), tuned (an affine translator per layer first, fitted by "
                            "`mirrorsd train-exit`: the target's shipped one, or give its folder), or auto (the "
                            "shipped tuned exit where the target has one for ℓe, else the lens)", parse=str,
                            metavar="HEAD")
    suffix_match: int = suffix_match_option()
    draft_vocab: int | None = draft_vocab_option(None)  # measured: 0.69x ar vs 0.62x full (docs/drafting.md)

    def check(self, shape: ModelShape | None) -> None:
        if self.budget is not None and self.roots != "budget":
            raise OptionError("budget", "takes a number of roots with roots='budget'")
        if self.draft_vocab and self.draft_streams is not None:
            raise OptionError("draft_vocab", "applies to an AR draft, not with draft_streams")
        if self.threads is not None and self.backend not in ("threads", "devices", "processes"):
            raise OptionError("threads", "applies to backend='threads' (or 'devices', 'processes')")
        if self.candidates == "draft" and self.draft_streams is not None:
            raise OptionError("candidates", "draft reads an AR draft's logits; use candidates='exit' with "
                              "draft_streams")
        if self.backend == "processes" and self.acceptance == "rejection":
            raise OptionError("acceptance", "rejection needs the draft's distributions; backend='processes' carries "
                              "token ids only (use acceptance='match')")
        if isinstance(self.exit_layer, float) and not self.exit_layer.is_integer() and not 0 < self.exit_layer < 1:
            raise OptionError("exit_layer", f"as a fraction must be in (0, 1), got {self.exit_layer}")
        if self.backend == "serial" and self.roots == "budget" and self.budget is None:
            unused = [name for name, default in (("kappa", DEFAULT_KAPPA), ("candidates", "exit"),
                                                 ("exit_layer", DEFAULT_EXIT), ("exit_vocab", None))
                      if getattr(self, name) != default]
            if unused:
                warnings.warn("mirror: the serial backend rolls out no branch unless told (nothing overlaps there, "
                              f"so a rollout is never hidden), so these options change nothing: {', '.join(unused)}; "
                              "give budget=N or roots='paper', or an overlapping backend", UserWarning, stacklevel=2)
        if shape is not None:
            resolve_exit_layer(self.exit_layer, shape.n_layers)
            if self.kappa > shape.vocab_size:
                raise OptionError("kappa", f"must be in 1..{shape.vocab_size} (the vocabulary), got {self.kappa}")


def resolve_exit_layer(exit_layer: int | float, n_layers: int) -> int:
    """An index in ``1..N-1``, or a fraction of the depth in (0, 1) (``0.5`` is the paper's N/2)."""
    if isinstance(exit_layer, float) and not exit_layer.is_integer():
        if not 0 < exit_layer < 1:
            raise OptionError("exit_layer", f"as a fraction must be in (0, 1), got {exit_layer}")
        index = round(exit_layer * n_layers)
    else:
        index = int(exit_layer)
    if not 1 <= index <= n_layers - 1:
        raise OptionError("exit_layer", f"must be in 1..{n_layers - 1} for a {n_layers}-layer target (or a fraction "
                          f"in (0, 1)), got {exit_layer}")
    return index


# -- token channel and root selection ------------------------------------------------------------------


@dataclass(frozen=True)
class ChannelMessage:
    """What crosses the token channel at the early exit: ids and bf16 log-probs, nothing else."""

    ids: list[list[int]]  # [w+1][κ]: row j holds the candidates for slot j+1 (after a, d_1..d_j), best first
    logprobs: list[list[float]]  # [w+1][κ]
    runner_ups: list[list[int]] | None = None  # candidates=draft: [w][≤κ] the draft's own, its token left out

    def row(self, j: int) -> list[int]:
        """Position j's κ candidates: the draft's runner-ups where it has them, else the early exit's."""
        return self.runner_ups[j] if self.runner_ups is not None and j < len(self.runner_ups) else self.ids[j]

    def candidates(self, window: list[int], j: int) -> list[int]:
        """Position j's candidates that can be a correction: a correction never equals the draft token it
        replaces (at j = w, the bonus slot, all of them can)."""
        return [v for v in self.row(j) if j >= len(window) or v != window[j]]

    def with_draft(self, draft: Draft, kappa: int) -> ChannelMessage:
        """The same message, with candidates from the draft's own distributions at the positions it drafted.

        On the Qwen pair, teacher-forced over the 1.5B's chat answers, the 0.5B's next 8 likeliest tokens hold the
        target's correction at 87% of its wrong guesses; the tuned exit's top-8 at N/2 at 33% (docs/mirror_sd.md).
        """
        if draft.alternatives is None:
            return self
        runner_ups = [[v for v in alt if v != token][:kappa] for alt, token in zip(draft.alternatives, draft.tokens,
                                                                                    strict=True)]
        return replace(self, runner_ups=runner_ups)


def early_exit(target: Transformer, hidden: torch.Tensor, kappa: int, params: SamplingParams,
               translate: Callable[[torch.Tensor], torch.Tensor] | None = None,
               head: SubsetHead | None = None) -> ChannelMessage:
    """Top-κ of the target's own head on layer-ℓe hidden states (at the sampling temperature, raw if greedy);
    ``translate`` maps them towards the final layer's first (the tuned exit, :mod:`mirrorsd.exit_heads`);
    ``head`` restricts the exit to a frequent-token subset (log-probs then normalise over it)."""
    logits, ids = head_logits(target, hidden if translate is None else translate(hidden), head)
    if not params.greedy:
        logits = logits / params.temperature
    logprobs, top = top_tokens(logits[0], ids, kappa)
    return ChannelMessage(top.tolist(), logprobs.to(torch.bfloat16).float().tolist())  # the paper's bf16


def select_roots(msg: ChannelMessage, window: list[int], mode: str, scorer: RootScorer | None = None,
                 budget: int = 0) -> list[tuple[int, int]]:
    """Roots ``(position j, candidate v)`` to roll out: ``paper``, all ``(w+1)·κ`` top-κ candidates;
    ``budget``, the ``budget`` roots the scorer rates most likely to be this step's correction."""
    if mode == "paper":
        return [(j, v) for j in range(len(msg.ids)) for v in msg.row(j)]
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
    alternatives: list[list[list[int]]] | None = None  # [R][γ][κ+1] the draft's likeliest tokens (candidates=draft)

    def branch(self, accepted: int, correction: int) -> int | None:
        for r, root in enumerate(self.roots):
            if root == (accepted, correction):
                return r
        return None


class BranchProposer:
    """The draft: fresh rollouts (vanilla SD's, through the shared proposer), tree rollouts launched by the
    scorer at the early exit, and, on the verdict, the branch the correction selects (hit) or a fresh rollout
    at the next step (miss). A failing draft degrades the request to target-only decoding."""

    def __init__(self, run: MirrorRun, fresh: ModelProposer, lookup: SuffixProposer | None = None,
                 min_match: int = 0) -> None:
        self.run, self.fresh, self.model = run, fresh, fresh.model
        self.lookup, self.min_match = lookup, min_match  # the suffix hybrid: a long match replaces a fresh rollout
        self.rejection, self.confidence, self.params = fresh.rejection, fresh.confidence, fresh.params
        self.ready: Draft | None = None  # the next window, when a branch was kept
        self.future: Future[Tree] | None = None
        self.failed = False
        self.source = "model"  # who drafted the last window: "branch", "suffix" or "model" (a fresh rollout)

    def start(self, state: RequestState) -> None:
        if self.lookup is not None:
            self.lookup.start(state)

    def propose(self, state: RequestState) -> Draft:
        if self.ready is not None:
            window, self.ready, self.source = self.ready, None, "branch"
            return window
        start = time.perf_counter()
        window, self.source = Draft(), "model"
        if self.lookup is not None:
            window = self.lookup.propose(state, self.min_match)
            self.source = "suffix" if window.tokens else "model"
        if not window.tokens and not self.failed and min(self.run.opts.gamma, state.room) > 0:
            try:
                window = self.fresh_rollout(state)
                self.run.stats.fresh_tokens += len(window.tokens)
                self.run.stats.fresh_forwards += window.forwards
            except Exception as error:  # noqa: BLE001 - any draft failure degrades to target-only decoding
                self.fail(error)
        self.run.fresh_done(time.perf_counter() - start)
        return window

    def fresh_rollout(self, state: RequestState) -> Draft:
        with self.run.tracer.span("draft", "fresh rollout"):
            return self.fresh.propose(state)

    def launch(self, state: RequestState, window: list[int], roots: list[tuple[int, int]], steps: int) -> None:
        # What the draft cache lacks of the spine (the committed text and the window): the window's last token
        # after a model draft; more after a suffix draft, or when the cache lags behind suffix steps.
        spine = [*state.tokens, *window][len(state.draft_cache):]
        self.future = self.run.executor.submit(
            partial(self.rollout, len(state.tokens), window, spine, roots, steps, state))

    def rollout(self, committed: int, window: list[int], spine: list[int], roots: list[tuple[int, int]],
                steps: int, state: RequestState) -> Tree:
        with self.run.tracer.span("draft", "rollout", roots=len(roots), steps=steps) as span:
            tree = self._rollout(state, committed, window, spine, roots, steps)
        tree.span = span
        return tree

    def _rollout(self, state: RequestState, committed: int, window: list[int], spine_feed: list[int],
                 roots: list[tuple[int, int]], steps: int) -> Tree:
        """γ tokens after every root, one batched tree-masked forward per step over the shared cache.

        ``committed`` is the length of the committed text (through ``a``); the cache holds the spine (that text
        and ``window``) but ``spine_feed``, which the first step feeds causally. Root ``(j, v)`` sits at
        position ``committed + j`` and sees the spine up to ``d_j``.
        """
        model, cache, params = self.model, state.draft_cache, self.params
        device = model.device
        if len(cache) + len(spine_feed) != committed + len(window):
            raise RuntimeError(f"draft cache holds {len(cache)} positions and {len(spine_feed)} are fed, expected "
                               f"{committed + len(window)} in all")
        n_roots, past = len(roots), len(cache)
        base = past + len(spine_feed)  # == committed + len(window)
        sees_spine = torch.tensor([committed + j for j, _ in roots], device=device)  # root (j, v) sees [0, L+j)
        branch_rows = torch.arange(n_roots, device=device)
        root_pos = torch.tensor([committed + j for j, _ in roots], device=device)
        feed = spine_feed + [v for _, v in roots]
        tokens: list[list[int]] = [[] for _ in roots]
        top_probs: list[list[float]] | None = [[] for _ in roots] if self.confidence > 0 else None
        q_steps: list[torch.Tensor] = []
        alternatives: list[list[list[int]]] | None = [[] for _ in roots] if self.fresh.runner_ups else None
        for step in range(steps):
            lead = len(spine_feed) if step == 0 else 0
            total = base + (step + 1) * n_roots
            cols = torch.arange(total, device=device)
            mask = torch.zeros(1, lead + n_roots, total, dtype=torch.bool, device=device)
            for i in range(lead):
                mask[0, i, : past + i + 1] = True  # the spine's missing tokens, causally
            rows = mask[0, lead:]
            rows |= cols.unsqueeze(0) < sees_spine.unsqueeze(1)
            for s in range(step + 1):  # the branch's own earlier inputs and itself
                rows[branch_rows, base + s * n_roots + branch_rows] = True
            positions = torch.cat([torch.arange(past, past + lead, device=device), root_pos + step]).unsqueeze(0)
            hidden = model.run_layers(model.embed(draft_tokens(model, feed)), positions, cache, mask)
            rows = hidden[0, lead:]
            logits = model.logits(rows) if self.fresh.head is None else self.fresh.head(model.norm(rows))
            if self.fresh.need_probs:
                q = probabilities(logits, params) if not params.greedy else logits.double().softmax(-1)
                if top_probs is not None:
                    for r, p in enumerate(q.max(-1).values.tolist()):
                        top_probs[r].append(p)
                if self.rejection:
                    q_steps.append(torch.nn.functional.pad(q, (0, self.fresh.pad)) if self.fresh.pad else q)
            drawn = self.fresh.tokens_of(sample(logits, (root_pos + step + 1).tolist(), params, self.fresh.noise))
            for r, token in enumerate(drawn):
                tokens[r].append(token)
            if alternatives is not None:
                for r, likeliest in enumerate(self.fresh.likeliest(logits)):
                    alternatives[r].append(likeliest)
            feed = drawn
        q = torch.stack(q_steps, 1) if q_steps else None
        return Tree(roots, tokens, top_probs, q, base, steps, alternatives=alternatives)

    def feedback(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        """The final rendezvous: wait for the rollout, keep the branch the correction selects, or fall back."""
        if self.lookup is not None:
            self.lookup.feedback(state, scores, verdict)
        tree, future, self.future = None, self.future, None
        if future is not None:
            try:
                tree = future.result()
                state.stats.draft_forwards += tree.forwards
            except Exception as error:  # noqa: BLE001 - degrade, never lose the verified tokens
                self.fail(error)
        self.run.joined(tree)
        branch = None
        if tree is not None and not self.failed:
            with self.run.tracer.span("draft", "select") as select:
                branch = tree.branch(verdict.accepted, verdict.next_token)
                if branch is not None:
                    self.ready = self.keep_branch(state, tree, branch)
            self.run.selected(select.seconds, branch is not None)
        if branch is None and not self.failed:
            ModelProposer.rollback(state, verdict.accepted)

    def keep_branch(self, state: RequestState, tree: Tree, branch: int) -> Draft:
        """Compact the cache to the spine through ``d_A`` plus the branch's inputs ``c, t_1..t_{w-1}``."""
        limit = min(self.fresh.gamma, state.room)
        if tree.top_probs is None:
            window = min(limit, len(tree.tokens[branch]))
        else:
            window = min(limit, window_end(tree.top_probs[branch], self.confidence))
        before = len(state.tokens) - 1  # the spine through d_A
        n = len(tree.roots)
        state.draft_cache.keep(list(range(before)) + [tree.base + s * n + branch for s in range(max(window, 1))])
        probs = tree.q[branch, :window] if tree.q is not None and window else None
        alternatives = tree.alternatives[branch][:window] if tree.alternatives is not None else None
        return Draft(tree.tokens[branch][:window], probs=probs, alternatives=alternatives)

    def close(self) -> None:
        """The request is over (the draft here needs nothing released)."""

    def fail(self, error: BaseException) -> None:
        self.failed, self.ready = True, None
        self.run.stats.draft_failed = f"{type(error).__name__}: {error}"
        warnings.warn(f"mirror: the draft failed ({self.run.stats.draft_failed}); continuing with the target alone",
                      RuntimeWarning, stacklevel=3)


# -- the target side --------------------------------------------------------------------------------------


class EarlyExitScorer(ChainScorer):
    """The target in two halves: layers below ℓe, the early exit and the launch of the draft's rollouts, then
    the layers above ℓe while the rollouts run."""

    def __init__(self, run: MirrorRun, target: Transformer, draft: BranchProposer) -> None:
        super().__init__(target)
        self.run, self.draft = run, draft

    def prefill(self, state: RequestState) -> int:
        with self.run.tracer.span("target", "prefill"):
            return super().prefill(state)

    def score(self, state: RequestState, draft: Draft) -> Scores:
        run, target, opts = self.run, self.model, self.run.opts
        start = time.perf_counter()
        committed = len(state.tokens)
        ids = torch.tensor([[state.tokens[-1], *draft.tokens]], device=target.device)
        positions = torch.arange(committed - 1, committed + len(draft.tokens), device=target.device)[None]
        with run.tracer.span("target", "layers < ℓe") as pre:
            exit_hidden = target.run_layers(target.embed(ids), positions, state.target_cache, end=run.exit_layer)
        # The next window can hold at most this many tokens; rollouts past it would be wasted.
        steps = min(opts.gamma, state.room - 1)
        message, roots, t_ee, submitted = None, [], 0.0, 0.0
        if not self.draft.failed and steps > 0 and run.rolls_out:
            with run.tracer.span("target", "early exit") as ee:
                message = early_exit(target, exit_hidden, opts.kappa, state.params, run.translate, run.exit_vocab)
                if opts.candidates == "draft":
                    message = message.with_draft(draft, opts.kappa)
            t_ee = ee.seconds
            budget = run.budget.current if run.budget else 0
            roots = select_roots(message, draft.tokens, opts.roots, run.root_scorer, budget)
            submitted = time.perf_counter()
            self.draft.launch(state, draft.tokens, roots, steps)
        with run.executor.overlapping(), run.tracer.span("target", "layers ≥ ℓe") as suffix:
            hidden = target.run_layers(exit_hidden, positions, state.target_cache, start=run.exit_layer)
            logits = target.logits(hidden)[0]
        run.scored(MirrorStep(accepted=0, drafted=len(draft.tokens), roots=len(roots), hit=None, t_pre=pre.seconds,
                              t_ee=t_ee, t_channel=0.0, delta=suffix.seconds, t_draft=0.0, t_fv=0.0,
                              t_fallback=0.0, hidden=0.0, step_s=0.0), start, submitted, suffix, message, steps)
        return Scores(logits, draft, hidden=exit_hidden)


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
    candidates: str = "exit"
    steps: list[MirrorStep] = field(default_factory=list)
    draft_failed: str | None = None
    draft_streams: bool = False
    fresh_tokens: int = 0
    fresh_forwards: int = 0
    channel_s: dict[str, list[float]] = field(default_factory=dict)  # processes backend: message -> latencies

    def to_dict(self) -> dict[str, Any]:
        steps = self.steps
        with_tree = [s for s in steps if s.hit is not None]
        misses = sum(1 for s in with_tree if not s.hit)
        draft_total = sum(s.t_draft + s.t_fallback for s in steps)
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return {
            "backend": self.backend, "exit_layer": self.exit_layer, "kappa": self.kappa, "roots": self.roots_mode,
            "candidates": self.candidates,
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
            # processes backend: send -> the draft process has it, per message (median ms)
            "channel_ms": {name: round(1e3 * sorted(v)[len(v) // 2], 3) for name, v in self.channel_s.items() if v},
        }


# -- the method ----------------------------------------------------------------------------------------------


class MirrorRun:
    """One request's Mirror-SD bookkeeping shared by its scorer and proposer: the executor, the tracer, the
    root budget and scorer, and the step record both halves fill in."""

    def __init__(self, req: DecodeRequest, opts: MirrorOptions, exit_layer: int, executor: Executor,
                 translate: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 exit_vocab: SubsetHead | None = None) -> None:
        self.opts, self.exit_layer, self.executor, self.translate = opts, exit_layer, executor, translate
        self.exit_vocab = exit_vocab
        self.tracer = Tracer()
        req.stats.spans = self.tracer.spans
        self.stats = MirrorStats(executor.name, exit_layer, opts.kappa, opts.roots, opts.candidates)
        req.stats.extra["mirror"] = self.stats
        most = (opts.gamma + 1) * opts.kappa
        self.overlapped = executor.name != "serial"  # serial runs the rollout after the suffix: no channel wait
        # Where nothing overlaps, R roots cost γ R-row draft forwards for a hit that saves γ one-row ones at best:
        # a budget never pays there, so the serial backend fits none (and skips the exit that would pick them).
        fitted = opts.roots == "budget" and opts.budget is None
        self.rolls_out = not fitted or self.overlapped
        self.budget = RootBudget(opts.budget or opts.kappa, most) if opts.roots == "budget" else None
        self.root_scorer = RootScorer(opts.kappa) if opts.roots == "budget" else None
        self.record: MirrorStep | None = None
        self._step: tuple[float, float, Span, ChannelMessage | None, int] | None = None

    def scored(self, record: MirrorStep, start: float, submitted: float, suffix: Span,
               message: ChannelMessage | None, steps: int) -> None:
        self.record = record
        self.stats.steps.append(record)  # now: the caller may stop after these tokens
        self._step = (start, submitted, suffix, message, steps)

    def joined(self, tree: Tree | None) -> None:
        """The rollout is back (or there was none): its timings go into the step's record."""
        record, (start, submitted, suffix, _, steps) = self.record, self._step
        joined = time.perf_counter()
        rollout = tree.span if tree is not None else None
        if rollout is not None:
            record.t_draft = rollout.seconds
            record.t_channel = max(0.0, rollout.start - submitted) if self.overlapped else 0.0
            record.hidden = overlap(rollout, suffix)
        record.t_fv = max(0.0, joined - max(suffix.end, rollout.end if rollout else suffix.end))
        record.step_s = joined - start
        if self.budget is not None and tree is not None and self.opts.budget is None:
            self.budget.observe(record.roots, steps, record.t_draft, suffix.seconds)

    def selected(self, seconds: float, hit: bool) -> None:
        self.record.t_fv += seconds
        self.record.step_s += seconds
        self.record.hit = hit

    def observe(self, window: list[int], verdict: Verdict) -> None:
        self.record.accepted = verdict.accepted
        message = self._step[3]
        if self.root_scorer is not None and message is not None:
            self.root_scorer.observe(message, window, verdict.accepted, verdict.next_token)

    def fresh_done(self, seconds: float) -> None:
        """A fresh rollout (the first window, or after a miss) took ``seconds``, exposed."""
        if self.record is not None:
            self.record.t_fallback += seconds
            self.record.step_s += seconds


def fresh_proposer(draft: Transformer, target_vocab: int, sampling: SamplingParams,
                   opts: MirrorOptions) -> ModelProposer:
    """The draft's own proposer (vanilla SD's): fresh rollouts, and the sampler every tree rollout uses."""
    rejection = opts.acceptance == "rejection"
    if opts.draft_streams is None:
        return ModelProposer(draft, target_vocab, sampling, opts.gamma, confidence=opts.confidence,
                             rejection=rejection, vocab=draft_vocab_size(opts.draft_vocab, draft))
    return StreamProposer(draft, load_adapters(draft, opts.draft_streams), target_vocab, sampling, opts.gamma,
                          confidence=opts.confidence, rejection=rejection)


def build(req: DecodeRequest, opts: MirrorOptions) -> Roles:
    check_draft(req.target, req.draft)
    exit_layer = resolve_exit_layer(opts.exit_layer, req.target.config.n_layers)
    if opts.kappa > req.target.config.vocab_size:
        raise OptionError("kappa", f"must be in 1..{req.target.config.vocab_size} (the vocabulary), got {opts.kappa}")
    # "auto" reaches here unresolved only for a model without a zoo name (the API resolves it), so: the lens
    translate = None if opts.exit_head in ("lens", "auto") else tuned_exit(req.target, opts.exit_head, exit_layer)
    executor = make_executor(opts.backend, req.target.device, req.draft.device, opts.threads)
    run = MirrorRun(req, opts, exit_layer, executor, translate, optional_head(req.target, opts.exit_vocab))
    rejection = opts.acceptance == "rejection"
    run.stats.draft_streams = opts.draft_streams is not None
    lookup = suffix_proposer(req, HYBRID_LOOKUP, gamma=opts.gamma, rejection=rejection) if opts.suffix_match else None
    proposer: BranchProposer
    if opts.backend == "processes":
        from .mirror_remote import RemoteBranchProposer  # the draft's process runs this module's BranchProposer

        proposer = RemoteBranchProposer(run, req, lookup, opts.suffix_match)
    else:
        fresh = fresh_proposer(req.draft, req.target.config.vocab_size, req.sampling, opts)
        fresh.runner_ups = opts.kappa + 1 if opts.candidates == "draft" else 0  # the drafted token is one of them
        proposer = BranchProposer(run, fresh, lookup, opts.suffix_match)
    scorer = EarlyExitScorer(run, req.target, proposer)
    verify = VERIFIERS[opts.acceptance]

    def verifier(state: RequestState, scores: Scores) -> Verdict:
        verdict = verify(state, scores)
        run.observe(scores.draft.tokens, verdict)
        return verdict

    def log(scores: Scores, verdict: Verdict) -> dict[str, Any]:
        r = run.record
        return {"roots": r.roots, "hit": r.hit, "gamma": opts.gamma, "exit_layer": exit_layer,
                "source": proposer.source}

    def close() -> None:
        proposer.close()
        executor.close()
        if lookup is not None:
            lookup.close()

    return Roles(proposer, scorer, verifier, gamma=opts.gamma, close=close, log=log)


def step_cost(costs: Any, step: dict[str, Any], opts: MirrorOptions) -> float:
    """Eq. 10 plus the exposed fresh rollout after a miss, which Eq. 10 leaves out: prefix + early exit +
    max(Δ, rollout) (their sum on the serial backend) + the miss's fresh rollout."""
    backend = opts.backend
    c = costs.for_backend(backend)
    w, gamma, roots = step["drafted"] + 1, step["gamma"], step["roots"]
    pre = c.prefix(step["exit_layer"], w)
    delta = c.target(w) - pre
    rollout = gamma * c.draft(roots, opts.draft_vocab) if roots else 0.0
    core = max(delta, rollout) if backend != "serial" else delta + rollout
    # a window no branch was kept for (a miss, or no rollout) is a fresh rollout; a suffix draft is free
    fresh = float(step["hit"] is not True and step.get("source", "model") == "model")
    exit_head = c.exit_head(w) if roots else 0.0  # the exit only picks roots: none rolled out, none read
    return pre + exit_head + core + fresh * gamma * c.draft(1, opts.draft_vocab)


register("mirror", "Mirror-SD: early-exit token channel, draft rollouts overlapped with the target's upper layers",
         needs_draft=True, options=MirrorOptions, build=build, step_cost=step_cost, rejection=True)

"""Mirror-SD's statistics (the paper's Eq. 10 terms per step) and the per-request record both halves fill in."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...draft_vocab import SubsetHead
from ...runtime import Executor, Span, Tracer
from ...runtime.trace import overlap
from ...verify import Verdict
from ..engine import DecodeRequest
from .channel import ChannelMessage
from .options import MirrorOptions
from .roots import RootBudget, RootScorer

if TYPE_CHECKING:
    from .draft import Tree


#: The target's spans of one step: layers below ℓe, the early exit (None when nothing rolls out), layers from ℓe.
TargetSpans = tuple[Span, Span | None, Span]


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
    hidden: float  # rollout time overlapped by the target's upper layers
    step_s: float  # measured: step start to the next window ready
    rollout_depth: float = 0  # tokens each branch rolled out (the rollout's γ)
    rollout_forwards: int = 0  # draft forwards that took (J: γ for an AR draft, ~⌈γ/η̄⌉ with SS streams)
    rollout_graphed: bool = False  # the rollout replayed as one CUDA graph

    @property
    def eq10_s(self) -> float:
        """T_pre + T_rv^ee + max(Δ, T_draft) + T_rv^fv (the paper's Eq. 10, which leaves fallbacks out)."""
        return self.t_pre + self.t_ee + self.t_channel + max(self.delta, self.t_draft) + self.t_fv

    @property
    def predicted_s(self) -> float:
        """Eq. 10 plus this step's exposed fresh rollout after a miss: over a run, Eq. 10 + miss rate × fallback."""
        return self.eq10_s + self.t_fallback

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
    device_times: bool = False  # the Eq. 10 terms are CUDA events' times (:class:`~mirrorsd.runtime.Tracer`)
    fresh_tokens: int = 0
    fresh_forwards: int = 0
    channel_s: dict[str, list[float]] = field(default_factory=dict)  # processes backend: message -> latencies
    # A draft sharded over ranks (--draft-tp): its all-reduces in fresh and branch rollouts, as [count, seconds,
    # elements] per kind of rollout (the spd form times each; the layer form counts only)
    draft_syncs: dict[str, list[float]] = field(default_factory=dict)

    def summary(self) -> str:
        m = self.to_dict()
        serial_budget = m["backend"] == "serial" and m["roots"] == "budget"
        rollouts = (f"fallback {m['fallback_frequency']}, hidden draft {m['hidden_draft_fraction']}"
                    if m["fallback_frequency"] is not None else "no branch rolled out"
                    + (" (the serial backend's budget: nothing overlaps)" if serial_budget else ""))
        sharded = (f", {m['draft_all_reduces_per_forward']} all-reduces per draft forward"
                   if m["draft_all_reduces"] else "")
        return f", {rollouts}, step {m['mean_ms']['step_s']:.1f} ms vs Eq. 10 {m['mean_ms']['eq10_s']:.1f} ms{sharded}"

    def counters(self) -> dict[str, float]:
        with_tree = [s for s in self.steps if s.hit is not None]
        return {"tree_steps": len(with_tree), "misses": sum(not s.hit for s in with_tree),
                "hidden_s": sum(s.hidden for s in self.steps),
                "draft_s": sum(s.t_draft + s.t_fallback for s in self.steps),
                "fresh_tokens": self.fresh_tokens, "fresh_forwards": self.fresh_forwards,
                "rollout_depth": sum(s.rollout_depth for s in with_tree),
                "rollout_forwards": sum(s.rollout_forwards for s in with_tree)}

    def timeline(self) -> bool:
        return self.backend != "serial"

    def to_dict(self) -> dict[str, Any]:
        steps = self.steps
        with_tree = [s for s in steps if s.hit is not None]
        misses = sum(1 for s in with_tree if not s.hit)
        draft_total = sum(s.t_draft + s.t_fallback for s in steps)
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        forwards = self.fresh_forwards + sum(s.rollout_forwards for s in with_tree)
        syncs = int(sum(c for c, _, _ in self.draft_syncs.values()))
        sync_s = sum(t for _, t, _ in self.draft_syncs.values())
        return {
            "backend": self.backend, "exit_layer": self.exit_layer, "kappa": self.kappa, "roots": self.roots_mode,
            "candidates": self.candidates,
            "steps": len(steps),
            "fallback_frequency": round(misses / len(with_tree), 4) if with_tree else None,
            "mean_roots": round(mean([s.roots for s in with_tree]), 2),
            "rollouts_as_one_graph": round(mean([s.rollout_graphed for s in with_tree]), 4) if with_tree else None,
            "hidden_draft_fraction": round(sum(s.hidden for s in steps) / draft_total, 4) if draft_total else None,
            "exposed_draft_s": round(sum(s.exposed for s in steps), 4),
            "mean_ms": {name: round(1e3 * mean([getattr(s, name) for s in steps]), 3) for name in (
                "t_pre", "t_ee", "t_channel", "delta", "t_draft", "t_fv", "t_fallback", "step_s", "eq10_s",
                "predicted_s")},
            "device_times": self.device_times,
            "draft_failed": self.draft_failed,
            "draft_streams": self.draft_streams,
            # η̄: draft tokens per draft forward in fresh rollouts (1 for an AR draft, more with SS streams)
            "fresh_tokens_per_draft_forward": round(self.fresh_tokens / self.fresh_forwards, 4)
            if self.fresh_forwards else None,
            # the same for the branch rollouts: rollout depth over the forwards it took (the paper's γ / J)
            "rollout_tokens_per_draft_forward": round(sum(s.rollout_depth for s in with_tree)
                                                      / sum(s.rollout_forwards for s in with_tree), 4)
            if any(s.rollout_forwards for s in with_tree) else None,
            # a sharded draft: all-reduces per draft forward (2 for the spd form, 2 per layer for the layer form)
            "draft_all_reduces": syncs,
            "draft_all_reduces_per_forward": round(syncs / forwards, 3) if syncs and forwards else None,
            "draft_all_reduce_ms": round(1e3 * sync_s / syncs, 4) if syncs and sync_s else None,
            # per kind (fresh: one row a forward; rollout: one per root): mean ms and elements per all-reduce, what
            # the latency law's T_allreduce(M; G) = α log G + β M is fitted to
            "draft_all_reduce_by_kind": {kind: {"count": int(c), "ms": round(1e3 * t / c, 4),
                                                "elements": round(e / c, 1)} for kind, (c, t, e) in
                                         self.draft_syncs.items() if c},
            # processes backend: send -> the draft process has it, per message (median ms)
            "channel_ms": {name: round(1e3 * sorted(v)[len(v) // 2], 3) for name, v in self.channel_s.items() if v},
        }


class MirrorRun:
    """One request's Mirror-SD bookkeeping shared by its scorer and proposer: the executor, the tracer, the
    root budget and scorer, and the step record both halves fill in."""

    def __init__(self, req: DecodeRequest, opts: MirrorOptions, exit_layer: int, executor: Executor,
                 translate: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 exit_vocab: SubsetHead | None = None) -> None:
        self.opts, self.exit_layer, self.executor, self.translate = opts, exit_layer, executor, translate
        self.exit_vocab = exit_vocab
        # Both halves on one CUDA device, issued from this process: the Eq. 10 terms on the device's clock (a draft
        # rank's replica has no target)
        target, draft = req.target, req.draft
        on_device = executor.name in ("serial", "cuda-streams") and target is not None and draft is not None \
            and draft.device == target.device
        self.tracer = Tracer(target.device if on_device else None)
        # The exit's top-κ reach the rollouts where they were computed (DeviceRoots): every candidate is a root, so
        # nothing needs them on the host before the verdict, and the draft reads the target's device in this process
        # (a copy to another device would wait for the target's upper layers, queued by then).
        self.device_roots = opts.roots == "paper" and opts.candidates == "exit" and executor.name != "processes" \
            and target is not None and draft is not None and draft.device == target.device
        req.stats.spans = self.tracer.spans
        self.stats = MirrorStats(executor.name, exit_layer, opts.kappa, opts.roots, opts.candidates,
                                 device_times=self.tracer.device_times)
        req.stats.extra["mirror"] = self.stats
        most = (opts.gamma + 1) * opts.kappa
        self.overlapped = executor.name != "serial"  # serial runs the rollout after the upper layers: no channel wait
        # Where nothing overlaps, R roots cost γ R-row draft forwards for a hit that saves γ one-row ones at best:
        # a budget never pays there, so the serial backend fits none (and skips the exit that would pick them).
        fitted = opts.roots == "budget" and opts.budget is None
        self.rolls_out = not fitted or self.overlapped
        self.budget = RootBudget(opts.budget or opts.kappa, most) if opts.roots == "budget" else None
        self.root_scorer = RootScorer(opts.kappa) if opts.roots == "budget" else None
        self.record: MirrorStep | None = None
        self.kappa = opts.kappa  # this step's κ: the option's, or less in a busy batch (options.batch_caps)
        self._step: tuple[float, float, TargetSpans, ChannelMessage | None, int] | None = None

    def scored(self, record: MirrorStep, start: float, submitted: float, spans: TargetSpans,
               message: ChannelMessage | None, steps: int) -> None:
        """The target's half of a step is issued: its spans (``pre``, ``ee`` or None, ``upper``) give the record's
        target terms once :meth:`joined` has them on their final clock."""
        self.record = record
        self.stats.steps.append(record)  # now: the caller may stop after these tokens
        self._step = (start, submitted, spans, message, steps)

    def joined(self, tree: Tree | None) -> None:
        """The rollout is back (or there was none): the step's terms go into its record. On the device's clock
        (:attr:`Tracer.device_times`) the hand-off runs from the exit's end to the rollout's start, and the final
        rendezvous is the host's branch selection alone (:meth:`selected`): what the device spends after both
        lanes is in neither lane."""
        record, (start, submitted, (pre, ee, upper), _, steps) = self.record, self._step
        joined = time.perf_counter()
        device = self.tracer.device_times
        self.tracer.resolve()
        record.t_pre, record.t_ee, record.delta = pre.seconds, ee.seconds if ee else 0.0, upper.seconds
        rollout = tree.span if tree is not None else None
        if tree is not None:
            record.rollout_depth, record.rollout_forwards = tree.depth(steps), tree.forwards
            record.rollout_graphed = tree.graphed
        if rollout is not None:
            record.t_draft = rollout.seconds
            handoff = ee.end if device and ee is not None else submitted
            record.t_channel = max(0.0, rollout.start - handoff) if self.overlapped else 0.0
            record.hidden = overlap(rollout, upper)
        record.t_fv = 0.0 if device else max(0.0, joined - max(upper.end, rollout.end if rollout else upper.end))
        record.step_s = joined - start
        if self.budget is not None and tree is not None and self.opts.budget is None:
            self.budget.observe(record.roots, steps, record.t_draft, upper.seconds)

    def selected(self, seconds: float, hit: bool) -> None:
        self.record.t_fv += seconds
        self.record.step_s += seconds
        self.record.hit = hit

    def observe(self, window: list[int], verdict: Verdict) -> None:
        self.record.accepted = verdict.accepted
        message = self._step[3]
        if self.root_scorer is not None and message is not None:
            self.root_scorer.observe(message, window, verdict.accepted, verdict.next_token)

    def synced(self, kind: str, count: int, microseconds: int, elements: int) -> None:
        """A sharded draft's all-reduces in the last ``kind`` ("fresh" or "rollout") of rollout."""
        if count:
            total = self.stats.draft_syncs.setdefault(kind, [0, 0.0, 0])
            total[0] += count
            total[1] += microseconds / 1e6
            total[2] += elements

    def fresh_done(self, seconds: float) -> None:
        """A fresh rollout (the first window, or after a miss) took ``seconds``, exposed."""
        if self.record is not None:
            self.record.t_fallback += seconds
            self.record.step_s += seconds

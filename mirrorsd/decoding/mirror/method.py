"""Mirror-SD on the loop: the roles for one request, the cost model (Eq. 10) and what it offers the planner."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ...draft_vocab import draft_table_kind, optional_head, subset_table
from ...exit_heads import tuned_exit
from ...model import Transformer
from ...runtime import make_executor
from ...sampling import SamplingParams
from ...verify import Verdict
from ..drafting import draft_vocab_size
from ..engine import VERIFIERS, DecodeRequest, Proposer, Roles, Scores
from ..lookup import HYBRID_LOOKUP, SuffixFirst, suffix_proposer
from ..proposers import check_draft
from ..registry import Method, OptionError, PlanInputs, Priced, register
from ..streams.adapters import resolve_adapter
from .channel import early_exit
from .draft import BranchProposer, DraftSide, LocalDraft, fresh_proposer
from .options import DEFAULT_KAPPA, MirrorOptions, resolve_exit_layer
from .remote import RemoteDraft
from .stats import MirrorRun
from .target import EarlyExitScorer


def build(req: DecodeRequest, opts: MirrorOptions) -> Roles:
    check_draft(req.target, req.draft)
    exit_layer = resolve_exit_layer(opts.exit_layer, req.target.config.n_layers)
    if opts.kappa > req.target.config.vocab_size:
        raise OptionError("kappa", f"must be in 1..{req.target.config.vocab_size} (the vocabulary), got {opts.kappa}")
    # "auto" reaches here unresolved only for a model without a zoo name (the API resolves it), so: the lens
    translate = None if opts.exit_head in ("lens", "auto") else tuned_exit(req.target, opts.exit_head, exit_layer)
    executor = make_executor(opts.backend, req.target.device, req.draft.device, opts.threads,
                             graphs=opts.overlap_graphs == "on", inline=opts.draft_issue == "inline")
    run = MirrorRun(req, opts, exit_layer, executor, translate, optional_head(req.target, opts.exit_vocab))
    run.stats.draft_streams = opts.draft_streams is not None
    if opts.backend == "processes":  # what the draft rank would refuse, refused here, as the serial backend does
        if size := draft_vocab_size(opts.draft_vocab, req.draft):
            subset_table(req.draft.config.vocab_size, size, draft_table_kind(req.draft.config.vocab_size))
        if opts.draft_streams is not None:
            resolve_adapter(opts.draft_streams)
    side: DraftSide = (RemoteDraft(run, req) if opts.backend == "processes" else
                       LocalDraft(run, fresh_proposer(req.draft, req.target.config.vocab_size, req.sampling, opts)))
    branches = BranchProposer(run, side)
    proposer: Proposer = branches
    lookup = None
    if opts.suffix_match:  # a long suffix match replaces a fresh rollout (never a kept branch)
        lookup = suffix_proposer(req, HYBRID_LOOKUP, gamma=opts.gamma, rejection=opts.acceptance == "rejection")
        proposer = SuffixFirst(lookup, branches, opts.suffix_match)

    def log(scores: Scores, verdict: Verdict) -> dict[str, Any]:
        r = run.record
        return {"roots": r.roots, "hit": r.hit, "gamma": opts.gamma, "exit_layer": exit_layer, "kappa": run.kappa,
                "source": proposer.source}

    def close() -> None:
        branches.close()
        executor.close()
        if lookup is not None:
            lookup.close()

    return Roles(proposer, EarlyExitScorer(run, req.target, branches), VERIFIERS[opts.acceptance],
                 gamma=opts.gamma, close=close, log=log)


def step_cost(costs: Any, step: dict[str, Any], opts: MirrorOptions) -> float:
    """Eq. 10 plus the exposed fresh rollout after a miss, which Eq. 10 leaves out: prefix + early exit +
    max(Δ, rollout) (their sum on the serial backend) + the miss's fresh rollout."""
    backend = opts.backend
    c = costs.for_backend(backend)
    # threads and processes: only the upper layers and the branch rollouts share the cores; the prefix and the exit
    # run with all of them (the executors split the threads around the overlap alone), and so does a fresh rollout
    # on the threads backend (in the draft's process, on its share, with processes)
    whole = costs if backend in ("threads", "processes") else c
    fresh_costs = costs if backend == "threads" else c
    w, gamma, roots = step["drafted"] + 1, step["gamma"], step["roots"]
    pre = whole.prefix(step["exit_layer"], w)
    delta = c.target(w) - c.prefix(step["exit_layer"], w)
    rollout = gamma * c.draft(roots, opts.draft_vocab) if roots else 0.0
    core = max(delta, rollout) if backend != "serial" else delta + rollout
    # a window no branch was kept for (a miss, or no rollout) is a fresh rollout; a suffix draft is free
    fresh = float(step["hit"] is not True and step.get("source", "model") == "model")
    exit_head = whole.exit_head(w) if roots else 0.0  # the exit only picks roots: none rolled out, none read
    # the fresh rollout's first forward reads what the draft's cache lacked (the prompt, on the first step), as sd's;
    # its forwards as recorded (a confident window ends early), else one per drafted token
    forwards = step.get("draft_forwards", step["drafted"])
    d = partial(fresh_costs.draft, vocab=opts.draft_vocab)
    first = fresh_costs.draft_read(max(step.get("fed", 1), 1), opts.draft_vocab)  # (the head on its last row only)
    rollout_fresh = first + (forwards - 1) * d(1) if forwards else 0.0
    return pre + exit_head + core + fresh * rollout_fresh


def plan(inputs: PlanInputs, method: Method) -> list[Priced]:
    """Eq. 10 (plus the exposed rollout after a miss) per window, exit layer, κ and backend, at the probe's
    acceptance and fallback frequencies, plus the draft's prefill of the whole prompt."""
    if not inputs.has_draft:
        return []
    prefill = inputs.draft_prefill(None)
    out = []
    for g in inputs.gammas:
        tokens = inputs.expected_tokens(g)
        for e, by_kappa in inputs.fallback.get(g, {}).items():
            for k in inputs.kappas:
                if k not in by_kappa:
                    continue
                for backend in inputs.backends:
                    if backend == "threads" and not inputs.costs.split:
                        continue
                    options = {"gamma": g, "kappa": k, "exit_layer": e, "roots": "paper", "backend": backend,
                               "confidence": 0.0}
                    step = {"drafted": g, "gamma": g, "roots": (g + 1) * k, "exit_layer": e}
                    miss = method.price(inputs.costs, {**step, "hit": False}, **options)
                    hit = method.price(inputs.costs, {**step, "hit": True}, **options)
                    f = by_kappa[k]
                    out.append(Priced(options, tokens, f * miss + (1 - f) * hit + tokens * prefill))
    return out


def exit_probe(target: Transformer) -> Callable[[torch.Tensor], Any]:
    """The early exit as a step runs it by default (κ, the reduced-vocabulary exit head), on a window's hidden
    states: what the planner times for the exit-head cost row."""
    return partial(early_exit, target, kappa=DEFAULT_KAPPA, params=SamplingParams(), head=optional_head(target, None))


register("mirror", "Mirror-SD: early-exit token channel, draft rollouts overlapped with the target's upper layers",
         needs_draft=True, options=MirrorOptions, build=build, step_cost=step_cost, rejection=True,
         tensor_parallel=True, plan=plan, exit_probe=exit_probe)

"""Mirror-SD's target side: the target in two halves around the early exit, launching the draft's rollouts
between them."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ...model import Transformer
from ...transfer import send
from ..engine import ChainScorer, Proposal, RequestState, Scores
from .channel import ChannelMessage, exit_top_k
from .draft import BranchProposer
from .options import batch_caps
from .roots import DeviceRoots, select_roots
from .stats import MirrorRun, MirrorStep


class EarlyExitScorer(ChainScorer):
    """The target in two halves: layers below ℓe, the early exit and the launch of the draft's rollouts, then
    the layers above ℓe while the rollouts run."""

    def __init__(self, run: MirrorRun, target: Transformer, draft: BranchProposer) -> None:
        super().__init__(target)
        self.run, self.draft = run, draft

    def prefill(self, state: RequestState) -> int:
        with self.run.tracer.span("target", "prefill"):
            return super().prefill(state)

    def score(self, state: RequestState, draft: Proposal) -> Scores:
        run, target, opts = self.run, self.model, self.run.opts
        start = time.perf_counter()
        committed = len(state.tokens)
        ids = torch.cat([send([state.tokens[-1]], target.device), draft.on(target.device)])[None]
        positions = torch.arange(committed - 1, committed + draft.length, device=target.device)[None]
        with run.tracer.span("target", "layers < ℓe") as pre:
            exit_hidden = target.run_layers(target.embed(ids), positions, state.target_cache, end=run.exit_layer)
        # The next window can hold at most this many tokens; rollouts past it would be wasted.
        steps = min(opts.gamma, state.room - 1)
        message: ChannelMessage | None = None
        roots: Sequence[tuple[int, int]] = []
        ee, submitted, launch, pick = None, 0.0, False, None
        if not self.draft.failed and steps > 0 and run.rolls_out:
            kappa = min(opts.kappa, batch_caps(state.batch)[0] or opts.kappa)  # fewer roots in a busy batch
            run.kappa = kappa
            with run.tracer.span("target", "early exit") as ee:
                top = exit_top_k(target, exit_hidden, kappa, state.params, run.translate, run.exit_vocab)
                if run.device_roots:
                    roots = DeviceRoots(top)
                else:
                    message = top.message()
                    if opts.candidates == "draft":
                        message = message.with_draft(draft, kappa)
            if message is not None:
                budget = run.budget.current if run.budget else 0
                roots = select_roots(message, draft.tokens, opts.roots, run.root_scorer, budget)
            launch = True  # the exit ran: the draft rolls out (its roots may be none)
        # A worker (or a deferred job) starts the rollouts before the upper layers run here; an inline executor issues
        # them after the upper layers are queued on the target's stream, so the two streams still overlap.
        late = run.executor.issues_after_target
        if launch and not late:
            submitted = time.perf_counter()
            pick = self.draft.launch(state, draft, roots, steps)
        with run.executor.overlapping(), run.tracer.span("target", "layers ≥ ℓe") as upper:
            hidden = target.run_layers(exit_hidden, positions, state.target_cache, start=run.exit_layer)
            logits = target.logits(hidden)[0]
        if launch and late:
            submitted = time.perf_counter()
            pick = self.draft.launch(state, draft, roots, steps)
        # (the target's terms are read off its spans once the step is joined: on a GPU they are device times then)
        run.scored(MirrorStep(accepted=0, drafted=draft.length, roots=len(roots), hit=None, t_pre=0.0,
                              t_ee=0.0, t_channel=0.0, delta=0.0, t_draft=0.0, t_fv=0.0, t_fallback=0.0, hidden=0.0,
                              step_s=0.0), start, submitted, (pre, ee, upper), message, steps)
        return Scores(logits, draft, rider=pick)

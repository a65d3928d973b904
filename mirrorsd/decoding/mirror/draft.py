"""Mirror-SD's draft side: the proposer the loop sees (:class:`BranchProposer`: a kept branch, else a fresh
rollout) over a draft that runs here (:class:`LocalDraft`) or in another process
(:class:`~mirrorsd.decoding.mirror.remote.RemoteDraft`), through one small interface (:class:`DraftSide`)."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch

from ...model import Transformer
from ...runtime import Span
from ...sampling import SamplingParams, choose, rows_apart
from ...transfer import read_all, send
from ...verify import Verdict, verify_tree
from ..draft_graph import graphed_draft
from ..drafting import draft_vocab_size, window_end, window_ends
from ..engine import DrawnChain, Proposal, RequestState, Scores, VerdictRider, draft_tokens
from ..proposers import ModelProposer, StreamProposer
from ..streams.adapters import load_adapters, stream_mask
from ..streams.passes import StreamGuesses, ancestors, reads_every_row, stream_tops
from ..streams.rollout_graph import graphed_stream_draft
from .options import MirrorOptions, batch_caps
from .roots import DeviceRoots
from .stats import MirrorRun


@dataclass
class Tree:
    """Branch-complete rollouts: branch r continues root ``roots[r]`` with ``tokens[r]`` (γ tokens)."""

    roots: Sequence[tuple[int, int]]
    tokens: list[list[int]] | torch.Tensor  # [R, γ]: read, or (:class:`BranchPick`) still where they were drawn
    top_probs: list[list[float]] | None  # confidence rule
    q: torch.Tensor | None  # [R, γ, vocab] draft distributions (rejection sampling)
    entries: list[list[int]] | torch.Tensor  # branch r's inputs (its root, then its tokens) at these cache indices
    forwards: int
    span: Span | None = None
    alternatives: list[list[list[int]]] | None = None  # [R][γ][κ+1] the draft's likeliest tokens (candidates=draft)
    graphed: bool = False  # replayed as one captured CUDA graph (:mod:`~..draft_graph`)
    # a stream rollout's graph (:mod:`~..streams.rollout_graph`): branch r's first ``counts[r]`` tokens, and ``entries``
    # then ``[R, ·]`` on the device too; what was read of them on the host
    counts: torch.Tensor | None = None
    read_counts: list[int] | None = None
    read_entries: dict[int, list[int]] = field(default_factory=dict)
    # under the confidence rule, with the tokens on the device: each branch's window end (:func:`window_ends`), and
    # what was read of them (the kept branch's, with the verdict)
    ends: torch.Tensor | None = None
    read_ends: dict[int, int] = field(default_factory=dict)

    def branch(self, accepted: int, correction: int) -> int | None:
        for r, root in enumerate(self.roots):
            if root == (accepted, correction):
                return r
        return None

    def kept(self, branch: int) -> tuple[int, list[int]]:
        """Branch ``branch``'s token count and its inputs' cache entries, on the host (a ragged rollout's read with
        the verdict, or else every branch's in one read)."""
        if self.counts is None:
            return len(self.tokens[branch]), self.entries[branch]
        if branch not in self.read_entries:
            self._read()
        assert self.read_counts is not None
        return self.read_counts[branch], self.read_entries[branch]

    def end(self, branch: int) -> int | None:
        """Branch ``branch``'s window under the confidence rule, if the host has not read its top probabilities
        (the verdict's read carries it; else one read here)."""
        if self.ends is None:
            return None
        if branch not in self.read_ends:
            self.read_ends[branch] = int(self.ends[branch])
        return self.read_ends[branch]

    def depth(self, steps: int) -> float:
        """The tokens a branch holds for its window, on average: ``steps``, or fewer where a ragged rollout's
        fixed passes ended a branch short."""
        if self.counts is None:
            return steps
        if self.read_counts is None:
            self._read()
        assert self.read_counts is not None
        return sum(min(c, steps) for c in self.read_counts) / len(self.read_counts)

    def _read(self) -> None:
        """Every branch's count and entries in one host read (where the verdict did not carry the kept one's)."""
        assert self.counts is not None and isinstance(self.entries, torch.Tensor)
        self.read_counts, entries = read_all(self.counts, self.entries)
        self.read_entries = dict(enumerate(entries))


class BranchPick:
    """:meth:`Tree.branch` on the device, from the verdict as the target's device holds it, read in the verdict's
    own host read (a :class:`~..engine.VerdictRider`): with the rollout's tokens and roots still on the device, a
    step reads the host once. ``join`` returns the rollout (on the serial backend it runs then); a rollout that
    failed rides along with nothing, and :meth:`LocalDraft.verdict` meets its error where it meets a host pick's."""

    def __init__(self, join: Callable[[], Tree]) -> None:
        self.join: Callable[[], Tree] | None = join  # (dropped with the step: the scores need not keep the tree)
        self.taken = False  # whether the verdict carried it (else the branch is picked on the host)
        self.branch: int | None = None
        self.join_s = 0.0  # the verdict's wait for the rollout (all of it, on the serial backend): the draft's time
        self.tree: Tree | None = None  # the rollout whose kept branch the read carries (its end, a ragged one's count)

    def tensors(self, accepted: torch.Tensor, correction: torch.Tensor) -> list[torch.Tensor]:
        if self.join is None:
            return []
        start = time.perf_counter()
        try:
            tree = self.join()
            roots = tree.roots
        except Exception:  # noqa: BLE001 - the draft's failure is the proposer's to handle, not the verdict's
            return []
        finally:
            self.join_s = time.perf_counter() - start
        if not isinstance(roots, DeviceRoots):  # a host-driven rollout read them: the branch is picked on the host
            return []
        found = (send(roots.at, accepted.device) == accepted) & (roots.ids.to(accepted.device) == correction)
        branch = found.long().argmax()
        picked = [found.any().long(), branch]
        if tree.ends is not None:  # the confidence rule: the picked branch's window end too
            picked.append(tree.ends.to(branch.device).gather(0, branch.view(1))[0])
        riding = [torch.stack(picked)]
        self.tree = tree
        if tree.counts is not None:  # a ragged rollout: every branch's count and the picked one's entries too
            riding += [tree.counts, tree.entries.index_select(0, branch.to(tree.counts.device).view(1))[0]]
        return riding

    def read(self, values: list) -> None:
        if values:
            hit, branch, *end = values[0]
            self.branch, self.taken = branch if hit else None, True
            assert self.tree is not None
            if end:
                self.tree.read_ends[branch] = end[0]
            if self.tree.counts is not None:
                self.tree.read_counts, self.tree.read_entries[branch] = values[1], values[2]


class DraftSide(Protocol):
    """Where the draft model runs, as :class:`BranchProposer` drives it. Each call may raise: the proposer then
    degrades the request to target-only decoding (:meth:`abandon` names the error)."""

    def start(self, state: RequestState) -> None: ...

    def fresh(self, state: RequestState) -> Proposal:
        """A fresh rollout after the committed text (the first window, or after a miss)."""
        ...

    def launch(self, state: RequestState, window: Proposal, roots: Sequence[tuple[int, int]],
               steps: int) -> VerdictRider | None:
        """Start ``steps``-token rollouts after every root, overlapping the target's upper layers; the branch
        pick for the verdict to carry, where the rollout stays on the target's device."""
        ...

    def verdict(self, state: RequestState, verdict: Verdict) -> Proposal | None:
        """The final rendezvous: join the rollout, record it (:meth:`MirrorRun.joined`, called only once nothing
        can fail any more), and return the branch the correction selects (a hit) or None (a miss, or no rollout),
        with the draft's cache rolled back to match."""
        ...

    def abandon(self, error: BaseException) -> BaseException:
        """The draft failed: release what it holds, and return the error to report."""
        ...

    def close(self, failed: bool) -> None: ...


class BranchProposer:
    """The draft: a kept branch when the last verdict hit one, else a fresh rollout; the scorer launches the
    tree rollouts at the early exit (:meth:`launch`). A failing draft degrades the request to target-only
    decoding. The suffix hybrid wraps it (:class:`~mirrorsd.decoding.lookup.SuffixFirst`), which hands a held
    branch (:attr:`ready`) precedence over a suffix match."""

    def __init__(self, run: MirrorRun, side: DraftSide) -> None:
        self.run, self.side = run, side
        self.ready: Proposal | None = None  # the next window, when a branch was kept
        self.failed = False
        self.source = "model"  # who drafted the last window: "branch" or "model" (a fresh rollout)
        self.fresh_window: Proposal | None = None  # this step's fresh rollout (its stats, once the verdict read it)

    def start(self, state: RequestState) -> None:
        try:
            self.side.start(state)
        except Exception as error:  # noqa: BLE001 - no draft: the target decodes alone
            self.fail(error)

    def propose(self, state: RequestState) -> Proposal:
        if self.ready is not None:
            window, self.ready, self.source = self.ready, None, "branch"
            return window
        start = time.perf_counter()
        window, self.source = Proposal(), "model"
        if not self.failed and min(self.run.opts.gamma, state.room) > 0:
            try:
                window = self.fresh_window = self.side.fresh(state)
            except Exception as error:  # noqa: BLE001 - any draft failure degrades to target-only decoding
                self.fail(error)
        self.run.fresh_done(time.perf_counter() - start)
        return window

    def launch(self, state: RequestState, window: Proposal, roots: Sequence[tuple[int, int]],
               steps: int) -> VerdictRider | None:
        try:
            return self.side.launch(state, window, roots, steps)
        except Exception as error:  # noqa: BLE001 - degrade, never lose the verified tokens
            self.fail(error)
            return None

    def feedback(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        self.run.observe(scores.draft.tokens, verdict)  # the root scorer learns from every verdict
        if self.run.record is not None:  # (a window cut on the device is read with the verdict)
            self.run.record.drafted = scores.draft.length
        if scores.draft is self.fresh_window:
            self.run.stats.fresh_tokens += scores.draft.length
            self.run.stats.fresh_forwards += scores.draft.forwards
        self.fresh_window = None
        if self.failed:
            self.run.joined(None)
            return
        try:
            self.ready = self.side.verdict(state, verdict)
        except Exception as error:  # noqa: BLE001 - degrade, never lose the verified tokens
            self.fail(error)
            self.run.joined(None)

    def fail(self, error: BaseException) -> None:
        error = self.side.abandon(error)
        self.failed, self.ready = True, None
        self.run.stats.draft_failed = f"{type(error).__name__}: {error}"
        warnings.warn(f"mirror: the draft failed ({self.run.stats.draft_failed}); continuing with the target alone",
                      RuntimeWarning, stacklevel=3)

    def close(self) -> None:
        self.side.close(self.failed)


def fresh_proposer(draft: Transformer, target_vocab: int, sampling: SamplingParams,
                   opts: MirrorOptions) -> ModelProposer:
    """The draft's own proposer (vanilla SD's): fresh rollouts, and the sampler every tree rollout uses."""
    rejection = opts.acceptance == "rejection"
    if opts.draft_streams is None:
        proposer = ModelProposer(draft, target_vocab, sampling, opts.gamma, confidence=opts.confidence,
                                 rejection=rejection, vocab=draft_vocab_size(opts.draft_vocab, draft),
                                 cut_on_device=True)
    else:
        proposer = StreamProposer(draft, load_adapters(draft, opts.draft_streams), target_vocab, sampling,
                                  opts.gamma, confidence=opts.confidence, rejection=rejection,
                                  vocab=draft_vocab_size(opts.draft_vocab, draft))
    proposer.sampler.runner_ups = opts.kappa + 1 if opts.candidates == "draft" else 0  # the drafted token too
    return proposer


class LocalDraft:
    """The draft model in this process: fresh rollouts through the shared proposer, tree rollouts on the run's
    executor (serial, a worker thread, a CUDA stream or another device), the branch kept in its cache."""

    def __init__(self, run: MirrorRun, fresh: ModelProposer) -> None:
        self.run, self.proposer, self.model = run, fresh, fresh.model
        self.confidence = fresh.confidence
        # a fresh window cut on the device feeds its last token where it stays unread (:meth:`fresh`); read at once,
        # the extra step would be wasted
        fresh.through_end = run is not None and run.device_roots
        self.future: Future[Tree] | None = None
        self.pick: BranchPick | None = None
        self.streamed = [0, 0]  # tokens after the first pass, and the passes that made them (:meth:`passes`)

    def start(self, state: RequestState) -> None:
        pass

    def fresh(self, state: RequestState) -> Proposal:
        with self.run.tracer.span("draft", "fresh rollout"):
            if not isinstance(self.proposer, StreamProposer):
                # a window cut on the device stays there where the roots do, its last token fed (the tree rollouts
                # read the spine through any root): the verdict reads it; else it is read now, as the host loop's
                window = self.proposer.propose(state)
                return window if self.run.device_roots else self.proposer.settled(state, window)
            window = self.proposer.propose(state, streams=batch_caps(state.batch)[1])  # (App. D.1: fewer in a batch)
            if window.forwards > 1:
                self.learn(window.length, window.forwards)
            return window

    def learn(self, tokens: int, passes: int) -> None:
        """A stream rollout of ``passes`` passes made ``tokens`` tokens (the first pass one of them)."""
        self.streamed[0] += tokens - 1
        self.streamed[1] += passes - 1

    def launch(self, state: RequestState, window: Proposal, roots: Sequence[tuple[int, int]],
               steps: int) -> BranchPick | None:
        # What the draft cache lacks of the spine (the committed text and the window): the window's last token
        # after a model draft (where it was drawn, if it is still there; an unread window cut on the device holds a
        # placeholder there past its end, which only roots past the end see, and no verdict keeps them); more after
        # a suffix draft, or when the cache lags behind suffix steps.
        lag = len(state.tokens) + window.length - len(state.draft_cache)
        spine: list[int] | torch.Tensor
        if isinstance(window, DrawnChain) and window.unread and window.end is not None and not window.through_end:
            raise RuntimeError("an unread window cut on the device must feed its last token (through_end) to roll out")
        if isinstance(window, DrawnChain) and window.unread and lag == 1:
            spine = window.ids[-1:]
        else:
            spine = [*state.tokens, *window.tokens][len(state.draft_cache):]
        self.future = self.run.executor.submit(
            partial(self.rollout, len(state.tokens), window.length, spine, roots, steps, state))
        self.pick = BranchPick(self.future.result) if self.stays_on_device(roots) else None
        return self.pick

    def stays_on_device(self, roots: Sequence[tuple[int, int]]) -> bool:
        """Whether a rollout keeps its tokens where it drew them: roots still on the device, and nothing else
        the host needs of it (runner-ups for ``candidates=draft``; a stream rollout's top probabilities for the
        confidence rule, read pass by pass; a host-driven stream rollout's per-pass verdicts, which
        :meth:`BranchPick.tensors` finds read). A model rollout's confidence rule cuts each branch on the device
        (:attr:`Tree.ends`), and the verdict's read carries the kept branch's end."""
        return isinstance(roots, DeviceRoots) and not self.proposer.sampler.runner_ups \
            and (self.confidence == 0 or not isinstance(self.proposer, StreamProposer))

    def rollout(self, committed: int, window: int, spine: list[int] | torch.Tensor,
                roots: Sequence[tuple[int, int]], steps: int, state: RequestState) -> Tree:
        with self.run.tracer.span("draft", "rollout", roots=len(roots), steps=steps) as span:
            if isinstance(self.proposer, StreamProposer):
                tree = self._stream_rollout(state, committed, window, spine, roots, steps)
            else:
                tree = self._rollout(state, committed, window, spine, roots, steps)
        tree.span = span
        return tree

    def _rollout(self, state: RequestState, committed: int, window: int, spine_feed: list[int] | torch.Tensor,
                 roots: Sequence[tuple[int, int]], steps: int) -> Tree:
        """γ tokens after every root, one batched tree-masked forward per step over the shared cache.

        ``committed`` is the length of the committed text (through ``a``); the cache holds the spine (that text
        and the ``window`` tokens after it) but ``spine_feed``, which the first step feeds causally. Root ``(j, v)``
        sits at position ``committed + j`` and sees the spine up to ``d_j``. Roots still on the device
        (:class:`~.roots.DeviceRoots`) and a spine token still where the draft drew it feed the first step as they
        are.

        No step reads anything on the host: each step's drawn tokens feed the next forward where they were drawn,
        and the tokens, top probabilities, runner-ups and roots are read together, after the last step (on a GPU the
        steps then queue back to back, as :meth:`ModelProposer._chain`'s do). Where only the tokens are wanted
        (:meth:`stays_on_device`), nothing is read: the verdict picks the branch on the device (:class:`BranchPick`).
        """
        model, cache, sampler = self.model, state.draft_cache, self.proposer.sampler
        device = model.device
        if len(cache) + len(spine_feed) != committed + window:
            raise RuntimeError(f"draft cache holds {len(cache)} positions and {len(spine_feed)} are fed, expected "
                               f"{committed + window} in all")
        n_roots, past = len(roots), len(cache)
        base = past + len(spine_feed)  # == committed + window
        at = roots.at if isinstance(roots, DeviceRoots) else [j for j, _ in roots]
        root_ids = roots.ids.to(device) if isinstance(roots, DeviceRoots) else [v for _, v in roots]
        entries = [[base + s * n_roots + r for s in range(steps)] for r in range(n_roots)]
        graphed = graphed_draft(model, cache, sampler, spine_feed, [committed + j for j in at], root_ids, steps)
        if graphed is not None:  # (under the confidence rule with every step's top probabilities)
            out, replayed = graphed
            tokens, tops = out if isinstance(out, tuple) else (out, None)
            tree = self._tree(roots, tokens, [] if tops is None else list(tops.unbind(1)), [], [], entries, steps)
            tree.graphed = replayed
            return tree
        root_pos = send([committed + j for j in at], device)
        # branch r drafts the window that starts after its root (a seed of its own under rejection sampling)
        keys = None if sampler.params.greedy else sampler.keys([committed + j + 1 for j in at], device)
        # Every step's mask is a prefix of one: branch r sees the spine before its root (root (j, v) sees
        # [0, committed + j)) and its own inputs, which step s puts at base + s·R + r.
        cols = torch.arange(base + steps * n_roots, device=device)
        own = (cols >= base) & ((cols - base) % n_roots == torch.arange(n_roots, device=device).unsqueeze(1))
        branches = (cols < root_pos.unsqueeze(1)) | own
        ids = torch.cat([draft_tokens(model, spine_feed), draft_tokens(model, root_ids)], 1)
        drawn: list[torch.Tensor] = []  # per step: [R] token ids
        tops: list[torch.Tensor] = []  # per step: [R] top probabilities (confidence rule)
        q_steps: list[torch.Tensor] = []  # per step: [R, vocab] distributions (rejection sampling)
        runner_ups: list[torch.Tensor] = []  # per step: [R, κ+1] likeliest ids (candidates=draft)
        for step in range(steps):
            lead = len(spine_feed) if step == 0 else 0
            total = base + (step + 1) * n_roots
            mask = branches[:, :total]
            if lead:  # the spine's missing tokens, causally
                spine = cols[:total] < torch.arange(past + 1, past + lead + 1, device=device).unsqueeze(1)
                mask = torch.cat([spine, mask])
            mask = mask.unsqueeze(0).contiguous()
            positions = torch.cat([torch.arange(past, past + lead, device=device), root_pos + step]).unsqueeze(0)
            hidden = model.run_layers(model.embed(ids), positions, cache, mask)
            rows = hidden[0, lead:]
            logits = model.logits(rows, sampler.head)
            q, top = sampler.judged(logits)
            if top is not None and self.confidence > 0:
                tops.append(top)
            if q is not None:
                q_steps.append(q)
            drawn.append(sampler.choose(logits, root_pos + step + 1, keys))
            if sampler.runner_ups:
                runner_ups.append(sampler.likeliest_ids(logits))
            ids = draft_tokens(model, drawn[-1])
        return self._tree(roots, torch.stack(drawn, 1), tops, q_steps, runner_ups, entries, steps)

    def _tree(self, roots: Sequence[tuple[int, int]], tokens: torch.Tensor, tops: list[torch.Tensor],
              q_steps: list[torch.Tensor], runner_ups: list[torch.Tensor], entries: list[list[int]],
              steps: int) -> Tree:
        """A rollout's :class:`Tree` from its tokens ``[R, γ]`` and per-step tensors, read on the host in one read
        unless only the tokens are wanted and the roots are still on the device (:meth:`stays_on_device`)."""
        n_roots, device = len(roots), self.model.device
        q = torch.stack(q_steps, 1) if q_steps else None
        if self.stays_on_device(roots):  # the verdict picks the branch on the device (BranchPick)
            ends = window_ends(torch.stack(tops, 1), self.confidence) if self.confidence > 0 else None
            return Tree(roots, tokens, None, q, entries, steps, ends=ends)
        # The tokens, and what else was asked for, in one host read (the roots' ids too, if still on the device).
        wanted = {"tops": tops if self.confidence > 0 else None,
                  "alternatives": runner_ups if self.proposer.sampler.runner_ups else None}
        reading = {"tokens": tokens} | {name: torch.stack(per_step, 1) if per_step else
                                        torch.zeros(n_roots, 0, device=device)
                                        for name, per_step in wanted.items() if per_step is not None}
        if isinstance(roots, DeviceRoots):
            reading["roots"] = roots.ids
        read = dict(zip(reading, read_all(*reading.values()), strict=True))
        if isinstance(roots, DeviceRoots):
            roots.read(read["roots"])
        return Tree(roots, read["tokens"], read.get("tops"), q, entries, steps, alternatives=read.get("alternatives"))

    def passes(self, steps: int) -> int:
        """A graphed stream rollout's fixed pass count: the first pass (roots alone, no guesses) adds one token, and
        each later one its accepted guesses and one more, so J = 1 + ⌈(γ − 1)/η̄'⌉, the paper's ⌈γ/η̄⌉ bound with
        η̄' the tokens per guessing pass so far: of the fresh rollouts (windows cut at γ: a little low, so J errs
        long) and of the branches graphed rollouts kept. Branches that accept less end short of γ: their windows are
        shorter."""
        tokens, passes = self.streamed
        eta = max(1.0, tokens / passes) if passes else 1.0
        return 1 + math.ceil((steps - 1) / eta) if steps > 1 else 1

    def _stream_rollout(self, state: RequestState, committed: int, window: int, spine_feed: list[int] | torch.Tensor,
                        roots: Sequence[tuple[int, int]], steps: int) -> Tree:
        """:meth:`_rollout` with Speculative Streaming passes (``draft_streams``): in every forward each branch
        verifies its streams' last guesses and drafts the next, so a rollout takes about ⌈γ/η̄⌉ forwards instead
        of γ (the paper's J ≤ ⌈γ/η̄⌉), with the same tokens: each branch's main stream verifies, as in
        :class:`~..proposers.StreamProposer`.

        Where a graph applies, the rollout is one (:func:`~..streams.rollout_graph.graphed_stream_draft`): J =
        :meth:`passes` passes verified on the device, chains of the streams' top guesses, nothing read until the
        verdict, and branches ending with their own counts. Otherwise, driven from the host: one forward carries
        every unfinished branch: its next input (the root, then its last token) and its guess tree, over the spine
        it sees and its own cache entries. Branches accept different counts, so the cache
        keeps each branch's inputs wherever they land (``entries``), compacted past the spine after every pass.

        The pass's mask and positions are built on the host and sent once. Its verdicts decide the next pass's
        inputs, so each pass reads the host: off the CPU once, every branch row's own token with every row's next
        guesses (:func:`~..streams.passes.reads_every_row`); on a CPU twice, the guesses of the rows the verdicts kept
        after them (and sampled rows not drawn apart, ``top_p``, one by one)."""
        proposer = self.proposer
        assert isinstance(proposer, StreamProposer)
        model, cache, sampler, adapters = self.model, state.draft_cache, proposer.sampler, proposer.adapters
        device = model.device
        if len(cache) + len(spine_feed) != committed + window:
            raise RuntimeError(f"draft cache holds {len(cache)} positions and {len(spine_feed)} are fed, expected "
                               f"{committed + window} in all")
        n_streams = adapters.stream_count(batch_caps(state.batch)[1])
        at = roots.at if isinstance(roots, DeviceRoots) else [j for j, _ in roots]
        passes = self.passes(steps)
        ids = roots.ids.to(device) if isinstance(roots, DeviceRoots) else [v for _, v in roots]
        graphed = graphed_stream_draft(model, adapters, cache, sampler, spine_feed, [committed + j for j in at], ids,
                                       passes, n_streams)
        if graphed is not None:
            drawn, counts, kept, replayed = graphed
            return Tree(roots, drawn, None, None, kept, passes, graphed=replayed, counts=counts)
        # Each pass reads its verdicts on the host anyway, so the roots' ids and the spine are read here, in the job.
        roots = list(roots)
        if isinstance(spine_feed, torch.Tensor):
            spine_feed = spine_feed.tolist()
        n_roots, base, split = len(roots), len(cache) + len(spine_feed), adapters.first_layer
        sees = [committed + j for j, _ in roots]  # root (j, v) sits at committed + j and sees the spine before it
        entries: list[list[int]] = [[] for _ in roots]
        tokens: list[list[int]] = [[] for _ in roots]
        q_rows: list[list[torch.Tensor]] = [[] for _ in roots]
        tops: list[list[float]] = [[] for _ in roots]
        inputs = [v for _, v in roots]  # each branch's next input, which the cache lacks
        guesses = [StreamGuesses() for _ in roots]
        lead, forwards = list(spine_feed), 0
        while live := [r for r in range(n_roots) if len(tokens[r]) < steps]:
            past = len(cache)
            feed, positions = list(lead), list(range(past, past + len(lead)))
            starts: list[int] = []  # per branch row, the start of the window its branch drafts
            blocks: list[tuple[int, int, Proposal]] = []  # (branch, first row, guess tree)
            for r in live:
                tree = guesses[r].tree(min(n_streams, steps - len(tokens[r]) - 1), proposer.tree_budget)
                blocks.append((r, len(feed), tree))
                at = sees[r] + len(tokens[r])
                depths = [0]
                for parent in tree.parents or []:
                    depths.append(depths[parent + 1] + 1)
                feed += [inputs[r], *tree.tokens]
                positions += [at + d for d in depths]
                starts += [sees[r] + 1] * len(depths)
            n, rows = len(feed), len(feed) - len(lead)
            main = torch.zeros(n, past + n, dtype=torch.bool)  # on the host: one copy to the device, no index copies
            for i in range(len(lead)):
                main[i, : past + i + 1] = True  # the spine's missing tokens, causally
            for r, first, tree in blocks:
                size = 1 + len(tree.tokens)
                block = main[first:first + size]
                block[:, :sees[r]] = True
                block[:, entries[r]] = True
                block[:, past + first:past + first + size] = ancestors([-1, *(p + 1 for p in tree.parents or [])])
            main = send(main, device)
            streamed = torch.arange(len(lead), n, device=device)  # every branch row may be the last accepted
            pos = send(positions, device)
            hidden = model.run_layers(model.embed(draft_tokens(model, feed)), pos[None], cache, main[None], 0, split)
            x = torch.cat([hidden, adapters.insert(hidden[:, streamed], n_streams)[:, len(streamed):]], 1)
            up_positions = torch.cat([pos, pos[streamed].repeat_interleave(n_streams)])[None]
            out = model.run_layers(x, up_positions, cache, stream_mask(main, streamed, n_streams), split, None,
                                   streams=adapters.rows(len(streamed) * n_streams))[0]
            forwards += 1
            logits = model.logits(out[len(lead):n], sampler.id_head)
            # every branch row's own token in one op (each row predicts the position after it), read at once with
            # every row's next guesses where rows are cheap, else before the kept rows' guesses
            own: list[int] | None = None
            every = reads_every_row(logits, proposer.params)
            if rows_apart(logits, proposer.params):
                keys = None if sampler.params.greedy else sampler.keys(starts, device)
                drawn = choose(logits, pos[len(lead):] + 1, sampler.params, sampler.noise, keys)
                if every:
                    own, top_ids, logprobs = read_all(drawn, *stream_tops(model, out[n:n + rows * n_streams], n_streams,
                                                                          proposer.tree_k, proposer.stream_head))
                else:
                    own = drawn.tolist()
            lasts: list[int] = []  # per block, the stream rows' main row: the last accepted node
            for r, first, tree in blocks:
                at, size = first - len(lead), 1 + len(tree.tokens)
                verdict = verify_tree(tree.tokens, tree.parents or [], logits[at:at + size], positions[first] + 1,
                                      sampler.params_at(sees[r] + 1), sampler.noise,
                                      own[at:at + size] if own is not None else None)
                tokens[r] += [*(tree.tokens[i] for i in verdict.nodes), verdict.next_token]
                entries[r] += [past + first, *(past + first + 1 + i for i in verdict.nodes)]
                inputs[r] = verdict.next_token
                lasts.append(first + (verdict.nodes[-1] + 1 if verdict.accepted else 0))
                if sampler.need_probs:
                    q, top = sampler.judge(logits[at:at + size][[0, *(i + 1 for i in verdict.nodes)]])
                    q_rows[r] += list(q) if q is not None else []
                    tops[r] += top or []
            nodes = [row - len(lead) for row in lasts]  # each block's last accepted row, among the branch rows
            if not every:  # the kept rows' guesses, every branch's in one read
                stream_rows = send([n + node * n_streams + j for node in nodes for j in range(n_streams)], device)
                top_ids, logprobs = read_all(*stream_tops(model, out[stream_rows], n_streams, proposer.tree_k,
                                                          proposer.stream_head))
                nodes = list(range(len(blocks)))
            for b, (r, _, _) in enumerate(blocks):
                guesses[r] = StreamGuesses(top_ids[nodes[b]], logprobs[nodes[b]])
            kept = [e for branch in entries for e in branch]
            cache.compact(base, [e - base for e in kept])
            at = base
            for r in range(n_roots):
                entries[r], at = list(range(at, at + len(entries[r]))), at + len(entries[r])
            lead = []
        q = torch.stack([torch.stack(rows[:steps]) for rows in q_rows]) if any(q_rows) else None
        top_probs = [t[:steps] for t in tops] if self.confidence > 0 else None
        return Tree(roots, [t[:steps] for t in tokens], top_probs, q, entries, forwards)

    def verdict(self, state: RequestState, verdict: Verdict) -> Proposal | None:
        tree, future, self.future = None, self.future, None
        pick, self.pick = self.pick, None
        if pick is not None:  # the rollout the verdict waited for is the draft's time, not the target's
            state.stats.target_s -= pick.join_s
            state.stats.draft_s += pick.join_s
            pick.join = None
        if future is not None:
            tree = future.result()
            state.stats.draft_forwards += tree.forwards
        self.run.joined(tree)
        kept = None
        if tree is not None:
            with self.run.tracer.span("draft", "select") as select:
                branch = pick.branch if pick is not None and pick.taken else \
                    tree.branch(verdict.accepted, verdict.next_token)
                if branch is not None:
                    kept = self.keep_branch(state, tree, branch)
            self.run.selected(select.seconds, branch is not None)
        if kept is None:
            ModelProposer.rollback(state, verdict.accepted)
        return kept

    def keep_branch(self, state: RequestState, tree: Tree, branch: int) -> Proposal:
        """Compact the cache to the spine through ``d_A`` plus the branch's inputs ``c, t_1..t_{w-1}``."""
        limit = max(0, min(self.proposer.gamma, state.room))  # (a window that filled the room: nothing left)
        count, entries = tree.kept(branch)
        if tree.top_probs is not None:
            window = min(limit, window_end(tree.top_probs[branch], self.confidence))
        else:
            end = tree.end(branch)
            window = min(limit, count, count if end is None else end)
        if tree.counts is not None and tree.forwards > 1:  # what a ragged rollout's guessing passes made
            self.learn(count, tree.forwards)
        before = len(state.tokens) - 1  # the spine through d_A
        state.draft_cache.keep(list(range(before)) + entries[:max(window, 1)])
        probs = tree.q[branch, :window] if tree.q is not None and window else None
        if isinstance(tree.tokens, torch.Tensor) and window:  # the next step's forward and verdict take them there
            chain = DrawnChain(tree.tokens[branch, :window])
            chain.probs = probs
            return chain
        alternatives = tree.alternatives[branch][:window] if tree.alternatives is not None else None
        return Proposal(list(tree.tokens[branch][:window]), probs=probs, alternatives=alternatives)

    def abandon(self, error: BaseException) -> BaseException:
        self.future, self.pick = None, None
        return error

    def close(self, failed: bool) -> None:
        """The request is over (the draft here needs nothing released)."""

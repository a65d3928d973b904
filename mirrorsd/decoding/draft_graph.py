"""γ draft steps after each of R roots, every step's token choice included, as one CUDA graph (issues 61 item 2 and
62 item 1): a chain (one root: ``sd``'s window, Mirror-SD's fresh rollouts) or Mirror-SD's tree rollout (one root per
candidate, each continued γ tokens).

Why: step by step, a draft on the GPU is γ layer-graph replays with a few to ~20 eager launches around each (the
embedding, a tree's gather lists, the head, the choice), all issued by the host; a 0.5B draft's forward then costs
what the host spends, not what its weights take, and Mirror-SD's rollouts run at the host's pace beside the target's
upper layers. As one graph the host issues a few copies and a replay, and the draft's steps run back to back.

The steps are those of :meth:`~.proposers.ModelProposer._chain` and :meth:`~.mirror.draft.LocalDraft._rollout`, bit
for bit: the same layers (the fused CUDA path, the only one where graphs apply) on the same rows, with each query's
visible keys in the order :func:`~mirrorsd.kernels.cuda_attention.visible_keys` lists them from a mask, here computed
on the device from the roots' positions: root ``r`` sees the cache before it, then its own inputs, which step ``s``
writes at ``base + s·R + r`` (one root: a causal chain). The model's own
:meth:`~mirrorsd.model.Transformer.run_layers` and :meth:`~mirrorsd.model.Transformer.logits` run inside, so a model
that overrides them (the GPU bench's oracle draft) is captured as it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from ..cuda_graphs import Captured, Output, StaticStep, run_if
from ..execution import static_graph
from ..kv_cache import KVCache
from ..linear import FIXED_ROWS
from ..model import Transformer
from ..sampling import stream_key
from ..transfer import send
from .drafting import DraftSampler
from .engine import draft_tokens


class RootedGraph(Captured):
    """Draft work after R roots over one draft cache's buffers, for one sampler's choice
    (:attr:`~.drafting.DraftSampler.choice`: the head, the warp and the noise): the static device inputs its body
    reads, which :meth:`feed` writes before each run. They are the cache length before the work, the spine's missing
    tokens (``lead`` of them), the roots' positions and ids, how far the noise's positions run ahead of the cache's
    (a draft that skipped prompt tokens), and the noise's stream key (the request's seed)."""

    def __init__(self, model: Transformer, cache: KVCache, sampler: DraftSampler, lead: int, n_roots: int,
                 pool: tuple | None) -> None:
        super().__init__(model.device, pool)
        self.model, self.sampler = model, sampler  # (not the cache, which holds this graph: no cycle)
        self.lead, self.n_roots = lead, n_roots
        device = model.device
        with torch.inference_mode(False):  # written in place from no_grad code too, not only inference mode
            self.past = torch.zeros((), dtype=torch.long, device=device)
            self.stream_key = torch.zeros((), dtype=torch.long, device=device)  # the noise's (the seed's)
            self.shift = torch.zeros((), dtype=torch.long, device=device)
            self.spine = torch.zeros(lead, dtype=torch.long, device=device)
            self.root_pos = torch.zeros(n_roots, dtype=torch.long, device=device)
            self.root_ids = torch.zeros(n_roots, dtype=torch.long, device=device)
            # the keys every layer's buffer holds (the layers grow one by one)
            self.keys = torch.arange(min(k.shape[2] for k in cache.keys), device=device)
            self.branches = torch.arange(n_roots, device=device)

    def feed(self, cache: KVCache, past: int, spine: torch.Tensor, root_pos: torch.Tensor, root_ids: torch.Tensor,
             shift: int, seed: int) -> Output:
        """The body's output; ``cache`` (the one this graph was made over) holds the work's inputs after
        ``past + lead`` (the caller sets the lengths). ``spine`` and ``root_ids`` are draft ids
        (:func:`~.engine.draft_tokens`); ``seed``: the request's (a sampled draft's noise)."""
        self.past.fill_(past)
        self.shift.fill_(shift)
        if not self.sampler.params.greedy:
            self.stream_key.fill_(stream_key(seed, self.sampler.noise))
        self.spine.copy_(spine.view(-1))
        self.root_pos.copy_(root_pos)
        self.root_ids.copy_(root_ids.view(-1))
        return self.run(lambda: self.body(cache))

    def body(self, cache: KVCache) -> Output:
        raise NotImplementedError


class DraftGraph(RootedGraph):
    """γ draft steps after R roots (a chain: one root): the drafted tokens ``[R, steps]``. Under the sampler's
    confidence rule also what the rule reads: each step's top probabilities ``[R, steps]`` (float64, as a host read
    gives them; a tree's window ends come from them, :func:`~.drafting.window_ends`), or with ``cut`` (a chain) where
    its window ends (``[1]``, :func:`~.drafting.window_end`'s count), the steps after its first doubtful token skipped
    on the device (:func:`~mirrorsd.cuda_graphs.run_if`): the confidence rule without a host read per draft step.
    ``through_end``: the step after the doubtful one runs too, so the cache holds every proposed token but a whole
    window's last (Mirror-SD's tree rollouts read the spine through any root that can be kept before anything is
    read; they feed that last token themselves)."""

    def __init__(self, model: Transformer, cache: KVCache, sampler: DraftSampler, lead: int, n_roots: int,
                 steps: int, pool: tuple | None, cut: bool = False, through_end: bool = False) -> None:
        super().__init__(model, cache, sampler, lead, n_roots, pool)
        self.steps, self.cut, self.through_end = steps, cut, through_end
        with torch.inference_mode(False):
            self.spine_rows = torch.arange(lead, device=model.device)

    def body(self, cache: KVCache) -> Output:
        model, sampler, lead, n_roots, device = self.model, self.sampler, self.lead, self.n_roots, self.model.device
        keys, root_pos, capacity = self.keys, self.root_pos, self.keys.numel()
        base = self.past + lead
        # root r's gather list: the cache before it, then its own inputs (past its count: any valid slot)
        own = base + (keys - root_pos.unsqueeze(1)) * n_roots + self.branches.unsqueeze(1)
        branch_keys = torch.where(keys < root_pos.unsqueeze(1), keys, own).clamp_(0, capacity - 1).int()
        judging = sampler.confidence > 0
        tokens = torch.zeros(n_roots, self.steps, dtype=torch.long, device=device)
        tops = torch.zeros(n_roots, self.steps if judging and not self.cut else 0, dtype=torch.float64, device=device)
        live = torch.ones((), dtype=torch.bool, device=device)  # (a cut chain: no doubtful token yet)
        feeds = torch.ones((), dtype=torch.bool, device=device)  # (through_end: the next step feeds this one's token)
        end = torch.full((1,), self.steps, dtype=torch.long, device=device)

        def step(s: int) -> None:
            positions, slots = root_pos + s, base + s * n_roots + self.branches
            index, count = branch_keys, (root_pos + s + 1).int()
            if s == 0:
                ids = torch.cat([self.spine, self.root_ids]).unsqueeze(0)
            else:
                ids = draft_tokens(model, tokens[:, s - 1])
            if s == 0 and lead:  # the spine's missing tokens first, causally
                spine_at = self.past + self.spine_rows
                positions, slots = torch.cat([spine_at, positions]), torch.cat([spine_at, slots])
                index = torch.cat([keys.int().expand(lead, capacity), index])
                count = torch.cat([(spine_at + 1).int(), count])
            static = StaticStep(positions.unsqueeze(0), slots, index.unsqueeze(0), count.unsqueeze(0))
            hidden = model.run_layers(model.embed(ids), static.positions, cache, static=static)
            rows = hidden[0, lead:] if s == 0 else hidden[0]
            logits = model.logits(rows, sampler.head)
            tokens[:, s].copy_(sampler.choose(logits, root_pos + s + 1 + self.shift, self.stream_key))
            if not judging:
                return
            top = sampler.judged(logits)[1]
            assert top is not None
            if not self.cut:
                tops[:, s].copy_(top)
                return
            doubt = (top[0].double() < sampler.confidence) & live  # (compared as the host compares what it reads)
            end.copy_(torch.where(doubt, 0 if s == 0 else s + 1, end))
            feeds.copy_(live)  # (before this step's doubt)
            live.copy_(live & doubt.logical_not())  # (a step past the end, run anyway, changes neither)

        warm = self.uses <= 1  # (a capture's warm-up runs every kernel the capture will record)
        for s in range(self.steps):
            if self.cut and s:
                run_if(feeds if self.through_end else live, partial(step, s), warm)
            else:
                step(s)
        if self.cut:
            return tokens, end
        return (tokens, tops) if judging else tokens


def graphed_draft(model: Transformer, cache: KVCache, sampler: DraftSampler, spine: list[int] | torch.Tensor,
                  root_pos: Sequence[int], root_ids: list[int] | torch.Tensor, steps: int, shift: int = 0,
                  cut: bool = False, through_end: bool = False) -> tuple[Output, bool] | None:
    """What :class:`DraftGraph` drafts (``[R, steps]`` tokens, and under the confidence rule the top probabilities,
    or with ``cut`` a chain's window end), and whether it came from a replay (not the warm-up, a failed capture or a
    CPU). ``spine``: the tokens the cache lacks before the roots; root ``r`` sits at cache position ``root_pos[r]``,
    and the noise keys each drawn token by its text position (its cache position plus ``shift``). Where one applies
    (:func:`~mirrorsd.execution.static_graph`, at most one fixed-row slab a step, no distributions or runner-ups;
    ``cut``: a chain, whose cache's lengths then run past the steps that ran, for the caller to truncate;
    ``through_end``: its last proposed token fed too). None
    otherwise, and on a shape's first sight: the caller then runs the steps one by one."""
    lead, n_roots = len(spine), len(root_pos)
    if cut and (sampler.confidence <= 0 or n_roots != 1):
        raise ValueError("a cut draft is a chain under the confidence rule")
    if lead + n_roots > FIXED_ROWS or sampler.rejection or sampler.runner_ups:
        return None
    past = len(cache)
    needed = past + lead + steps * n_roots
    through_end = cut and through_end
    key = ("draft", model, lead, n_roots, steps, sampler.confidence, cut, through_end, sampler.choice)
    graph = static_graph(model, cache, key, needed,
                         lambda pool: DraftGraph(model, cache, sampler, lead, n_roots, steps, pool, cut, through_end))
    if graph is None:
        return None
    out = graph.feed(cache, past, draft_tokens(model, spine), send(list(root_pos), model.device),
                     draft_tokens(model, root_ids), shift, sampler.params.seed)
    cache.lengths[:] = [needed] * cache.n_layers
    return out, graph.graph is not None

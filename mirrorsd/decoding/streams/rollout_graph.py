"""Speculative Streaming passes after each of R roots as one CUDA graph (issue 62 item 2): Mirror-SD's tree rollout
with ``draft_streams`` (the paper's draft drafts with streams), a fixed number of passes.

Why: the host-driven stream rollout (:meth:`~..mirror.draft.LocalDraft._stream_rollout`) reads the host after every
pass (its verdicts choose the next pass's inputs and tree), so its passes run at the host's pace and the rollout
cannot be one graph beside the target's upper layers. Here every pass verifies on the device: J passes are issued
blind (J = 1 + ⌈(γ − 1)/η̄′⌉, :meth:`~..mirror.draft.LocalDraft.passes`: the paper's J ≤ ⌈γ/η̄⌉ with the first pass's
one token apart), and the host reads nothing until the verdict.

Each pass feeds, per branch, its next input and a chain of its streams' top-1 guesses (the first pass: the spine's
missing tokens and the roots alone), runs the layers below N − N_s, inserts the streams beside every branch row,
runs the top layers, and verifies: a branch accepts its leading guesses that equal its main stream's own choices and
adds them and its next token, as :func:`~mirrorsd.verify.verify_tree` does on a chain. So the tokens are the draft's
own continuation, the same as the host-driven rollout's and the plain one's. Nothing is compacted inside: each branch
keeps the cache slots of its accepted rows in its own list, and its queries gather the spine before its root, that
list, then their own block (ascending slots, as a mask lists them). Branches accept different counts: each ends with
its own count of tokens (at least J), and its inputs' cache entries, on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...cuda_graphs import StaticStep
from ...draft_vocab import head_logits
from ...execution import static_graph
from ...kv_cache import KVCache
from ...linear import FIXED_ROWS
from ...model import Transformer
from ...transfer import send
from ..draft_graph import RootedGraph
from ..drafting import DraftSampler
from ..engine import draft_tokens
from .adapters import StreamAdapters
from .passes import stream_step


class StreamDraftGraph(RootedGraph):
    """One stream rollout shape (spine tokens fed before the roots, roots, passes, streams): the output is each
    branch's tokens ``[R, J·(1+S)]``, their counts ``[R]`` and the cache entries of each branch's inputs (its root,
    then its tokens but the last) ``[R, J·(1+S)]``."""

    def __init__(self, model: Transformer, adapters: StreamAdapters, cache: KVCache, sampler: DraftSampler,
                 lead: int, n_roots: int, passes: int, streams: int, pool: tuple | None) -> None:
        super().__init__(model, cache, sampler, lead, n_roots, pool)
        self.adapters, self.passes, self.streams = adapters, passes, streams
        self.head = adapters.head(model)  # the vocabulary the streams were trained on

    @staticmethod
    def rows(n_roots: int, passes: int, streams: int) -> int:
        """The cache slots a rollout writes past the spine: every pass's branch rows, then one pass's stream rows
        (scratch: attended within the pass, never kept)."""
        block = 1 + streams
        main = n_roots + (passes - 1) * n_roots * block
        return main + n_roots * block * streams

    def body(self, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        model, adapters, sampler = self.model, self.adapters, self.sampler
        lead, n_roots, n_streams = self.lead, self.n_roots, self.streams
        split, block = adapters.first_layer, 1 + n_streams
        keys, capacity, device = self.keys, self.keys.numel(), self.keys.device
        width = self.passes * block  # the most tokens a branch can end with
        root_pos, branches = self.root_pos, self.branches
        base = self.past + lead
        tokens = torch.zeros(n_roots, width + 1, dtype=torch.long, device=device)  # column ``width``: the unkept
        entries = torch.zeros_like(tokens)
        count = torch.zeros(n_roots, dtype=torch.long, device=device)  # tokens so far == inputs in the cache
        inputs = draft_tokens(self.model, self.root_ids).view(-1)
        guesses = torch.zeros(n_roots, 0, dtype=torch.long, device=device)
        written = 0  # branch rows the passes before this one wrote after the spine
        scratch = base + self.rows(n_roots, self.passes, n_streams) - n_roots * block * n_streams
        for step in range(self.passes):
            rows = 1 if step == 0 else block
            n = n_roots * rows
            offsets = torch.arange(rows, device=device)
            slots = base + written + branches.unsqueeze(1) * rows + offsets  # [R, rows]
            positions = (root_pos + count).unsqueeze(1) + offsets  # the input after ``count`` tokens, then guesses
            # branch r's gather list: the spine before its root, its kept entries, then its own block
            seen = root_pos.unsqueeze(1) + count.unsqueeze(1)  # [R, 1]
            kept = entries.gather(1, (keys - root_pos.unsqueeze(1)).clamp(0, width))
            own = slots[:, :1] + keys - seen
            index = torch.where(keys < root_pos.unsqueeze(1), keys, torch.where(keys < seen, kept, own))
            index = index.clamp(0, capacity - 1).int().repeat_interleave(rows, 0)  # [n, C]
            counts = (seen + offsets + 1).int().view(n)
            ids = torch.cat([inputs.unsqueeze(1), guesses], 1).view(n)
            positions, slots = positions.view(n), slots.view(n)
            if step == 0 and lead:  # the spine's missing tokens first, causally
                spine_at = self.past + torch.arange(lead, device=device)
                ids = torch.cat([draft_tokens(model, self.spine).view(-1), ids])
                positions, slots = torch.cat([spine_at, positions]), torch.cat([spine_at, slots])
                index = torch.cat([keys.int().expand(lead, capacity), index])
                counts = torch.cat([(spine_at + 1).int(), counts])
            first = lead if step == 0 else 0
            static = StaticStep(positions.unsqueeze(0), slots, index.unsqueeze(0), counts.unsqueeze(0))
            hidden = model.run_layers(model.embed(ids.unsqueeze(0)), static.positions, cache, None, 0, split,
                                      static=static)
            upper = stream_step(positions, slots, index, counts, first, n_streams, scratch, keys)
            x = torch.cat([hidden, adapters.insert(hidden[:, first:], n_streams)[:, n:]], 1)
            out = model.run_layers(x, upper.positions, cache, None, split, None, streams=adapters.rows(n * n_streams),
                                   static=upper)[0]
            logits = model.logits(out[first:first + n], sampler.head)  # (sampler.choose maps its columns to ids)
            chosen = sampler.choose(logits, positions[first:] + 1 + self.shift, self.stream_key).view(n_roots, rows)
            # the leading guesses the main stream chose too, then its own token after them
            accepted = (guesses == chosen[:, :-1]).long().cumprod(1).sum(1)
            at = torch.where(offsets <= accepted.unsqueeze(1), count.unsqueeze(1) + offsets, width)
            tokens.scatter_(1, at, chosen)
            entries.scatter_(1, at, slots[first:].view(n_roots, rows))
            count = count + accepted + 1
            inputs = chosen.gather(1, accepted.unsqueeze(1)).view(-1)
            written += n
            if step + 1 < self.passes:  # the last accepted row's streams guess the next pass's chain
                last = (branches * rows + accepted).unsqueeze(1) * n_streams + torch.arange(n_streams, device=device)
                stream_logits, ids_of = head_logits(model, out[first + n + last.view(-1)], self.head)
                top = stream_logits.argmax(-1)
                guesses = draft_tokens(model, top if ids_of is None else ids_of[top]).view(n_roots, n_streams)
        return tokens[:, :width], count, entries[:, :width]


def graphed_stream_draft(model: Transformer, adapters: StreamAdapters, cache: KVCache, sampler: DraftSampler,
                         spine: list[int] | torch.Tensor, root_pos: Sequence[int], root_ids: list[int] | torch.Tensor,
                         passes: int, streams: int, shift: int = 0
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool] | None:
    """A stream rollout through its :class:`StreamDraftGraph`: each branch's tokens, their counts and its inputs'
    cache entries (on the device), and whether they came from a replay. Arguments as
    :func:`~..draft_graph.graphed_draft`'s, with ``passes`` and the ``streams`` inserted beside each row; where it
    applies as there (:func:`~mirrorsd.execution.static_graph`), with every pass's branch rows in one fixed-row slab
    (the top layers' stream rows may span more), and no top-p. None otherwise and on a shape's first sight: the
    caller then runs the host-driven rollout. The cache then holds every row the passes wrote (the caller keeps a
    branch's entries, or rolls back)."""
    lead, n_roots = len(spine), len(root_pos)
    if lead + n_roots * (1 + streams) > FIXED_ROWS or passes < 1 or sampler.need_probs or sampler.runner_ups \
            or sampler.params.top_p < 1.0:  # (top-p's sums may depend on the row count: the host draws rows apart)
        return None
    past = len(cache)
    needed = past + lead + StreamDraftGraph.rows(n_roots, passes, streams)
    key = ("stream draft", model, adapters, lead, n_roots, passes, streams, sampler.choice)
    graph = static_graph(model, cache, key, needed, lambda pool: StreamDraftGraph(
        model, adapters, cache, sampler, lead, n_roots, passes, streams, pool))
    if graph is None:
        return None
    assert isinstance(graph, StreamDraftGraph)
    tokens, count, entries = graph.feed(cache, past, draft_tokens(model, spine), send(list(root_pos), model.device),
                                        draft_tokens(model, root_ids), shift, sampler.params.seed)
    cache.lengths[:] = [needed] * cache.n_layers
    return tokens, count, entries, graph.graph is not None

"""The Speculative Streaming forward (Bhendawade et al. 2024), shared by the ``ss`` method (the target verifies
and drafts) and :class:`~mirrorsd.decoding.proposers.StreamProposer` (a draft that self-verifies).

One pass, with committed text ending in a *trunk* of tokens the cache lacks (its last one is the root) and
candidate tokens from the previous pass's streams: the tree is the trunk plus the Cartesian product of the top-k
tokens of streams 1..γ (stream ``g`` at depth ``g``, every node under every node of the depth above: ``1 + Σ k^g``
nodes), or that tree's most likely nodes under a budget (:meth:`StreamGuesses.tree`). All nodes run layers
``[0, N - N_s)`` under a tree mask (ancestors only). At layer ``N - N_s`` the pruning adapter's early exit scores each
parent→child edge and drops children (with their subtrees) whose probability is under the threshold; ``γ`` streams
are inserted beside every surviving node and the top ``N_s`` layers run with the MSA mask. The main stream verifies
(:func:`mirrorsd.verify.verify_tree`); the streams of the last accepted node give the next tree's candidates, and
the cache is compacted to the accepted path. Main rows use the base weights only (:mod:`.adapters`), so the
committed tokens are the model's own.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...cuda_graphs import Captured, StaticStep
from ...draft_vocab import SubsetHead, head_logits, top_tokens
from ...execution import static_graph
from ...kv_cache import KVCache
from ...linear import FIXED_ROWS
from ...model import Transformer
from ...sampling import Noise, SamplingParams, choose, graph_choice, rows_apart, stream_key
from ...transfer import read_all, send
from ...verify import Verdict, tree_positions, verify_tree
from ..engine import Proposal, draft_tokens
from .adapters import StreamAdapters, stream_mask

DEFAULT_TREE_K = 3  # PMLR: γ = 3, k = 3 (a 40-node tree)
DEFAULT_TREE_BUDGET = 3  # the most likely nodes of that tree a pass runs (0: all); 2-4 measured alike, 6 slower
#: The head of a pass's main rows: None, the model's own; a draft's reduced vocabulary as a full row
#: (:meth:`~mirrorsd.draft_vocab.SubsetHead.full`, -inf outside it: column c still scores token c for the tree
#: verification). The main rows of a draft's pass only propose, so they may read the reduced head its AR steps do.
MainHead = Callable[[torch.Tensor], torch.Tensor] | None


def build_tree(trunk: list[int], candidates: list[list[int]]) -> tuple[list[int], list[int], list[int]]:
    """Tokens, parents and depths (from the first trunk token) in breadth-first order: the trunk is a chain of
    committed tokens the cache lacks (its last one is the root), then the Cartesian product of the candidates."""
    tokens, parents, depths = list(trunk), list(range(-1, len(trunk) - 1)), list(range(len(trunk)))
    level = [len(trunk) - 1]
    for options in candidates:
        nxt = []
        for parent in level:
            for token in options:
                nxt.append(len(tokens))
                tokens.append(token)
                parents.append(parent)
                depths.append(depths[parent] + 1)
        level = nxt
    return tokens, parents, depths


def guess_tree(candidates: list[list[int]]) -> Proposal:
    """A draft tree (root = the last committed token) from per-depth candidates."""
    tokens, parents, _ = build_tree([0], candidates)
    return Proposal(tokens[1:], [p - 1 for p in parents[1:]])


@dataclass(frozen=True)
class StreamGuesses:
    """The top-k tokens of streams 1..γ at the last accepted node, best first, with their log-probabilities."""

    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)

    def tree(self, depth: int, budget: int = 0) -> Proposal:
        """The draft tree over the first ``depth`` streams: the whole Cartesian product, or with ``budget > 0``
        only its ``budget`` most likely nodes (path log-probability = the sum of its streams' log-probabilities).

        Why a budget: every node runs the bottom ``N - N_s`` layers before the pruning exit can drop it, and on a
        CPU a window's cost grows with its rows (the 40-node PMLR tree costs ~5x a one-token forward on the q4
        1.5B), while the unlikely nodes it adds are rarely accepted. Best-first keeps parents before children,
        since a child's path is never more likely than its parent's (EAGLE-2's dynamic tree, on stream scores)."""
        levels = self.tokens[:max(depth, 0)]
        if budget <= 0:
            return guess_tree(levels)
        tokens: list[int] = []
        parents: list[int] = []
        frontier: list[tuple[float, int, int, int]] = []  # (-path log-probability, depth - 1, option, parent node)

        def push_children(cost: float, level: int, parent: int) -> None:
            if level < len(levels):
                for option, logprob in enumerate(self.logprobs[level]):
                    heapq.heappush(frontier, (cost - logprob, level, option, parent))

        push_children(0.0, 0, -1)
        while frontier and len(tokens) < budget:
            cost, level, option, parent = heapq.heappop(frontier)
            tokens.append(levels[level][option])
            parents.append(parent)
            push_children(cost, level + 1, len(tokens) - 1)
        return Proposal(tokens, parents)


def ancestors(parents: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[n, n]``: node ``a`` sees node ``b`` iff ``b`` is ``a`` or one of its ancestors (parents come first)."""
    n = len(parents)
    anc = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            anc[i] |= anc[parent]
    return send(anc, device)


@dataclass
class TreeForward:
    """One fused forward over ``trunk + tree``, before verification."""

    past: int  # cache length before the pass
    trunk: int  # trunk length (the root is node ``trunk - 1``)
    nodes: int  # tree size before pruning, trunk included
    kept: list[int]  # surviving nodes in order (the trunk always survives); their rows in ``out``
    out: torch.Tensor | None  # [1, m + (m - root)·γ, d]: main rows of the kept nodes, then the stream rows of those
    # from the root on (none when deferred); None from a graphed pass (:func:`graphed_pass`), which read its streams
    main_logits: torch.Tensor  # [m - root, vocab]: main logits from the root on
    draft: Proposal  # the surviving tree below the root, aligned with main_logits rows 1..
    streams: int  # stream rows per kept node (the adapters' streams, or the first of them)
    positions: torch.Tensor  # [m] the kept nodes' positions
    deferred: torch.Tensor | None = None  # [1, m, d] kept nodes' states at layer N - N_s: streams run after compaction
    graphed: bool = False  # replayed as one captured CUDA graph (:func:`graphed_pass`)

    @property
    def root_row(self) -> int:
        return self.trunk - 1

    def nodes_of(self, verdict: Verdict) -> list[int]:
        """The verdict's accepted path as node indices of the unpruned tree."""
        return [self.kept[self.trunk + i] for i in verdict.nodes]


def fused_forward(model: Transformer, adapters: StreamAdapters, cache: KVCache, trunk: list[int], tree: Proposal,
                  threshold: float = 0.0, head: SubsetHead | None = None,
                  prune_exit: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  streams: int | None = None, defer: str = "never", main_head: MainHead = None) -> TreeForward:
    """Layers below ``N - N_s`` over the whole tree, pruning, then the top layers with stream rows. ``head``: the
    restricted vocabulary the pruning exit reads (an edge to a token outside it is kept unscored). ``prune_exit``:
    a tuned exit's translator for layer ``N - N_s`` to score edges with instead of the adapter's o_θ. ``streams``:
    run only the first of the adapters' streams (stream ``j`` sees streams ``1..j`` alone, so they are what they are
    with all of them: fewer rows when a batch has few to spare). ``defer`` (:data:`DEFER_STREAMS`): run the top
    layers over the main rows only, and only the last accepted node's streams after compaction
    (:func:`next_guesses`). ``main_head``: the main rows' head (:data:`MainHead`)."""
    device = model.device
    past = len(cache)
    root = len(trunk) - 1
    tokens = [*trunk, *tree.tokens]
    parents = [*range(-1, root), *(root if p < 0 else p + len(trunk) for p in tree.parents or [])]
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    n = len(tokens)
    anc = ancestors(parents, device)
    positions = send(depths, device) + past
    low_mask = torch.cat([torch.ones(n, past, dtype=torch.bool, device=device), anc], 1).unsqueeze(0)
    split = adapters.first_layer
    hidden = model.run_layers(model.embed(draft_tokens(model, tokens)), positions[None], cache, low_mask, 0, split)

    kept = list(range(n))
    if threshold > 0 and n > len(trunk):
        parent_nodes = sorted({parents[i] for i in range(len(trunk), n)})
        states = hidden[0, parent_nodes]
        if prune_exit is None:
            logits, ids = adapters.prune_logits(model, states, head)
        else:
            logits, ids = head_logits(model, prune_exit(states), head)
        row = {node: r for r, node in enumerate(parent_nodes)}
        edges = range(len(trunk), n)
        children = send([tokens[i] for i in edges], device)
        columns = children if ids is None else head.index[children]  # -1: outside the restricted vocabulary
        probs = logits.softmax(-1)[[row[parents[i]] for i in edges], columns.clamp(min=0)]
        # an edge the exit cannot score stays: only a suffix chain's tokens lie outside the vocabulary the streams
        # guess from, and a rare token copied from the context is what a suffix match is for
        edge_probs = probs.masked_fill(columns < 0, 1.0).tolist()
        alive = [True] * n
        for i, p in zip(edges, edge_probs, strict=True):
            alive[i] = alive[parents[i]] and p >= threshold
        kept = [i for i in range(n) if alive[i]]

    m, n_streams = len(kept), adapters.stream_count(streams)
    sub = send(kept, device)
    main_mask = torch.cat([torch.ones(m, past, dtype=torch.bool, device=device), anc[sub][:, sub]], 1)
    deferred = None
    if defers(defer, m - root, n_streams, device):
        deferred = hidden[:, sub]
        out = model.run_layers(deferred, positions[sub][None], cache, main_mask[None], split, None)
    else:  # stream rows beside the root and the tree only (the next tree grows under one of them; a trunk before
        # the root, a prompt or a suffix step the cache lacks, is never read: on a GPU, where passes do not defer,
        # a prompt's every token would carry γ rows and the mask would grow with their square)
        main = hidden[:, sub]
        x = torch.cat([main, adapters.insert(main[:, root:], n_streams)[:, m - root:]], 1)
        up_positions = torch.cat([positions[sub], positions[sub][root:].repeat_interleave(n_streams)])[None]
        up_mask = stream_mask(main_mask, torch.arange(root, m, device=device), n_streams)
        out = model.run_layers(x, up_positions, cache, up_mask, split, None,
                               streams=adapters.rows((m - root) * n_streams))
    where = {node: r for r, node in enumerate(kept)}
    below = kept[len(trunk):]
    draft = Proposal([tokens[i] for i in below],
                  [-1 if parents[i] == root else where[parents[i]] - len(trunk) for i in below])
    return TreeForward(past, len(trunk), n, kept, out, model.logits(out[0, root:m], main_head), draft, n_streams,
                       positions[sub], deferred)


DEFER_STREAMS = ("auto", "always", "never")


def defers(defer: str, nodes: int, streams: int, device: torch.device) -> bool:
    """Whether a pass runs its streams after verification. ``nodes``: the root and the kept tree nodes, which one
    pass gives ``nodes · γ`` stream rows through the top layers beside the main rows; deferred, γ rows in a second
    call, which reads those layers' weights again. A GPU's row curve is flat, so one call wins there; on a CPU rows
    cost (16 rows ~3x one on AVX-512, ~6x on AVX2, ``docs/benchmarks.md``), and ``auto`` defers from 3 nodes up,
    where the rows saved outweigh the second read (``benchmarks/ss_pass_cost.py``; ``docs/speculative_streaming.md``,
    "Stream deltas in one call, and streams after verification")."""
    if defer == "auto":
        return device.type == "cpu" and nodes >= 3 and streams > 1
    return defer == "always"


def stream_tops(model: Transformer, rows: torch.Tensor, streams: int, tree_k: int,
                head: SubsetHead | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The streams' top-``tree_k`` ids and fp32 log-probabilities, ``[nodes, streams, k]`` each, of stream rows laid
    out node by node (over ``head``'s ids when given), still on the device: the next trees' candidates."""
    logprobs, ids = top_tokens(*head_logits(model, rows, head), tree_k)
    return ids.view(-1, streams, ids.shape[-1]), logprobs.float().view(-1, streams, ids.shape[-1])


def next_guesses(model: Transformer, adapters: StreamAdapters, forward: TreeForward, verdict: Verdict,
                    tree_k: int, head: SubsetHead | None = None, cache: KVCache | None = None) -> StreamGuesses:
    """Top-k of streams 1..γ at the last accepted node (over ``head``'s ids when given): the next tree. A deferred
    pass runs that node's stream rows now, over ``cache`` compacted to the accepted path (the node is its last
    entry, and a stream sees what its node sees)."""
    n_streams, m = forward.streams, len(forward.kept)
    last = forward.trunk + verdict.nodes[-1] if verdict.accepted else forward.root_row
    if forward.deferred is not None:
        if cache is None:
            raise ValueError("a deferred pass reads its streams over the compacted cache: pass it")
        tops = last_token_tops(model, adapters, cache, forward.deferred[:, [last]], forward.positions[last],
                               n_streams, tree_k, head)
    else:
        assert forward.out is not None  # (a graphed pass read its streams: it never gets here)
        first = m + (last - forward.root_row) * n_streams
        rows = forward.out[0, first:first + n_streams]
        tops = stream_tops(model, rows, n_streams, tree_k, head)
    ids, logprobs = read_all(*tops)
    return StreamGuesses(ids[0], logprobs[0])


def last_token_tops(model: Transformer, adapters: StreamAdapters, cache: KVCache, state: torch.Tensor,
                    position: torch.Tensor | int, streams: int, tree_k: int,
                    head: SubsetHead | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`stream_tops` of the cache's last token's streams, run on their own: ``state`` is that token's hidden
    state at layer ``N - N_s`` ``[1, 1, hidden]`` and ``position`` its position (a stream sees what its token sees,
    the whole cache). After a deferred pass's compaction that token is the last accepted node; after a whole-prompt
    prefill (:meth:`~mirrorsd.model.Transformer.prefill_at`), the prompt's last token."""
    device = state.device
    x = adapters.insert(state, streams)[:, 1:]
    mask = stream_mask(torch.ones(1, len(cache), dtype=torch.bool, device=device),
                       torch.zeros(1, dtype=torch.long, device=device), streams)[:, 1:]
    positions = torch.as_tensor(position, device=device).expand(1, streams)
    rows = model.run_layers(x, positions, cache, mask, adapters.first_layer, None, streams=adapters.rows(streams))[0]
    return stream_tops(model, rows, streams, tree_k, head)


def read_root(model: Transformer, adapters: StreamAdapters, cache: KVCache, state: torch.Tensor,
              logits: torch.Tensor, params: SamplingParams, streams: int, tree_k: int,
              head: SubsetHead | None = None) -> tuple[list[int] | None, StreamGuesses]:
    """After a whole-prompt prefill, the first tree's candidates: the streams of the prompt's last token (its
    ``state`` at layer ``N - N_s``; :func:`last_token_tops`). Where :func:`reads_every_row` says so, the model's own
    token after the prompt (from the prefill's ``logits``) comes in the same host read, as a pass's do
    (:func:`read_pass`); else None, for the verdict to choose."""
    ids, logprobs = last_token_tops(model, adapters, cache, state, len(cache) - 1, streams, tree_k, head)
    own = None
    if reads_every_row(logits, params):
        own, ids, logprobs = read_all(choose(logits, [len(cache)], params), ids, logprobs)
    else:
        ids, logprobs = read_all(ids, logprobs)
    return own, StreamGuesses(ids[0], logprobs[0])


@dataclass(frozen=True)
class PassRead:
    """A pass's verdict material and next guesses, read in one go (:func:`read_pass`)."""

    own: list[int]  # the model's own token at every verification row: the root's, then each tree node's
    guesses: list[StreamGuesses]  # per row: the next tree's candidates, should that row be the last accepted

    def next_guesses(self, verdict: Verdict) -> StreamGuesses:
        return self.guesses[verdict.nodes[-1] + 1 if verdict.accepted else 0]


def reads_every_row(logits: torch.Tensor, params: SamplingParams) -> bool:
    """Whether a pass reads its own tokens and every row's next guesses in one host read: off the CPU, where each
    host read waits for the device's queue and rows cost next to nothing, for rows drawn apart
    (:func:`~mirrorsd.sampling.rows_apart`). On a CPU the other rows' streams through the head cost more than the
    second read they save."""
    return logits.device.type != "cpu" and rows_apart(logits, params)


def reads_once(forward: TreeForward, params: SamplingParams) -> bool:
    """Whether :func:`read_pass` applies: :func:`reads_every_row`, for a pass whose streams ran beside its main rows
    (not deferred)."""
    return forward.deferred is None and reads_every_row(forward.main_logits, params)


def read_pass(model: Transformer, forward: TreeForward, params: SamplingParams, tree_k: int,
              head: SubsetHead | None = None, noise: int = Noise.TARGET) -> PassRead | None:
    """The model's own token at every verification row and the top-``tree_k`` of the streams at every one of them,
    in one host read, where :func:`reads_once` says so (else None: verify, then :func:`next_guesses`). Which node's
    guesses the next tree takes depends on the verdict, so reading them all lets the device's queue run on from the
    verdict's read to the next pass; the tokens are the ones :func:`~mirrorsd.verify.verify_tree` draws."""
    if not reads_once(forward, params):
        return None
    rows, root, n_streams = forward.main_logits.shape[0], forward.root_row, forward.streams
    m = len(forward.kept)
    own = choose(forward.main_logits, tree_positions(forward.draft.parents or [], forward.past + forward.trunk),
                 params, noise)
    assert forward.out is not None
    ids, logprobs = stream_tops(model, forward.out[0, m:m + (m - root) * n_streams], n_streams, tree_k, head)
    own, ids, logprobs = read_all(own, ids, logprobs)
    return PassRead(own, [StreamGuesses(ids[r], logprobs[r]) for r in range(rows)])


def compact(model: Transformer, adapters: StreamAdapters, cache: KVCache, forward: TreeForward,
            verdict: Verdict) -> None:
    """The cache keeps the trunk and the accepted path, in both layer groups (their trees differ after
    pruning: the bottom layers saw every node, the top ones the kept nodes only)."""
    path = [*range(forward.trunk), *forward.nodes_of(verdict)]
    where = {node: r for r, node in enumerate(forward.kept)}
    split = adapters.first_layer
    cache.compact(forward.past, path, range(split))
    cache.compact(forward.past, [where[i] for i in path], range(split, model.config.n_layers))


@dataclass
class PassResult:
    accepted: list[int]  # tree tokens accepted after the root
    next_token: int  # the model's token after the last accepted node
    candidates: StreamGuesses  # top-k of streams 1..γ at that node: the next tree
    path_logits: torch.Tensor  # [accepted + 1, vocab] main logits that chose accepted + next_token


def ss_pass(model: Transformer, adapters: StreamAdapters, cache: KVCache, trunk: list[int], tree: Proposal,
            params: SamplingParams, *, noise: int = Noise.TARGET, threshold: float = 0.0,
            tree_k: int = DEFAULT_TREE_K, head: SubsetHead | None = None, streams: int | None = None,
            defer: str = "never", main_head: MainHead = None) -> PassResult:
    """One self-verified pass: verify ``tree`` under ``trunk[-1]``, compact, draft the next one (``streams``: the
    first of the adapters' streams only; ``defer`` and ``main_head``: see :func:`fused_forward`)."""
    forward, read = pass_and_read(model, adapters, cache, trunk, tree, params, noise, threshold, tree_k, head,
                                  streams=streams, defer=defer, main_head=main_head)
    verdict = verify_tree(forward.draft.tokens, forward.draft.parents, forward.main_logits,
                          forward.past + forward.trunk, params, noise, own=read.own if read else None)
    chose = [0, *(i + 1 for i in verdict.nodes)]
    compact(model, adapters, cache, forward, verdict)
    guesses = read.next_guesses(verdict) if read else next_guesses(model, adapters, forward, verdict, tree_k, head,
                                                                  cache)
    return PassResult([forward.draft.tokens[i] for i in verdict.nodes], verdict.next_token, guesses,
                      forward.main_logits[chose])


def pass_and_read(model: Transformer, adapters: StreamAdapters, cache: KVCache, trunk: list[int], tree: Proposal,
                  params: SamplingParams, noise: int, threshold: float, tree_k: int, head: SubsetHead | None,
                  prune_exit: Callable[[torch.Tensor], torch.Tensor] | None = None, streams: int | None = None,
                  defer: str = "never", main_head: MainHead = None) -> tuple[TreeForward, PassRead | None]:
    """:func:`fused_forward` and :func:`read_pass`: as one graph where the pass prunes nothing and runs its streams
    beside its nodes (:func:`graphed_pass`), else op by op."""
    n_streams = adapters.stream_count(streams)
    if (threshold == 0 or not tree.tokens) and defer != "always":
        graphed = graphed_pass(model, adapters, cache, trunk, tree, params, noise, n_streams, tree_k, head,
                               main_head)
        if graphed is not None:
            return graphed
    forward = fused_forward(model, adapters, cache, trunk, tree, threshold, head, prune_exit, streams, defer,
                            main_head)
    return forward, read_pass(model, forward, params, tree_k, head, noise)


# -- a pass as one CUDA graph ----------------------------------------------------------------------------------


def stream_step(positions: torch.Tensor, slots: torch.Tensor, index: torch.Tensor, counts: torch.Tensor, first: int,
                n_streams: int, scratch: torch.Tensor | int, keys: torch.Tensor) -> StaticStep:
    """The top layers' static inputs: the pass's rows (``positions``, ``slots``, gather lists ``index`` [rows, C] and
    ``counts``), then stream ``j`` beside each row from ``first`` on, which sees its row's keys and then its row's
    streams through ``j``, written at ``scratch + row·γ + j`` (:func:`~.adapters.stream_mask`'s attention)."""
    device, capacity = keys.device, keys.numel()
    n = positions.numel() - first
    row_of = torch.arange(n, device=device).repeat_interleave(n_streams)
    stream_of = torch.arange(n_streams, device=device).repeat(n)
    sees = counts[first:].long()[row_of].unsqueeze(1)
    own = (scratch + row_of * n_streams).unsqueeze(1) + keys - sees
    streamed = torch.where(keys < sees, index[first:][row_of].long(), own).clamp(0, capacity - 1).int()
    return StaticStep(torch.cat([positions, positions[first:][row_of]]).unsqueeze(0),
                      torch.cat([slots, scratch + row_of * n_streams + stream_of]),
                      torch.cat([index, streamed]).unsqueeze(0),
                      torch.cat([counts, (sees.view(-1) + stream_of + 1).int()]).unsqueeze(0))


class StreamPassGraph(Captured):
    """One pass's shape (a trunk of ``trunk`` tokens, its last the root, then a tree of ``parents``) with
    ``streams`` streams beside every node, over one cache's buffers, for one choice (:func:`~mirrorsd.sampling.
    graph_choice`). Inputs: the cache length, the tokens (draft ids) and the noise's stream key. Output: the main
    logits from the root on ``[1 + tree, vocab]``, each such row's own token, and every such row's streams' top-k
    ids and log-probabilities ``[1 + tree, streams, k]``."""

    def __init__(self, model: Transformer, adapters: StreamAdapters, cache: KVCache, params: SamplingParams,
                 noise: int, trunk: int, parents: tuple[int, ...], streams: int, tree_k: int,
                 head: SubsetHead | None, main_head: MainHead, pool: tuple | None) -> None:
        super().__init__(model.device, pool)
        self.model, self.adapters, self.params, self.noise = model, adapters, params, noise
        self.trunk, self.streams, self.tree_k, self.head, self.main_head = trunk, streams, tree_k, head, main_head
        device = model.device
        # the whole pass's parents and depths (the trunk a chain, the tree under its last token), and each node's
        # ancestors, itself included, ascending
        every = [*range(-1, trunk - 1), *(trunk - 1 if p < 0 else p + trunk for p in parents)]
        depths: list[int] = []
        seen: list[list[int]] = []
        for node, parent in enumerate(every):
            depths.append(0 if parent < 0 else depths[parent] + 1)
            seen.append([*(seen[parent] if parent >= 0 else []), node])
        self.n = len(every)
        width = max(len(a) for a in seen)
        with torch.inference_mode(False):  # written in place from no_grad code too, not only inference mode
            self.past = torch.zeros((), dtype=torch.long, device=device)
            self.stream_key = torch.zeros((), dtype=torch.long, device=device)
            self.ids = torch.zeros(self.n, dtype=torch.long, device=device)
            self.depths = send(depths, device)
            self.ancestors = send([a + [a[-1]] * (width - len(a)) for a in seen], device)  # [n, width]
            self.seen = send([len(a) for a in seen], device)
            self.keys = torch.arange(min(k.shape[2] for k in cache.keys), device=device)

    def __call__(self, cache: KVCache, past: int, ids: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
        self.past.fill_(past)
        if not self.params.greedy:
            self.stream_key.fill_(stream_key(seed, self.noise))
        self.ids.copy_(ids.view(-1))
        out = self.run(lambda: self.body(cache))
        assert isinstance(out, tuple)
        return out

    def body(self, cache: KVCache) -> tuple[torch.Tensor, ...]:
        model, adapters, n, root = self.model, self.adapters, self.n, self.trunk - 1
        keys, past, capacity = self.keys, self.past, self.keys.numel()
        positions, slots = past + self.depths, past + torch.arange(n, device=keys.device)
        at = (keys - past).clamp(0, self.ancestors.shape[1] - 1)
        index = torch.where(keys < past, keys, past + self.ancestors.gather(1, at.expand(n, -1)))
        index, counts = index.clamp(0, capacity - 1).int(), (past + self.seen).int()
        static = StaticStep(positions.unsqueeze(0), slots, index.unsqueeze(0), counts.unsqueeze(0))
        split = adapters.first_layer
        hidden = model.run_layers(model.embed(self.ids.unsqueeze(0)), static.positions, cache, None, 0, split,
                                  static=static)
        upper = stream_step(positions, slots, index, counts, 0, self.streams, past + n, keys)
        x = adapters.insert(hidden, self.streams)
        out = model.run_layers(x, upper.positions, cache, None, split, None, streams=adapters.rows(n * self.streams),
                               static=upper)[0]
        logits = model.logits(out[root:n], self.main_head)
        own = choose(logits, positions[root:] + 1, self.params, self.noise, self.stream_key)
        ids, logprobs = stream_tops(model, out[n + root * self.streams:n + n * self.streams], self.streams,
                                    self.tree_k, self.head)
        return logits, own, ids, logprobs


def graphed_pass(model: Transformer, adapters: StreamAdapters, cache: KVCache, trunk: list[int], tree: Proposal,
                 params: SamplingParams, noise: int, streams: int, tree_k: int, head: SubsetHead | None,
                 main_head: MainHead = None) -> tuple[TreeForward, PassRead] | None:
    """:func:`fused_forward` (no pruning, streams beside every node) and :func:`read_pass` through the pass's
    :class:`StreamPassGraph`, with what they return; where it applies (:func:`~mirrorsd.execution.static_graph`, rows
    drawn apart, the whole pass in one fixed-row slab), from a shape's second sight. None otherwise."""
    parents = tuple(tree.parents or ()) if tree.tokens else ()
    n = len(trunk) + len(tree.tokens)
    if (tree.tokens and tree.parents is None) or n * (1 + streams) > FIXED_ROWS \
            or not rows_apart(model.device, params):
        return None
    past = len(cache)
    choice = (main_head, *graph_choice(params, noise))  # (one setting's graphs a cache, as a DraftSampler's choice)
    key = ("stream pass", model, adapters, len(trunk), parents, streams, tree_k, head, choice)
    graph = static_graph(model, cache, key, past + n * (1 + streams), lambda pool: StreamPassGraph(
        model, adapters, cache, params, noise, len(trunk), parents, streams, tree_k, head, main_head, pool))
    if graph is None:
        return None
    assert isinstance(graph, StreamPassGraph)
    logits, own, ids, logprobs = graph(cache, past, draft_tokens(model, [*trunk, *tree.tokens]), params.seed)
    cache.lengths[:] = [past + n] * cache.n_layers  # (the verdict's compaction keeps the accepted path)
    own, ids, logprobs = read_all(own, ids, logprobs)
    forward = TreeForward(past, len(trunk), n, list(range(n)), None, logits, tree, streams, graph.depths + past,
                          graphed=graph.graph is not None)
    return forward, PassRead(own, [StreamGuesses(ids[r], logprobs[r]) for r in range(len(own))])

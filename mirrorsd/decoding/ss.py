"""``ss``: Speculative Streaming (Bhendawade et al. 2024) -- one model verifies the last draft tree and drafts
the next one in the same forward pass.

One pass, with committed text ending in ``a`` (not yet in the cache) and candidate tokens from the previous
pass's streams: the tree is ``a`` plus the Cartesian product of the top-k tokens of streams 1..γ (stream ``g``
at depth ``g``, every node under every node of the depth above: ``1 + Σ k^g`` nodes). All nodes run layers
``[0, N - N_s)`` under a tree mask (ancestors only). At layer ``N - N_s`` the pruning adapter's early exit scores
each parent→child edge and drops children (with their subtrees) whose probability is under the threshold;
``γ`` streams are inserted beside every surviving node and the top ``N_s`` layers run with the MSA mask. The
main stream verifies: from ``a``, the child whose token is the target's own choice at that node (argmax, or
the position-keyed Gumbel-max draw) is accepted, and so on down. The target's token after the last accepted
node is the correction (or bonus); that node's streams give the next tree's candidates, and the cache is
compacted to the accepted path. The committed tokens are the target's own at every position, so the output
equals ``ar`` (main rows use the base weights only, see :mod:`mirrorsd.streams`).

:func:`rollout` is the same loop used by a Mirror-SD draft: passes until a window is full, each self-verified
by the draft's main stream, so the window equals the draft's plain autoregressive continuation.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kv_cache import KVCache
from ..model import Transformer
from ..sampling import TARGET_STREAM, SamplingParams, probabilities, sample
from ..streams import StreamAdapters, load_adapters, msa_mask
from .base import DecodeRequest, Timer
from .sd import Proposal, draft_tokens, window_end

DEFAULT_TREE_K = 3  # PMLR: γ = 3, k = 3 (a 40-node tree)
DEFAULT_THRESHOLD = 0.05  # the paper gives none; at 0.05 the CR was unchanged and k=3 ran 1.5x faster


@dataclass(frozen=True)
class SSOptions:
    streams: Any = None  # adapter folder, shipped zoo name or StreamAdapters (api fills in the zoo default)
    tree_k: int = DEFAULT_TREE_K
    depth: int | None = None  # tree depth, at most γ (None = γ)
    threshold: float = DEFAULT_THRESHOLD  # prune edges whose early-exit probability is below this

    @classmethod
    def parse(cls, options: dict[str, Any]) -> SSOptions:
        unknown = sorted(set(options) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown options for method 'ss': {unknown}")
        opts = cls(**options)
        if opts.streams is None:
            raise ValueError("method 'ss' needs a stream adapter (streams=FOLDER or a zoo name with a shipped one)")
        if opts.tree_k < 1:
            raise ValueError(f"tree_k must be >= 1, got {opts.tree_k}")
        if opts.depth is not None and opts.depth < 0:
            raise ValueError(f"depth must be >= 0, got {opts.depth}")
        if not 0.0 <= opts.threshold < 1.0:
            raise ValueError(f"threshold must be in [0, 1), got {opts.threshold}")
        return opts


@dataclass
class PassResult:
    accepted: list[int]  # tree tokens accepted after the root
    next_token: int  # the target's token after the last accepted node
    candidates: list[list[int]]  # top-k of streams 1..γ at that node: the next tree
    path_logits: torch.Tensor  # [accepted + 1, vocab] main logits that chose accepted + next_token
    tree_size: int
    kept: int
    depth: int  # deepest surviving tree level (window positions drafted, after pruning)


@dataclass
class SSStats:
    """Per pass: tree size before and after pruning; tokens committed per pass (the call-reduction ratio)."""

    tree_before: list[int] = field(default_factory=list)
    tree_after: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)

    def record(self, result: PassResult) -> None:
        self.tree_before.append(result.tree_size)
        self.tree_after.append(result.kept)
        self.committed.append(len(result.accepted) + 1)

    @property
    def call_reduction(self) -> float:
        """Tokens per forward pass = AR forwards / SS forwards for the same text (the paper's CR ratio)."""
        return sum(self.committed) / len(self.committed) if self.committed else 0.0

    def to_dict(self) -> dict[str, Any]:
        n = max(len(self.tree_before), 1)
        return {"passes": len(self.committed), "call_reduction": round(self.call_reduction, 4),
                "mean_tree_before_pruning": round(sum(self.tree_before) / n, 2),
                "mean_tree_after_pruning": round(sum(self.tree_after) / n, 2)}


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


def ancestors(parents: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[n, n]``: node ``a`` sees node ``b`` iff ``b`` is ``a`` or one of its ancestors (parents come first)."""
    n = len(parents)
    anc = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            anc[i] |= anc[parent]
    return anc.to(device)


def ss_pass(model: Transformer, adapters: StreamAdapters, cache: KVCache, trunk: list[int],
            candidates: list[list[int]], params: SamplingParams, *, stream: int = TARGET_STREAM,
            threshold: float = 0.0, tree_k: int = DEFAULT_TREE_K) -> PassResult:
    """One Speculative Streaming forward: verify the tree under ``trunk[-1]``, draft the next one, compact."""
    device = model.device
    past = len(cache)
    tokens, parents, depths = build_tree(trunk, candidates)
    n, root = len(tokens), len(trunk) - 1
    anc = ancestors(parents, device)
    positions = torch.tensor(depths, device=device) + past
    low_mask = torch.cat([torch.ones(n, past, dtype=torch.bool, device=device), anc], 1).unsqueeze(0)
    split = adapters.first_layer
    hidden = model.run_layers(model.embed(draft_tokens(model, tokens)), positions[None], cache, low_mask, 0, split)

    kept = list(range(n))
    if threshold > 0 and n > len(trunk):
        heads = sorted({parents[i] for i in range(len(trunk), n)})
        probs = adapters.prune_logits(model, hidden[0, heads]).softmax(-1)
        row = {h: r for r, h in enumerate(heads)}
        alive = [True] * n
        for i in range(len(trunk), n):
            alive[i] = alive[parents[i]] and probs[row[parents[i]], tokens[i]].item() >= threshold
        kept = [i for i in range(n) if alive[i]]

    m, gamma = len(kept), adapters.config.streams
    sub = torch.tensor(kept, device=device)
    x = adapters.insert(hidden[:, sub])
    up_positions = torch.cat([positions[sub], positions[sub].repeat_interleave(gamma)])[None]
    up_mask = msa_mask(anc[sub][:, sub], past, gamma)
    out = model.run_layers(x, up_positions, cache, up_mask, split, None, streams=adapters.rows(m * gamma))

    # Verify down the tree: a child is accepted iff its token is the target's own choice at its parent.
    where = {node: r for r, node in enumerate(kept)}
    children: dict[int, dict[int, int]] = {}
    for node in kept[len(trunk):]:
        children.setdefault(parents[node], {})[tokens[node]] = node
    main_logits = model.logits(out[0, root:m])  # rows from the root on (trunk rows are committed already)
    node, path, accepted, chose = root, [], [], []
    while True:
        own = sample(main_logits[where[node] - root][None], [past + depths[node] + 1], params, stream)[0]
        chose.append(where[node] - root)
        nxt = children.get(node, {}).get(own)
        if nxt is None:
            break
        path.append(nxt)
        accepted.append(own)
        node = nxt
    last = where[node]
    stream_logits = model.logits(out[0, m + last * gamma: m + (last + 1) * gamma])
    next_candidates = stream_logits.topk(min(tree_k, stream_logits.shape[-1]), dim=-1).indices.tolist()

    # The cache keeps the trunk and the accepted path, in both layer groups (their trees differ after pruning).
    full_path = list(range(len(trunk))) + path
    cache.compact(past, full_path, range(split))
    cache.compact(past, [where[i] for i in full_path], range(split, model.config.n_layers))
    depth = max(depths[i] for i in kept) - depths[root]
    return PassResult(accepted, own, next_candidates, main_logits[chose], n, m, depth)


def decode(req: DecodeRequest) -> Iterator[list[int]]:
    opts = SSOptions.parse(req.options)
    adapters = load_adapters(req.target, opts.streams)
    return _run(req, opts, adapters)


@torch.inference_mode()
def _run(req: DecodeRequest, opts: SSOptions, adapters: StreamAdapters) -> Iterator[list[int]]:
    target, params, stats, timer = req.target, req.sampling, req.stats, Timer(req.stats)
    sstats = SSStats()
    stats.extra["ss"] = sstats
    depth = adapters.config.streams if opts.depth is None else min(opts.depth, adapters.config.streams)
    seq = list(req.prompt_ids)
    cache = target.new_cache(capacity=len(seq) + req.max_new_tokens + 2)
    with timer("prefill_s"):
        if len(seq) > 1:
            target.prefill(torch.tensor([seq[:-1]], device=target.device), cache)
            stats.target_forwards += 1
    produced, candidates = 0, []
    while True:
        tree = candidates[: max(0, min(depth, req.max_new_tokens - produced - 1))]
        with timer("target_s"):
            result = ss_pass(target, adapters, cache, [seq[-1]], tree, params, threshold=opts.threshold,
                             tree_k=opts.tree_k)
        stats.target_forwards += 1
        sstats.record(result)
        stats.record_step(result.depth, len(result.accepted))
        new = [*result.accepted, result.next_token]
        seq.extend(new)
        produced += len(new)
        candidates = result.candidates
        yield new


def rollout(model: Transformer, adapters: StreamAdapters, cache: KVCache, pending: list[int], position: int,
            window: int, params: SamplingParams, stream: int, need_probs: bool, confidence: float, pad: int,
            tree_k: int = DEFAULT_TREE_K) -> Proposal:
    """:func:`mirrorsd.decoding.sd.propose` with Speculative Streaming passes: the same tokens (each is the
    draft's own choice, checked by its main stream), fewer forwards. The cache ends holding the committed
    text and every proposed token but the last."""
    tokens: list[int] = []
    q_rows: list[torch.Tensor] = []
    trunk, candidates, forwards, end = list(pending), [], 0, window
    while len(tokens) < window:
        depth = min(adapters.config.streams, window - len(tokens) - 1)
        result = ss_pass(model, adapters, cache, trunk, candidates[:depth], params, stream=stream, tree_k=tree_k)
        forwards += 1
        new = [*result.accepted, result.next_token]
        tokens += new
        trunk, candidates = [new[-1]], result.candidates
        if not need_probs:
            continue
        for logits in result.path_logits:
            q = probabilities(logits[None], params)[0] if not params.greedy else logits.double().softmax(-1)
            q_rows.append(torch.nn.functional.pad(q, (0, pad)) if pad else q)
        tops = [q.max().item() for q in q_rows[:window]]
        if confidence > 0 and min(tops) < confidence:  # propose() stops at the first doubtful token
            end = window_end(tops, confidence)
            break
    tokens, q_rows = tokens[:end], q_rows[:end]
    cache.truncate(position + max(end, 1) - 1)
    return Proposal(tokens, q_rows, forwards)

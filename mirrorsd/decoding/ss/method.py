"""``ss``: Speculative Streaming (Bhendawade et al. 2024) -- one model verifies the last draft tree and drafts
the next one in the same forward pass (:mod:`..streams.passes`).

On the loop: the proposer turns the last pass's stream candidates into a tree (no forward of its own); the
scorer runs the fused pass (pruning included) and exposes the stream rows; the shared tree verifier walks the
tree; committing compacts the cache to the accepted path; the feedback reads the next candidates off the
streams of the last accepted node. With ``suffix_match`` a long suffix match is proposed instead, as a
one-branch tree (:class:`~mirrorsd.decoding.lookup.SuffixFirst`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from statistics import fmean
from typing import Any

import torch

from ...draft_vocab import SubsetHead
from ...exit_heads import tuned_exit
from ...model import Transformer
from ...sampling import Noise
from ...verify import Verdict
from ..drafting import defer_streams_option
from ..engine import ChainScorer, DecodeRequest, Proposal, RequestState, Roles, Scores, match
from ..lookup import HYBRID_LOOKUP, SuffixFirst, suffix_match_option, suffix_proposer
from ..registry import (
    Method,
    MethodOptions,
    ModelShape,
    OptionError,
    PlanInputs,
    Priced,
    ShippedFiles,
    at_least,
    option,
    probability,
    register,
)
from ..streams.adapters import StreamAdapters, load_adapters
from ..streams.passes import (
    DEFAULT_TREE_BUDGET,
    DEFAULT_TREE_K,
    PassRead,
    StreamGuesses,
    TreeForward,
    compact,
    next_guesses,
    pass_and_read,
    read_root,
)

DEFAULT_THRESHOLD = 0.05  # the paper gives none; on the whole k=3 tree the CR was unchanged and a CPU ran 1.5x faster


MAX_TREE_CANDIDATES = 1 << 16  # candidates a budgeted tree weighs (budget × tree_k): beyond, one pass took seconds
MAX_WHOLE_TREE = 4096  # nodes of an unbudgeted tree (the paper's k = 3, γ = 3 has 40): beyond, a pass's rows OOM


@dataclass(frozen=True)
class SSOptions(MethodOptions):
    streams: Any = option(None, "stream adapter folder (from `mirrorsd train-streams`) or a zoo name with a shipped "
                          "one", parse=str, metavar="ADAPTER", default_text="the target's shipped adapter")
    tree_k: int = option(DEFAULT_TREE_K, "top-k tokens per stream; the tree is their Cartesian product, 1+Σk^g nodes",
                         check=at_least(1))
    tree_budget: int = option(DEFAULT_TREE_BUDGET, "run only the N most likely nodes of that tree (by the streams' "
                              "path probability); 0 runs all of them, as the paper does", check=at_least(0))
    depth: int | None = option(None, "tree depth, at most the adapter's γ streams (a pass runs streams 1..depth)",
                               parse=int, default_text="γ",
                               check=at_least(0), flag="--tree-depth")
    threshold: float | None = option(None, "drop tree edges whose pruning-exit probability is below this, with their "
                                     "subtrees; 0 never prunes", parse=float, check=probability(),
                                     flag="--prune-threshold", default_text=f"{DEFAULT_THRESHOLD} on a CPU with "
                                     "--tree-budget 0 or a tuned --prune-exit, else 0 (a budgeted tree has few rows "
                                     "to prune: the pruning head costs more than they do)")
    prune_exit: str = option("adapter", "what scores tree edges at layer N - N_s: adapter (the pruning adapter o_θ "
                             "trained with the streams, the paper's) or tuned (a tuned exit's translator, "
                             "`mirrorsd train-exit --layers N-N_s`: the target's shipped one, or give its folder)",
                             parse=str, metavar="EXIT")
    stream_vocab: int | None = option(None, "read stream rows and the pruning exit through the N most frequent token "
                                      "ids only (0: the full vocabulary)", parse=int, check=at_least(0),
                                      default_text="the adapter's training vocabulary")
    defer_streams: str = defer_streams_option()
    suffix_match: int = suffix_match_option()

    def check(self, shape: ModelShape | None) -> None:
        if shape is not None and self.tree_k > shape.vocab_size:
            raise OptionError("tree_k", f"must be in 1..{shape.vocab_size} (the vocabulary), got {self.tree_k}")
        if self.tree_budget > MAX_WHOLE_TREE:  # (its rows run in every pass, and beside a batch's other requests)
            raise OptionError("tree_budget", f"must be at most {MAX_WHOLE_TREE} nodes, got {self.tree_budget}")
        if self.tree_budget * self.tree_k > MAX_TREE_CANDIDATES:  # each node chosen offers its tree_k children
            raise OptionError("tree_k", f"{self.tree_k} with tree_budget {self.tree_budget} weighs "
                              f"{self.tree_k * self.tree_budget} candidate nodes in every pass (at most "
                              f"{MAX_TREE_CANDIDATES}): give a smaller tree_k or tree_budget")
        if self.prune_exit != "adapter" and self.threshold == 0:
            raise OptionError("prune_exit", "scores edges for pruning, and threshold 0 never prunes: give a "
                              "threshold above 0 (--prune-threshold), or leave prune_exit at 'adapter'")

    def resolved(self, files: ShippedFiles, shape: ModelShape) -> SSOptions:
        """No ``streams``: the target's shipped adapter; ``prune_exit="tuned"``: its shipped tuned exit."""
        opts = self
        if opts.streams is None:
            opts = replace(opts, streams=files.streams("target"))
        if opts.prune_exit == "tuned":
            opts = replace(opts, prune_exit=files.tuned_exit("prune_exit"))
        return opts


@dataclass
class SSStats:
    """Per pass: tree size before and after pruning; tokens committed per pass (the call-reduction ratio)."""

    tree_before: list[int] = field(default_factory=list)
    tree_after: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    graphed: list[bool] = field(default_factory=list)  # the pass replayed as one CUDA graph

    @property
    def call_reduction(self) -> float:
        """Tokens per forward pass = AR forwards / SS forwards for the same text (the paper's CR ratio)."""
        return sum(self.committed) / len(self.committed) if self.committed else 0.0

    def summary(self) -> str:
        x = self.to_dict()
        return (f", call reduction {x['call_reduction']:.2f} tokens/pass, tree {x['mean_tree_before_pruning']:.1f}"
                f" → {x['mean_tree_after_pruning']:.1f} after pruning")

    def counters(self) -> dict[str, float]:
        return {"passes": len(self.committed), "committed": sum(self.committed)}

    def timeline(self) -> None:
        return None

    def to_dict(self) -> dict[str, Any]:
        n = max(len(self.tree_before), 1)
        return {"passes": len(self.committed), "call_reduction": round(self.call_reduction, 4),
                "mean_tree_before_pruning": round(sum(self.tree_before) / n, 2),
                "mean_tree_after_pruning": round(sum(self.tree_after) / n, 2),
                "passes_as_one_graph": round(sum(self.graphed) / n, 4)}


@dataclass
class TreeScores(Scores):
    forward: TreeForward | None = None
    read: PassRead | None = None  # the verdict's tokens and every row's next guesses, read at once (off the CPU)


@dataclass
class RootScores(Scores):
    """The first step's: the prefill's logits after the prompt, and the first tree's candidates."""

    guesses: StreamGuesses = field(default_factory=StreamGuesses)


class StreamTreeScorer(ChainScorer):
    """The fused pass over ``[last committed] + tree``; commit compacts the cache to the accepted path. ``streams``:
    the stream rows a pass runs, the first of the adapters' (a tree ``depth`` deep reads no deeper stream).

    The prefill takes the whole prompt and keeps its last token's state at layer ``N - N_s``: the first step then
    runs only that token's stream rows (:meth:`first`), where a pass over it would cost a forward more than ``ar``
    spends on its first token."""

    def __init__(self, model: Transformer, adapters: StreamAdapters, threshold: float, stats: SSStats,
                 head: SubsetHead | None, prune_exit: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 defer: str = "never", tree_k: int = DEFAULT_TREE_K, streams: int | None = None) -> None:
        super().__init__(model, whole_prompt=True)
        self.adapters, self.threshold, self.stats, self.head = adapters, threshold, stats, head
        self.prune_exit, self.defer, self.tree_k, self.streams = prune_exit, defer, tree_k, streams
        self.root: torch.Tensor | None = None  # the prompt's last token at layer N - N_s, until its streams run

    def prefill(self, state: RequestState) -> int:
        ids = torch.tensor([self.unfilled(state)], device=self.model.device)
        state.next_logits, self.root = self.model.prefill_at(ids, state.target_cache, self.adapters.first_layer)
        return 1

    def score(self, state: RequestState, draft: Proposal) -> Scores:
        if state.room == 0 and not draft.tokens:  # a plain step: see :meth:`plain`
            return self.plain(state, draft)
        if state.next_logits is not None:
            if not draft.tokens:
                return self.first(state, draft)
            # A tree already (a suffix match in the prompt): the pass verifies it under the prompt's last token, which
            # it runs again.
            state.target_cache.truncate(len(state.tokens) - 1)
            state.next_logits = self.root = None
        forward, read = pass_and_read(self.model, self.adapters, state.target_cache, state.tokens[-1:], draft,
                                      state.params, Noise.TARGET, self.threshold, self.tree_k, self.head,
                                      self.prune_exit, streams=self.streams, defer=self.defer)
        self.stats.tree_before.append(forward.nodes)
        self.stats.tree_after.append(len(forward.kept))
        self.stats.graphed.append(forward.graphed)
        return TreeScores(forward.main_logits, forward.draft, forward=forward, own=read.own if read else None,
                          read=read, proposed=draft)

    def first(self, state: RequestState, draft: Proposal) -> Scores:
        """The first step: the prefill's logits after the prompt, and the streams of its last token over the whole
        prompt (:func:`~..streams.passes.read_root`: the stream rows of a deferred pass; part of the prefill's
        forward, as those are of their pass's)."""
        assert self.root is not None and state.next_logits is not None
        n_streams = self.adapters.stream_count(self.streams)
        logits, state.next_logits, root, self.root = state.next_logits, None, self.root, None
        own, guesses = read_root(self.model, self.adapters, state.target_cache, root, logits, state.params,
                                 n_streams, self.tree_k, self.head)
        self.stats.tree_before.append(1)
        self.stats.tree_after.append(1)
        self.stats.graphed.append(False)
        return RootScores(logits, draft, forwards=0, own=own, guesses=guesses)

    def plain(self, state: RequestState, draft: Proposal) -> Scores:
        """The target's own one-row step, with no stream rows: a step that may draft nothing (a batch's speculation
        budget of 0, or the answer's last token) has no next tree to draft, and so costs what ``ar``'s step costs
        (the batching issue's "skipping speculation costs nothing"). The next pass then starts with no tree, as
        the first one does."""
        self.stats.tree_before.append(1)
        self.stats.tree_after.append(1)
        self.stats.graphed.append(False)
        self.root = None  # (a first step sent plain: the next pass starts with no tree)
        return super().score(state, draft)

    def commit(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        self.stats.committed.append(verdict.accepted + 1)
        if isinstance(scores, TreeScores):
            compact(self.model, self.adapters, state.target_cache, scores.forward, verdict)
        else:
            super().commit(state, scores, verdict)


class StreamGuessProposer:
    """Proposes the tree of the last pass's stream candidates, cut to its ``budget`` most likely nodes (the first pass
    has none)."""

    def __init__(self, model: Transformer, adapters: StreamAdapters, depth: int, tree_k: int, budget: int,
                 head: SubsetHead | None) -> None:
        self.model, self.adapters, self.depth, self.tree_k, self.head = model, adapters, depth, tree_k, head
        self.budget = budget
        self.candidates = StreamGuesses()

    def start(self, state: RequestState) -> None:
        self.candidates = StreamGuesses()

    def propose(self, state: RequestState) -> Proposal:
        # A batch's speculation budget caps the nodes too: the tree shrinks to its likeliest nodes, down to the best
        # path (the paper's rule for batches) and to none.
        budget = self.budget
        if state.limit is not None and state.limit > 0:  # (budget 0: the whole product, limit 0: room 0, no tree)
            budget = state.limit if budget <= 0 else min(budget, state.limit)
        return self.candidates.tree(min(self.depth, state.room), budget)

    def feedback(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        if isinstance(scores, RootScores):
            self.candidates = scores.guesses
            return
        if not isinstance(scores, TreeScores):  # a plain step drafted nothing
            self.candidates = StreamGuesses()
            return
        if scores.read is not None:
            self.candidates = scores.read.next_guesses(verdict)
            return
        self.candidates = next_guesses(self.model, self.adapters, scores.forward, verdict, self.tree_k, self.head,
                                       state.target_cache)


def prune_threshold(opts: SSOptions, device: torch.device) -> float:
    """The option's, or by default :data:`DEFAULT_THRESHOLD` where pruning saves more than its head costs: on a CPU
    for the whole Cartesian tree (``tree_budget=0``: 40 nodes at k = 3, where a pruned node saves a row's cost), and
    wherever a tuned prune exit is asked for (it exists to prune). Else 0: off the CPU rows cost next to nothing and
    pruning would read its edge scores on the host mid-pass (a pass that prunes nothing reads the host once,
    :func:`~..streams.passes.read_pass`); and a budgeted tree (3 nodes by default) leaves a CPU little to prune, where
    the pruning exit's head over the parents costs ~1.6 ms of the 1.5B's pass: without it ``ss`` was faster in six of
    nine paired Spec-Bench runs, +0.019x ``ar`` in the median one, with a higher call reduction in every bench
    (``docs/speculative_streaming.md``, "Pruning a budgeted tree")."""
    if opts.threshold is not None:
        return opts.threshold
    if opts.prune_exit != "adapter":
        return DEFAULT_THRESHOLD
    return DEFAULT_THRESHOLD if device.type == "cpu" and opts.tree_budget == 0 else 0.0


def build(req: DecodeRequest, opts: SSOptions) -> Roles:
    if opts.streams is None:
        raise ValueError("method 'ss' needs a stream adapter (streams=FOLDER or a zoo name with a shipped one)")
    adapters = load_adapters(req.target, opts.streams)
    depth = adapters.config.streams if opts.depth is None else min(opts.depth, adapters.config.streams)
    nodes = sum(opts.tree_k ** g for g in range(depth + 1))
    if opts.tree_budget == 0 and nodes > MAX_WHOLE_TREE:
        raise OptionError("tree_k", f"{opts.tree_k} with tree_budget 0 runs the whole tree, {nodes} nodes {depth} "
                          f"deep, in every pass (at most {MAX_WHOLE_TREE}): give a tree_budget, a smaller tree_k or "
                          "depth")
    streams = max(depth, 1)  # stream rows per node: a tree ``depth`` deep reads streams 1..depth only
    stats = SSStats()
    req.stats.extra["ss"] = stats
    top_fraction = adapters.config.layers / req.target.config.n_layers

    head = adapters.head(req.target, opts.stream_vocab)
    prune_exit = None
    if opts.prune_exit != "adapter":
        prune_exit = tuned_exit(req.target, opts.prune_exit, adapters.first_layer, "prune_exit")
    proposer: Any = StreamGuessProposer(req.target, adapters, depth, opts.tree_k, opts.tree_budget, head)
    lookup, window = None, depth
    if opts.suffix_match:  # suffix windows are not bounded by the streams
        window = max(depth, HYBRID_LOOKUP.gamma)
        lookup = suffix_proposer(req, HYBRID_LOOKUP, gamma=window)
        proposer = SuffixFirst(lookup, proposer, opts.suffix_match, tree=True)

    def log(scores: Scores, verdict: Verdict) -> dict[str, Any]:
        forward = scores.forward if isinstance(scores, TreeScores) else None  # None: a plain step
        return {"tree": forward.nodes if forward else 1, "kept": len(forward.kept) if forward else 1,
                "streams": forward.streams if forward else 0,
                "deferred": forward is not None and forward.deferred is not None, "top_fraction": top_fraction,
                **(proposer.log(scores, verdict) if lookup else {})}

    scorer = StreamTreeScorer(req.target, adapters, prune_threshold(opts, req.target.device), stats, head, prune_exit,
                              opts.defer_streams, opts.tree_k, streams)
    return Roles(proposer, scorer, match, gamma=window,
                 log=log, close=lookup.close if lookup else None, timed_steps=True)


def step_cost(costs: Any, step: dict[str, Any], opts: SSOptions) -> float:
    """The whole tree runs the bottom layers; the kept nodes and their streams run the top N_s layers (deferred: the
    kept nodes, then one node's streams in a second call)."""
    top, kept, streams = step["top_fraction"], step["kept"], step["streams"]
    if step.get("deferred"):
        return (1 - top) * costs.target(step["tree"]) + top * (costs.target(kept) + costs.target(streams))
    return (1 - top) * costs.target(step["tree"]) + top * costs.target(kept * (1 + streams))


def plan(inputs: PlanInputs, method: Method) -> list[Priced]:
    """Short runs with the target's shipped adapter: their call reduction and mean trees, by the cost model."""
    if inputs.files is None:  # pricing without models
        return []
    try:
        inputs.files.streams("target")
    except ValueError:  # no shipped adapter
        return []
    runs = inputs.runs(method.name, {}, prompts=2, max_new=32)
    if not runs:
        return []
    stats = [run.extra[method.name] for run in runs]
    steps = [step for run in runs for step in run.step_log]
    return [Priced({}, fmean(c for s in stats for c in s.committed),
                   fmean(method.price(inputs.costs, step) for step in steps))]


register("ss", "Speculative Streaming: one model with stream adapters verifies a tree and drafts the next in one "
         "pass", needs_draft=False, options=SSOptions, build=build, step_cost=step_cost, plan=plan)

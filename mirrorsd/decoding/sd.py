"""``sd``: vanilla speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

One step: the draft feeds the committed tokens its cache lacks and proposes up to γ tokens one at a time
(:class:`~mirrorsd.decoding.proposers.ModelProposer`); the target scores ``[last committed, d_1..d_k]`` in one
forward; the verifier accepts ``A`` tokens and gives the target's own next token; both caches roll back to
what is committed. ``confidence=0`` with ``schedule="constant"`` is textbook fixed-γ SD (the papers' baseline).
``suffix_match`` puts the suffix proposer in front (:class:`~mirrorsd.decoding.lookup.SuffixFirst`);
``draft_vocab`` restricts the draft's LM head (:mod:`mirrorsd.draft_vocab`). A draft with a tokenizer of its own
drafts through text (:class:`~mirrorsd.decoding.bridge.BridgedProposer`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from .bridge import BridgedProposer
from .drafting import (
    SINK_TOKENS,
    acceptance_option,
    defer_streams_option,
    draft_streams_option,
    draft_vocab_option,
    draft_vocab_size,
    streams_flag,
)
from .engine import VERIFIERS, ChainScorer, DecodeRequest, Proposer, Roles
from .lookup import GATES, HYBRID_LOOKUP, ModelGate, SuffixFirst, suffix_match_option, suffix_proposer
from .proposers import SCHEDULES, ModelProposer, StreamProposer, check_draft
from .registry import (
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
from .streams.adapters import load_adapters


@dataclass(frozen=True)
class SDOptions(MethodOptions):
    gamma: int = option(20, "most draft tokens per verification window", check=at_least(1))
    confidence: float = option(
        0.6, "end a draft window at the first position where the draft's top probability is below this; "
        "0 always drafts γ tokens (textbook SD)", check=probability())
    schedule: str = option("constant", "heuristic: window limit +2 after a fully accepted step, -1 otherwise",
                           choices=SCHEDULES)
    suffix_match: int = suffix_match_option(3)  # measured: 0.93x ar vs 0.88x without (docs/drafting.md)
    model_gate: str = option("measured", "with suffix_match, when the match is short: always draft with the model, "
                             "or only while model-drafted steps measure more tokens/s than suffix-only ones on this "
                             "request (re-tried with back-off)", choices=GATES)  # measured 0.97x ar vs 0.94x always
    draft_vocab: int | None = draft_vocab_option(None)  # measured: 1.26x ar vs 1.20x full (docs/drafting.md)
    draft_context: int = option(128, "the draft model reads only the prompt's first 4 and last N tokens "
                                "(StreamingLLM's sink and window; its prompt prefill is what makes a draft lose on "
                                "long prompts); 0: the whole prompt (a draft_streams draft always reads it whole)",
                                check=at_least(0))  # 1.22x ar vs 1.20x at 256
    acceptance: str = acceptance_option()
    draft_streams: Any = draft_streams_option()  # Mirror-SD paper Fig. 4's "SD × SS draft" cell
    defer_streams: str = defer_streams_option()  # with draft_streams

    def __post_init__(self) -> None:
        object.__setattr__(self, "draft_streams", streams_flag(self.draft_streams))

    def check(self, shape: ModelShape | None) -> None:
        if self.draft_streams is None and self.defer_streams != "auto":
            raise OptionError("defer_streams", "applies to an SS draft: give draft_streams too")

    def draft_positions(self, prompt: int, new: int) -> int:
        """A ``draft_context`` draft reads the prompt's sink and last tokens, at positions that close the gap (an SS
        draft reads it whole)."""
        if self.draft_context and self.draft_streams is None:
            prompt = min(prompt, SINK_TOKENS + self.draft_context)
        return prompt + new

    def resolved(self, files: ShippedFiles, shape: ModelShape) -> SDOptions:
        """``draft_streams`` alone: the draft's shipped adapter."""
        return replace(self, draft_streams=files.streams("draft")) if self.draft_streams == "auto" else self


def model_proposer(req: DecodeRequest, opts: SDOptions, rejection: bool) -> Proposer:
    vocab = req.target.config.vocab_size
    if opts.draft_streams is not None:  # the draft reads the whole prompt (its passes key noise by true positions)
        if req.bridge is not None:
            raise OptionError("draft_streams", "needs a draft sharing the target's tokenizer")
        check_draft(req.target, req.draft)
        return StreamProposer(req.draft, load_adapters(req.draft, opts.draft_streams), vocab, req.sampling,
                              opts.gamma, confidence=opts.confidence, rejection=rejection, schedule=opts.schedule,
                              defer=opts.defer_streams, vocab=draft_vocab_size(opts.draft_vocab, req.draft))
    if req.bridge is None:
        check_draft(req.target, req.draft)
        return ModelProposer(req.draft, vocab, req.sampling, opts.gamma, confidence=opts.confidence,
                             rejection=rejection, schedule=opts.schedule,
                             vocab=draft_vocab_size(opts.draft_vocab, req.draft), context=opts.draft_context,
                             cut_on_device=True)
    if opts.schedule != "constant":
        raise OptionError("schedule", "a draft with a tokenizer of its own keeps a constant window limit")
    return BridgedProposer(req.draft, req.bridge, vocab, opts.gamma, confidence=opts.confidence,
                           rejection=rejection and not req.sampling.greedy, context=opts.draft_context,
                           vocab=draft_vocab_size(opts.draft_vocab, req.draft))


def build(req: DecodeRequest, opts: SDOptions) -> Roles:
    rejection = opts.acceptance == "rejection"
    proposer = model_proposer(req, opts, rejection)
    scorer = ChainScorer(req.target, chooses=not rejection or req.sampling.greedy)  # (rejection: match when greedy)
    # Timed steps: a draft model's forwards per draft token (fewer where the suffix lookup drafts), its catch-up and
    # its acceptance set what a window is worth, and a batch's goodput rule measures that rather than modelling it.
    if not opts.suffix_match:
        return Roles(proposer, scorer, VERIFIERS[opts.acceptance], gamma=opts.gamma, timed_steps=True)
    lookup = suffix_proposer(req, HYBRID_LOOKUP, gamma=opts.gamma, rejection=rejection)
    hybrid = SuffixFirst(lookup, proposer, opts.suffix_match, gate=ModelGate(opts.model_gate == "measured"))
    return Roles(hybrid, scorer, VERIFIERS[opts.acceptance], gamma=opts.gamma,
                 close=lookup.close, log=hybrid.log, timed_steps=True)


def step_cost(costs: Any, step: dict[str, Any], opts: SDOptions) -> float:
    """Serial draft then verification (a step with nothing drafted is one AR forward; a suffix draft is free); the
    draft's forwards are priced with the head ``draft_vocab`` asks for, the first one over what it read (the
    prompt, on the draft's first step: up to ``draft_context`` tokens a one-token price would hide)."""
    if step.get("source") == "suffix":
        drafting = 0.0
    elif "draft_forwards" in step:
        d = partial(costs.draft, vocab=opts.draft_vocab)
        first = costs.draft_read(max(step["fed"], 1), opts.draft_vocab)  # (the head on its last row only)
        drafting = first + (step["draft_forwards"] - 1) * d(1) if step["draft_forwards"] else 0.0
    else:  # a step recorded without them
        drafting = step["drafted"] * costs.draft(1, opts.draft_vocab)
    return drafting + costs.target(step["drafted"] + 1)


#: suffix_match values the planner prices by running them in front of its best analytic window.
PLANNED_HYBRID_MATCHES = (3,)


def plan(inputs: PlanInputs, method: Method) -> list[Priced]:
    """Windows at the probe's acceptance (it measured the draft alone: no confidence rule, no suffix lookup) plus
    the draft's prompt prefill; then ``sd`` as it ships (suffix first, the model gate, the reduced head), which no
    analytic law prices, by running it; and the best window with the suffix lookup in front."""
    out = []
    if inputs.has_draft:
        prefill = inputs.draft_prefill(SINK_TOKENS + SDOptions().draft_context)
        for g in inputs.gammas:
            tokens = inputs.expected_tokens(g)
            options = {"gamma": g, "confidence": 0.0, "suffix_match": 0}
            out.append(Priced(options, tokens, method.price(inputs.costs, {"drafted": g}, **options)
                              + tokens * prefill))
    best = max(out, key=lambda p: p.tokens_per_s, default=None)
    shipped = inputs.calibrated(method.name, {})
    if shipped is not None:
        out.append(shipped)
        if best is not None and not inputs.quick:
            out += [inputs.calibrated(method.name, {**best.options, "suffix_match": m})
                    for m in PLANNED_HYBRID_MATCHES]
    return out


register("sd", "vanilla speculative decoding: a draft model proposes, the target verifies", needs_draft=True,
         options=SDOptions, build=build, step_cost=step_cost, rejection=True, bridged=True, tensor_parallel=True,
         plan=plan)

"""``sd``: vanilla speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

Invariant at the start of every step, with ``seq`` the committed tokens (prompt + output):
the target cache holds ``seq[:-1]``; the draft cache holds some prefix of ``seq`` and ``pending`` is the
rest. One step: the draft feeds ``pending`` and then proposes up to ``gamma`` tokens one at a time; the
target scores ``[seq[-1], d_1..d_k]`` in one forward; the verifier accepts ``A`` tokens and gives the
target's own next token; both caches roll back to what is committed.

Two proposal policies change only *how many* tokens the draft proposes, never what is committed:

* ``confidence`` (default 0.6): the window ends at the first position where the draft's most likely
  token has less than this probability. That token is still proposed (it is drafted already, and once a
  window is non-empty one more token barely changes the cost of verifying it) -- unless it would be the
  first: on a CPU verifying one draft token costs about a whole extra target forward, so then the window
  stays empty and the step is a plain 1-token target forward. (HF's ``assistant_confidence_threshold``
  always proposes it.) The decision reads the draft's distribution only, never its draw.
* ``schedule="heuristic"``: the window limit grows by 2 after a fully accepted step and shrinks by 1
  otherwise (HF's ``num_assistant_tokens_schedule``); ``"constant"`` (default) keeps ``gamma``.

``confidence=0`` with ``schedule="constant"`` is textbook fixed-γ SD (the papers' baseline).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..kv_cache import KVCache
from ..model import Transformer
from ..sampling import DRAFT_STREAM, TARGET_STREAM, SamplingParams, probabilities, sample
from ..verify import ACCEPTANCE_RULES, verify_match, verify_rejection
from .base import DecodeRequest, Timer

DEFAULT_GAMMA = 20
DEFAULT_CONFIDENCE = 0.6
SCHEDULES = ("constant", "heuristic")


def check_draft(target: Transformer, draft: Transformer | None) -> None:
    """The draft must share the target's token ids; its embedding may be smaller (Qwen2.5-7B pads its
    vocabulary to 152,064 rows while 0.5B-3B have 151,936 with the same tokenizer)."""
    if draft is None:
        raise ValueError("speculative decoding needs a draft model (draft=... / --draft)")
    if draft.config.vocab_size > target.config.vocab_size:
        raise ValueError(
            f"draft vocabulary ({draft.config.vocab_size}) is larger than the target's "
            f"({target.config.vocab_size}); the draft must share the target's tokenizer"
        )


def parse_options(options: dict) -> tuple[int, str, float, str]:
    options = dict(options)
    gamma = int(options.pop("gamma", DEFAULT_GAMMA))
    rule = options.pop("acceptance", "match")
    confidence = float(options.pop("confidence", DEFAULT_CONFIDENCE))
    schedule = options.pop("schedule", "constant")
    if options:
        raise ValueError(f"unknown options for method 'sd': {sorted(options)}")
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if rule not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {rule!r}")
    if not 0.0 <= confidence < 1.0:
        raise ValueError(f"confidence must be in [0, 1), got {confidence}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return gamma, rule, confidence, schedule


def decode(req: DecodeRequest) -> Iterator[list[int]]:
    options = parse_options(req.options)
    check_draft(req.target, req.draft)
    return _run(req, *options)


def draft_tokens(draft: Transformer, tokens: list[int]) -> torch.Tensor:
    """``[1, T]`` ids for the draft; ids past a smaller draft vocabulary (the target's padding rows) become 0,
    which can only change what the draft proposes, never what is committed."""
    vocab = draft.config.vocab_size
    return torch.tensor([[t if t < vocab else 0 for t in tokens]], device=draft.device)


def window_end(top_probs: list[float], confidence: float) -> int:
    """How many of a rollout's tokens to propose under the confidence rule (all when ``confidence`` is 0):
    through the first doubtful token, or none when the first one is doubtful."""
    for i, p in enumerate(top_probs):
        if p < confidence:
            return 0 if i == 0 else i + 1
    return len(top_probs)


@dataclass
class Proposal:
    tokens: list[int]
    q_rows: list[torch.Tensor]  # the distributions the tokens were drawn from (rejection / confidence only)
    forwards: int


def propose(draft: Transformer, cache: KVCache, pending: list[int], position: int, window: int,
            params: SamplingParams, stream: int, need_probs: bool, confidence: float, pad: int) -> Proposal:
    """Feed ``pending`` (committed tokens the draft cache lacks), then draft up to ``window`` tokens one at a
    time; ``position`` is the absolute position of the first drafted token. The cache ends holding the
    committed text and every proposed token but the last."""
    tokens: list[int] = []
    q_rows: list[torch.Tensor] = []
    forwards = 0
    for i in range(window):
        feed = pending if i == 0 else tokens[-1:]
        logits = draft(draft_tokens(draft, feed), cache=cache, last=1)[0]
        forwards += 1
        doubtful = False
        if need_probs:
            q = probabilities(logits, params)[0] if not params.greedy else logits[0].double().softmax(-1)
            # Decided on the draft's distribution only, never on the draw, so that rejection
            # sampling still sees proposals distributed exactly as q.
            doubtful = q.max().item() < confidence
            if doubtful and i == 0:
                break
            q_rows.append(torch.nn.functional.pad(q, (0, pad)) if pad else q)
        tokens.append(sample(logits, [position + i], params, stream)[0])
        if doubtful:
            break
    return Proposal(tokens, q_rows, forwards)


@torch.inference_mode()
def _run(req: DecodeRequest, gamma: int, rule: str, confidence: float, schedule: str) -> Iterator[list[int]]:
    target, draft = req.target, req.draft
    params, stats, timer = req.sampling, req.stats, Timer(req.stats)
    rejection = rule == "rejection" and not params.greedy
    # Coupled drafting (same noise as the target) maximises sample-and-match acceptance; rejection
    # sampling needs the draft's draws independent of the target's acceptance noise.
    draft_stream = DRAFT_STREAM if rejection else TARGET_STREAM
    need_probs = rejection or confidence > 0
    pad = target.config.vocab_size - draft.config.vocab_size

    seq = list(req.prompt_ids)
    capacity = len(seq) + req.max_new_tokens + 2
    t_cache, d_cache = target.new_cache(capacity=capacity), draft.new_cache(capacity=capacity)
    pending = list(seq)
    with timer("prefill_s"):
        if len(seq) > 1:
            target.prefill(torch.tensor([seq[:-1]], device=target.device), t_cache)
            stats.target_forwards += 1

    produced = 0
    while True:
        window = min(gamma, req.max_new_tokens - produced - 1)
        with timer("draft_s"):
            drafted = propose(draft, d_cache, pending, len(seq), window, params, draft_stream, need_probs,
                              confidence, pad)
        stats.draft_forwards += drafted.forwards
        proposal = drafted.tokens
        with timer("target_s"):
            window_tokens = torch.tensor([[seq[-1], *proposal]], device=target.device)
            t_logits = target(window_tokens, cache=t_cache)[0]
            stats.target_forwards += 1
            positions = list(range(len(seq), len(seq) + len(proposal) + 1))
            if rejection:
                verdict = verify_rejection(proposal, torch.stack(drafted.q_rows) if drafted.q_rows else None,
                                           t_logits, positions, params)
            else:
                verdict = verify_match(proposal, t_logits, positions, params)
        stats.record_step(len(proposal), verdict.accepted)
        if proposal and schedule == "heuristic":
            gamma = gamma + 2 if verdict.accepted == len(proposal) else max(1, gamma - 1)
        new = verdict.committed(proposal)
        # Roll back: the target keeps seq + accepted; the draft keeps what it saw of the committed text.
        t_cache.truncate(len(seq) + verdict.accepted)
        keep = min(len(d_cache), len(seq) + verdict.accepted)
        d_cache.truncate(keep)
        seq.extend(new)
        pending = seq[keep:]
        produced += len(new)
        yield new

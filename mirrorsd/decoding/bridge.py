"""A draft model with a tokenizer of its own: drafting through text (HF's universal assisted generation; the
string-level exact match of Timor et al., arXiv 2502.05202).

The only draft cheap enough to pay on a 2-core CPU may come from another model family: SmolLM2-135M costs
~0.15x the q4 Qwen2.5-1.5B per token, where Qwen's own 0.5B costs ~0.4x. It shares no token ids with the target,
so the proposer works on bytes: the committed target tokens become text, the text becomes the draft's tokens
(re-tokenizing only the tail that new text can change), the draft continues it greedily in its own vocabulary,
and its continuation becomes target tokens again.

The draft is a deterministic guess in the target's vocabulary, like a suffix match's, so losslessness is the
verifier's as usual: ``match`` keeps the target's own tokens (greedy and sample-and-match), and under
``rejection`` the guess is a point mass, accepted with the target's probability of it (exact speculative
sampling). A re-tokenization that splits text differently from the target only costs acceptance.
"""

from __future__ import annotations

import weakref
from itertools import takewhile
from typing import Any

import torch
from tokenizers.decoders import ByteLevel

from ..model import Transformer
from ..prefix_cache import common_prefix
from ..sampling import SamplingParams
from ..verify import Verdict
from .drafting import SINK_TOKENS, DraftSampler, prompt_window
from .engine import Proposal, RequestState, Scores, point_masses

RETOKENIZE = 2  # trailing draft tokens re-tokenized with new text (a BPE merge can reach back over them)


def byte_level(tokenizer: Any) -> bool:
    """Whether a (fast) HF tokenizer is GPT-2-style byte-level BPE, whose tokens are exact byte strings."""
    return isinstance(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None), ByteLevel)


def complete_utf8(data: bytes | bytearray) -> int:
    """Length of the longest prefix of ``data`` that ends on a whole UTF-8 character."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        byte = data[n - back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for its lead
            continue
        need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
        return n if need <= back else n - back
    return n


class ByteTokenizer:
    """A byte-level tokenizer seen as bytes: each id's exact bytes, and bytes back to ids."""

    def __init__(self, tokenizer: Any) -> None:
        if not byte_level(tokenizer):
            raise ValueError(f"{type(tokenizer).__name__} is not a byte-level BPE tokenizer; a draft with another "
                             "tokenizer than the target's needs both to be byte-level (GPT-2 style: Qwen, Llama 3, "
                             "SmolLM2)")
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # (1 s to import: only a bridge needs it)

        self.backend = tokenizer.backend_tokenizer
        # GPT-2's alphabet: the printable character standing for each byte (str.translate, then latin-1 is the bytes)
        to_bytes = {ord(c): b for b, c in bytes_to_unicode().items()}
        added = tokenizer.get_added_vocab()
        vocab = tokenizer.get_vocab()
        self.bytes: list[bytes] = [b""] * (max(vocab.values()) + 1)
        for token, i in vocab.items():
            self.bytes[i] = token.encode("utf-8") if token in added else token.translate(to_bytes).encode("latin-1")

    def decode(self, ids: list[int]) -> bytes:
        table = self.bytes
        return b"".join(table[i] if 0 <= i < len(table) else b"" for i in ids)

    def encode(self, data: bytes | bytearray) -> list[int]:
        """Ids of ``data`` up to its last whole character (special tokens written out become their ids)."""
        text = bytes(data[: complete_utf8(data)]).decode("utf-8", errors="replace")
        return self.backend.encode(text, add_special_tokens=False).ids if text else []


_BYTE_TOKENIZERS: weakref.WeakKeyDictionary[Any, ByteTokenizer] = weakref.WeakKeyDictionary()


def byte_tokenizer(tokenizer: Any) -> ByteTokenizer:
    """:class:`ByteTokenizer` of a tokenizer, built once per process (its table takes ~0.5 s for 152k tokens)."""
    if tokenizer not in _BYTE_TOKENIZERS:
        _BYTE_TOKENIZERS[tokenizer] = ByteTokenizer(tokenizer)
    return _BYTE_TOKENIZERS[tokenizer]


class TokenBridge:
    """The target's and the draft's tokenizers, as bytes."""

    def __init__(self, target_tokenizer: Any, draft_tokenizer: Any) -> None:
        self.target, self.draft = byte_tokenizer(target_tokenizer), byte_tokenizer(draft_tokenizer)
        eos = draft_tokenizer.eos_token_id
        self.draft_eos = frozenset([eos] if eos is not None else [])


class BridgedProposer:
    """A draft model in its own vocabulary, proposing target tokens through text (greedy drafts).

    The draft cache holds ``cached[:len(cache) + skipped]``: the draft's tokens of the committed text, then its
    own drafted tokens (``skipped``: prompt tokens a ``context``-limited draft leaves out, as in
    :class:`~mirrorsd.decoding.proposers.ModelProposer`). Each proposal re-tokenizes the committed text's tail and
    keeps the cache up to the first token that differs, so text the target accepted as drafted costs no forward.
    """

    def __init__(self, draft: Transformer, bridge: TokenBridge, target_vocab: int, gamma: int, *,
                 confidence: float = 0.0, rejection: bool = False, context: int = 0, vocab: int = 0) -> None:
        self.model, self.bridge, self.target_vocab, self.gamma = draft, bridge, target_vocab, gamma
        self.confidence, self.rejection, self.context = confidence, rejection, context
        # Greedy steps through the draft core, in the draft's own vocabulary (a reduced one: its most frequent ids).
        self.sampler = DraftSampler(draft, draft.config.vocab_size, SamplingParams(), confidence=confidence,
                                    vocab=vocab)
        self.text = bytearray()  # the committed text
        self.converted = 0  # committed target tokens already in ``text``
        self.ids: list[int] = []  # draft tokens of the committed text (up to its last whole character)
        self.ends: list[int] = []  # byte offset where each of ``ids`` ends
        self.cached: list[int] = []  # what the draft cache was fed, in order (see the class docstring)
        self.skipped = 0
        self.last: Proposal | None = None

    def start(self, state: RequestState) -> None:
        pass

    def _sync(self, state: RequestState) -> list[int]:
        """Bring the draft's tokens up to the committed text; roll the cache back to what still agrees with them
        and return what it must be fed."""
        self.text += self.bridge.target.decode(state.tokens[self.converted:])
        self.converted = len(state.tokens)
        keep = max(0, len(self.ids) - RETOKENIZE)
        # A draft token may end inside a character (byte-level BPE splits CJK and emoji): text re-tokenized from
        # there would start with bytes that decode to U+FFFD, and the offsets would drift from the text.
        while keep and self.ends[keep - 1] < len(self.text) and self.text[self.ends[keep - 1]] & 0xC0 == 0x80:
            keep -= 1
        start = self.ends[keep - 1] if keep else 0
        fresh = self.bridge.draft.encode(self.text[start:])
        table = self.bridge.draft.bytes
        ends = self.ends[:keep]
        for token in fresh:
            ends.append((ends[-1] if ends else 0) + len(table[token]))
        self.ids, self.ends = self.ids[:keep] + fresh, ends
        cache = state.draft_cache
        assert cache is not None
        if not len(cache):  # the prompt: the draft core's prompt window of it
            feed, self.skipped = prompt_window(self.ids, self.context)
            self.cached = list(self.ids)
            return list(feed)
        # (at least the last token is fed again: the draft's next-token logits come from feeding something)
        agree = min(common_prefix(self.cached[: len(cache) + self.skipped], self.ids), len(self.ids) - 1)
        if agree < SINK_TOKENS + self.skipped:  # (a tiny prompt re-tokenized under the sink: start over)
            cache.truncate(0)
            return self._sync(state)
        cache.truncate(agree - self.skipped)
        self.cached = list(self.ids)
        return self.ids[agree:]

    def propose(self, state: RequestState) -> Proposal:
        """Up to ``gamma`` target tokens: the draft continues the text until its words make more target tokens
        than the window holds, or, with ``confidence``, up to its first doubtful token (none if that is the
        first)."""
        window = min(self.gamma, state.room)
        self.last = Proposal()
        if window <= 0:
            return self.last
        feed = self._sync(state)
        if not feed or complete_utf8(self.text) < len(self.text):
            # (no whole character of text yet; or the target stopped inside one, which the draft's text cannot
            # continue: its tokens would start the character again, and none could be accepted)
            return self.last
        cache = state.draft_cache
        drafted: list[int] = []
        proposal: list[int] = []
        forwards, fed = 0, len(feed)
        for _ in range(2 * window + 2):  # (a draft token holds at least half a target token in practice)
            logits = self.model(torch.tensor([feed], device=self.model.device), cache=cache, last=1,
                                head=self.sampler.head)[0]
            forwards += 1
            token = self.sampler.tokens_of([int(logits[-1].argmax())])[0]
            _, top = self.sampler.judge(logits)
            doubtful = top is not None and self.sampler.doubtful(top[0])
            if doubtful and not drafted:
                break
            drafted.append(token)
            self.cached.append(token)
            proposal = self.bridge.target.encode(self.bridge.draft.decode(drafted))
            if doubtful or token in self.bridge.draft_eos or len(proposal) > window:
                break
            feed = [token]
        self.cached = self.cached[: len(cache) + self.skipped]  # the last drafted token was never fed
        tokens = list(takewhile(lambda t: t < self.target_vocab, proposal[:window]))
        probs = point_masses(tokens, self.target_vocab) if self.rejection else None
        self.last = Proposal(tokens, probs=probs, forwards=forwards, fed=fed)
        return self.last

    def feedback(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        pass  # the next proposal re-tokenizes what was committed and keeps the cache where it agrees

"""Where has the text's current suffix occurred before, and what followed it there?

:class:`SuffixIndex` maps every n-gram (n = 1..``key_len``) of its documents to where it ended, so the longest
indexed suffix is found with ``key_len`` dictionary lookups. The true match length of each occurrence is then
measured by comparing tokens backwards (up to ``MAX_MATCH``), which is what SuffixDecoding's suffix tree and
SAM-Decoding's automaton give, at a cost per appended token of ``key_len`` dictionary inserts -- the right
trade for Python, where a pointer-based suffix tree walks one object per token.

A request's own text (prompt and output) is one growing document; the process keeps a second, *shared*
index of earlier outputs (:func:`shared_index`), bounded by a token budget and evicting the oldest document
first. A third, fixed one (:func:`datastore`) holds a model family's own answers to chat prompts of ours, shipped
with the package: REST's datastore (arXiv 2311.08252), which gives a new process's first requests the phrasing
its model keeps repeating. :meth:`SuffixIndex.continuations` merges the occurrences of the longest match into a
frequency trie, from which the proposer follows the most frequent continuation (a chain; trees are not drafted
yet).
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..collector import paused_collector

MAX_MATCH = 64  # longest match length measured (SuffixDecoding's tree depth)
KEY_LEN = 4  # longest indexed n-gram


@dataclass
class TrieNode:
    """Continuations after a matched suffix: ``count`` occurrences reached this node."""

    count: int = 0
    children: dict[int, TrieNode] = field(default_factory=dict)


@dataclass
class Match:
    """The longest suffix found and the continuations that followed its occurrences."""

    length: int  # tokens matched (the longest among the occurrences)
    occurrences: int
    root: TrieNode


class SuffixIndex:
    """n-gram → (document, end position) over a set of token documents, with eviction by a token budget."""

    def __init__(self, key_len: int = KEY_LEN, max_tokens: int | None = None) -> None:
        self.key_len, self.max_tokens = key_len, max_tokens
        self.docs: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        self.table: dict[tuple[int, ...], dict[int, list[int]]] = {}  # key -> doc -> end positions (exclusive)
        self.tokens = 0
        self._next_doc = 0
        self.lock = threading.Lock()  # the shared index is read and written by concurrent requests
        self._save_lock = threading.Lock()
        self._copies = self._saved = 0  # of the documents taken for saving, and the newest one written

    def __len__(self) -> int:
        return self.tokens

    def add(self, tokens: Sequence[int]) -> int:
        """A new document; returns its id. Evicts the oldest documents beyond ``max_tokens``."""
        doc = self._next_doc
        self._next_doc += 1
        self.docs[doc] = []
        self.extend(doc, tokens)
        self._evict(keep=doc)
        return doc

    def extend(self, doc: int, tokens: Iterable[int]) -> None:
        """Append tokens to a document, indexing the n-grams they end."""
        text = self.docs[doc]
        for token in tokens:
            text.append(token)
            end = len(text)
            for n in range(1, min(self.key_len, end) + 1):
                key = tuple(text[end - n:end])
                self.table.setdefault(key, {}).setdefault(doc, []).append(end)
            self.tokens += 1

    def _evict(self, keep: int) -> None:
        while self.max_tokens is not None and self.tokens > self.max_tokens and len(self.docs) > 1:
            doc = next(iter(self.docs))
            if doc == keep:
                break
            text = self.docs.pop(doc)
            for end in range(1, len(text) + 1):
                for n in range(1, min(self.key_len, end) + 1):
                    key = tuple(text[end - n:end])
                    entry = self.table.get(key)
                    if entry is not None and entry.pop(doc, None) is not None and not entry:
                        del self.table[key]
            self.tokens -= len(text)

    def occurrences(self, text: Sequence[int], *, limit: int = 32) -> list[tuple[int, int, int]]:
        """``(match length, doc, end)`` of the latest ``limit`` occurrences of ``text``'s longest indexed suffix
        that something follows (so ``text`` itself, when it is a document, is skipped), longest match first."""
        for n in range(min(self.key_len, len(text)), 0, -1):
            entry = self.table.get(tuple(text[len(text) - n:]))
            if not entry:
                continue
            found = []
            for doc in reversed(entry):  # newest documents first
                ends = entry[doc]
                for end in reversed(ends):
                    if end >= len(self.docs[doc]):
                        continue  # nothing follows the occurrence
                    found.append((self._match_length(text, self.docs[doc], end, n), doc, end))
                    if len(found) >= limit:
                        break
                if len(found) >= limit:
                    break
            if found:
                found.sort(key=lambda x: -x[0])
                return found
        return []

    @staticmethod
    def _match_length(text: Sequence[int], other: Sequence[int], end: int, known: int) -> int:
        n = known
        while n < MAX_MATCH and n < len(text) and n < end and text[len(text) - 1 - n] == other[end - 1 - n]:
            n += 1
        return n

    def continuations(self, text: Sequence[int], depth: int, *, limit: int = 32,
                      into: Match | None = None) -> Match | None:
        """The occurrences of the longest match merged into a trie of their next ``depth`` tokens (added to
        ``into`` when it matched as long; replacing it when this match is longer)."""
        found = self.occurrences(text, limit=limit)
        if not found:
            return into
        longest = found[0][0]
        if into is not None and into.length > longest:
            return into
        match = into if into is not None and into.length == longest else Match(longest, 0, TrieNode())
        for length, doc, end in found:
            if length < longest:
                break
            match.occurrences += 1
            node = match.root
            node.count += 1
            for token in self.docs[doc][end:end + depth]:
                node = node.children.setdefault(token, TrieNode())
                node.count += 1
        return match

    # -- persistence of the shared index (documents only; the table is rebuilt) -------------------------------

    def save(self, path: Path) -> None:
        """Write the documents to ``path`` whole. Call it without holding :attr:`lock`: the copy is taken under it,
        the write is not (requests keep drafting meanwhile); each write has a temporary file of its own (two
        processes may persist to one path), and a slower writer never replaces a newer copy."""
        with self.lock:
            docs = [list(doc) for doc in self.docs.values()]
            self._copies += 1
            copy = self._copies
        with self._save_lock:
            if copy < self._saved:
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(docs, f)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self._saved = copy

    def load(self, path: Path) -> None:
        for doc in json.loads(path.read_text()):
            self.add(doc)


SHARED_TOKENS = 1 << 18  # token budget of a process's shared index (262k tokens: 180-240 MB of Python objects at
# the cap, measured with tracemalloc on stdlib text, more the less it repeats)
_shared: dict[str, SuffixIndex] = {}
_shared_lock = threading.Lock()
_isolation = threading.local()  # .indexes: this thread's own while it runs isolated_shared_indexes


def shared_index(tokenizer_key: str, max_tokens: int = SHARED_TOKENS) -> SuffixIndex:
    """The process-wide index of earlier outputs for one tokenizer (token ids mean nothing across them)."""
    with _shared_lock:
        indexes = getattr(_isolation, "indexes", None)
        indexes = _shared if indexes is None else indexes
        index = indexes.get(tokenizer_key)
        if index is None:
            index = indexes[tokenizer_key] = SuffixIndex(max_tokens=max_tokens)
        return index


def persisting_allowed() -> bool:
    """False inside :func:`isolated_shared_indexes`: the persisted index is neither read (a benchmark answer
    could find a saved copy of itself) nor written (it would be replaced by the isolated index's contents)."""
    return getattr(_isolation, "indexes", None) is None


@contextmanager
def isolated_shared_indexes() -> Iterator[None]:
    """Run the block with empty shared indexes and no persisted one: a benchmark answer or a planner calibration
    run must not be looked up in a copy of itself, and must neither wipe nor pollute what the process's real
    requests gathered, in memory or on disk. The isolation is this thread's: requests that other threads run
    meanwhile (a server's) keep using the process's indexes."""
    saved = getattr(_isolation, "indexes", None)
    _isolation.indexes = {}
    try:
        yield
    finally:
        _isolation.indexes = saved


_datastores: dict[str, SuffixIndex] = {}


def datastore(spec: str, tokenizer_key: str, vocab_size: int) -> SuffixIndex | None:
    """The fixed index ``spec`` names: ``auto``, the one shipped for this tokenizer (``mirrorsd/data/suffix/
    <tokenizer_key>.json.gz``; None when there is none), ``none``, or a path to such a file. Loaded once per
    process and never written, so requests read it without a lock. Benchmarks keep it: it holds answers to our
    own prompts (``scripts/make_suffix_datastore.py``), never to a benchmark's."""
    if spec == "none":
        return None
    if spec == "auto":
        source = resources.files("mirrorsd.data").joinpath("suffix", f"{tokenizer_key}.json.gz")
        if not source.is_file():
            return None
        name = f"package:{tokenizer_key}"
    else:
        source = Path(spec).expanduser()
        if not source.is_file():
            raise FileNotFoundError(f"suffix datastore {spec!r}: no such file (give auto, none, or a .json.gz "
                                    "written by scripts/make_suffix_datastore.py)")
        name = str(source.resolve())
    with _shared_lock:
        index = _datastores.get(name)
        if index is None:
            docs = json.loads(gzip.decompress(source.read_bytes()))["docs"]
            top = max((max(doc) for doc in docs if doc), default=-1)
            if top >= vocab_size:
                raise ValueError(f"suffix datastore {spec!r} holds token id {top}, beyond the target's vocabulary "
                                 f"({vocab_size}): it was written for another tokenizer")
            index = SuffixIndex()
            with paused_collector():
                for doc in docs:
                    index.add(doc)
            _datastores[name] = index
        return index

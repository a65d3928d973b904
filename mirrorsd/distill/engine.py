"""The data engine: a model's own answers to :mod:`.prompts`, generated in batches and written to compressed shards
that a stopped run resumes from.

The output folder holds ``prompts.jsonl.gz`` (the prompt set, frozen at the first run, so that a later run on a
machine whose Python has another standard library answers the same prompts), ``shard-NNNNN.npz`` (one per flush:
the answered items' token ids) and ``index.json`` (counts per kind, tokens, rate). Shards are the truth: the index is
rebuilt from them, and an item is done once a shard holds it; each shard also records the settings it was made
with. A stop at any moment loses at most the items answered since the last flush (``shard_items``); a Ctrl-C or
SIGTERM writes those at once, then the items in flight once they finish.

Every record is one answered turn: the prompt's token ids as the model read them (its chat template applied, earlier
turns included) and the answer's ids as the model produced them, never re-tokenized. Greedy for most items and
sampled (seeded by the item's id) for a share of them. Many items decode at once through a
:class:`~mirrorsd.batching.Batcher` (one ragged forward per step), each getting exactly the tokens it gets alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import json
import queue
import threading
import time
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ..api import LoadedModel, encode_chat, generate
from ..batching import Batcher
from ..decoding import REFERENCE
from ..execution import release_thread_team
from ..files import replace_synced, write_atomic
from ..prefix_cache import PrefixCache
from .prompts import ASKED_ANEW, KINDS, VERSION, Prompt, build, digest, extend

PROMPTS_FILE, INDEX_FILE, LOCK_FILE = "prompts.jsonl.gz", "index.json", ".lock"


@dataclass(frozen=True)
class Settings:
    """How answers are made; recorded in the index, and a resumed run must match it."""

    model: str
    method: str = REFERENCE
    max_new_tokens: int = 256
    sampled_share: float = 0.2
    temperature: float = 0.7


@dataclass
class Record:
    """One answered turn."""

    item: int
    turn: int
    kind: str
    sampled: bool
    prompt_ids: list[int]
    answer_ids: list[int]


def sampled(item: int, share: float) -> bool:
    """Whether an item's answers are sampled: a fixed hash of its id, so a resumed run decides alike."""
    return (item * 2654435761) % 10_000 < share * 10_000


def answer(target: LoadedModel, item: Prompt, settings: Settings, prefix_cache: PrefixCache | None = None
           ) -> list[Record]:
    """Every turn of ``item`` answered in one conversation; the answer of an :data:`ASKED_ANEW` kind (a question)
    is then asked in a conversation of its own. ``prefix_cache``: a later turn (and the shared chat template's start)
    is not prefilled again."""
    sample = sampled(item.id, settings.sampled_share)
    kw: dict[str, Any] = {"method": settings.method, "max_new_tokens": settings.max_new_tokens,
                          "temperature": settings.temperature if sample else 0.0, "seed": item.id,
                          "prefix_cache": prefix_cache}
    records, conversation = [], []
    text = ""
    for turn, content in enumerate(item.turns):
        conversation.append({"role": "user", "content": content})
        ids = encode_chat(target, conversation)
        g = generate(target, ids, **kw)
        records.append(Record(item.id, turn, item.kind, sample, ids, g.token_ids))
        text = g.text
        conversation.append({"role": "assistant", "content": text})
    if item.kind in ASKED_ANEW and text.strip():
        ids = encode_chat(target, [{"role": "user", "content": text.strip()}])
        g = generate(target, ids, **kw)
        records.append(Record(item.id, len(item.turns), item.kind, sample, ids, g.token_ids))
    return records


class Shards:
    """An output folder (the module docstring)."""

    def __init__(self, folder: str | Path, settings: Settings, prompts: Sequence[Prompt] | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.settings = settings
        path = self.folder / PROMPTS_FILE
        if path.exists():
            self.prompts = read_prompts(path)
        else:
            self.prompts = list(prompts) if prompts is not None else build()
            self.freeze()
        index = self.folder / INDEX_FILE
        if index.exists():
            self._check(json.loads(index.read_text())["settings"], index)
        self.done: set[int] = set()
        self.stats: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.shards = sorted(self.folder.glob("shard-*.npz"))
        for shard in self.shards:
            data = np.load(shard)
            if "settings" in data.files:  # (each shard says how it was made: the index may be gone, or not yet written)
                self._check(json.loads(str(data["settings"])), shard)
            self._count(data)
        self.seconds = json.loads(index.read_text()).get("seconds", 0.0) if index.exists() else 0.0

    def _check(self, recorded: dict[str, Any], where: Path) -> None:
        if recorded != asdict(self.settings):
            changed = {k: (recorded.get(k), v) for k, v in asdict(self.settings).items() if recorded.get(k) != v}
            raise ValueError(f"{where} was made with other settings (recorded, asked): {changed}; resume with the "
                             "recorded ones or use another folder")

    def _count(self, data: Any) -> None:
        items = data["item"]
        new = set(items.tolist()) - self.done
        self.done |= new
        kinds = data["kind"]
        first = {}
        for i, item in enumerate(items.tolist()):
            first.setdefault(item, int(kinds[i]))
        self.kinds.update(KINDS[first[i]] for i in new)
        starts, answers, ends = data["start"], data["answer"], data["end"]
        self.stats["records"] += len(items)
        self.stats["prompt_tokens"] += int((answers - starts).sum())
        self.stats["answer_tokens"] += int((ends - answers).sum())
        self.stats["sampled_records"] += int(data["sampled"].sum())

    def pending(self, kinds: Collection[str] | None = None) -> list[Prompt]:
        """The items no shard holds yet, of ``kinds`` only if given."""
        return [p for p in self.prompts if p.id not in self.done and (kinds is None or p.kind in kinds)]

    def add_prompts(self, items: Sequence[tuple[str, tuple[str, ...]]]) -> int:
        """Append the (kind, turns) the frozen set lacks, ids going on, so a folder made before a prompt kind
        existed answers it too; returns how many were added."""
        grown = extend(self.prompts, items)
        added = len(grown) - len(self.prompts)
        if added:
            self.prompts = grown
            self.freeze()
        return added

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """One run writes to a folder at a time: two would both number their next shard alike, and one would
        replace the other's (its items counted done, then gone)."""
        with (self.folder / LOCK_FILE).open("a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ValueError(f"another mirrorsd distill is writing to {self.folder}: one run per folder at a "
                                 "time") from None
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def freeze(self) -> None:
        write_atomic(self.folder / PROMPTS_FILE,
                     gzip.compress("".join(json.dumps(asdict(p)) + "\n" for p in self.prompts).encode(), mtime=0))

    def write(self, records: Sequence[Record], seconds: float) -> Path:
        """One shard for ``records``, then the index."""
        tokens, start, ans, end = [], [], [], []
        at = 0
        for r in records:
            start.append(at)
            tokens += r.prompt_ids
            ans.append(at + len(r.prompt_ids))
            tokens += r.answer_ids
            at += len(r.prompt_ids) + len(r.answer_ids)
            end.append(at)
        data = {"tokens": np.asarray(tokens, dtype=np.uint32), "start": np.asarray(start, dtype=np.int64),
                "answer": np.asarray(ans, dtype=np.int64), "end": np.asarray(end, dtype=np.int64),
                "item": np.asarray([r.item for r in records], dtype=np.int32),
                "turn": np.asarray([r.turn for r in records], dtype=np.int8),
                "kind": np.asarray([KINDS.index(r.kind) for r in records], dtype=np.int8),
                "sampled": np.asarray([r.sampled for r in records], dtype=bool),
                "settings": np.asarray(json.dumps(asdict(self.settings)))}
        # numbered from the folder: a shard renamed into place just before a Ctrl-C is on disk but not yet listed
        number = max((int(p.stem.split("-")[1]) for p in self.folder.glob("shard-*.npz")), default=-1) + 1
        path = self.folder / f"shard-{number:05d}.npz"
        tmp = self.folder / f"incomplete-{number:05d}.npz"  # a crash mid-write leaves no file named shard-*
        np.savez_compressed(tmp, **data)
        replace_synced(tmp, path)  # on disk before its name says complete: a power cut leaves no empty shard-*
        self.shards.append(path)
        self._count(data)
        self.seconds += seconds
        self.write_index()
        return path

    def write_index(self) -> None:
        answer_tokens = self.stats["answer_tokens"]
        index = {
            "version": VERSION, "prompts_digest": digest(self.prompts), "prompts": len(self.prompts),
            "prompts_per_kind": dict(Counter(p.kind for p in self.prompts)),
            "settings": asdict(self.settings), "done_items": len(self.done), "done_per_kind": dict(self.kinds),
            **dict(self.stats), "shards": len(self.shards),
            "bytes": sum(p.stat().st_size for p in self.shards), "seconds": round(self.seconds, 1),
            "answer_tokens_per_s": round(answer_tokens / self.seconds, 2) if self.seconds else None,
        }
        write_atomic(self.folder / INDEX_FILE, (json.dumps(index, indent=1) + "\n").encode())


def read_prompts(path: Path) -> list[Prompt]:
    rows = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]
    return [Prompt(r["id"], r["kind"], tuple(r["turns"])) for r in rows]


def records(folder: str | Path) -> Iterator[tuple[np.ndarray, int, str]]:
    """Every record of a folder's shards: (token ids, where the answer starts, kind), for training."""
    for shard in sorted(Path(folder).glob("shard-*.npz")):
        data = np.load(shard)
        for s, a, e, k in zip(data["start"], data["answer"], data["end"], data["kind"], strict=True):
            yield data["tokens"][s:e], int(a - s), KINDS[int(k)]


def run(target: LoadedModel, shards: Shards, *, batch: int = 16, shard_items: int = 64, items: int | None = None,
        seconds: float | None = None, progress: bool = True, prefix_cache_bytes: int = 1 << 30,
        kinds: Collection[str] | None = None) -> dict[str, Any]:
    """Answer pending items (of ``kinds`` only, if given), ``batch`` at a time through one batcher, until all are
    done, ``items`` more are, or ``seconds`` have passed; flush a shard every ``shard_items`` items. Ctrl-C stops
    after the items in flight. ``prefix_cache_bytes``: a :class:`PrefixCache` of that size is shared by the
    conversations (0: none)."""
    with shards.writing():
        return _run(target, shards, batch, shard_items, shards.pending(kinds)[:items], seconds, progress,
                    prefix_cache_bytes)


def _run(target: LoadedModel, shards: Shards, batch: int, shard_items: int, todo: list[Prompt],
         seconds: float | None, progress: bool, prefix_cache_bytes: int) -> dict[str, Any]:
    store = PrefixCache(target.model, prefix_cache_bytes) if prefix_cache_bytes else None
    work = iter(todo)
    lock, stop = threading.Lock(), threading.Event()
    done: queue.Queue[tuple[Prompt, list[Record]] | BaseException] = queue.Queue()
    batcher = Batcher(speculation="fixed")

    def worker() -> None:
        while not stop.is_set():
            with lock:
                item = next(work, None)
            if item is None:
                return
            try:
                with batcher.member():
                    done.put((item, answer(target, item, shards.settings, store)))
            except BaseException as error:  # noqa: BLE001 - handed to the main thread, which stops the run
                done.put(error)
                return

    threads = [threading.Thread(target=worker, daemon=True, name=f"distill-{i}") for i in range(min(batch,
                                                                                                 len(todo)))]
    start = flushed = time.perf_counter()
    buffer: list[Record] = []
    answered = new_tokens = 0
    bar = tqdm(total=len(todo), desc="distilling", unit="item", disable=not progress)
    release_thread_team()  # every forward runs on the batcher's engine now (see release_thread_team)
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads) or not done.empty():
            try:
                got = done.get(timeout=0.5)
            except queue.Empty:
                continue
            if isinstance(got, BaseException):
                raise got
            item, recs = got
            buffer += recs
            answered += 1
            new_tokens += sum(len(r.answer_ids) for r in recs)
            bar.update(1)
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.1f}")
            if answered % shard_items == 0:
                # the buffer empties before the write: a Ctrl-C inside it (after the shard is in place) must not
                # write the same records again below; one before it loses them, and a resumed run answers them again
                now, flushing, buffer = time.perf_counter(), buffer, []
                shards.write(flushing, now - flushed)
                flushed = now
            if seconds is not None and time.perf_counter() - start >= seconds:
                stop.set()
    except KeyboardInterrupt:
        stop.set()
        if buffer:  # the answers already made reach the disk first: a SIGKILL may follow the SIGTERM before the
            now, flushing, buffer = time.perf_counter(), buffer, []  # items in flight finish (docker stop: 10 s)
            shards.write(flushing, now - flushed)
            flushed = now
        for t in threads:  # the items in flight finish and are kept
            t.join()
        while not done.empty():
            got = done.get()
            if not isinstance(got, BaseException):
                buffer += got[1]
                answered += 1
    finally:
        stop.set()
        bar.close()
        if buffer:
            shards.write(buffer, time.perf_counter() - flushed)
    elapsed = time.perf_counter() - start
    return {"answered": answered, "answer_tokens": new_tokens, "seconds": round(elapsed, 1),
            "prefix_cache_queried_tokens": store.queried_tokens if store else 0,
            "prefix_cache_hit_tokens": store.hit_tokens if store else 0,
            "answer_tokens_per_s": round(new_tokens / elapsed, 2) if elapsed else None,
            "done_items": len(shards.done), "prompts": len(shards.prompts)}

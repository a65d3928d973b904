"""What the state-cache trainers share (``train-streams``, ``train-draft``, ``train-eagle``): the corpora and their
windows, the sharded cache of what a frozen model gives each window, and the resumable optimizer loop.

Each trainer freezes most of a model, so what the frozen part computes is cached once per window
(:func:`write_shards`); training then runs many epochs over the cache. The loop (:func:`fit`) checkpoints every few
steps and evaluates into a learning curve, so a run stopped at any moment resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
import sysconfig
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .draft_vocab import head_weight
from .files import save_tensors, save_torch
from .model import Transformer

CORPORA = {
    "stdlib": "Python standard library source (top-level *.py files of this interpreter)",
    "pydoc-topics": "the Python language reference topics shipped in pydoc_data (English technical prose)",
    "chat-answers": "the model's own greedy answers (128 tokens) to mirrorsd's 448 shipped chat prompts (never "
                    "Spec-Bench's), each through its chat template, in 8 texts of ~56 conversations",
}
CHAT_TEXTS = 8  # chat-answers: conversations are joined into this many texts, so 256-token windows fill up
DISTILL = "distill:"  # a `mirrorsd distill` folder: token ids as the model read and wrote them, not re-tokenized
DISTILL_RECORDS = 32  # records joined per document, so windows fill up
# How distill_documents builds documents; a state cache records it, so one built from other documents is refused.
# 2: a conversation's earlier turn is dropped where the next turn's record holds it whole.
# 3: and a record that another holds whole (as its start or as itself) is kept once.
DISTILL_DOCUMENTS = 3
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
CHECKPOINT, CURVE, CURVE_PLOT = "checkpoint.pt", "curve.json", "learning_curve.png"
CACHE_META, HELD_OUT = "cache.json", "held-out.safetensors"
SHARD_CHUNKS = 32  # chunks per cache shard: the unit of resuming
Item = TypeVar("Item")


def chat_answer_texts(model: str, tokenizer) -> list[str]:
    """``chat-answers``: ``model``'s greedy answers to every shipped chat prompt set
    (:data:`mirrorsd.vocab_tables.PROMPT_SETS`; generated once and cached by :func:`mirrorsd.vocab_tables.answers_of`),
    each conversation through the chat template, joined into :data:`CHAT_TEXTS` texts (conversation i in text
    i mod CHAT_TEXTS). Streams trained on code and reference prose read chat answers poorly; these are the text
    decoding actually asks them for."""
    from .vocab_tables import PROMPT_SETS, answers_of, prompts

    conversations = []
    for prompt_set in PROMPT_SETS:
        for p, ids in zip(prompts(prompt_set), answers_of(model, prompt_set=prompt_set), strict=True):
            answer = tokenizer.decode(ids, skip_special_tokens=True)
            messages = [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": answer}]
            conversations.append(tokenizer.apply_chat_template(messages, tokenize=False))
    return ["\n".join(conversations[j::CHAT_TEXTS]) for j in range(CHAT_TEXTS)]


class Tokens(list):
    """A document given as token ids (taken as they are, not re-tokenized), with ``answer[i]`` true where token i
    was written by the model rather than read by it: drafting is only ever asked for the written ones."""

    def __init__(self, ids: list[int], answer: list[bool]) -> None:
        super().__init__(ids)
        self.answer = answer


def distill_documents(folder: str | Path) -> list[Tokens]:
    """A ``mirrorsd distill`` folder's records (prompt and answer ids), :data:`DISTILL_RECORDS` to a document.

    A conversation's next turn is recorded with the earlier turns as its prompt, ids for ids, so the earlier record
    is dropped and its answer marks carried over: read twice, those turns were ~17% of the folder's tokens and
    weighed double in training. A record that another holds whole, as that one's start or as itself, is kept once:
    a multi-turn item opens with a code or QA item's prompt word for word, and answered greedily both record the same
    ids (and a window of one could land in the held-out chunks while the other trains)."""
    from .distill.engine import records

    kept: list[tuple[np.ndarray, list[bool], set[bytes]]] = []  # (ids, answer marks, the earlier turns it holds)
    for ids, answer_from, _ in records(folder):
        answer = [False] * answer_from + [True] * (len(ids) - answer_from)
        holds: set[bytes] = set()
        if kept and len(ids) > len(kept[-1][0]) and np.array_equal(ids[:len(kept[-1][0])], kept[-1][0]):
            earlier, marks, held = kept.pop()
            answer[:len(marks)] = marks
            holds = held | {_key(earlier)}
        kept.append((ids, answer, holds))
    if not kept:
        raise ValueError(f"{folder} holds no distilled records: run `mirrorsd distill --out {folder}` first")
    starts = set().union(*(held for _, _, held in kept))
    unique, seen = [], set()
    for ids, answer, _ in kept:
        key = _key(ids)
        if key not in seen and key not in starts:
            seen.add(key)
            unique.append((ids.tolist(), answer))
    docs = []
    for start in range(0, len(unique), DISTILL_RECORDS):
        group = unique[start:start + DISTILL_RECORDS]
        docs.append(Tokens([t for ids, _ in group for t in ids], [a for _, answer in group for a in answer]))
    return docs


def _key(ids: np.ndarray) -> bytes:
    """A record's ids as a short fixed-size key (32k records of ~250 ids each)."""
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.uint32).tobytes(), digest_size=16).digest()


def data_versions(sources: list[str]) -> dict[str, int]:
    """What a state cache must also match: the shard count of each ``distill:`` folder (shards are only added)."""
    return {s: len(list(Path(s.removeprefix(DISTILL)).glob("shard-*.npz"))) for s in sources if s.startswith(DISTILL)}


def text_digests(sources: list[str], recorded: dict[str, str] | None = None) -> dict[str, str]:
    """What a state cache must also match for its text sources: a digest of the text each reads (``stdlib`` differs
    between Python versions, files are edited), so a cache of other text is refused rather than reused stale, or
    resumed from another chunking (repeated windows, held-out ones trained on). ``distill:`` folders count their
    shards instead (:func:`data_versions`); ``chat-answers`` are the recorded model's own. A file or folder gone
    since takes its ``recorded`` digest: a cache made from it still serves (only an incomplete one needs the text)."""
    out = {}
    for source in sources:
        if source.startswith(DISTILL) or source == "chat-answers":
            continue
        if source not in CORPORA and not Path(source).exists() and source in (recorded or {}):
            out[source] = recorded[source]
            continue
        h = hashlib.sha256()
        for text in corpus_texts([source]):
            h.update(str(text).encode("utf-8", errors="replace") + b"\0")
        out[source] = h.hexdigest()[:16]
    return out


def corpus_texts(sources: list[str], model: str | None = None, tokenizer=None) -> list[str | list[int]]:
    """Texts from named offline corpora (:data:`CORPORA`), files, or folders (their *.py/*.txt/*.md/*.rst), and
    token-id documents from ``distill:FOLDER`` sources. ``chat-answers`` needs the ``model`` name and its
    ``tokenizer``."""
    texts: list[str | list[int]] = []
    for source in sources:
        if source.startswith(DISTILL):
            texts.extend(distill_documents(source.removeprefix(DISTILL)))
            continue
        if source == "chat-answers":
            if model is None or tokenizer is None:
                raise ValueError("the chat-answers corpus needs the model whose answers it holds (and its tokenizer)")
            texts.extend(chat_answer_texts(model, tokenizer))
            continue
        if source == "stdlib":
            files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        elif source == "pydoc-topics":
            from pydoc_data.topics import topics

            texts.extend(topics[key] for key in sorted(topics))
            continue
        else:
            path = Path(source)
            if not path.exists():
                raise FileNotFoundError(f"no such data file or folder: {source} (or a corpus name: "
                                        f"{', '.join(CORPORA)})")
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES)
        texts.extend(f.read_text(encoding="utf-8", errors="replace") for f in files)
    if not texts:
        raise ValueError(f"no training text found in {sources}")
    return texts


@dataclass
class Chunk:
    ids: torch.Tensor  # [T] token ids
    loss_from: int  # first position whose token is a training target (completion tokens only)
    answer: torch.Tensor | None = None  # [T] bool: the token was written by the model (None: not known)


def make_chunks(tokenizer, texts: list[str | list[int]], seq_len: int, count: int, seed: int) -> list[Chunk]:
    """``count`` windows of ``seq_len`` tokens drawn evenly from the shuffled texts (deterministic); a text given
    as token ids is taken as it is (with its :class:`Tokens` answer marks)."""
    rng = random.Random(seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    chunks: list[Chunk] = []
    for i in order:
        text = texts[i]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if isinstance(text, str) else text
        answer = getattr(text, "answer", None)
        for start in range(0, len(ids) - seq_len + 1, seq_len):
            chunks.append(Chunk(torch.tensor(ids[start:start + seq_len]), 1,
                                None if answer is None else torch.tensor(answer[start:start + seq_len])))
    rng.shuffle(chunks)
    if len(chunks) < count:
        raise ValueError(f"the data gives {len(chunks)} chunks of {seq_len} tokens; {count} were asked for")
    return chunks[:count]


def _save_shard(items: list[dict[str, torch.Tensor]], path: Path) -> None:
    # a shard is complete or absent (on disk, not only named): an interrupted run redoes only the last one
    save_tensors({k: torch.stack([x[k] for x in items]).cpu().contiguous() for k in items[0]}, path)


def shard_paths(folder: Path, count: int, shard_size: int) -> list[Path]:
    return [folder / f"shard-{i:05d}.safetensors" for i in range(-(-count // shard_size))]


def check_cache(folder: Path, meta: dict[str, Any]) -> None:
    """Record ``meta`` (model, weight format, shape, data, seq_len, seed...) in a new cache; refuse one built with
    other settings rather than mix them. A cache that holds no states yet (a run that failed before caching, on bad
    flags) takes the new settings."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CACHE_META
    if not path.exists() or not any(folder.glob("*.safetensors")):
        path.write_text(json.dumps(meta, indent=1) + "\n")
        return
    old = json.loads(path.read_text())
    if "data_digests" not in old:  # (a cache from before the text was digested: as it was)
        meta = {k: v for k, v in meta.items() if k != "data_digests"}
    if old != meta:
        changed = sorted(k for k in meta.keys() | old.keys() if old.get(k) != meta.get(k))
        # (the chunk count follows --steps unless given: more steps over the same cache need it named)
        hint = f"--chunks {old['chunks']} trains over it, " if changed == ["chunks"] and "chunks" in old else ""
        raise ValueError(f"the state cache in {folder} was built with other settings ({', '.join(changed)}); "
                         f"{hint}give another --cache folder or delete this one")


def write_shards(folder: Path, train_chunks: list[Chunk], held_out: list[Chunk],
                 rows: Callable[[Path, list[Chunk]], Iterable[dict[str, torch.Tensor]]], *, desc: str,
                 shard_size: int = SHARD_CHUNKS, progress: bool = True) -> None:
    """Write a state cache's missing shards: ``held-out.safetensors``, then the training chunks in the shards of
    :func:`shard_paths`; ``rows(path, chunks)`` gives a shard's rows, one per chunk. An interrupted run resumes at
    its last shard (the cache every state-cache trainer builds)."""
    jobs = [(folder / HELD_OUT, held_out)]
    jobs += [(path, train_chunks[i * shard_size:(i + 1) * shard_size])
             for i, path in enumerate(shard_paths(folder, len(train_chunks), shard_size))]
    todo = [(path, chunks) for path, chunks in jobs if not path.exists()]
    bar = tqdm(total=sum(len(c) for _, c in todo), desc=desc, unit="chunk", disable=not progress)
    for path, chunks in todo:
        items = []
        for item in rows(path, chunks):
            items.append(item)
            bar.update()
        _save_shard(items, path)
    bar.close()


class ShardCache(Sequence[Item]):
    """The cached chunks of some shards, read one chunk at a time from the memory-mapped files: at the distillation
    issue's scale a cache does not fit in memory, and reading one chunk (~2 MB at 256 tokens) costs milliseconds
    against a training step's seconds. A subclass names its tensors and builds its item in ``__getitem__``."""

    names: tuple[str, ...] = ()  # the tensors a chunk is made of
    optional: tuple[str, ...] = ()  # read where the shard has them (older caches may not)

    def __init__(self, paths: list[Path], device: torch.device | str) -> None:
        from safetensors import safe_open

        self.device = str(device)
        self._files = [safe_open(str(path), framework="pt") for path in paths]
        counts = [f.get_slice("labels").get_shape()[0] for f in self._files]
        self._where = [(f, i) for f, n in zip(self._files, counts, strict=True) for i in range(n)]

    def __len__(self) -> int:
        return len(self._where)

    def row(self, index: int) -> dict[str, torch.Tensor]:
        """Chunk ``index``'s tensors by name."""
        f, i = self._where[index]
        names = [*self.names, *(name for name in self.optional if name in f.keys())]  # noqa: SIM118 (not a dict)
        return {name: f.get_slice(name)[i].to(self.device) for name in names}


class TrainHead:
    """The LM head on a vocabulary subset, for the training loss only (held-out accuracy reads the full head)."""

    def __init__(self, model: Transformer, ids: torch.Tensor) -> None:
        ids = ids.sort().values.to(model.device)
        self.weight = head_weight(model.lm_head, model.embed_tokens.weight, model.config.tie_word_embeddings)[ids]
        self.weight = self.weight.to(model.dtype)
        self.index = torch.full((model.config.vocab_size,), -100, dtype=torch.long, device=model.device)
        self.index[ids] = torch.arange(len(ids), device=model.device)
        self.norm = model.norm

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(hidden), self.weight).float()

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary labels (-100 = none) as subset indices; ids outside the subset are not trained on."""
        return torch.where(labels >= 0, self.index[labels.clamp(min=0)], -100)


def warmup_decay(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over the first 5% of ``steps``, then linear decay to 0 (the state-cache trainers' schedule)."""
    warmup = max(1, steps // 20)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(1, steps - warmup))))


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The chunk order of one epoch: a fresh shuffle per epoch, the same on every resume."""
    index = list(range(count))
    random.Random(seed * 1_000_003 + epoch).shuffle(index)
    return index


def open_cache(folder: Path, meta: dict[str, Any], sources: list[str], count: int
               ) -> tuple[list[Path], bool, dict[str, Any]]:
    """A state cache's training shard paths for ``count`` windows, whether it is complete (all of them and the
    held-out shard exist), and its ``meta`` with the data's version: the ``distill:`` sources' shard counts and the
    text sources' digests, checked by :func:`check_cache`. A checkpoint records that meta, so a run resumes only on
    the data it started on (other data reshuffles the windows: its held-out ones were trained on)."""
    if versions := data_versions(list(sources)):
        meta = meta | {"data_shards": versions, "distill_documents": DISTILL_DOCUMENTS}
    path = folder / CACHE_META
    old = json.loads(path.read_text()) if path.is_file() else {}
    if digests := text_digests(list(sources), old.get("data_digests")):
        meta = meta | {"data_digests": digests}
    shards = shard_paths(folder, count, SHARD_CHUNKS)
    complete = all(p.exists() for p in [*shards, folder / HELD_OUT])
    grown = {s: (n, meta["data_shards"][s]) for s, n in old.get("data_shards", {}).items()
             if meta.get("data_shards", {}).get(s, n) > n}
    if complete and grown and old == meta | {"data_shards": old["data_shards"]}:
        # A distill folder grows while it is trained on; a complete cache reads none of it, so a stopped run
        # resumes over the windows it was built from (its checkpoint records that version).
        meta = old
        warnings.warn("the state cache in {} was built from {}; training goes on over it as built (another --cache "
                      "folder uses the new shards)".format(folder, ", ".join(
                          f"{n} of the {now} shards {s.removeprefix(DISTILL)} holds now" for s, (n, now) in
                          grown.items())), stacklevel=2)
    check_cache(folder, meta)
    return shards, complete, meta


def optimize(optimizer: torch.optim.Optimizer, loss: torch.Tensor, params: Iterable[torch.Tensor]) -> None:
    """One optimizer step on ``loss``, gradients clipped to norm 1 (every trainer's step)."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()


@dataclass
class Trainable:
    """What :func:`fit` trains: its parameters, and its state under ``key`` in the checkpoint."""

    params: list[torch.Tensor]
    state: Callable[[], dict[str, torch.Tensor]]
    load: Callable[[dict[str, torch.Tensor]], None]
    key: str


Step = Callable[[Any], tuple[torch.Tensor | None, int, dict[str, str]]]  # item -> (loss or None, tokens, postfix)


@dataclass
class Fitted:
    curve: list[dict[str, Any]]  # held-out measures at step 0, every ``eval_every`` steps and at the end
    tokens: int  # training tokens seen, repeats over epochs included
    seconds: float  # this run's training time (not a resumed run's earlier part)
    # every run that shaped the weights, in order: the steps it trained and its command (a run extended with more
    # steps is not the run its last command would train from scratch: the schedule decayed to the first count)
    runs: list[dict[str, Any]] = field(default_factory=list)


class StopNow(KeyboardInterrupt):
    """The second Ctrl-C: it lands anywhere in a step, so nothing it leaves half done is saved."""


@contextmanager
def interrupts_between_steps(bar: tqdm) -> Iterator[Callable[[], bool]]:
    """Ctrl-C (or a SIGTERM: ``kill``, a job scheduler) takes effect after the step it came in: inside one it could
    save parameters the optimizer had half updated, or a step without its evaluation; a SIGTERM ended the process
    at once, losing every step since the last save. A second one stops at once. (Signals reach the main thread
    only: elsewhere they are left as they are.)"""
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    # each signal on its own: a background job ignores Ctrl-C, yet is stopped by SIGTERM (another thread, or a signal
    # ignored or handled outside Python: left as it is)
    taken = [s for s, handler in previous.items() if handler is not signal.SIG_IGN and handler is not None]
    if not taken:
        yield lambda: False
        return
    asked: list[bool] = []

    def ask(signum: int, frame: Any) -> None:
        if asked:
            raise StopNow
        asked.append(True)
        bar.write(f"{signal.Signals(signum).name}: stopping after this step (again to stop at once)")

    for s in taken:
        signal.signal(s, ask)
    try:
        yield lambda: bool(asked)
    finally:
        for s in taken:
            signal.signal(s, previous[s])


def fit(out: Path, trainable: Trainable, items: Sequence[Any], step: Step, evaluate: Callable[[], dict[str, Any]],
        *, steps: int, lr: float, seed: int, eval_every: int, save_every: int, desc: str, tokens: int = 0,
        settings: Mapping[str, Any] | None = None, device: torch.device | str = "cpu", progress: bool = True,
        command: str | None = None) -> Fitted:
    """Train ``steps`` steps of AdamW under :func:`warmup_decay` over ``items`` in :func:`epoch_order`, or resume a
    run from ``out/checkpoint.pt``. ``step(item)`` gives the loss (None: nothing to learn in this window, only the
    schedule moves), its token count and the progress bar's postfix. ``tokens`` counts what a warm start had seen.
    ``settings``: what else shapes the run (its loss, its start...); a checkpoint resumes only the same run, on to
    ``steps`` (the optimizer's state would bring back the old learning rate, and a finished run would train
    nothing yet be saved under the new recipe). ``command``: this run's, kept with the steps it trained
    (:attr:`Fitted.runs`)."""
    optimizer = torch.optim.AdamW(trainable.params, lr=lr, weight_decay=0.0)
    schedule = warmup_decay(optimizer, steps)
    out.mkdir(parents=True, exist_ok=True)
    start_step, curve = 0, []
    checkpoint = out / CHECKPOINT
    # (not --steps: a finished or stopped run trains on to a larger count)
    run = json.loads(json.dumps({"lr": lr, "seed": seed, **(settings or {})}, default=str))
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=device, weights_only=False)
        recorded = state.get("settings", run)  # (checkpoints from before settings were recorded: as asked)
        if recorded != run:
            changed = {k: (recorded.get(k), run.get(k)) for k in {*recorded, *run} if recorded.get(k) != run.get(k)}
            raise ValueError(f"{checkpoint} is a run with other settings (recorded, asked): {changed}; give the "
                             "recorded ones to resume it, or another --out")
        if state["step"] > steps:  # (it would train nothing and save the longer run under this recipe)
            raise ValueError(f"{checkpoint} is a run at step {state['step']}, past --steps {steps}: give --steps "
                             f"{state['step']} or more to go on with it, or another --out")
        trainable.load(state[trainable.key])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        start_step, curve, tokens = state["step"], state["curve"], state["train_tokens"]
        # (a checkpoint from before runs were recorded: its steps by an unrecorded command)
        earlier = state.get("runs", [{"steps": [0, start_step], "of": None, "command": "not recorded"}])
    else:
        earlier = []
    if not curve:
        curve.append({"step": 0, "train_tokens": tokens} | evaluate())

    def runs(step: int) -> list[dict[str, Any]]:
        this = {"steps": [start_step, step], "of": steps} | ({"command": command} if command else {})
        return earlier + [this] if step > start_step or not earlier else earlier

    def save(step: int) -> None:
        save_torch({"step": step, trainable.key: {k: v.detach() for k, v in trainable.state().items()},  # (whole)
                    "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "curve": curve,
                    "train_tokens": tokens, "settings": run, "runs": runs(step)}, checkpoint)
        (out / CURVE).write_text(json.dumps(curve, indent=1) + "\n")

    bar = tqdm(total=steps, initial=start_step, desc=desc, unit="step", disable=not progress)
    started = time.perf_counter()
    done = saved = start_step
    try:
        with interrupts_between_steps(bar) as stop_asked:
            for index in range(start_step, steps):
                epoch, position = divmod(index, len(items))
                loss, counted, postfix = step(items[epoch_order(len(items), seed, epoch)[position]])
                if loss is not None:
                    optimize(optimizer, loss, trainable.params)
                    bar.set_postfix(postfix | {"epoch": epoch})
                schedule.step()
                tokens += counted
                done = index + 1
                bar.update()
                if done % eval_every == 0 or done == steps:
                    curve.append({"step": done, "train_tokens": tokens} | evaluate())
                    bar.write(f"step {done}: held-out {curve[-1]}")
                if done % save_every == 0 or done == steps:
                    save(done)
                    saved = done
                if stop_asked():
                    raise KeyboardInterrupt
    except KeyboardInterrupt as stopped:  # Ctrl-C keeps every finished step: the next run resumes after it
        if isinstance(stopped, StopNow):  # (mid-step: the weights may hold part of the next step)
            bar.write(f"stopped at once: {checkpoint} holds step {saved}; run the same command to resume" if saved
                      else "stopped at once, before the first checkpoint: the same command starts over")
            raise
        if done > saved:
            save(done)
        bar.write(f"interrupted after step {done} of {steps}: saved to {checkpoint}; run the same command to resume")
        raise
    finally:
        bar.close()
    (out / CURVE).write_text(json.dumps(curve, indent=1) + "\n")  # also after --steps 0: an evaluation alone
    return Fitted(curve, tokens, round(time.perf_counter() - started, 1), runs(done))


def plot_learning_curve(curve: list[dict[str, Any]], path: Path, series: dict[str, list[float]], ylabel: str,
                        title: str, dashed: Collection[str] = ()) -> None:
    """``series`` (label -> one value per curve point) against training tokens, log scale; the ``dashed`` labels
    (a series trained beside the main ones, such as the streams' pruning exit) drawn apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    xs = [max(1, p["train_tokens"]) for p in curve]
    for label, ys in series.items():
        ax.plot(xs, ys, "s--" if label in dashed else "o-", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens (with repeats over epochs)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    if len(series) > 1:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""Building the frequency tables of :mod:`mirrorsd.draft_vocab`: the corpus table from offline corpora, and the
draft table re-ranked by English word frequencies and a target's own greedy answers to the shipped chat prompts.
A tool on the API (it generates the answers), so it lives above the model layer that reads the tables.

    python -m mirrorsd.vocab_tables MODEL_FOLDER                      # the corpus table, vocab{V}.pt
    python -m mirrorsd.vocab_tables MODEL_FOLDER --answers-of TARGET  # the draft table, draft{V}.pt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections import Counter
from importlib import resources
from pathlib import Path

import torch

from .draft_vocab import TABLE_FILES

PROMPT_SETS = {  # chat prompts of ours (never Spec-Bench's): package-relative files under mirrorsd/data
    "draft_vocab": "draft_vocab/prompts.jsonl",  # their answers rank the draft table
    "streams": "streams/chat_prompts.jsonl",  # more, for the chat-answers corpus (scripts/make_stream_prompts.py)
}
ANSWER_WEIGHT = 1.0  # the answers' total count, as a multiple of the corpus total, when both are merged


def _corpora(limit_chars: int) -> list[str]:
    import pydoc_data.topics
    import sysconfig

    texts = list(pydoc_data.topics.topics.values())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = sum(map(len, texts))
    for path in sorted(stdlib.rglob("*.py")):
        if total > limit_chars:
            break
        text = path.read_text(encoding="utf-8", errors="ignore")
        texts.append(text)
        total += len(text)
    return texts


def corpus_counts(tokenizer, limit_chars: int = 30_000_000) -> Counter[int]:
    """Token counts over the offline corpora and two chat-templated conversations."""
    from tqdm.auto import tqdm

    counts: Counter[int] = Counter()
    for text in tqdm(_corpora(limit_chars), desc="counting tokens", unit="text"):
        counts.update(tokenizer(text)["input_ids"])
    chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in (
        ("Write a Python function that adds two numbers.", "def add(a, b):\n    return a + b"),
        ("What is the capital of France?", "The capital of France is Paris."),
    )]
    for chat in chats:
        counts.update(tokenizer(tokenizer.apply_chat_template(chat, tokenize=False))["input_ids"])
    return counts


def english_counts(tokenizer, total: float, words: int = 50_000) -> dict[int, float]:
    """Token counts of running English text, estimated from ``wordfreq``'s word frequencies (Wikipedia, subtitles,
    news, books, web) and scaled to ``total``: library source and docs lack everyday words (' food', ' money',
    ' She' rank below 32k there). Each word counts as ' word' (85%), ' Word' (10%) and 'Word' (5%, a line's start)."""
    try:
        from wordfreq import top_n_list, word_frequency
    except ImportError:
        raise ImportError("the draft table needs English word frequencies: pip install 'mirrorsd[tables]'") from None

    counts: Counter[int] = Counter()
    for word in top_n_list("en", words):
        f = word_frequency(word, "en")
        for text, share in ((" " + word, 0.85), (" " + word.capitalize(), 0.10), (word.capitalize(), 0.05)):
            for t in tokenizer(text)["input_ids"]:
                counts[t] += f * share
    scale = total / max(1e-12, sum(counts.values()))
    return {t: c * scale for t, c in counts.items()}


def ranked(counts: Counter[int] | dict[int, float], tokenizer, vocab: int) -> torch.Tensor:
    """Every id below ``vocab``: the special tokens first (always kept), then by count (ties by id, so a rebuild
    gives the same file), then the unseen ones by BPE rank (earlier merges are commoner)."""
    counts = Counter(counts)
    for token_id in tokenizer.all_special_ids:
        counts[token_id] += 10**12
    order = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t < vocab]
    seen = set(order)
    order += [t for t in range(vocab) if t not in seen]
    return torch.tensor(order, dtype=torch.int32)


def merged_counts(corpus: Counter[int] | dict[int, float], answers: list[list[int]],
                  weight: float = ANSWER_WEIGHT) -> dict[int, float]:
    """Corpus counts plus answer counts scaled so that the answers weigh ``weight`` times the corpus in all."""
    spoken = Counter(t for answer in answers for t in answer)
    scale = weight * sum(corpus.values()) / max(1, sum(spoken.values()))
    merged = {t: float(c) for t, c in corpus.items()}
    for t, c in spoken.items():
        merged[t] = merged.get(t, 0.0) + scale * c
    return merged


def draft_counts(tokenizer, answers: list[list[int]], weight: float = ANSWER_WEIGHT) -> dict[int, float]:
    """What the draft table ranks by: the corpus, as much again of English (:func:`english_counts`), and the
    answers at ``weight`` times the two."""
    corpus = corpus_counts(tokenizer)
    merged = Counter(english_counts(tokenizer, float(sum(corpus.values()))))
    merged.update(corpus)
    return merged_counts(merged, answers, weight)


def build_table(model_dir: Path, limit_chars: int = 30_000_000) -> torch.Tensor:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    vocab = AutoConfig.from_pretrained(model_dir, local_files_only=True).vocab_size
    return ranked(corpus_counts(tokenizer, limit_chars), tokenizer, vocab)


def prompts(prompt_set: str = "draft_vocab") -> list[dict[str, str]]:
    """One of the shipped chat prompt sets (:data:`PROMPT_SETS`): rows of ``category`` and ``prompt``."""
    text = resources.files("mirrorsd.data").joinpath(PROMPT_SETS[prompt_set]).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def answers_key(model_name: str) -> str:
    """The name a model's cached answers go under: a zoo name as it is; a local folder's name and a digest of its
    path (two fine-tunes in run-a/model and run-b/model shared one file, and each trained on the other's answers)."""
    from .zoo import ZOO

    path = Path(model_name).expanduser()
    if model_name in ZOO or not path.exists():  # (a zoo name wins over a same-named folder, as load_model has it)
        return path.name
    return f"{path.name}-{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:10]}"


def answers_of(model_name: str, max_new_tokens: int = 128, prompt_set: str = "draft_vocab") -> list[list[int]]:
    """``model_name``'s greedy answers (token ids) to ``prompts(prompt_set)``, generated once and kept in the cache
    (``draft_vocab/answers-NAME-N.jsonl``, one line per answer keyed by its prompt, so an interrupted run resumes
    where it stopped and the prompt sets share one file)."""
    from tqdm.auto import tqdm

    from .api import generate, load_model
    from .cache import ensure_cache_dir
    from .decoding import REFERENCE

    path = ensure_cache_dir() / "draft_vocab" / f"answers-{answers_key(model_name)}-{max_new_tokens}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill: its prompt is answered again
                continue
            done[row["prompt"]] = row["answer_ids"]
    rows = prompts(prompt_set)
    todo = [p for p in rows if p["prompt"] not in done]
    if todo:
        model = load_model(model_name)
        with path.open("a", encoding="utf-8") as out:
            for p in tqdm(todo, desc=f"answers of {model_name}", unit="prompt"):
                # the model's own greedy tokens (every method gives these; the reference names no other)
                ids = generate(model, p["prompt"], method=REFERENCE, max_new_tokens=max_new_tokens).token_ids
                done[p["prompt"]] = ids
                out.write(json.dumps({**p, "answer_ids": ids}) + "\n")
                out.flush()
    return [done[p["prompt"]] for p in rows]


def main() -> None:
    p = argparse.ArgumentParser(description="Build a draft-vocabulary frequency table for a model's tokenizer: the "
                                "corpus table from offline corpora (the stdlib source and docs, chat templates), or "
                                "with --answers-of the draft table, re-ranked by a model's own chat answers.")
    p.add_argument("folder", type=Path, help="a model folder with config.json and the tokenizer (a prepared zoo "
                   "model: ~/.cache/mirrorsd/NAME)")
    p.add_argument("--answers-of", metavar="MODEL", help="build the draft table from this model's greedy answers to "
                   "the shipped prompts (a zoo name or folder; the target whose tokens the draft must propose)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (default 128)")
    p.add_argument("--weight", type=float, default=ANSWER_WEIGHT,
                   help=f"the answers' total count as a multiple of the corpus total (default {ANSWER_WEIGHT})")
    args = p.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    if not (args.folder / "config.json").is_file():  # (transformers would take a missing folder for a hub name)
        p.error(f"{args.folder} holds no config.json: give a model folder (a prepared zoo model: "
                "~/.cache/mirrorsd/NAME)")
    vocab = AutoConfig.from_pretrained(args.folder, local_files_only=True).vocab_size
    if args.answers_of is None:
        kind, table = "corpus", build_table(args.folder)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.folder, local_files_only=True)
        spoken = answers_of(args.answers_of, args.max_new_tokens)
        kind, table = "draft", ranked(draft_counts(tokenizer, spoken, args.weight), tokenizer, vocab)
    out = Path(__file__).parent / "data" / "draft_vocab" / TABLE_FILES[kind].format(vocab)
    partial = out.with_name(out.name + ".partial")  # a kill while writing keeps the old table, not half a new one
    torch.save(table, partial)
    os.replace(partial, out)
    print(f"{out}: {len(table)} ids")


if __name__ == "__main__":
    main()

"""Reduced-vocabulary draft heads (FR-Spec, arXiv 2502.14856; EAGLE-3's draft vocabulary).

A small draft's LM head is a large share of its per-token cost (Qwen2.5-0.5B: 136M of its 494M parameters).
Restricted to the N most frequent token ids it reads N/V of that matrix. Drafting stays lossless: the target
verifies with its full vocabulary, and the draft's distribution is exactly the subset softmax with zeros
elsewhere (what rejection sampling is given).

Two kinds of frequency table ship per tokenizer (``mirrorsd/data/draft_vocab/``; every id, those seen most
frequent first, the unseen ones after them by id -- BPE's merge order):

* ``corpus`` (``vocab{V}.pt``): counted over offline corpora -- the Python standard library's source, its
  documentation (``pydoc_data``) and chat-templated conversations, plus the tokenizer's special tokens, which
  always stay in. The early exits and the stream adapters were trained on its first 32,768 ids, so it stays as it is.
* ``draft`` (``draft{V}.pt``): the corpus counts re-ranked by the target's own greedy answers to chat prompts of
  ours (``prompts.jsonl``): a draft is rewarded for proposing what the target says, and chat answers use Markdown
  and prose tokens that rank low in library source. Reduced-vocabulary drafts read it where it ships.

``python -m mirrorsd.draft_vocab FOLDER`` builds the corpus table; ``--answers-of MODEL`` the draft table.
"""

from __future__ import annotations

import argparse
import json
import weakref
from collections import Counter
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from .linear import DenseLinear, make_linear
from .quant import quantize_q8

SIZES = (8192, 16384, 32768)
DEFAULT_SIZE = 32768  # what the early exit and the streams read by default (and the streams are trained on)


TABLE_FILES = {"corpus": "vocab{}.pt", "draft": "draft{}.pt"}  # kind -> file name, by vocabulary size


def table_path(vocab_size: int, kind: str = "corpus") -> Path:
    return Path(str(resources.files("mirrorsd.data.draft_vocab").joinpath(TABLE_FILES[kind].format(vocab_size))))


def load_table(vocab_size: int, kind: str = "corpus") -> torch.Tensor:
    """Token ids of the tokenizer with ``vocab_size`` rows, most frequent first (``kind``: see the module)."""
    path = table_path(vocab_size, kind)
    if not path.is_file():
        flag = " --answers-of TARGET" if kind == "draft" else ""
        raise FileNotFoundError(f"no {kind} vocabulary table ships for a {vocab_size}-token vocabulary ({path}); "
                                f"build one with `python -m mirrorsd.draft_vocab MODEL_FOLDER{flag}`")
    return torch.load(path)


def draft_table_kind(vocab_size: int) -> str:
    """The table a reduced-vocabulary draft reads: ``draft`` where one ships for the vocabulary, else ``corpus``."""
    return "draft" if table_path(vocab_size, "draft").is_file() else "corpus"


class SubsetHead(nn.Module):
    """The LM head on ``ids`` only: a restricted vocabulary reads (and computes) only its rows, never 152k logits
    per row. Its logits come in subset order (``ids`` ascending: column ``c`` scores token ``ids[c]``, and ties
    break towards the lower id as over the full row); :meth:`full` scatters them into a full-vocabulary row (-inf
    elsewhere) for sampling, whose noise is keyed by token id."""

    def __init__(self, head: nn.Module, embedding: torch.Tensor, ids: torch.Tensor, tied: bool) -> None:
        super().__init__()
        ids = ids.sort().values.long().to(embedding.device)
        rows = head_weight(head, embedding, tied)[ids].float()
        self.linear = make_linear(quantize_q8(rows) if rows.shape[1] % 32 == 0 else rows)
        self.register_buffer("ids", ids)
        self.vocab = embedding.shape[0]
        index = torch.full((self.vocab,), -1, dtype=torch.long, device=ids.device)
        index[ids] = torch.arange(len(ids), device=ids.device)
        self.register_buffer("index", index)  # token id -> its column, -1 outside the subset

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., len(ids)]`` of normed hidden states."""
        return self.linear(normed).float()

    def full(self, normed: torch.Tensor) -> torch.Tensor:
        sub = self(normed)
        out = torch.full((*sub.shape[:-1], self.vocab), float("-inf"), device=sub.device)
        out[..., self.ids] = sub
        return out


def head_logits(model, hidden: torch.Tensor, head: SubsetHead | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Final norm + LM head on raw hidden states, and what each column scores: with ``head=None`` the full
    vocabulary (column = token id, ids ``None``), else ``head``'s subset (column ``c`` = ``ids[c]``)."""
    if head is None:
        return model.logits(hidden), None
    return head(model.norm(hidden)), head.ids


def top_tokens(logits: torch.Tensor, ids: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` log-probabilities of :func:`head_logits` rows and their token ids."""
    top = logits.log_softmax(-1).topk(min(k, logits.shape[-1]), dim=-1)
    return top.values, top.indices if ids is None else ids[top.indices]


@torch.inference_mode()
def head_weight(head: nn.Module, embedding: torch.Tensor, tied: bool) -> torch.Tensor:
    """The head's ``[vocab, hidden]`` weight: the embedding when tied (a tied quantized head holds the embedding's
    codes, which the embedding holds dequantized), else read off the head by applying it to the identity (exact
    for int8-activation kernels too: each row has one non-zero)."""
    if tied:
        return embedding
    if isinstance(head, DenseLinear):
        return head.weight
    return head(torch.eye(head.in_features, device=embedding.device)).float().T


_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(size, kind, device): SubsetHead}


def subset_head(model, size: int, kind: str = "corpus") -> SubsetHead:
    """``model``'s head restricted to the ``size`` most frequent ids of its tokenizer's shipped ``kind`` table;
    built once per model (a q8 copy of those rows) and shared by every request and role that asks for it."""
    heads = _HEADS.setdefault(model, {})
    key = (size, kind, model.device)
    if key not in heads:
        table = load_table(model.config.vocab_size, kind)
        if size > len(table):
            raise ValueError(f"the shipped table has {len(table)} ids; a restricted vocabulary must be at most that")
        heads[key] = SubsetHead(model.lm_head, model.embed_tokens.weight, table[:size],
                                model.config.tie_word_embeddings).eval()
    return heads[key]


def optional_head(model, size: int | None) -> SubsetHead | None:
    """The head a vocabulary option asks for. ``0``: the full vocabulary (``None``). ``None`` (a default): the
    :data:`DEFAULT_SIZE` most frequent ids where a table ships for the model's vocabulary and it is larger, else
    the full one. ``N``: the N most frequent ids (an error where no table ships)."""
    vocab = model.config.vocab_size
    if size is None:
        size = default_size(vocab)
    return subset_head(model, size) if 0 < size < vocab else None


def default_size(vocab_size: int) -> int:
    """The restricted vocabulary read by default: :data:`DEFAULT_SIZE` ids where a table ships for this
    vocabulary and it is larger, else 0 (the full one)."""
    return DEFAULT_SIZE if vocab_size > DEFAULT_SIZE and table_path(vocab_size).is_file() else 0


# -- building a table ----------------------------------------------------------------------------------------

PROMPTS = "prompts.jsonl"  # chat prompts of ours whose answers rank the draft table (never Spec-Bench's)
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
    """Every id below ``vocab``: the special tokens first (always kept), then by count, then the unseen ones by
    BPE rank (earlier merges are commoner)."""
    counts = Counter(counts)
    for token_id in tokenizer.all_special_ids:
        counts[token_id] += 10**12
    order = [t for t, _ in counts.most_common() if t < vocab]
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

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return ranked(corpus_counts(tokenizer, limit_chars), tokenizer, AutoConfig.from_pretrained(model_dir).vocab_size)


def prompts() -> list[dict[str, str]]:
    """The shipped chat prompts (``category``, ``prompt``)."""
    text = resources.files("mirrorsd.data.draft_vocab").joinpath(PROMPTS).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def answers_of(model_name: str, max_new_tokens: int = 128) -> list[list[int]]:
    """``model_name``'s greedy answers (token ids) to :func:`prompts`, generated once and kept in the cache
    (``draft_vocab/answers-NAME-N.jsonl``, one line per answer, so an interrupted run resumes where it stopped)."""
    from tqdm.auto import tqdm

    from .api import generate, load_model
    from .cache import ensure_cache_dir

    path = ensure_cache_dir() / "draft_vocab" / f"answers-{Path(model_name).name}-{max_new_tokens}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            done[row["prompt"]] = row["answer_ids"]
    todo = [p for p in prompts() if p["prompt"] not in done]
    if todo:
        model = load_model(model_name)
        with path.open("a", encoding="utf-8") as out:
            for p in tqdm(todo, desc=f"answers of {model_name}", unit="prompt"):
                # suffix decoding: the model's own greedy tokens, faster than ar
                ids = generate(model, p["prompt"], method="suffix", max_new_tokens=max_new_tokens).token_ids
                done[p["prompt"]] = ids
                out.write(json.dumps({**p, "answer_ids": ids}) + "\n")
                out.flush()
    return [done[p["prompt"]] for p in prompts()]


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

    vocab = AutoConfig.from_pretrained(args.folder).vocab_size
    if args.answers_of is None:
        kind, table = "corpus", build_table(args.folder)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.folder)
        spoken = answers_of(args.answers_of, args.max_new_tokens)
        kind, table = "draft", ranked(draft_counts(tokenizer, spoken, args.weight), tokenizer, vocab)
    out = Path(__file__).parent / "data" / "draft_vocab" / TABLE_FILES[kind].format(vocab)
    torch.save(table, out)
    print(f"{out}: {len(table)} ids")


if __name__ == "__main__":
    main()

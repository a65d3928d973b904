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
* ``draft`` (``draft{V}.pt``): the corpus counts plus English word frequencies, re-ranked by the target's own greedy
  answers to chat prompts of ours (``prompts.jsonl``): a draft is rewarded for proposing what the target says, and
  chat answers use prose tokens that rank low in library source. Reduced-vocabulary drafts read it where it ships.

:mod:`mirrorsd.vocab_tables` builds both (``python -m mirrorsd.vocab_tables FOLDER [--answers-of TARGET]``).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch
from torch import nn

from .kept import Kept
from .linear import DenseLinear, make_linear, on_huge_pages
from .quant import quantize_q8

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
                                f"build one with `python -m mirrorsd.vocab_tables MODEL_FOLDER{flag}`")
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
        rows = head_weight(head, embedding, tied)[ids]
        if embedding.device.type == "cpu" and embedding.dtype == torch.float32:  # our int8 CPU kernel
            rows = rows.float()
            self.linear = make_linear(quantize_q8(rows) if rows.shape[1] % 32 == 0 else rows)
        else:  # a GPU or a bf16 model: the rows as they are, in the model's dtype (cuBLAS on CUDA)
            self.linear = make_linear(rows.to(embedding.dtype))
        on_huge_pages(self.linear)
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
    return model.logits(hidden, head), None if head is None else head.ids


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


#: Heads kept per model, the least recently used dropped first: a server's clients may ask for any size (18 MB each
#: on SmolLM2, more on the Qwen pair), and every new one was kept for the life of the process.
KEPT_HEADS = 4
_HEADS = Kept(KEPT_HEADS)  # model -> {(size, kind, device): SubsetHead}


def subset_table(vocab_size: int, size: int, kind: str = "corpus") -> torch.Tensor:
    """The ``size`` most frequent ids of a tokenizer's shipped ``kind`` table (a process that only checks the option,
    as the target's does for a draft in another process, builds no head)."""
    table = load_table(vocab_size, kind)
    if size > len(table):
        raise ValueError(f"a restricted vocabulary of {size} ids is larger than the shipped table ({len(table)} ids "
                         "for this tokenizer): give at most that, or 0 for the full vocabulary")
    return table[:size]


def subset_head(model, size: int, kind: str = "corpus") -> SubsetHead:
    """``model``'s head restricted to the ``size`` most frequent ids of its tokenizer's shipped ``kind`` table;
    built once per model (a q8 copy of those rows) and shared by every request and role that asks for it."""
    return _HEADS.get(model, (size, kind, model.device), lambda: SubsetHead(
        model.lm_head, model.embed_tokens.weight, subset_table(model.config.vocab_size, size, kind),
        model.config.tie_word_embeddings).eval())


def optional_head(model, size: int | None) -> SubsetHead | None:
    """The head a vocabulary option asks for. ``0``: the full vocabulary (``None``). ``None`` (a default): the
    :data:`DEFAULT_SIZE` most frequent ids where a table ships for the model's vocabulary and it is larger, else
    the full one. ``N``: the N most frequent ids (an error where no table ships)."""
    vocab = model.config.vocab_size
    if size is None:
        size = default_size(vocab)
    return subset_head(model, size) if 0 < size < vocab else None


def default_size(vocab_size: int, kind: str = "corpus") -> int:
    """The restricted vocabulary read by default: :data:`DEFAULT_SIZE` ids where a ``kind`` table ships for this
    vocabulary and it is larger, else 0 (the full one). A draft model reads the ``draft`` table (ranked by the
    target's answers: measured on Spec-Bench, docs/drafting.md), the exits and the streams the corpus one."""
    return DEFAULT_SIZE if vocab_size > DEFAULT_SIZE and table_path(vocab_size, kind).is_file() else 0

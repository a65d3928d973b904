"""``mirrorsd train-eagle``: an EAGLE-3-style draft head (:mod:`mirrorsd.decoding.eagle.head`) trained on the
target's own features (issue 59, item 5).

Training unrolls drafting ``depth`` times (EAGLE-3's training-time test, TTT): step j's query attends to the
target-fed keys of the prefix and to its own earlier steps' keys at the same position, exactly what drafting's
cache holds then, and reads the head's own previous output state where drafting will.

Why a head: the cost side of speculation. A 0.5B draft token costs ~0.8x a 1.5B target token on these CPUs; one
layer and a reduced-vocabulary head cost ~1/10. Whether it is right often enough is what this trainer measures:
held-out chain acceptance, the share of positions whose first j drafted tokens all equal the target's greedy
tokens.

The target is frozen, so its features and greedy labels are computed once by the weights decoding runs (q4 on
CPU) and cached (3 x hidden bf16 per token, 9 KB on the 1.5B); a step then runs only the head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .decoding.eagle.head import EagleHead, HeadConfig, check_target, feature_layers, rms_norm
from .draft_vocab import draft_table_kind, head_weight, load_table
from .linear import batch_invariance
from .model import Transformer
from .training import (
    CURVE_PLOT,
    HELD_OUT,
    Chunk,
    ShardCache,
    Trainable,
    TrainHead,
    corpus_texts,
    fit,
    make_chunks,
    open_cache,
    plot_learning_curve,
    write_shards,
)

# -- the cache ------------------------------------------------------------------------------------------------


@torch.no_grad()
@batch_invariance(False)
def target_features(model: Transformer, chunk: Chunk) -> dict[str, torch.Tensor]:
    """One chunk's fused-feature inputs ``[T, 3h]`` and the target's teacher-forced greedy tokens, from the weights
    decoding runs."""
    ids = chunk.ids[None].to(model.device)
    n = ids.shape[1]
    positions = torch.arange(n, device=model.device)[None]
    cache = model.new_cache(capacity=n)
    hidden, start, taken = model.embed(ids), 0, []
    for layer in feature_layers(model.config.n_layers):
        hidden = model.run_layers(hidden, positions, cache, None, start, layer)
        taken.append(hidden[0])
        start = layer
    final = model.run_layers(hidden, positions, cache, None, start, None)
    answer = chunk.answer if chunk.answer is not None else torch.ones(n, dtype=torch.bool)
    return {"features": torch.cat(taken, -1).to(torch.bfloat16),
            "labels": model.logits(final[0]).argmax(-1).to(torch.int32),
            "ids": ids[0].to(torch.int32), "loss_from": torch.tensor(chunk.loss_from), "answer": answer.to(torch.uint8)}


def cache_features(model: Transformer, train_chunks: list[Chunk], held_out: list[Chunk], folder: Path, *,
                   progress: bool = True) -> None:
    """The target's features and labels per chunk (:func:`target_features`), by :func:`write_shards`."""
    write_shards(folder, train_chunks, held_out, lambda _, chunks: (target_features(model, c) for c in chunks),
                 desc="caching target features", progress=progress)


@dataclass
class FeatureItem:
    features: torch.Tensor  # [T, 3h] bf16
    labels: torch.Tensor  # [T] the target's greedy token after each position
    ids: torch.Tensor  # [T] the tokens read
    loss_from: int
    answer: torch.Tensor  # [T] bool: the token was written by the target


class FeatureCache(ShardCache[FeatureItem]):
    names = ("features", "labels", "ids", "loss_from", "answer")
    optional = ()

    def __getitem__(self, index: int) -> FeatureItem:  # type: ignore[override]
        row = self.row(index)
        return FeatureItem(row["features"], row["labels"].long(), row["ids"].long(), int(row["loss_from"]),
                           row["answer"].bool())


def ttt_mask(n: int, step: int, device: torch.device | str) -> torch.Tensor:
    """``[T, (step + 1) T]``: step ``step``'s query at t sees the target-fed keys of positions <= t and its own
    chain's keys of steps 1..step at t, what drafting's cache holds when it drafts that token."""
    t = torch.arange(n, device=device)
    blocks = [t[None, :] <= t[:, None]] + [t[None, :] == t[:, None]] * step
    return torch.cat(blocks, 1)


def unroll(head: EagleHead, target: Transformer, features: torch.Tensor, ids: torch.Tensor, depth: int
           ) -> list[torch.Tensor]:
    """The head's output states ``[T - 1 - j, h]`` for steps j < ``depth`` over one chunk (teacher-forced tokens):
    step j at t reads token t + 1 + j and predicts the target's token after it (``labels[t + 1 + j]``)."""
    n = ids.shape[0]
    feature = head.fc3(features.to(head.fc3.weight.dtype))
    keys, values, outs = [], [], []
    for j in range(depth):
        tokens = torch.cat([ids[1 + j:], ids.new_zeros(1 + j)])  # (rows past the end are dropped below)
        x = head.join(target.embed(tokens), feature)
        cos, sin = (c[None] for c in target.rope(torch.arange(n, device=ids.device) + j))
        q, k, v = head.qkv(x, cos, sin)
        keys.append(k)
        values.append(v)
        attended = F.scaled_dot_product_attention(q, torch.cat(keys, 1), torch.cat(values, 1),
                                                  attn_mask=ttt_mask(n, j, ids.device), enable_gqa=True)
        feature = head.finish(x, attended)
        outs.append(feature[: n - 1 - j])
    return outs


# -- training -------------------------------------------------------------------------------------------------


def step_labels(item: FeatureItem, depth: int, answers_only: bool) -> list[torch.Tensor]:
    """Per step j, the labels ``[T - 1 - j]`` (-100 where not a target: before ``loss_from`` and, ``answers_only``,
    where the target did not write the token, or where the token step j reads is not the target's greedy one: a
    drafted chain reads the target's tokens, so text it would not have written (a sampled answer's, a corpus's)
    measures no chain)."""
    out = []
    n = item.labels.shape[0]
    for j in range(depth):
        u = torch.arange(1 + j, n, device=item.labels.device)  # the label's own position, and the token read
        keep = u + 1 >= item.loss_from
        if answers_only:
            keep &= torch.cat([item.answer[1:], item.answer[-1:]])[u]
            keep &= item.ids[u] == item.labels[u - 1]
        out.append(torch.where(keep, item.labels[u], -100))
    return out


def chain(hits: list[torch.Tensor], labels: list[torch.Tensor]) -> tuple[list[int], int]:
    """Per depth j, how many start positions had steps 0..j all right (counted where all of their labels exist),
    and how many start positions had every label of ``depth`` steps."""
    n = labels[-1].shape[0]
    valid = torch.stack([lab[:n] >= 0 for lab in labels]).all(0)
    right = torch.stack([hit[:n] for hit in hits]).cumprod(0).bool()
    return [int((r & valid).sum()) for r in right], int(valid.sum())


@torch.no_grad()
def evaluate(head: EagleHead, target: Transformer, full_head: torch.Tensor, items: FeatureCache, depth: int
             ) -> dict[str, Any]:
    """Held-out chain acceptance on the positions whose tokens the target wrote (full vocabulary): ``accept[j]``
    is the share of start positions whose first j + 1 drafted tokens all equal the target's greedy tokens;
    ``tokens_per_pass`` = 1 + their sum, a chain of ``depth`` drafted tokens verified in one target pass."""
    right, total = [0] * depth, 0
    for item in items:
        with torch.autocast(full_head.device.type, dtype=full_head.dtype, enabled=full_head.dtype != torch.float32):
            states = unroll(head, target, item.features, item.ids, depth)
            labels = step_labels(item, depth, answers_only=True)
            hits = [F.linear(rms_norm(s, head.norm, head.eps), full_head).argmax(-1) == lab
                    for s, lab in zip(states, labels, strict=True)]
        got, count = chain(hits, labels)
        right = [a + b for a, b in zip(right, got, strict=True)]
        total += count
    accept = [round(r / max(1, total), 4) for r in right]
    return {"accept": accept, "tokens_per_pass": round(1 + sum(accept), 4), "positions": total}


def train(target: Transformer, tokenizer, data: list[str], out: Path, *, model_name: str, decode_format: str,
          cache: Path | None = None, steps: int = 200, chunks: int | None = None, seq_len: int = 256,
          lr: float = 2e-4, held_out: int = 16, vocab: int = 32768, depth: int = 3, eval_every: int = 50,
          save_every: int = 25, seed: int = 0, dtype: torch.dtype = torch.bfloat16, recipe: dict | None = None,
          progress: bool = True) -> dict:
    """Train (or resume) a head in ``out``; returns a summary with the learning curve. ``target`` is the model
    decoding runs: it fills the feature cache (default ``out/cache``) and lends its embedding and LM head."""
    check_target(target)  # (before the feature cache's minutes)
    torch.manual_seed(seed)
    cfg = target.config
    layers = feature_layers(cfg.n_layers)
    cache = cache or out / "cache"
    n_train = chunks or min(steps, 10_000)
    meta = {"model": model_name, "weights": decode_format, "data": list(data), "seq_len": seq_len,
            "chunks": n_train, "held_out": held_out, "seed": seed, "features": list(layers)}
    shards, complete, meta = open_cache(cache, meta, data, n_train)  # (meta: with the data's version)
    if not complete:
        all_chunks = make_chunks(tokenizer, corpus_texts(data, model_name, tokenizer), seq_len, n_train + held_out,
                                 seed)
        cache_features(target, all_chunks[held_out:], all_chunks[:held_out], cache, progress=progress)
    train_items, eval_items = FeatureCache(shards, target.device), FeatureCache([cache / HELD_OUT], target.device)

    full = head_weight(target.lm_head, target.embed_tokens.weight, cfg.tie_word_embeddings).to(dtype)
    # The draft table: the subset decoding's head reads by default (--draft-vocab), ranked by the target's answers.
    table = load_table(cfg.vocab_size, draft_table_kind(cfg.vocab_size)) if vocab else None
    train_head = TrainHead(target, table[:vocab] if table is not None else torch.arange(cfg.vocab_size))
    head = EagleHead(target).to(target.device)  # fp32 master weights; the products run in ``dtype`` (autocast)
    weights = [0.8 ** j for j in range(depth)]  # EAGLE-3's per-step loss weights

    def step(item: FeatureItem) -> tuple[torch.Tensor, int, dict[str, str]]:
        labels = [train_head.labels(lab) for lab in step_labels(item, depth, answers_only=False)]
        with torch.autocast(target.device.type, dtype=dtype, enabled=dtype != torch.float32):
            states = unroll(head, target, item.features, item.ids, depth)
            loss = sum(w * F.cross_entropy(F.linear(rms_norm(s, head.norm, head.eps), train_head.weight).float(),
                                           lab, ignore_index=-100)
                       for w, s, lab in zip(weights, states, labels, strict=True))
        return loss, int((labels[0] >= 0).sum()), {"loss": f"{loss.item():.3f}"}

    trainable = Trainable(list(head.parameters()), head.state_dict, head.load_state_dict, "head")
    fitted = fit(out, trainable, train_items, step, lambda: evaluate(head, target, full, eval_items, depth),
                 steps=steps, lr=lr, seed=seed, eval_every=eval_every, save_every=save_every,
                 desc="train eagle head", settings={"vocab": vocab, "depth": depth, "dtype": str(dtype), "cache": meta},
                 progress=progress, command=(recipe or {}).get("command"))
    curve, tokens = fitted.curve, fitted.tokens
    summary = {"tokens_per_pass_before": curve[0]["tokens_per_pass"],
               "tokens_per_pass_after": curve[-1]["tokens_per_pass"], "accept_after": curve[-1]["accept"],
               "depth": depth, "train_vocab": vocab or cfg.vocab_size,
               "train_seconds_this_run": fitted.seconds, "steps": steps, "runs": fitted.runs,
               "train_tokens": tokens, "seq_len": seq_len, "train_chunks": len(train_items),
               "epochs": round(steps / max(1, len(train_items)), 2), "held_out_chunks": len(eval_items),
               "dtype": str(dtype).removeprefix("torch."), "curve": curve}
    HeadConfig(model_name, layers, cfg.hidden_size, cfg.n_layers, depth, (recipe or {}) | summary).save(out, head)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_curve(curve, out / CURVE_PLOT, f"EAGLE-3-style head on {model_name}: {len(train_items)} chunks × {seq_len} "
               f"tokens, depth {depth}")
    return summary


def plot_curve(curve: list[dict[str, Any]], path: Path, title: str) -> None:
    series = {f"first {j + 1} drafted tokens right": [p["accept"][j] for p in curve]
              for j in range(len(curve[0]["accept"]))}
    plot_learning_curve(curve, path, series, "held-out share (target-written positions)", title)

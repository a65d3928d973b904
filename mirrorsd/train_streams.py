"""``mirrorsd train-streams``: train Speculative Streaming adapters (lossless mode) on a CPU, at scale.

Lossless mode freezes the whole base model and main rows use it alone, so what the streams read from the main
stream -- the layer ``N - N_s`` states and the top layers' main keys/values -- and what they must predict -- the
model's own greedy tokens -- do not depend on anything trained. :func:`cache_states` therefore runs the model
decoding will use (q4 on CPU) once over the corpus and stores them (~7 KB per token in bf16 on the 1.5B), and
:func:`train` runs many epochs over that cache: a step pushes only the stream rows through the top ``N_s``
layers (held in bf16, 3x faster than fp32 GEMMs on AVX-512 BF16) and a restricted-vocabulary LM head (the
most frequent ids of the tokenizer's shipped table: the full 152k-way softmax would be most of a step).

Loss: Σ_j CE(stream j at t, model's token at t+1+j) over completion tokens (α_j equal; α0 = 0 in lossless
mode), plus the pruning adapter's next-token CE on layer ``N - N_s`` states. Labels are the model's own
teacher-forced predictions, since verification rewards agreeing with the model, not with the corpus. Held-out
accuracy is measured with the full vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .decoding.streams.adapters import CONFIG_FILE, WEIGHTS_FILE, StreamAdapters, StreamConfig, msa_mask
from .draft_vocab import load_table
from .kv_cache import KVCache
from .linear import batch_invariance
from .model import Transformer
from .training import (
    CURVE_PLOT,
    HELD_OUT,
    SHARD_CHUNKS,
    Chunk,
    ShardCache,
    Trainable,
    TrainHead,
    corpus_texts,
    fit,
    make_chunks,
    open_cache,
    optimize,
    plot_learning_curve,
    write_shards,
)


def self_distilled(model: Transformer, chunk: Chunk, prompt_len: int) -> Chunk:
    """The chunk with its text after ``prompt_len`` tokens replaced by the model's own greedy continuation: the
    streams then learn to predict exactly what decoding will ask them for."""
    from .api import generate
    from .decoding import REFERENCE

    prompt = chunk.ids[:prompt_len].tolist()
    g = generate(model, prompt, method=REFERENCE, max_new_tokens=len(chunk.ids) - prompt_len)
    return Chunk(torch.tensor(prompt + g.token_ids), prompt_len)


# -- the cache: what the frozen model gives each chunk, computed once --------------------------------------


@dataclass
class Cached:
    """One chunk as the frozen model sees it (read from its shard)."""

    hidden: torch.Tensor  # [T, h] layer N - N_s states
    keys: torch.Tensor  # [N_s, kv_heads, T, head_dim] the top layers' main keys (rotary applied)
    values: torch.Tensor  # [N_s, kv_heads, T, head_dim]
    labels: torch.Tensor  # [T] the model's greedy next token after each position (teacher-forced)
    loss_from: int  # first position whose token is a training target
    answer: torch.Tensor | None = None  # [T] bool: the token was written by the model (caches before 2026-11-28: None)


@torch.no_grad()
@batch_invariance(False)
def freeze(model: Transformer, first: int, chunk: Chunk) -> dict[str, torch.Tensor]:
    """The cached tensors of one chunk, from the model decoding will use (so the states are the ones it sees)."""
    ids = chunk.ids[None].to(model.device)
    n = ids.shape[1]
    positions = torch.arange(n, device=model.device)[None]
    cache = model.new_cache(capacity=n)
    hidden = model.run_layers(model.embed(ids), positions, cache, None, 0, first)
    final = model.run_layers(hidden, positions, cache, None, first, None)
    upper = range(first, model.config.n_layers)
    return {"hidden": hidden[0].to(torch.bfloat16),
            "keys": torch.stack([cache.keys[i][0, :, :n] for i in upper]).to(torch.bfloat16),
            "values": torch.stack([cache.values[i][0, :, :n] for i in upper]).to(torch.bfloat16),
            "labels": model.logits(final[0]).argmax(-1).to(torch.int32),
            "ids": ids[0].to(torch.int32), "loss_from": torch.tensor(chunk.loss_from),
            "answer": (chunk.answer if chunk.answer is not None else torch.ones(n, dtype=torch.bool)).to(torch.uint8)}


def cache_states(model: Transformer, first: int, train_chunks: list[Chunk], held_out: list[Chunk], folder: Path,
                 *, shard_size: int = SHARD_CHUNKS, progress: bool = True, distill: int = 0) -> None:
    """The frozen model's cache (:func:`freeze` per chunk), by :func:`write_shards`. ``distill``: the first that
    many training chunks are :func:`self_distilled` by ``model`` as their shard is written, so a resumed
    build generates only for the shards it lacks (all of them were generated again, and a stop before the first
    shard lost every one)."""
    distilled = {id(c) for c in train_chunks[:distill]}
    prompt_len = min(32, len(train_chunks[0].ids) // 2) if train_chunks else 0

    def rows(_: Path, chunks: list[Chunk]) -> Iterator[dict[str, torch.Tensor]]:
        for c in chunks:
            yield freeze(model, first, self_distilled(model, c, prompt_len) if id(c) in distilled else c)

    write_shards(folder, train_chunks, held_out, rows, desc="caching frozen states" + (
        f" (the first {distill} chunks self-distilled)" if distill else ""), shard_size=shard_size, progress=progress)


class StateCache(ShardCache[Cached]):
    """The streams' cache: per chunk, the layer ``N - N_s`` states, the top layers' main keys and values, and the
    model's labels (~7 KB a token on the 1.5B, 28 GB for 4M tokens: read a chunk at a time)."""

    names = ("hidden", "keys", "values", "labels", "loss_from")
    optional = ("answer",)  # read where the shard has them (older caches do not)

    def __getitem__(self, index: int) -> Cached:  # type: ignore[override]
        row = self.row(index)
        answer = row["answer"].bool() if "answer" in row else None
        return Cached(row["hidden"], row["keys"], row["values"], row["labels"].long(), int(row["loss_from"]), answer)


# -- the loss ------------------------------------------------------------------------------------------------


def stream_sources(n: int, n_streams: int, device: torch.device | str) -> torch.Tensor:
    """``[T, γ]``: the row whose next token stream j (from 0) at t is trained to predict, t + 1 + j. The labels,
    the model's own logits and (plus one) the answer marks are read there; rows ≥ T have no target."""
    return torch.arange(n, device=device).unsqueeze(1) + torch.arange(1, n_streams + 1, device=device)


def stream_targets(item: Cached, n_streams: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, γ]`` labels (-100 = none) of stream j at t, the model's token at t+1+j, and ``[T]`` labels of the
    pruning head at t (the model's next token), completion tokens only."""
    n = item.labels.shape[0]
    t = torch.arange(n, device=item.labels.device)
    source = stream_sources(n, n_streams, item.labels.device)
    valid = (source < n) & (source + 1 >= item.loss_from)
    streams = torch.where(valid, item.labels[source.clamp(max=n - 1)], -100)
    prune = torch.where(t + 1 >= item.loss_from, item.labels, -100)
    return streams, prune


@batch_invariance(False)
def stream_forward(model: Transformer, adapters: StreamAdapters, item: Cached) -> torch.Tensor:
    """Final states ``[T, γ, h]`` of every stream row over the cached main keys/values."""
    n_streams, first = adapters.config.streams, adapters.first_layer
    n = item.labels.shape[0]
    device = model.device
    cache = KVCache(model.config.n_layers, model.config.n_kv_heads, model.config.head_dim, capacity=1,
                    dtype=model.dtype, device=device)
    for i, layer in enumerate(range(first, model.config.n_layers)):  # fresh tensors: the cache is written to
        cache.keys[layer] = item.keys[i][None].to(model.dtype, copy=True)
        cache.values[layer] = item.values[i][None].to(model.dtype, copy=True)
        cache.lengths[layer] = n
    streams = adapters.insert(item.hidden[None].to(model.dtype))[:, n:]  # stream (t, j) at t·γ + j - 1
    positions = torch.arange(n, device=device).repeat_interleave(n_streams)[None]
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    mask = msa_mask(causal, 0, n_streams)[:, n:]  # stream rows over [cached main keys | stream keys]
    out = model.run_layers(streams, positions, cache, mask, first, None, streams=adapters.rows(n * n_streams))
    return out[0].view(n, n_streams, -1)


LOSSES = ("ce", "kl")  # the streams' training loss: see :func:`losses`
LABELS = {"ce": "the model's own greedy tokens (teacher-forced)",
          "kl": "the model's own next-token distributions (teacher-forced, restricted vocabulary)"}


@torch.no_grad()
@batch_invariance(False)
def main_states(model: Transformer, first: int, item: Cached) -> torch.Tensor:
    """``[T, h]`` the main rows' final states, run through the frozen top layers from the cached layer ``first``
    states. The cache keeps only the model's argmax; its distributions cost this forward, a third of the stream
    rows' (γ = 3) and without their backward."""
    n = item.hidden.shape[0]
    positions = torch.arange(n, device=model.device)[None]
    return model.run_layers(item.hidden[None].to(model.dtype), positions, model.new_cache(capacity=n), None,
                            first, None)[0]


def teacher_logits(model: Transformer, first: int, item: Cached, head: TrainHead) -> torch.Tensor:
    """``[T, V']`` the model's own next-token logits at every position of the chunk, on the restricted head."""
    return head.logits(main_states(model, first, item))


def losses(model: Transformer, adapters: StreamAdapters, item: Cached, head: TrainHead, loss: str = "ce"
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(stream loss, pruning CE) of one chunk on the restricted head.

    ``ce``: cross-entropy on the model's greedy token t+1+j (what greedy verification accepts). ``kl``: forward
    KL from the model's own distribution over token t+1+j to stream j's, on the restricted vocabulary (the soft
    target DistillSpec and Medusa-2's self-distillation train on): a stream also learns how sure the model is,
    where the argmax label says only which token won. The pruning head keeps CE in both."""
    streams, prune = stream_targets(item, adapters.config.streams)
    out = stream_forward(model, adapters, item)
    logits = head.logits(out)
    if loss == "ce":
        stream_loss = F.cross_entropy(logits.flatten(0, 1), head.labels(streams).flatten(), ignore_index=-100)
    elif loss == "kl":
        n, n_streams = streams.shape
        source = stream_sources(n, n_streams, logits.device).clamp(max=n - 1)
        target = F.log_softmax(teacher_logits(model, adapters.first_layer, item, head)[source][streams >= 0], -1)
        stream_loss = F.kl_div(F.log_softmax(logits[streams >= 0], -1), target, log_target=True,
                               reduction="batchmean")
    else:
        raise ValueError(f"unknown loss {loss!r}: one of {', '.join(LOSSES)}")
    hidden = item.hidden.to(model.dtype)
    prune_ce = F.cross_entropy(head.logits(adapters.prune(hidden)), head.labels(prune), ignore_index=-100)
    return stream_loss, prune_ce


def train_step(model: Transformer, adapters: StreamAdapters, item: Cached, head: TrainHead,
               optimizer: torch.optim.Optimizer, loss: str = "ce") -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on one cached chunk; returns its (stream loss, pruning CE)."""
    stream_loss, prune_ce = losses(model, adapters, item, head, loss)
    optimize(optimizer, stream_loss + prune_ce, adapters.trainable())
    return stream_loss.detach(), prune_ce.detach()


@torch.no_grad()
def evaluate(model: Transformer, adapters: StreamAdapters, held_out: list[Cached]) -> dict[str, Any]:
    """Held-out top-1 agreement with the model's own tokens, full vocabulary: per stream, and of the pruning
    head (the early exit that scores tree edges). Where the cache marks which tokens the model wrote, also per
    stream on those alone (``stream_accuracy_answers``): decoding only ever asks the streams for written tokens,
    and on distilled data the draft's agreement differs by .11 between written and read ones.
    ``stream_overlap``: the mean of Σ_v min(p, q) between the model's next-token distribution p and stream j's q,
    the chance that speculative sampling accepts the stream's token after a correct prefix (Leviathan et al.'s β);
    top-1 agreement is greedy decoding's measure, this one sampling's."""
    n_streams = adapters.config.streams
    hits, counts = torch.zeros(n_streams), torch.zeros(n_streams)
    overlap = torch.zeros(n_streams)
    answer_hits, answer_counts = torch.zeros(n_streams), torch.zeros(n_streams)
    marked = all(item.answer is not None for item in held_out)
    prune_hits = prune_count = 0
    for item in held_out:
        streams, prune = stream_targets(item, n_streams)
        logits = model.logits(stream_forward(model, adapters, item))
        predicted = logits.argmax(-1)
        valid = streams >= 0
        hits += ((predicted == streams) & valid).sum(0).cpu()
        counts += valid.sum(0).cpu()
        model_logits = model.logits(main_states(model, adapters.first_layer, item))
        n = streams.shape[0]
        source = stream_sources(n, n_streams, streams.device)
        for j in range(n_streams):
            rows = valid[:, j].nonzero()[:, 0]
            p = model_logits[source[rows, j]].float().softmax(-1)
            q = logits[rows, j].float().softmax(-1)
            overlap[j] += float(torch.minimum(p, q).sum())
        if marked:  # the answer marks index tokens: the one stream j predicts at t is token source + 1
            written = valid & item.answer[(source + 1).clamp(max=n - 1).to(item.answer.device)]
            answer_hits += ((predicted == streams) & written).sum(0).cpu()
            answer_counts += written.sum(0).cpu()
        exit_predicted = adapters.prune_logits(model, item.hidden.to(model.dtype))[0].argmax(-1)
        prune_hits += int(((exit_predicted == prune) & (prune >= 0)).sum())
        prune_count += int((prune >= 0).sum())
    out = {"stream_accuracy": [round(x, 4) for x in (hits / counts.clamp(min=1)).tolist()],
           "stream_overlap": [round(x, 4) for x in (overlap / counts.clamp(min=1)).tolist()],
           "prune_accuracy": round(prune_hits / max(1, prune_count), 4)}
    if marked:
        out["stream_accuracy_answers"] = [round(x, 4) for x in (answer_hits / answer_counts.clamp(min=1)).tolist()]
    return out


# -- training ------------------------------------------------------------------------------------------------


def plot_curve(curve: list[dict[str, Any]], path: Path, title: str) -> None:
    """Held-out top-1 of each stream (and the pruning exit) against training tokens."""
    series = {f"stream {j + 1} (token t+{j + 2})": [p["stream_accuracy"][j] for p in curve]
              for j in range(len(curve[0]["stream_accuracy"]))}
    exit_label = "pruning exit (token t+1)"
    series[exit_label] = [p["prune_accuracy"] for p in curve]
    plot_learning_curve(curve, path, series, "held-out top-1 = the model's own token", title, dashed={exit_label})


def warm_start(model: Transformer, adapters: StreamAdapters, folder: Path) -> int:
    """Load a saved adapter's weights into ``adapters``; returns the training tokens it had seen (its recipe's
    ``train_tokens``, 0 when it does not say). γ and the ranks must match; N_s may grow, so a trained adapter can
    seed a deeper one: the layers it has keep their weights and the new lower ones start as peft does (B = 0,
    the base layer's own output), with the stream embeddings now added below them."""
    from safetensors.torch import load_file

    saved = StreamConfig(**json.loads((Path(folder) / CONFIG_FILE).read_text()))
    ours = adapters.config
    got, want = (saved.streams, saved.rank, saved.prune_rank), (ours.streams, ours.rank, ours.prune_rank)
    if got != want or saved.layers > ours.layers:
        raise ValueError(f"--init adapter has streams/rank/prune rank {got} and N_s={saved.layers}; this run trains "
                         f"{want} and N_s={ours.layers} (N_s may only grow)")
    saved.check(model)
    state = load_file(str(Path(folder) / WEIGHTS_FILE), device=str(model.device))
    own = adapters.adapter_state()
    new = range(adapters.first_layer, model.config.n_layers - saved.layers)  # the layers the saved adapter lacks
    adapters.load_adapter_state(state | {k: own[k].detach() for k in own
                                         if any(k.startswith(f"lora.{layer}_") for layer in new)})
    return int(saved.recipe.get("train_tokens", 0))


def train(model: Transformer, decode_model: Transformer, tokenizer, data: list[str], out: Path, *,
          model_name: str | None = None, decode_format: str | None = None, cache: Path | None = None,
          streams: int = 3, layers: int = 4, rank: int = 8,
          steps: int = 200, chunks: int | None = None, seq_len: int = 128, lr: float = 1e-3, held_out: int = 8,
          distill: int = 0, vocab: int = 32768, eval_every: int = 50, save_every: int = 25, seed: int = 0,
          init: Path | None = None, loss: str = "ce", recipe: dict | None = None, progress: bool = True) -> dict:
    """Train (or resume) adapters and save them in ``out``; returns a summary with the learning curve.

    ``model`` holds the frozen weights the stream rows are trained through (dense, autograd-capable: bf16 on a
    CPU with AVX-512 BF16); ``decode_model`` is the model decoding will run (it fills the state cache and
    writes the self-distilled chunks). ``chunks`` training chunks (default: ``steps``) are cached once in
    ``cache`` (default ``out/cache``) and visited in a fresh shuffled order each epoch. ``vocab`` restricts the
    training head to that many most frequent ids (0: the full vocabulary). ``init``: an adapter folder to start
    from (same γ, N_s and rank) instead of a fresh initialisation; the curve then counts its training tokens too.
    ``loss``: the streams' loss, ``ce`` or ``kl`` (:func:`losses`).
    ``model_name``: the model whose own chat answers the ``chat-answers`` corpus holds; it and ``decode_format``
    (``decode_model``'s weight format) are recorded in the cache, so that another model of the same shape, or
    the same model in other weights, cannot reuse states it did not compute.
    """
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}: one of {', '.join(LOSSES)}")
    torch.manual_seed(seed)
    model.requires_grad_(False)
    cfg = model.config
    config = StreamConfig(streams=streams, layers=layers, rank=rank, alpha=2 * rank, hidden_size=cfg.hidden_size,
                          n_layers=cfg.n_layers, vocab_size=cfg.vocab_size)
    adapters = StreamAdapters(model, config)
    first = adapters.first_layer
    cache = cache or out / "cache"
    n_train = chunks or min(steps, 10_000)
    meta = {"model": model_name, "weights": decode_format, "data": list(data), "seq_len": seq_len, "chunks": n_train,
            "held_out": held_out, "distill": distill, "seed": seed, "first_layer": first, "n_layers": cfg.n_layers,
            "hidden_size": cfg.hidden_size}
    # (the --init adapter is read first: a wrong one was refused only after the whole cache was built)
    warm_tokens = warm_start(model, adapters, init) if init is not None else 0
    shards, complete, meta = open_cache(cache, meta, data, n_train)  # (meta: with the data's version)
    if not complete:
        texts = corpus_texts(data, model_name, tokenizer)
        all_chunks = make_chunks(tokenizer, texts, seq_len, n_train + held_out, seed)
        train_chunks, eval_chunks = all_chunks[held_out:], all_chunks[:held_out]
        cache_states(decode_model, first, train_chunks, eval_chunks, cache, shard_size=SHARD_CHUNKS,
                     progress=progress, distill=distill)
    train_items, eval_items = StateCache(shards, model.device), StateCache([cache / HELD_OUT], model.device)
    head = TrainHead(model, load_table(cfg.vocab_size)[:vocab] if vocab else torch.arange(cfg.vocab_size))

    def step(item: Cached) -> tuple[torch.Tensor, int, dict[str, str]]:
        stream_loss, prune_ce = losses(model, adapters, item, head, loss)
        return (stream_loss + prune_ce, item.labels.shape[0] - item.loss_from + 1,
                {f"stream_{loss}": f"{stream_loss.item():.3f}", "prune_ce": f"{prune_ce.item():.3f}"})

    trainable = Trainable(list(adapters.trainable()), adapters.adapter_state, adapters.load_adapter_state, "adapter")
    fitted = fit(out, trainable, train_items, step, lambda: evaluate(model, adapters, eval_items), steps=steps, lr=lr,
                 seed=seed, eval_every=eval_every, save_every=save_every, desc="train streams",
                 tokens=warm_tokens, device=model.device,
                 settings={"streams": streams, "layers": layers, "rank": rank, "vocab": vocab, "loss": loss,
                           "init": init, "cache": meta}, progress=progress, command=(recipe or {}).get("command"))
    curve, tokens = fitted.curve, fitted.tokens
    summary = {"held_out_stream_accuracy_before": curve[0]["stream_accuracy"],
               "held_out_stream_accuracy_after": curve[-1]["stream_accuracy"],
               "held_out_prune_accuracy_before": curve[0]["prune_accuracy"],
               "held_out_prune_accuracy_after": curve[-1]["prune_accuracy"],
               "labels": LABELS[loss], "loss": loss, "train_vocab": vocab or cfg.vocab_size,
               "train_seconds_this_run": fitted.seconds, "steps": steps, "runs": fitted.runs,
               "train_tokens": tokens, "seq_len": seq_len, "train_chunks": len(train_items),
               "epochs": round(steps / max(1, len(train_items)), 2), "held_out_chunks": len(eval_items),
               "self_distilled_chunks": distill, "dtype": str(model.dtype).removeprefix("torch.")}
    for key in ("stream_accuracy_answers", "stream_overlap"):  # measures older curves' points may lack
        if key in curve[0] and key in curve[-1]:
            summary[f"held_out_{key}_before"], summary[f"held_out_{key}_after"] = curve[0][key], curve[-1][key]
    if init is not None:
        summary["init"] = str(init)
    adapters.save(out, recipe=(recipe or {}) | summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_curve(curve, out / CURVE_PLOT, f"{recipe.get('model', '') if recipe else ''} streams: γ={streams}, "
               f"N_s={layers}, rank {rank}, {len(train_items)} chunks × {seq_len} tokens")
    return summary

"""``mirrorsd train-streams``: train Speculative Streaming adapters (lossless mode) on CPU in bounded time.

Lossless mode freezes the whole base model and main rows use it alone, so the main stream's hidden states and
the top layers' main keys/values do not depend on anything trained. They are computed once per chunk without
gradients; a training step then runs only the stream rows through the top ``N_s`` layers (attending to the
cached main keys) and the LM head. Loss: Σ_j CE(stream j at t, y_{t+1+j}) over completion tokens (α_j equal;
α0 = 0 in lossless mode), plus the pruning adapter's next-token CE on layer ``N - N_s`` states.
"""

from __future__ import annotations

import json
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .kv_cache import KVCache
from .model import Transformer
from .streams import StreamAdapters, StreamConfig, msa_mask

CORPORA = {
    "stdlib": "Python standard library source (top-level *.py files of this interpreter)",
    "pydoc-topics": "the Python language reference topics shipped in pydoc_data (English technical prose)",
}
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
CHECKPOINT = "checkpoint.pt"


def corpus_texts(sources: list[str]) -> list[str]:
    """Texts from named offline corpora (:data:`CORPORA`), files, or folders (their *.py/*.txt/*.md/*.rst)."""
    texts: list[str] = []
    for source in sources:
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


def make_chunks(tokenizer, texts: list[str], seq_len: int, count: int, seed: int) -> list[Chunk]:
    """``count`` windows of ``seq_len`` tokens drawn evenly from the shuffled texts (deterministic)."""
    rng = random.Random(seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    chunks: list[Chunk] = []
    for i in order:
        ids = tokenizer(texts[i], add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - seq_len + 1, seq_len):
            chunks.append(Chunk(torch.tensor(ids[start:start + seq_len]), 1))
    rng.shuffle(chunks)
    if len(chunks) < count:
        raise ValueError(f"the data gives {len(chunks)} chunks of {seq_len} tokens; {count} were asked for")
    return chunks[:count]


def self_distill(model: Transformer, chunks: list[Chunk], prompt_len: int) -> list[Chunk]:
    """Replace each chunk's text after ``prompt_len`` tokens by the model's own greedy continuation: the
    streams then learn to predict exactly what decoding will ask them for."""
    from .api import generate

    out = []
    for chunk in tqdm(chunks, desc="self-distillation", unit="chunk"):
        prompt = chunk.ids[:prompt_len].tolist()
        g = generate(model, prompt, method="ar", max_new_tokens=len(chunk.ids) - prompt_len)
        ids = prompt + g.token_ids
        out.append(Chunk(torch.tensor(ids), prompt_len))
    return out


@dataclass
class Frozen:
    """What the frozen base gives a chunk once: layer N - N_s states and the top layers' main keys/values."""

    hidden: torch.Tensor  # [1, T, h]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    chunk: Chunk


@torch.no_grad()
def freeze_chunk(model: Transformer, first: int, chunk: Chunk) -> Frozen:
    ids = chunk.ids[None].to(model.device)
    positions = torch.arange(ids.shape[1], device=model.device)[None]
    cache = model.new_cache(capacity=ids.shape[1])
    hidden = model.run_layers(model.embed(ids), positions, cache, None, 0, first)
    model.run_layers(hidden, positions, cache, None, first, None)
    n = ids.shape[1]
    upper = range(first, model.config.n_layers)
    return Frozen(hidden, [cache.keys[i][:, :, :n].clone() for i in upper],
                  [cache.values[i][:, :, :n].clone() for i in upper], chunk)


def stream_losses(model: Transformer, adapters: StreamAdapters, frozen: Frozen
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(stream CE, pruning CE, per-stream top-1 accuracy ``[γ]``) on one chunk."""
    gamma, first = adapters.config.streams, adapters.first_layer
    hidden, ids = frozen.hidden, frozen.chunk.ids.to(model.device)
    n = ids.shape[0]
    cache = KVCache(model.config.n_layers, model.config.n_kv_heads, model.config.head_dim, capacity=1,
                    dtype=hidden.dtype, device=hidden.device)
    for i, layer in enumerate(range(first, model.config.n_layers)):
        cache.keys[layer], cache.values[layer], cache.lengths[layer] = frozen.keys[i], frozen.values[i], n
    streams = adapters.insert(hidden)[:, n:]  # [1, n·γ, h]: stream (t, j) at t·γ + j - 1
    positions = torch.arange(n, device=hidden.device).repeat_interleave(gamma)[None]
    causal = torch.ones(n, n, dtype=torch.bool, device=hidden.device).tril()
    mask = msa_mask(causal, 0, gamma)[:, n:]  # stream rows over [cached main keys | stream keys]
    out = model.run_layers(streams, positions, cache, mask, first, None, streams=adapters.rows(n * gamma))
    logits = model.logits(out[0]).view(n, gamma, -1)
    # Stream j at t predicts y_{t+1+j}; only completion tokens (index >= loss_from) are targets.
    t = torch.arange(n, device=ids.device).unsqueeze(1)
    target_index = t + 1 + torch.arange(1, gamma + 1, device=ids.device).unsqueeze(0)  # [n, γ]
    valid = (target_index < n) & (target_index >= frozen.chunk.loss_from)
    labels = torch.where(valid, ids[target_index.clamp(max=n - 1)], -100)
    stream_ce = F.cross_entropy(logits.reshape(n * gamma, -1), labels.reshape(-1), ignore_index=-100)
    with torch.no_grad():
        hits = (logits.argmax(-1) == labels) & valid
        accuracy = hits.sum(0).float() / valid.sum(0).clamp(min=1)
    prune_logits = adapters.prune_logits(model, hidden[0, :-1])
    next_ids = ids[1:]
    prune_labels = torch.where(torch.arange(1, n, device=ids.device) >= frozen.chunk.loss_from, next_ids, -100)
    prune_ce = F.cross_entropy(prune_logits, prune_labels, ignore_index=-100)
    return stream_ce, prune_ce, accuracy


def evaluate(model: Transformer, adapters: StreamAdapters, held_out: list[Frozen]) -> list[float]:
    """Mean held-out top-1 accuracy of each stream."""
    with torch.no_grad():
        accs = torch.stack([stream_losses(model, adapters, f)[2] for f in held_out])
    return [round(x, 4) for x in accs.mean(0).tolist()]


def train(model: Transformer, tokenizer, data: list[str], out: Path, *, streams: int = 3, layers: int = 4,
          rank: int = 8, steps: int = 200, seq_len: int = 128, lr: float = 1e-3, held_out: int = 8,
          distill: int = 0, distill_model: Transformer | None = None, save_every: int = 25, seed: int = 0,
          recipe: dict | None = None, progress: bool = True) -> dict:
    """Train (or resume) adapters for ``model`` (fp32 with autograd-capable linears) and save them in ``out``.

    Returns a summary with held-out stream accuracy before and after training.
    """
    torch.manual_seed(seed)
    model.requires_grad_(False)
    cfg = model.config
    config = StreamConfig(streams=streams, layers=layers, rank=rank, alpha=2 * rank, hidden_size=cfg.hidden_size,
                          n_layers=cfg.n_layers, vocab_size=cfg.vocab_size)
    adapters = StreamAdapters(model, config)
    texts = corpus_texts(data)
    n_train = min(steps, 10_000)
    chunks = make_chunks(tokenizer, texts, seq_len, n_train + held_out, seed)
    train_chunks, eval_chunks = chunks[held_out:], chunks[:held_out]
    if distill:
        prompt_len = min(32, seq_len // 2)
        train_chunks = self_distill(distill_model or model, train_chunks[:distill], prompt_len) + train_chunks[distill:]
    bar = tqdm(total=len(train_chunks) + len(eval_chunks), desc="frozen base (once)", unit="chunk",
               disable=not progress)
    frozen_train, frozen_eval = [], []
    for chunk in train_chunks:
        frozen_train.append(freeze_chunk(model, adapters.first_layer, chunk))
        bar.update()
    for chunk in eval_chunks:
        frozen_eval.append(freeze_chunk(model, adapters.first_layer, chunk))
        bar.update()
    bar.close()

    optimizer = torch.optim.AdamW(adapters.trainable(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(1, steps - warmup))))
    out.mkdir(parents=True, exist_ok=True)
    start_step, before = 0, None
    checkpoint = out / CHECKPOINT
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=model.device, weights_only=False)
        adapters.load_adapter_state(state["adapter"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        start_step, before = state["step"], state["before"]
    if before is None:
        before = evaluate(model, adapters, frozen_eval)

    def save(step: int) -> None:
        torch.save({"step": step, "adapter": {k: v.detach() for k, v in adapters.adapter_state().items()},
                    "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "before": before},
                   checkpoint)

    bar = tqdm(total=steps, initial=start_step, desc="train streams", unit="step", disable=not progress)
    started = time.perf_counter()
    for step in range(start_step, steps):
        frozen = frozen_train[step % len(frozen_train)]
        stream_ce, prune_ce, _ = stream_losses(model, adapters, frozen)
        loss = stream_ce + prune_ce
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(adapters.trainable(), 1.0)
        optimizer.step()
        schedule.step()
        bar.set_postfix(stream_ce=f"{stream_ce.item():.3f}", prune_ce=f"{prune_ce.item():.3f}")
        bar.update()
        if (step + 1) % save_every == 0 or step + 1 == steps:
            save(step + 1)
    bar.close()
    after = evaluate(model, adapters, frozen_eval)
    summary = {"held_out_stream_accuracy_before": before, "held_out_stream_accuracy_after": after,
               "train_seconds_this_run": round(time.perf_counter() - started, 1), "steps": steps,
               "seq_len": seq_len, "train_chunks": len(train_chunks), "held_out_chunks": held_out,
               "self_distilled_chunks": distill}
    adapters.save(out, recipe=(recipe or {}) | summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary

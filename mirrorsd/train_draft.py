"""``mirrorsd train-draft``: distil a draft toward its target on the target's own answers.

A draft's weights may change freely (verification keeps the output the target's), and every drafting method gains
when its proposals agree with the target more often. Low-rank deltas on every projection of the draft's top
``layers`` blocks are trained to predict the target's teacher-forced greedy token at each position: exactly what
greedy verification accepts. The lower blocks stay frozen, so their output (layer ``N - layers`` states, ~1.8 KB a
token in bf16 on the 0.5B) is computed once by the draft decoding runs and cached; a step then runs only the top
blocks forward and backward through dense copies, and a restricted-vocabulary head.

The labels come from the target's own ``mirrorsd train-streams`` state cache when one was built over the same
windows (same data, ``--seq-len``, ``--seed``, ``--chunks`` and ``--held-out``: the ids are checked), else from
the target itself. With ``soft_top`` k > 0 the cache also keeps the target's k likeliest tokens and their
log-probabilities, and the loss is the cross-entropy against the target's distribution over those k tokens plus one
bucket for the rest (:func:`soft_loss`). Argmax labels teach the draft to put all its mass on one token, so its
top probability overstates how often the target agrees, and the confidence rule drafts too far on it
(docs/distill.md); a distribution target keeps the draft's confidence the target's.

The result is a :mod:`mirrorsd.tuned_drafts` folder: ``--draft FOLDER`` loads the base draft with the deltas merged.

``spd_tracks`` > 1 trains the draft in the sharded form Mirror-SD runs it in (``--draft-tp G --draft-syncs spd``):
G tracks that re-align only at the segments' ends (:func:`~mirrorsd.runtime.tensor_parallel.run_tracks`). A draft
trained whole proposes far worse tokens once its syncs are dropped; the paper trains its drafts in that form.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .draft_vocab import load_table
from .linear import DenseLinear, batch_invariance
from .model import Transformer
from .runtime.tensor_parallel import run_tracks, segment_bounds
from .training import (
    CACHE_META,
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
from .tuned_drafts import TUNED_PROJECTIONS, TuneConfig

Labeller = Callable[[Path, list[Chunk]], list[dict[str, torch.Tensor]]]
"""(shard path, its chunks) -> per chunk the target's ``labels`` [T] and, with a top-k, ``top_ids`` / ``top_logp``
[T, k]."""


@dataclass
class DraftItem:
    """One cached chunk: the draft's frozen layer ``N - layers`` states and the target's tokens."""

    hidden: torch.Tensor  # [T, h]
    labels: torch.Tensor  # [T] the target's greedy token after each position (teacher-forced)
    loss_from: int
    answer: torch.Tensor  # [T] bool: the token was written by the target (all true where the data does not say)
    top_ids: torch.Tensor | None = None  # [T, k] the target's k likeliest next tokens (caches built with soft_top)
    top_logp: torch.Tensor | None = None  # [T, k] their log-probabilities


class DraftCache(ShardCache[DraftItem]):
    names = ("hidden", "labels", "loss_from", "answer")
    optional = ("top_ids", "top_logp")

    def __getitem__(self, index: int) -> DraftItem:  # type: ignore[override]
        row = self.row(index)
        top = (row["top_ids"].long(), row["top_logp"].float()) if "top_ids" in row else (None, None)
        return DraftItem(row["hidden"], row["labels"].long(), int(row["loss_from"]), row["answer"].bool(), *top)


class DraftLoRA(nn.Module):
    """peft LoRA on every projection of a dense model's top ``layers`` blocks, applied to all rows: unlike the
    streams' adapters, these change the draft's own tokens, which is the point."""

    def __init__(self, model: Transformer, layers: int, rank: int, alpha: int) -> None:
        from peft import LoraConfig
        from peft.tuners.lora.layer import Linear as LoraLinear

        super().__init__()
        n = model.config.n_layers
        if not 1 <= layers <= n:
            raise ValueError(f"--layers must be in 1..{n}, got {layers}")
        self.first_layer = n - layers
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0)
        self.lora = nn.ModuleDict()
        self.weight_names: list[str] = []
        for layer in range(self.first_layer, n):
            for path in TUNED_PROJECTIONS:
                owner, name = path.split(".")
                parent = getattr(model.layers[layer], owner)
                base = getattr(parent, name)
                if isinstance(base, LoraLinear):
                    raise ValueError("the model's projections already carry LoRA adapters")
                if not isinstance(base, DenseLinear):  # our packed/quantized kernels have no autograd
                    raise ValueError("train through dense weights: load the model with linear='dense'")
                with warnings.catch_warnings():  # peft warns that our linears are not nn.Linear; it only reads
                    warnings.simplefilter("ignore")  # their in/out features and calls them for the base product
                    wrapped = LoraLinear(base, "default", config=config, r=rank, lora_alpha=alpha)
                wrapped.base_layer.requires_grad_(False)
                wrapped.lora_A.float()  # the trained parts stay fp32 whatever dtype the base runs in
                wrapped.lora_B.float()
                setattr(parent, name, wrapped)  # the model's own forward now runs through the adapter
                key = f"layers.{layer}.{path}.weight"
                self.lora[key.replace(".", "_")] = wrapped
                self.weight_names.append(key)

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def state(self) -> dict[str, torch.Tensor]:
        """``{weight name}.A`` / ``.B`` of every tuned projection (the :mod:`~mirrorsd.tuned_drafts` file layout)."""
        out = {}
        for key in self.weight_names:
            lora = self.lora[key.replace(".", "_")]
            out[f"{key}.A"], out[f"{key}.B"] = lora.lora_A["default"].weight, lora.lora_B["default"].weight
        return out

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for key, tensor in self.state().items():
                tensor.copy_(state[key].to(tensor.dtype))


# -- the cache ------------------------------------------------------------------------------------------------


def _top(logits: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """The ``k`` likeliest tokens of ``logits`` [T, V] and their log-probabilities, as the cache stores them."""
    logp, ids = torch.log_softmax(logits.float(), -1).topk(k, -1)
    return {"top_ids": ids.to(torch.int32).cpu(), "top_logp": logp.to(torch.float16).cpu()}


def target_labels(target: Transformer, top_k: int = 0) -> Labeller:
    """Labels computed by ``target`` (the weights decoding runs, so they are the tokens it verifies with), and with
    ``top_k`` its ``top_k`` likeliest tokens."""

    @torch.no_grad()
    @batch_invariance(False)
    def labels(_: Path, chunks: list[Chunk]) -> list[dict[str, torch.Tensor]]:
        out = []
        for chunk in chunks:
            ids = chunk.ids[None].to(target.device)
            hidden = target.run_layers(target.embed(ids), torch.arange(ids.shape[1], device=target.device)[None],
                                       target.new_cache(capacity=ids.shape[1]))
            logits = target.logits(hidden[0])
            out.append({"labels": logits.argmax(-1).to(torch.int32).cpu()} | (_top(logits, top_k) if top_k else {}))
        return out

    return labels


def check_labeller(folder: Path, target_name: str) -> None:
    """A state cache's labels are its model's tokens (a draft cache's, its target's): another model's would distill
    the draft toward that model while its folder names ``target_name``."""
    path = folder / CACHE_META
    if not path.is_file():
        raise FileNotFoundError(f"{folder} holds no {CACHE_META}: not a state cache of `mirrorsd train-streams` or "
                                "`train-draft`")
    meta = json.loads(path.read_text())
    labeller = meta.get("target", meta.get("model"))

    def where(name: str) -> Path:  # a zoo name and its converted folder are one model
        from .zoo import ZOO, model_dir

        return (model_dir(name) if name in ZOO else Path(name).expanduser()).resolve()

    if labeller != target_name and where(labeller) != where(target_name):
        raise ValueError(f"the state cache {folder} holds {labeller}'s tokens, not {target_name}'s: give the cache "
                         f"of {target_name}, or --target {labeller}")


def cached_labels(folder: Path, target: Transformer | None = None, top_k: int = 0) -> Labeller:
    """Labels read from the target's ``train-streams`` state cache in ``folder`` (or another draft cache: the same
    ``ids`` and ``labels``): its shard of the same name holds the same windows (checked token by token).

    ``top_k``: the target's likeliest tokens too, read from a draft cache that holds at least that many, or from a
    ``train-streams`` cache by running ``target``'s layers above the cached ones (its top N_s of N: a seventh of a
    forward on the 1.5B)."""
    from safetensors import safe_open

    @torch.no_grad()
    @batch_invariance(False)
    def labels(path: Path, chunks: list[Chunk]) -> list[dict[str, torch.Tensor]]:
        source = folder / path.name
        if not source.exists():
            raise FileNotFoundError(f"the target's state cache {folder} has no {path.name}: build it over the same "
                                    "windows (same --data, --seq-len, --chunks, --held-out, --seed) or omit "
                                    "--target-cache")
        with safe_open(str(source), framework="pt") as f:
            ids, got, names = f.get_tensor("ids"), f.get_tensor("labels"), set(f.keys())
            ours = torch.stack([c.ids for c in chunks]).to(ids.dtype)
            if ids.shape != ours.shape or not torch.equal(ids, ours):
                raise ValueError(f"{source} holds other windows than this run's: build the draft's cache with the "
                                 "target cache's --data, --seq-len, --chunks, --held-out and --seed")
            out = [{"labels": row.to(torch.int32)} for row in got]
            if not top_k:
                return out
            if "top_ids" in names and f.get_slice("top_ids").get_shape()[-1] >= top_k:
                top_ids, top_logp = f.get_tensor("top_ids")[..., :top_k], f.get_tensor("top_logp")[..., :top_k]
                return [row | {"top_ids": i, "top_logp": p} for row, i, p in zip(out, top_ids, top_logp, strict=True)]
            if "keys" not in names or target is None:
                raise ValueError(f"{folder} holds no top-{top_k} of the target: give the target's train-streams "
                                 "cache (and the target) or a draft cache built with at least that --soft-top")
            hidden = f.get_tensor("hidden")  # layer N - N_s states, N_s = the layers whose keys it keeps
            first = target.config.n_layers - f.get_slice("keys").get_shape()[1]
        positions = torch.arange(hidden.shape[1], device=target.device)[None]
        for row, states in zip(out, hidden, strict=True):
            top = target.run_layers(states[None].to(target.device, target.dtype), positions, None, None, first)
            row |= _top(target.logits(top[0]), top_k)
        return out

    return labels


@torch.no_grad()
@batch_invariance(False)
def draft_states(draft: Transformer, first: int, chunk: Chunk, spd_tracks: int = 1) -> torch.Tensor:
    """Layer ``first`` states of one chunk, from the draft decoding runs (``spd_tracks`` > 1: in that sharded form,
    from the dense copy it runs as)."""
    ids = chunk.ids[None].to(draft.device)
    positions = torch.arange(ids.shape[1], device=draft.device)[None]
    if spd_tracks > 1:
        hidden = run_tracks(draft, draft.embed(ids), positions, 0, first, spd_tracks)
    else:
        hidden = draft.run_layers(draft.embed(ids), positions, draft.new_cache(capacity=ids.shape[1]), None, 0, first)
    return hidden[0].to(torch.bfloat16)


def cache_draft(draft: Transformer, first: int, labels: Labeller, train_chunks: list[Chunk], held_out: list[Chunk],
                folder: Path, *, spd_tracks: int = 1, progress: bool = True) -> None:
    """The draft's layer ``first`` states and the target's labels per chunk, by :func:`write_shards`."""

    def rows(path: Path, chunks: list[Chunk]) -> Iterator[dict[str, torch.Tensor]]:
        for chunk, teacher in zip(chunks, labels(path, chunks), strict=True):
            answer = chunk.answer if chunk.answer is not None else torch.ones(len(chunk.ids), dtype=torch.bool)
            yield teacher | {"hidden": draft_states(draft, first, chunk, spd_tracks), "ids": chunk.ids.to(torch.int32),
                             "loss_from": torch.tensor(chunk.loss_from), "answer": answer.to(torch.uint8)}

    write_shards(folder, train_chunks, held_out, rows, desc="caching draft states", progress=progress)


# -- training -------------------------------------------------------------------------------------------------


def loss_labels(item: DraftItem, answers_only: bool) -> torch.Tensor:
    """Labels with -100 where position t's next token is not a training target: before the first completion
    token, and (``answers_only``) where the target read the next token rather than wrote it: drafting only ever
    proposes written ones (on distilled data the untuned 0.5B agrees with the 1.5B on .84 of answer positions,
    .74 of prompt ones). At 253k tokens, training on every position measured better on answers all the same
    (docs/distill.md): the prompts act as more data."""
    t = torch.arange(item.labels.shape[0], device=item.labels.device)
    keep = t + 1 >= item.loss_from
    if answers_only:
        keep &= torch.cat([item.answer[1:], item.answer[-1:]])
    return torch.where(keep, item.labels, -100)


@batch_invariance(False)
def top_forward(model: Transformer, first: int, item: DraftItem, spd_tracks: int = 1) -> torch.Tensor:
    """Final states ``[T, h]`` of the tuned blocks over the cached layer ``first`` states (plain causal; in the spd
    form over ``spd_tracks`` tracks when > 1)."""
    n = item.hidden.shape[0]
    positions = torch.arange(n, device=model.device)[None]
    hidden = item.hidden[None].to(model.dtype)
    if spd_tracks > 1:
        return run_tracks(model, hidden, positions, first, model.config.n_layers, spd_tracks)[0]
    return model.run_layers(hidden, positions, None, None, first, None)[0]


def soft_loss(logits: torch.Tensor, top: torch.Tensor, top_logp: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the draft's ``logits`` [T, V] against the target's distribution over its top-k tokens
    ``top`` [T, k] (indices into V; < 0 where outside it) and one bucket for the rest of the vocabulary, at the
    ``keep`` [T] positions. The buckets partition V, so the loss is least exactly where the draft's bucketed
    distribution is the target's; mass of top tokens outside V joins the rest bucket."""
    logits, top, p = logits[keep], top[keep], top_logp[keep].float().exp()
    inside = top >= 0
    p = torch.where(inside, p, 0.0)
    index = top.clamp(min=0)
    taken = torch.zeros_like(logits).scatter_add(1, index, inside.to(logits.dtype)) > 0
    picked = logits.gather(1, index).masked_fill(~inside, float("-inf"))
    rest = torch.logsumexp(logits.masked_fill(taken, float("-inf")), -1, keepdim=True)
    student = torch.log_softmax(torch.cat([picked, rest], 1), -1)
    teacher = torch.cat([p, (1 - p.sum(1, keepdim=True)).clamp(min=0)], 1)
    return -torch.where(teacher > 0, teacher * student, 0.0).sum(1).mean()


def calibration(top: torch.Tensor, right: torch.Tensor, written: torch.Tensor, confidence: float
                ) -> dict[str, float]:
    """At the written positions (``written``), the share the draft is sure of under the confidence rule (top
    probability ``top`` ≥ ``confidence``: ``sure``) and its agreement with the target there (``sure_agreement``):
    the confidence rule drafts on while the draft is sure, so a draft whose sure agreement falls drafts tokens the
    target rejects."""
    confident = (top >= confidence) & written
    sure = int(confident.sum())
    return {"sure": round(sure / max(1, int(written.sum())), 4),
            "sure_agreement": round(int((confident & right).sum()) / max(1, sure), 4)}


@torch.no_grad()
def evaluate(model: Transformer, lora: DraftLoRA, held_out: DraftCache, spd_tracks: int = 1,
             confidence: float = 0.6) -> dict[str, float]:
    """Held-out top-1 agreement with the target's token (full vocabulary) at the positions whose next token the
    target wrote (``agreement``: what drafting meets) and at all of them (``agreement_all``), and the
    :func:`calibration` at ``confidence``."""
    hits = {True: 0, False: 0}
    count = {True: 0, False: 0}
    tops, rights, writtens = [], [], []
    for item in held_out:
        probs = torch.softmax(model.logits(top_forward(model, lora.first_layer, item, spd_tracks)).float(), -1)
        top, predicted = probs.max(-1)
        for answers_only in (True, False):
            labels = loss_labels(item, answers_only)
            hits[answers_only] += int(((predicted == labels) & (labels >= 0)).sum())
            count[answers_only] += int((labels >= 0).sum())
        written = loss_labels(item, True)
        tops.append(top.flatten())
        rights.append((predicted == written).flatten())
        writtens.append((written >= 0).flatten())
    return {"agreement": round(hits[True] / max(1, count[True]), 4),
            "agreement_all": round(hits[False] / max(1, count[False]), 4),
            **calibration(torch.cat(tops), torch.cat(rights), torch.cat(writtens), confidence)}


def train(model: Transformer, draft: Transformer, target: Transformer | None, tokenizer, data: list[str], out: Path,
          *, model_name: str, target_name: str, decode_format: str, cache: Path | None = None,
          target_cache: Path | None = None, layers: int = 8, rank: int = 16, steps: int = 200,
          chunks: int | None = None, seq_len: int = 256, lr: float = 3e-4, held_out: int = 16, vocab: int = 32768,
          eval_every: int = 50, save_every: int = 25, seed: int = 0, answers_only: bool = False,
          spd_tracks: int = 1, soft_top: int = 0, recipe: dict | None = None, progress: bool = True) -> dict:
    """Train (or resume) a tuned draft and save it in ``out``; returns a summary with the learning curve.

    ``model``: dense, autograd-capable copy of the draft (its top blocks get the adapters); ``draft``: the draft
    decoding runs (it fills the cache); ``target``: the target decoding runs, for labels when ``target_cache`` is
    None. ``chunks`` training windows (default ``steps``) are cached once in ``cache`` (default ``out/cache``).
    ``answers_only``: the loss covers only positions whose next token the target wrote (where the data marks them:
    ``distill:`` folders), else every position. ``spd_tracks`` > 1: trained, cached and evaluated in the spd form
    over that many tracks (the cache then comes from ``model``, dense as the sharded draft runs); the tuned layers
    must start at a segment bound. ``soft_top`` k > 0: the loss is :func:`soft_loss` against the target's k likeliest
    tokens (cached with the labels; it trains positions whose argmax lies outside ``vocab`` too), else cross-entropy
    on its argmax.
    """
    torch.manual_seed(seed)
    model.requires_grad_(False)
    cfg = model.config
    if spd_tracks > 1 and (first := cfg.n_layers - layers) not in (bounds := segment_bounds(cfg.n_layers)):
        raise ValueError(f"in the spd form the tracks re-align only at layers {bounds}: --layers must leave a "
                         f"segment bound below the tuned layers (one of {[cfg.n_layers - b for b in bounds[:-1]]}), "
                         f"got {layers} (layer {first})")
    lora = DraftLoRA(model, layers, rank, 2 * rank)
    first = lora.first_layer
    cache = cache or out / "cache"
    n_train = chunks or min(steps, 10_000)
    meta = {"model": model_name, "weights": decode_format, "target": target_name, "data": list(data), "version": 2,
            "seq_len": seq_len, "chunks": n_train, "held_out": held_out, "seed": seed, "first_layer": first,
            "n_layers": cfg.n_layers, "hidden_size": cfg.hidden_size}
    if spd_tracks > 1:
        meta["spd_tracks"] = spd_tracks
    if soft_top:
        meta["top_k"] = soft_top
    shards, complete, meta = open_cache(cache, meta, data, n_train)  # (meta: with the data's version)
    if not complete:
        if target_cache is None and target is None:
            raise ValueError("labels need the target model or its state cache")
        if target_cache is not None:
            check_labeller(target_cache, target_name)
        # (chat-answers: the target's answers, which the draft learns to propose, not its own)
        all_chunks = make_chunks(tokenizer, corpus_texts(data, target_name, tokenizer), seq_len, n_train + held_out,
                                 seed)
        labels = (cached_labels(target_cache, target, soft_top) if target_cache is not None
                  else target_labels(target, soft_top))
        cache_draft(model if spd_tracks > 1 else draft, first, labels, all_chunks[held_out:], all_chunks[:held_out],
                    cache, spd_tracks=spd_tracks, progress=progress)
    train_items, eval_items = DraftCache(shards, model.device), DraftCache([cache / HELD_OUT], model.device)
    head = TrainHead(model, load_table(cfg.vocab_size)[:vocab] if vocab else torch.arange(cfg.vocab_size))

    def step(item: DraftItem) -> tuple[torch.Tensor | None, int, dict[str, str]]:
        written = loss_labels(item, answers_only)
        labels = head.labels(written)
        # The soft target trains every written position: top tokens outside the subset join its rest bucket.
        keep = written >= 0 if soft_top else labels >= 0
        if not (trained := int(keep.sum())):  # a window of prompt text only has nothing to learn from
            return None, 0, {}
        logits = head.logits(top_forward(model, first, item, spd_tracks))
        if soft_top:
            loss = soft_loss(logits, head.labels(item.top_ids), item.top_logp, keep)
        else:
            loss = F.cross_entropy(logits, labels, ignore_index=-100)
        return loss, trained, {"ce": f"{loss.item():.3f}"}

    fitted = fit(out, Trainable(list(lora.trainable()), lora.state, lora.load_state, "lora"), train_items, step,
                 lambda: evaluate(model, lora, eval_items, spd_tracks), steps=steps, lr=lr, seed=seed,
                 eval_every=eval_every, save_every=save_every, desc="train draft", device=model.device,
                 settings={"layers": layers, "rank": rank, "vocab": vocab, "answers_only": answers_only,
                           "spd_tracks": spd_tracks, "soft_top": soft_top, "cache": meta}, progress=progress,
                 command=(recipe or {}).get("command"))
    curve, tokens = fitted.curve, fitted.tokens
    summary = {"held_out_agreement_before": curve[0]["agreement"], "held_out_agreement_after": curve[-1]["agreement"],
               "held_out_agreement_all_before": curve[0]["agreement_all"],
               "held_out_agreement_all_after": curve[-1]["agreement_all"],
               "labels": (f"{target_name}'s distribution over its top {soft_top} tokens and the rest" if soft_top
                          else f"{target_name}'s greedy tokens") + " (teacher-forced)"
               + (", at positions whose next token it wrote" if answers_only else ", at every position"),
               **{f"held_out_{name}_{when}": curve[at][name] for name in ("sure", "sure_agreement")
                  for when, at in (("before", 0), ("after", -1))},
               "train_vocab": vocab or cfg.vocab_size,
               "train_seconds_this_run": fitted.seconds, "steps": steps, "runs": fitted.runs,
               "train_tokens": tokens, "seq_len": seq_len, "train_chunks": len(train_items),
               "epochs": round(steps / max(1, len(train_items)), 2), "held_out_chunks": len(eval_items),
               "dtype": str(model.dtype).removeprefix("torch."), "spd_tracks": spd_tracks, "curve": curve}
    TuneConfig(base=model_name, target=target_name, layers=layers, rank=rank, alpha=2 * rank,
               hidden_size=cfg.hidden_size, n_layers=cfg.n_layers, vocab_size=cfg.vocab_size,
               spd_tracks=spd_tracks, recipe=(recipe or {}) | summary).save(out, lora.state())
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    form = f", spd form over {spd_tracks} tracks" if spd_tracks > 1 else ""
    plot_learning_curve(curve, out / CURVE_PLOT, {"agreement": [p["agreement"] for p in curve]},
                        "held-out top-1 = the target's token", f"{model_name} toward {target_name}: top {layers} "
                        f"layers, rank {rank}, {len(train_items)} chunks × {seq_len} tokens{form}")
    return summary
